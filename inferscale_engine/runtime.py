"""Composition root: builds an engine and its memory store from their configs and wires them.

The memory package does not import the engine module (it needs only an
:class:`~inferscale_engine.memory.encoding.Encoder`; the ``Span`` value type it returns is
looked up at call time), and the engine needs only a ``FactSource`` to resolve handles (it
builds its default store, :meth:`MemoryStore.for_engine
<inferscale_engine.memory.store.MemoryStore.for_engine>`, on first use of ``engine.memory``);
this module sits above both::

    EngineConfig ──▶ InferScaleEngine ─┐ (encoder, extraction model)
    MemoryConfig ──────────────────────┴──▶ MemoryStore ──▶ engine.memory (its FactSource)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inferscale_engine.config import EngineConfig, MemoryConfig

if TYPE_CHECKING:
    from inferscale_engine.engine import InferScaleEngine
    from inferscale_engine.memory import MemoryStore
    from inferscale_engine.types import AnySource


def warm_up(store: Any) -> None:
    """Load the store's embedder now: it loads lazily, with a progress bar, on first use, where
    it would hold up the first turn (or requests racing for it)."""
    embedder = getattr(store, "embedder", None)
    if embedder is not None and hasattr(embedder, "embed"):
        embedder.embed(["warm-up"])


@dataclass
class Runtime:
    """An engine serving the facts of its memory store; closing it closes both."""

    engine: InferScaleEngine
    memory: MemoryStore

    def close(self) -> None:
        self.engine.close()  # closes its store too

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build(engine_config: EngineConfig, memory_config: MemoryConfig | None = None) -> Runtime:
    """The engine of ``engine_config`` with the store of ``memory_config`` as its ``memory``."""
    from inferscale_engine.engine import InferScaleEngine
    from inferscale_engine.memory import MemoryStore

    engine = InferScaleEngine(**{f.name: getattr(engine_config, f.name) for f in dataclasses.fields(engine_config)})
    try:
        engine.memory = MemoryStore.for_engine(engine, memory_config)
    except BaseException:
        engine.close()
        raise
    return Runtime(engine, engine.memory)


@contextlib.contextmanager
def facts_from(engine: InferScaleEngine, source: AnySource) -> Iterator[None]:
    """``engine`` resolves handles through ``source`` (not its ``memory``) inside the block,
    and through whatever it used before after it, also when the block raises."""
    previous, engine.fact_source = engine.fact_source, source
    try:
        yield
    finally:
        engine.fact_source = previous
