"""InferScale: personalized LLM serving where memory costs no prefill."""

import os as _os
from typing import TYPE_CHECKING

# Small matmuls stall ~8 ms each on busy-waiting OpenMP threads of small CPU boxes; this only
# takes effect when set before torch starts its thread pool, so it lives at package import.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if TYPE_CHECKING:
    from inferscale_engine.engine import GenerationResult, InferScaleEngine, Span, StreamDelta, Usage
    from inferscale_engine.kv import FactKV

__all__ = ["FactKV", "GenerationResult", "InferScaleEngine", "Span", "StreamDelta", "Usage"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: importing the engine imports vLLM (seconds); `inferscale --help` and the memory or
    # handle modules should not pay for it.
    if name == "FactKV":
        from inferscale_engine.kv import FactKV

        return FactKV
    if name in __all__:
        from inferscale_engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'inferscale_engine' has no attribute {name!r}")
