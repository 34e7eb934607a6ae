"""Full CUDA graphs for small prefills, kept only once checked on the model being served.

vLLM's default (``FULL_AND_PIECEWISE``) replays a whole-forward graph only for batches of
single-token decodes; a step with a prefill in it runs as graph pieces with attention launched
eagerly between them. An injected request computes only its question, so its step is a small
prefill, and ``cudagraph_mode=FULL`` replays it as one graph: about 3 ms less TTFT on an H200
(docs/benchmarks.md, "Full CUDA graphs"). vLLM 0.26 rates FlashAttention 3 safe for that, but
on a head_dim-64 Llama the replayed prefills computed wrong attention (keys off by ~130% from
the second layer on), while a Llama-3.1-8B shape was fine.

So the engine starts with ``FULL``, prefills the same tokens once past the largest graph size
(run without a graph) and once as a small batch (replayed as a graph), and keeps ``FULL`` only
where the rows agree; otherwise it restarts with vLLM's default.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from inferscale_engine.types import EncodeWindow

if TYPE_CHECKING:
    import torch

    from inferscale_engine.config import EngineConfig
    from inferscale_engine.kv import FactKV

FULL: dict[str, Any] = {"compilation_config": {"cudagraph_mode": "FULL"}}
#: Largest relative difference (per layer: max |diff| / max |value|) between graphed and
#: ungraphed prefill KV that still counts as the same computation. Measured on the H200 in
#: bf16: 0.0035 (Llama-3.1-8B shape) to 0.015 (tiny Llama, piecewise against eager) where the
#: graphs are right, 1.3-1.7 where they were wrong.
TOLERANCE = 0.1
#: The two graphed windows (one step, two sequences: a varlen batch like a served one).
_GRAPHED = (48, 80)
_PAST_GRAPHS = 16  # tokens beyond the largest graph size in the ungraphed reference


class GraphedEngine(Protocol):
    """What the check needs of a started engine (the engine imports this module, so it is
    named by shape rather than imported)."""

    vllm_config: Any
    max_model_len: int
    vocab_size: int

    def encode(self, windows: Sequence[EncodeWindow]) -> list[list[FactKV]]: ...


def wanted(cfg: EngineConfig) -> bool:
    """Whether to start with full graphs: CUDA, graphs on, no graph settings of the caller's,
    a cache layout the connector reads captures back from (no KV write hook runs inside a full
    graph), and room for a prefill longer than vLLM's default largest graph (256 tokens)."""
    options = cfg.vllm_options
    room = 256 + _PAST_GRAPHS
    return (
        cfg.device == "cuda"
        and not cfg.enforce_eager
        and "compilation_config" not in options
        and options.get("kv_cache_dtype", "auto") == "auto"
        and (cfg.max_model_len is None or cfg.max_model_len > room)
        and options.get("max_num_batched_tokens", room) >= room
    )


def prefill_error(engine: GraphedEngine, graph_max: int | None = None) -> float | None:
    """Largest relative difference between the KV of graphed and ungraphed prefills of the
    same tokens; ``None`` where no step can run without a graph.

    ``graph_max``: the largest step replayed as a graph (default: vLLM's setting).
    """
    if graph_max is None:
        graph_max = engine.vllm_config.compilation_config.max_cudagraph_capture_size or 0
    step_max = engine.vllm_config.scheduler_config.max_num_batched_tokens
    n = max(graph_max, max(_GRAPHED)) + _PAST_GRAPHS
    if n > step_max or n >= engine.max_model_len or sum(_GRAPHED) > graph_max:
        return None
    rng = random.Random(0)
    hi = min(engine.vocab_size, 32000) - 1
    ids = tuple(rng.randint(min(100, hi // 2), hi) for _ in range(n))
    # Separate calls: submitted together, the three would share one step too large for a graph.
    (reference,), = engine.encode([EncodeWindow(ids, ((0, n),))])
    graphed = engine.encode([EncodeWindow(ids[:m], ((0, m),)) for m in _GRAPHED])
    errors = [
        _relative(got, want[:, :m])
        for (kv,), m in zip(graphed, _GRAPHED)
        for got, want in ((kv.k, reference.k), (kv.v, reference.v))
    ]
    return math.nan if any(map(math.isnan, errors)) else max(errors)


def keep(error: float | None) -> bool:
    """Whether a :func:`prefill_error` result shows graphs computing what eager steps do (NaN
    or no check at all: no)."""
    return error is not None and error <= TOLERANCE


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got.float() - want.float()).abs().amax(dim=(1, 2, 3))
    return float((diff / want.float().abs().amax(dim=(1, 2, 3)).clamp(min=1e-30)).max())
