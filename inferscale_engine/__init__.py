"""InferScale: personalized LLM serving where memory costs no prefill."""

import os as _os
from typing import TYPE_CHECKING

# Small matmuls stall ~8 ms each on busy-waiting OpenMP threads of small CPU boxes; this only
# takes effect when set before torch starts its thread pool, so it lives at package import.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from inferscale_engine.logs import configure_vllm_logging as _configure_vllm_logging  # noqa: E402

# Before anything imports vLLM, which configures its logging (INFO, stdout) when imported.
_configure_vllm_logging()

from inferscale_engine.types import (  # noqa: E402  (after the environment setting above)
    DEFAULT_USER,
    FactSource,
    GenerationResult,
    Messages,
    Mode,
    Segment,
    Span,
    StreamDelta,
    Usage,
)

if TYPE_CHECKING:
    from inferscale_engine.engine import InferScaleEngine
    from inferscale_engine.kv import FactKV

__all__ = [
    "DEFAULT_USER",
    "FactKV",
    "FactSource",
    "GenerationResult",
    "InferScaleEngine",
    "Messages",
    "Mode",
    "Segment",
    "Span",
    "StreamDelta",
    "Usage",
]


def _installed_version() -> str:
    # pyproject.toml is the one place the version is written; an installed package (editable
    # included) carries it in its metadata.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("inferscale")
    except PackageNotFoundError:  # a source checkout on sys.path that was never pip-installed
        return "0+unknown"


__version__ = _installed_version()


def __getattr__(name: str):
    # Lazy: importing the engine imports vLLM (seconds), and FactKV torch; `inferscale --help`
    # and the memory or handle modules should not pay for either.
    if name == "FactKV":
        from inferscale_engine.kv import FactKV

        return FactKV
    if name == "InferScaleEngine":
        from inferscale_engine.engine import InferScaleEngine

        return InferScaleEngine
    raise AttributeError(f"module 'inferscale_engine' has no attribute {name!r}")
