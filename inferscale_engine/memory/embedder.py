"""Old path of :class:`~inferscale_engine.memory.text.embedder.Embedder`, kept only while
``inferscale_apps/bench/locomo.py`` (owned elsewhere) imports it from here; remove with that line."""

from inferscale_engine.memory.text.embedder import Embedder

__all__ = ["Embedder"]
