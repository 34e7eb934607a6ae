"""Token-level recompute inside the injected region (``EngineConfig.recompute_tokens``), in the
connector's worker half.

Once a request's injected KV is in the paged cache, chosen positions of it (each memory's date
header, say: :mod:`inferscale_engine.token_recompute`) are computed again, as CacheBlend and EPIC
do, here layer by layer with the model's own modules: embed their tokens; at each layer take
their q/k/v from ``input_layernorm`` and ``self_attn.qkv_proj`` (Qwen3's ``q_norm``/``k_norm``),
rotate them at their *served* positions (``rotary_emb``), write their K/V over the injected rows
in the cache, let each attend causally over the request's whole prefix at that layer (the injected
rows and the recomputed ones), then ``o_proj``, the residual, ``post_attention_layernorm`` and
``mlp`` give the next layer's input. The last layer needs only its K/V.

What those rows hold is then what a prefill of the prompt would write, given the rest of the
prefix as it is: every row chosen means the prompt's KV up to kernel rounding (attention here is
torch's, not the backend's kernel: on the CPU in float32, on CUDA one fused SDPA call in the
model's precision, accumulating in float32 as the backend's kernel does). vLLM's forward pass runs
after, and the tokens it computes attend over the repaired rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from inferscale_engine import vllm_compat as compat

logger = logging.getLogger(__name__)

#: ``layer index -> (K, V)`` of a request's prefix rows ``[0, stop)`` at that layer, each
#: ``[stop, kv_heads, head_dim]``: what the paged cache holds, the rows :data:`RowWriter` wrote
#: at that layer included.
PrefixReader = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
#: ``(layer index, rows, K, V)``: write a layer's recomputed rows ``[len(rows), kv_heads, head_dim]``
#: to the cache; ``rows`` index the positions :meth:`LayerwiseRecompute.run` was given.
RowWriter = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]

#: The layer whose K/V deviation picks the rows kept (CacheBlend's check layer: the second).
SELECTION_LAYER = 1


class LayerwiseRecompute:
    """The model's decoder layers, run over a few chosen positions of a request at a time."""

    def __init__(self, model: Any, attention_layer_names: Sequence[str]) -> None:
        self._embed = compat.embed_tokens(model)
        self._layers = compat.decoder_layers(model, attention_layer_names)

    @torch.inference_mode()
    def run(self, token_ids: torch.Tensor, positions: torch.Tensor, prefix: PrefixReader, write: RowWriter,
            keep: float | None = None) -> None:
        """Recompute the KV of prompt ``positions`` (increasing, int64) holding ``token_ids``,
        each attending over the prefix rows ``[0, position]`` that ``prefix`` reads. With
        ``keep``, only that share of them from :data:`SELECTION_LAYER` on: the rows whose K/V
        there deviate most from the injected ones (CacheBlend); the others keep what was
        injected from that layer up."""
        rows = torch.arange(len(positions), device=positions.device)
        hidden = self._embed(token_ids)
        residual = hidden
        last = len(self._layers) - 1
        mask: torch.Tensor | None = None  # the fused attention's, the same at every layer: made once
        for index, (block, attn) in enumerate(self._layers):
            if index == 0:
                hidden = block.input_layernorm(hidden)
            else:
                hidden, residual = block.input_layernorm(hidden, residual)
            q, k, v = _qkv(attn, positions, hidden)
            k = k.reshape(len(positions), -1, attn.head_dim)
            v = v.reshape(len(positions), -1, attn.head_dim)
            if keep is not None and index == SELECTION_LAYER:
                injected_k, injected_v = prefix(index)  # read before this layer's rows are written
                chosen = most_deviating(k, v, injected_k[positions], injected_v[positions], keep)
                rows, positions, q, k, v, residual = (t[chosen] for t in (rows, positions, q, k, v, residual))
                mask = None
            write(index, rows, k, v)
            if index == last:
                break  # the last layer's output feeds nothing that is kept
            keys, values = prefix(index)
            q = q.reshape(len(positions), -1, attn.head_dim)
            if q.is_cuda:
                if mask is None:
                    mask = fused_mask(positions, len(keys), q.shape[1] // keys.shape[1])
                out = attend_fused(q, keys, values, mask, float(attn.scaling))
            else:
                out = attend_chunked(q, keys, values, positions, float(attn.scaling))
            hidden, _ = attn.o_proj(out.to(hidden.dtype))
            hidden, residual = block.post_attention_layernorm(hidden, residual)
            hidden = block.mlp(hidden)


class GraphedRecompute:
    """:meth:`LayerwiseRecompute.run` (every chosen row kept) captured as one CUDA graph per
    bucket of row count and prefix length, replayed with the request's rows and slots.

    Eagerly, the recompute's cost is the host's: ~1.5 ms of launches per layer whatever the row
    count (H100, Llama-3.1-8B shape: 48 ms at k=5), against ~0.13 ms of weight reads. A replay
    launches it all at once. Rows pad a bucket with slot -1 (vLLM's KV writes skip it) at
    position 0; prefix rows past the request's read slot 0, masked off for every real row.
    The first request of a bucket runs eagerly on the graph's buffers, then captures it."""

    def __init__(self, recompute: LayerwiseRecompute, read: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                 write: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None], device: torch.device) -> None:
        """``read(layer, slots)``: K and V of those cache slots at that layer;
        ``write(layer, slots, K, V)``: write rows there (slot -1: skipped)."""
        self._recompute = recompute
        self._read = read
        self._write = write
        self._device = device
        self._graphs: dict[tuple[int, int], _Graph | None] = {}
        self._pool: Any = None

    def run(self, token_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, prefix_slots: np.ndarray) -> bool:
        """Recompute rows ``positions`` (holding ``token_ids``, written to cache ``slots``) over
        the prefix in cache ``prefix_slots``; False where no bucket holds the request (the
        caller recomputes eagerly)."""
        bucket = _bucket(len(positions), len(prefix_slots))
        if bucket is None or not len(positions):
            return False
        if bucket not in self._graphs:
            self._graphs[bucket] = self._build(bucket, token_ids, positions, slots, prefix_slots)
            return True  # built by running it
        graph = self._graphs[bucket]
        if graph is None:
            return False
        graph.fill(token_ids, positions, slots, prefix_slots)
        graph.graph.replay()
        return True

    def _build(self, bucket: tuple[int, int], token_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
               prefix_slots: np.ndarray) -> _Graph | None:
        rows, keys = bucket
        graph = _Graph(rows, keys, self._device)
        graph.fill(token_ids, positions, slots, prefix_slots)

        def forward() -> None:
            self._recompute.run(graph.tokens, graph.positions, lambda index: self._read(index, graph.prefix),
                                lambda index, _rows, k, v: self._write(index, graph.slots, k, v))

        forward()  # this request's recompute, and the warm-up a capture needs
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph.graph, pool=self._pool, capture_error_mode="thread_local"):
                forward()
        except Exception as exc:  # a recompute that cannot be captured still runs, eagerly
            logger.warning("token-level recompute runs eagerly for %d rows over %d: CUDA graph capture failed: %s",
                           rows, keys, exc)
            return None
        return graph


