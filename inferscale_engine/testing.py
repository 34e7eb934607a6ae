"""What tests and measurement scripts may look at and do that the serving API does not offer.

Tests of InferScale (its own, and a user's of a component built on it) sometimes need to see
inside a request (the prompt vLLM gets, the spans staged for it), to count what a cache holds, or
to make a fault happen (a stuck encoder, a preemption, a busy GPU stream). They do it through
the functions here, never through private attributes: the internals a test depends on are then
listed in one module, under names that say what the test needs, and change with the code they
look at. Nothing here is needed to serve, and none of it is part of the serving API's promises
(``tests/test_public_api.py`` keeps tests and scripts to this module and the public names).

The engine, the store and vLLM are imported by the functions that need them: importing this
module starts none of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inferscale_engine.types import DEFAULT_USER, MemoryMix, Segment

if TYPE_CHECKING:
    import torch

    from inferscale_engine.connector.exchange import Geometry, KVExchange
    from inferscale_engine.connector.plan import LoadPieces
    from inferscale_engine.engine import InferScaleEngine
    from inferscale_engine.handles import Handle
    from inferscale_engine.kv import FactKV
    from inferscale_engine.memory import MemoryStore
    from inferscale_engine.memory.encoding import Encoder
    from inferscale_engine.memory.text.embedder import Embedder
    from inferscale_engine.memory.text.query_graph import GraphedQueryEncoder

__all__ = [
    "PreparedRequest",
    "cached_static_spans",
    "encoder_replaced",
    "has_unfinished_requests",
    "kv_digest",
    "memory_swapped_out",
    "model_fingerprint",
    "preempted_requests",
    "prepared",
    "query_embedding_eager",
    "query_graph_buckets",
    "rank_span_kvs",
    "recompute_attention",
    "reset_prefix_cache",
    "segment_free_ranges",
    "share_embedder_weights",
    "spin_gpu",
    "sse_events",
    "staged_refs",
    "takes_graphed_path",
    "verify_handle",
    "watching_prepare",
]

# ---------------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class PreparedRequest:
    """One request as the engine hands it to vLLM, before it runs.

    ``prompt`` is vLLM's token prompt (``prompt_token_ids``, and ``cache_salt`` where the
    request's blocks are salted); ``params`` its ``SamplingParams`` (the request's own: set
    ``logprobs`` on them before running it to see every token's); ``started`` the ``perf_counter()`` its preparation began at
    (what the engine loop counts time to first token from); ``memory_mix`` how the cost model
    served its memories (``None`` in ``mode="prompt"``)."""

    prompt: dict[str, Any]
    params: Any
    started: float
    memory_mix: MemoryMix | None
    #: Span keys staged in the engine's KV exchange for this request (released when
    #: :func:`prepared`'s block ends; a request the engine runs itself, when it ends).
    staged: tuple[str, ...]

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self.prompt["prompt_token_ids"])

    @property
    def cache_salt(self) -> str | None:
        return self.prompt.get("cache_salt")


def _public(prepared: Any, params: Any) -> PreparedRequest:
    return PreparedRequest(prepared.prompt, params, prepared.started, prepared.memory_mix,
                           tuple(s.key for s in prepared.staged))


@contextlib.contextmanager
def prepared(engine: InferScaleEngine, segments: Sequence[Segment], user_id: str = DEFAULT_USER,
             **options: Any) -> Iterator[PreparedRequest]:
    """The engine's preparation of one request alone, as :meth:`InferScaleEngine.generate_segments`
    would send it (``options`` as it takes them: ``max_tokens``, ``mode``, ``recompute``...).

    Its spans stay staged inside the block, released at its end: run it inside with
    ``engine.loop.iterate(p.prompt, p.params, p.started)``, or look at it without running it."""
    request, params = engine._prepare(segments, user_id, **options)
    try:
        yield _public(request, params)
    finally:
        engine._unstage(request.staged)


@contextlib.contextmanager
def watching_prepare(engine: InferScaleEngine, record: Callable[[str, PreparedRequest], None]) -> Iterator[None]:
    """Inside the block ``record(user_id, request)`` sees every request ``engine`` prepares, from
    any entry point (Python, the HTTP server, the integrations); a request refused before vLLM
    would get it is never seen."""
    prepare = engine._prepare

    def watched(segments: Sequence[Segment], user_id: str, **kw: Any) -> Any:
        request, params = prepare(segments, user_id, **kw)
        record(user_id, _public(request, params))
        return request, params

    engine.__dict__["_prepare"] = watched
    try:
        yield
    finally:
        engine.__dict__.pop("_prepare", None)


def cached_static_spans(engine: InferScaleEngine) -> int:
    """How many prompt heads and separators the engine holds encoded for reuse (per user unless
    ``shared_prefix_cache``)."""
    return len(engine._static)


def reset_prefix_cache(engine: InferScaleEngine) -> bool:
    """Empty vLLM's prefix cache (``True`` when no running request held a block of it)."""
    return bool(engine._vllm.reset_prefix_cache())


