"""How much of vLLM a library user sees.

vLLM's default is INFO and WARNING lines on stdout, mixed into the host program's own output
(about 33 per engine start). By default InferScale asks vLLM for errors only, on stderr; the
switch ``INFERSCALE_VERBOSE=1`` (or ``InferScaleEngine(verbose=True)``) leaves vLLM's own
defaults. The loading bars (vLLM's weight shards, the embedder's "Loading weights") follow the
same switch. Only what vLLM owns is touched: its ``VLLM_LOGGING_*`` settings (never over one the
user set) and its ``vllm`` logger; and, while the embedder loads, transformers' progress-bar switch
(restored after). The host's root logger, handlers and warning filters are not.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

_QUIET = {"VLLM_LOGGING_LEVEL": "ERROR", "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
#: The settings this module put in the environment (so verbose can take back only those).
_ours: dict[str, str] = {}


def verbose_from_env() -> bool:
    return os.environ.get("INFERSCALE_VERBOSE", "").strip().lower() not in ("", "0", "false", "no", "off")


def configure_vllm_logging(verbose: bool | None = None) -> None:
    """Quiet vLLM unless ``verbose`` (None: ``$INFERSCALE_VERBOSE``). Before vLLM is imported the
    environment decides; vLLM re-reads it when an engine starts, and its logger, configured at
    import, is adjusted in place."""
    if verbose is None:
        verbose = verbose_from_env()
    if verbose:
        for key, value in list(_ours.items()):
            if os.environ.get(key) == value:
                del os.environ[key]
            del _ours[key]
    else:
        for key, value in _QUIET.items():
            if key not in os.environ:
                os.environ[key] = _ours[key] = value
    if "vllm.logger" not in sys.modules:
        return
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    stream = sys.stderr if os.environ.get("VLLM_LOGGING_STREAM") == "ext://sys.stderr" else None
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.setLevel(level)
    for h in vllm_logger.handlers:
        h.setLevel(level)
        if stream is not None and isinstance(h, logging.StreamHandler) and h.stream is sys.stdout:
            h.setStream(stream)


def progress_bars() -> bool:
    """Whether the libraries' loading progress bars show (vLLM's weight shards, transformers'
    model loading): where vLLM's INFO logs do, not in the quiet default."""
    return os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper() in ("DEBUG", "INFO")


@contextlib.contextmanager
def transformers_progress(enabled: bool) -> Iterator[None]:
    """transformers' progress bars on or off for the block (its global switch, restored after)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()