class _Graph:
    """One bucket's graph and the static inputs it reads: tokens, positions and cache slots of
    the rows, cache slots of the prefix."""

    def __init__(self, rows: int, keys: int, device: torch.device) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.zeros(rows, dtype=torch.long, device=device)
        self.prefix = torch.zeros(keys, dtype=torch.long, device=device)

    def fill(self, token_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, prefix_slots: np.ndarray) -> None:
        n, s = len(positions), len(prefix_slots)
        host = torch.from_numpy(np.concatenate([token_ids, positions, slots, prefix_slots]).astype(np.int64))
        staged = host.to(self.tokens.device, non_blocking=False)
        self.tokens[:n] = staged[:n]
        self.positions[:n] = staged[n : 2 * n]
        self.slots[:n] = staged[2 * n : 3 * n]
        self.prefix[:s] = staged[3 * n :]
        self.tokens[n:] = staged[n - 1]  # any token: padding rows write nowhere
        self.positions[n:] = 0
        self.slots[n:] = -1
        self.prefix[s:] = staged[3 * n]  # slot 0's: past every real row's position, so masked


def _bucket(rows: int, keys: int) -> tuple[int, int] | None:
    """The graph bucket of a recompute: rows to the next power of two from 32 up to 256, then to
    the next multiple of 256 (a padded row costs what a real one does, and powers of two pad up
    to twice the rows); the prefix to the next multiple of 512. None past
    :data:`MAX_GRAPH_ROWS` / :data:`MAX_GRAPH_KEYS`."""
    if rows > MAX_GRAPH_ROWS or keys > MAX_GRAPH_KEYS:
        return None
    padded = max(32, 1 << (rows - 1).bit_length()) if rows <= 256 else -(-rows // 256) * 256
    return padded, -(-keys // 512) * 512


#: The largest recompute a graph takes; larger ones run eagerly. Its attention mask,
#: ``[rows * query heads per KV head, keys]`` booleans, is 128 MiB at 4,096 rows, 4 query heads
#: per KV head and 8,192 keys.
MAX_GRAPH_ROWS = 4096
MAX_GRAPH_KEYS = 8192


def _stops(positions: torch.Tensor) -> list[int]:
    """One past the last position of each chunk of :data:`_CHUNK` queries."""
    at = positions.tolist()
    return [at[min(len(at), lo + _CHUNK) - 1] + 1 for lo in range(0, len(at), _CHUNK)]


def most_deviating(k: torch.Tensor, v: torch.Tensor, old_k: torch.Tensor, old_v: torch.Tensor,
                    keep: float) -> torch.Tensor:
    """Indices (increasing) of the ``keep`` share of rows whose recomputed K and V deviate most
    from the injected ones, each relative to the injected row's own size (heads differ in scale)."""
    def relative(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        old = old.float()
        return (new.float() - old).pow(2).sum((1, 2)) / old.pow(2).sum((1, 2)).clamp_min(1e-12)

    deviation = relative(k, old_k) + relative(v, old_v)
    count = max(1, round(len(deviation) * keep))
    return torch.topk(deviation, count).indices.sort().values


def _qkv(attn: Any, positions: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention module's own q, k, v of ``hidden`` at ``positions``, as its forward makes them."""
    qkv, _ = attn.qkv_proj(hidden)
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    # Qwen3 always, Qwen2 where configured: per-head norms before the rotation.
    if getattr(attn, "q_norm", None) is not None and getattr(attn, "qk_norm", True):
        n, d = hidden.shape[0], attn.head_dim
        q = attn.q_norm(q.reshape(n, -1, d)).reshape(n, attn.q_size)
        k = attn.k_norm(k.reshape(n, -1, d)).reshape(n, attn.kv_size)
    q, k = attn.rotary_emb(positions, q, k)
    return q, k, v


def fused_mask(positions: torch.Tensor, keys: int, group: int) -> torch.Tensor:
    """:func:`attend_fused`'s mask: row ``g * n + i`` (query ``i`` of a KV head's ``g``-th query
    head, ``group`` query heads per KV head) sees the ``keys`` up to ``positions[i]``."""
    seen = torch.arange(keys, device=positions.device) <= positions[:, None]  # [n, keys]
    return seen.repeat(group, 1)


def attend_fused(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Causal attention of ``q`` ``[n, heads, d]`` over ``keys``/``values`` ``[S, kv_heads, d]``
    (grouped-query heads shared) under :func:`fused_mask`, flattened to ``[n, heads * d]``: one
    SDPA call in ``q``'s precision (its kernels accumulate in float32, as the backend's attention
    does), each KV head's query heads stacked as the rows of one head. On an H200 the chunked
    float32 path, without tensor cores, was more than half of a k=50 header recompute's GPU time
    (36 of 67 ms, Llama-3.1-8B shape)."""
    n, heads, d = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    k = keys.to(q.dtype).transpose(0, 1)[None]  # [1, kv_heads, S, d]
    v = values.to(q.dtype).transpose(0, 1)[None]
    rows = q.reshape(n, kv_heads, group, d).permute(1, 2, 0, 3).reshape(1, kv_heads, group * n, d)
    out = torch.nn.functional.scaled_dot_product_attention(rows, k, v, attn_mask=mask, scale=scale)
    return out.reshape(kv_heads, group, n, d).permute(2, 0, 1, 3).reshape(n, heads * d)


def attend_chunked(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Causal attention as :func:`attend_fused`'s, at ``positions``, in float32 (the CPU's path),
    by chunks of :data:`_CHUNK` queries, each over the keys up to its last position: memory stays
    bounded, and the causal half is not computed. Each KV head's query heads attend as one batch,
    not over copies of its keys. Plain matmul and softmax: torch's SDPA with a mask took 1.7x as
    long on the CPU (850 queries over 1,880 keys)."""
    n, heads, d = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    k = keys.float().transpose(0, 1)  # [kv_heads, S, d]
    v = values.float().transpose(0, 1)
    q = q.float().reshape(n, kv_heads, group, d).permute(1, 2, 0, 3)  # [kv_heads, group, n, d]
    out = torch.empty(kv_heads, group, n, d, dtype=torch.float32, device=q.device)
    for chunk, stop in enumerate(_stops(positions)):
        lo, hi = chunk * _CHUNK, min(n, (chunk + 1) * _CHUNK)
        rows = q[:, :, lo:hi].reshape(kv_heads, group * (hi - lo), d)
        scores = torch.bmm(rows, k[:, :stop].transpose(1, 2)).mul_(scale)
        future = torch.arange(stop, device=q.device) > positions[lo:hi, None]
        scores.view(kv_heads, group, hi - lo, stop).masked_fill_(future, float("-inf"))
        attended = torch.bmm(torch.softmax(scores, dim=-1), v[:, :stop])
        out[:, :, lo:hi] = attended.view(kv_heads, group, hi - lo, d)
    return out.permute(2, 0, 1, 3).reshape(n, heads * d)


#: Queries attended at once (bounds the ``[heads, chunk, keys]`` scores).
_CHUNK = 256
