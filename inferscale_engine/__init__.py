"""InferScale: personalized LLM serving where memory costs no prefill."""

import os as _os

# Small matmuls stall ~8 ms each on busy-waiting OpenMP threads of small CPU boxes; this only
# takes effect when set before torch starts its thread pool, so it lives at package import.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from inferscale_engine.engine import GenerationResult, InferScaleEngine, Span, StreamDelta, Usage  # noqa: E402
from inferscale_engine.kv import FactKV  # noqa: E402

__all__ = ["FactKV", "GenerationResult", "InferScaleEngine", "Span", "StreamDelta", "Usage"]
__version__ = "0.1.0"
