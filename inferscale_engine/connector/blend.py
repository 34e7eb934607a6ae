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
torch's, in float32, not the backend's kernel). vLLM's forward pass runs after, and the tokens it
computes attend over the repaired rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from inferscale_engine import vllm_compat as compat

#: ``layer index -> (K, V)`` of a request's prefix rows ``[0, stop)`` at that layer, each
#: ``[stop, kv_heads, head_dim]``, as injected (before this layer's recomputed rows replace theirs).
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
        stops = _stops(positions)
        for index, (block, attn) in enumerate(self._layers):
            if index == 0:
                hidden = block.input_layernorm(hidden)
            else:
                hidden, residual = block.input_layernorm(hidden, residual)
            q, k, v = _qkv(attn, positions, hidden)
            k = k.reshape(len(positions), -1, attn.head_dim)
            v = v.reshape(len(positions), -1, attn.head_dim)
            selecting = keep is not None and index == SELECTION_LAYER
            keys, values = prefix(index) if index < last or selecting else (None, None)
            if selecting:
                assert keys is not None and values is not None and keep is not None
                chosen = _most_deviating(k, v, keys[positions], values[positions], keep)
                rows, positions, q, k, v, residual = (t[chosen] for t in (rows, positions, q, k, v, residual))
                stops = _stops(positions)
            write(index, rows, k, v)
            if index == last:
                break  # the last layer's output feeds nothing that is kept
            assert keys is not None and values is not None
            keys, values = keys.clone(), values.clone()  # may be the spans' own rows
            keys[positions] = k.to(keys.dtype)
            values[positions] = v.to(values.dtype)
            n = len(positions)
            out = _attend(q.reshape(n, -1, attn.head_dim), keys, values, positions, stops, float(attn.scaling))
            hidden, _ = attn.o_proj(out.to(hidden.dtype))
            hidden, residual = block.post_attention_layernorm(hidden, residual)
            hidden = block.mlp(hidden)


def _stops(positions: torch.Tensor) -> list[int]:
    """One past the last position of each chunk of :data:`_CHUNK` queries."""
    at = positions.tolist()
    return [at[min(len(at), lo + _CHUNK) - 1] + 1 for lo in range(0, len(at), _CHUNK)]


def _most_deviating(k: torch.Tensor, v: torch.Tensor, old_k: torch.Tensor, old_v: torch.Tensor,
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


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
            stops: list[int], scale: float) -> torch.Tensor:
    """Causal attention of ``q`` ``[n, heads, d]`` at ``positions`` over ``keys``/``values``
    ``[S, kv_heads, d]`` (grouped-query heads shared); float32, flattened to ``[n, heads * d]``.

    By chunks of :data:`_CHUNK` queries, each over the keys up to its last query's position
    (``stops``: one past each chunk's last position): memory stays bounded, and the causal half
    is not computed. Plain matmul and softmax: torch's SDPA with a mask took 1.7x as long on the
    CPU (850 queries over 1,880 keys)."""
    n, heads, d = q.shape
    group = heads // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, S, d]
    v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
    q = q.float().transpose(0, 1)  # [heads, n, d]
    out = torch.empty(heads, n, d, dtype=torch.float32, device=q.device)
    for chunk, stop in enumerate(stops):
        lo, hi = chunk * _CHUNK, min(n, (chunk + 1) * _CHUNK)
        scores = torch.matmul(q[:, lo:hi], k[:, :stop].transpose(1, 2)).mul_(scale)
        future = torch.arange(stop, device=q.device) > positions[lo:hi, None]
        scores.masked_fill_(future, float("-inf"))
        out[:, lo:hi] = torch.matmul(torch.softmax(scores, dim=-1), v[:, :stop])
    return out.transpose(0, 1).reshape(n, heads * d)


#: Queries attended at once (bounds the ``[heads, chunk, keys]`` scores).
_CHUNK = 256