def has_unfinished_requests(engine: InferScaleEngine) -> bool:
    """Whether vLLM still runs (or holds queued) requests of this engine: an aborted one is gone
    from it once this is ``False``."""
    return bool(engine._vllm.has_unfinished_requests())


@contextlib.contextmanager
def preempted_requests() -> Iterator[list[str]]:
    """The ids of the requests vLLM's scheduler preempts (to free KV cache for others) inside the
    block, in order; an in-process engine's scheduler only (``multiprocess=False``)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    ids: list[str] = []
    preempt = Scheduler._preempt_request

    def counted(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        ids.append(request.request_id)
        return preempt(self, request, *args, **kwargs)

    Scheduler._preempt_request = counted  # type: ignore[method-assign]
    try:
        yield ids
    finally:
        Scheduler._preempt_request = preempt  # type: ignore[method-assign]


# ---------------------------------------------------------------------------------- KV exchange


def staged_refs(exchange: KVExchange) -> dict[str, int]:
    """Spans staged in the exchange (``engine.exchange``) for requests in flight, and how many
    use each; a span no request uses any more is not among them (even where the exchange keeps
    it for reuse: :meth:`KVExchange.holds` says that)."""
    return {key: staged.refs for key, staged in exchange._staged.items()}


def segment_free_ranges(exchange: KVExchange) -> dict[str, list[tuple[int, int]]]:
    """The exchange's shared-memory segments by name, each with its free ``(offset, size)`` byte
    ranges, by offset."""
    return {name: list(segment.free) for name, segment in exchange._segments.items()}


# ---------------------------------------------------------------------------------- store


@contextlib.contextmanager
def memory_swapped_out(engine: InferScaleEngine) -> Iterator[None]:
    """Inside the block the engine holds no store: its next use of :attr:`InferScaleEngine.memory`
    builds one from ``engine.config`` as it is then (another ``store_path``...). At the end a
    store built inside is closed and the one held before is back."""
    held, calibration = engine._memory, engine._calibration
    engine._memory, engine._calibration = None, None
    try:
        yield
    finally:
        built = engine._memory
        if built is not None and built is not held:
            built.close()
        engine._memory, engine._calibration = held, calibration


@contextlib.contextmanager
def encoder_replaced(store: MemoryStore, wrap: Callable[[Encoder], Encoder]) -> Iterator[None]:
    """Inside the block the store's KV keeper encodes facts with ``wrap(its encoder)`` (one that
    stalls, fails, counts...); the store's own encoder is back at the end."""
    keeper = store._keeper
    if keeper is None:
        raise ValueError("this store has no encoder (it was opened without an engine)")
    own = keeper.encoder
    keeper.encoder = wrap(own)
    try:
        yield
    finally:
        keeper.encoder = own


