"""LangGraph integration of InferScale: long-term memory whose items reach the model as KV.

* :class:`InferScaleStore`: a ``BaseStore`` (``graph.compile(store=...)``,
  ``create_agent(..., store=...)``) whose items are facts of the namespace's user; values read
  back carry fact handles that ``ChatInferScale`` injects.

See docs/langchain.md ("LangGraph store").
"""

from inferscale_integrations._common import get_engine, register_engine
from inferscale_integrations.langgraph.store import InferScaleStore

__all__ = ["InferScaleStore", "get_engine", "register_engine"]