def rank_span_kvs(pieces: LoadPieces, geometry: Geometry, rank: int, ranks: int) -> Sequence[FactKV]:
    """The KV the connector's worker half on tensor-parallel rank ``rank`` of ``ranks`` reads for
    ``pieces`` whose spans the plan carries by reference (``pieces.kvs``), for KV of
    ``geometry``: the worker placed as its geometry check places it (``rank_heads``, each rank
    holding ``heads // ranks`` KV heads, at least one), no vLLM behind it."""
    from inferscale_engine.connector.worker import ConnectorWorker, rank_heads

    worker = ConnectorWorker(block_size=16, fused=False)
    worker._geometry = geometry
    worker._heads = rank_heads(geometry.heads, max(1, geometry.heads // ranks), rank, ranks)
    return worker._load_kvs(pieces)


def verify_handle(store: MemoryStore, handle: Handle | str, user_id: str) -> str:
    """The fact id ``handle`` names if its MAC is valid under the store's secret for ``user_id``
    (:class:`~inferscale_engine.errors.ForgedHandleError` if not); whether the fact exists is not
    checked."""
    return store._codec.verify(handle, user_id)


def share_embedder_weights(source: Embedder, target: Embedder) -> None:
    """``target`` embeds with ``source``'s loaded model (a second store without a second load)."""
    target._model = source.model


def takes_graphed_path(embedder: Embedder, model: Any) -> bool:
    """Whether ``embedder`` embeds a search's one query with ``model`` through a CUDA graph."""
    return embedder._graphable(model)


def query_embedding_eager(model: Any, token_ids: list[int]) -> torch.Tensor:
    """One query's embedding by the query path's own computation, run eagerly on ``model``'s
    device (no graph): what a graphed replay of
    :class:`~inferscale_engine.memory.text.query_graph.GraphedQueryEncoder` must match."""
    import torch

    from inferscale_engine.memory.text import query_graph

    device = next(model.parameters()).device
    ids = torch.tensor([token_ids], device=device)
    with torch.inference_mode():
        return query_graph._embed(model, ids, torch.ones_like(ids))


def query_graph_buckets(encoder: GraphedQueryEncoder) -> list[int]:
    """The query lengths (buckets) ``encoder`` holds a captured CUDA graph for, ascending."""
    return sorted(bucket for bucket, graph in encoder._graphs.items() if graph is not None)


def recompute_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                        scale: float, *, fused: bool) -> torch.Tensor:
    """The token-level recompute's causal attention of rows ``q`` ``[n, heads, d]`` at
    ``positions`` over a prefix's ``keys``/``values`` ``[S, kv_heads, d]``: the fused path CUDA
    takes (one SDPA call in ``q``'s precision) or the chunked float32 one of the CPU."""
    from inferscale_engine.connector import blend

    if fused:
        mask = blend.fused_mask(positions, keys.shape[0], q.shape[1] // keys.shape[1])
        return blend.attend_fused(q, keys, values, mask, scale)
    return blend.attend_chunked(q, keys, values, positions, scale)


# ---------------------------------------------------------------------------------- KV files, GPU


def kv_digest(k: torch.Tensor, v: torch.Tensor) -> str:
    """The SHA-256 a disk-tier file records of its K and V (``read_metadata``'s ``sha256``),
    checked on every read from disk."""
    from inferscale_engine.memory.kv import disk_tier

    return disk_tier._digest(k, v)


def spin_gpu(cycles: int) -> None:
    """Queue about ``cycles`` GPU clock cycles of busy work on the current CUDA stream (a stream
    made busy: what runs after it on that stream waits, what runs elsewhere must not)."""
    import torch

    torch.cuda._sleep(cycles)


# ---------------------------------------------------------------------------------- model, remote


def model_fingerprint(model_path: str | Path, vllm_config: Any) -> str:
    """What the engine records as its KV fingerprint for a model folder under a vLLM config:
    stored KV made under another fingerprint is never served."""
    from inferscale_engine import engine

    return engine._fingerprint(str(model_path), vllm_config)


def sse_events(content: Any) -> AsyncIterator[dict[str, Any]]:
    """The front end's reader of a ``vllm serve`` stream: the JSON of each ``data:`` event of
    ``content`` (an object with aiohttp's ``iter_any()``), up to ``[DONE]``."""
    from inferscale_engine import remote

    return remote._events(content)
