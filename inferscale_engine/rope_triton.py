"""Fused GPU path of :func:`inferscale_engine.rope.rotate`: rotate keys by their position delta
and scatter keys and values straight into a paged KV cache, in one pass over the data.

Same math as the torch version (fp32 rotation, table from :class:`RopeTable`); the torch version
stays the reference and the CPU path. Needs a cache viewable as ``[blocks, block_size, heads,
head_dim]`` per K and V (``compat.paged_kv_views`` finds those views, whatever their strides).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferscale_engine.rope import RopeTable


@triton.jit
def _rotate_scatter(
    K, V, DELTA, SLOT, COS, SIN, KC_PTRS, VC_PTRS,
    s_kl, s_kn, s_kh, s_vl, s_vn, s_vh,
    s_cb, s_cn, s_ch,
    BLOCK_SIZE: tl.constexpr, H: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, CACHE_DTYPE: tl.constexpr,
):
    # One program moves one token row of one layer, all heads: a single launch covers the model.
    row = tl.program_id(0)
    layer = tl.program_id(1)
    slot = tl.load(SLOT + row)
    delta = tl.load(DELTA + row)
    dist = tl.abs(delta)
    sign = tl.where(delta < 0, -1.0, 1.0)
    half: tl.constexpr = ROT // 2

    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_D)[None, :]
    live = (h < H) & (j < D)
    src = K + layer * s_kl + row * s_kn + h * s_kh
    x = tl.load(src + j, mask=live, other=0.0).to(tl.float32)
    if NEOX:
        first = j < half
        partner = tl.where(first, j + half, j - half)
        freq = tl.where(first, j, j - half)
    else:
        first = (j % 2) == 0
        partner = tl.where(first, j + 1, j - 1)
        freq = j // 2
    turn = tl.where(first, -1.0, 1.0)
    rotating = j < ROT
    xp = tl.load(src + partner, mask=live & rotating, other=0.0).to(tl.float32)
    c = tl.load(COS + dist * half + freq, mask=rotating, other=1.0)
    s = tl.load(SIN + dist * half + freq, mask=rotating, other=0.0) * sign
    out = tl.where(rotating, x * c + turn * xp * s, x)
    out = tl.where(delta == 0, x, out)  # unmoved rows keep their exact bits

    dst = (slot // BLOCK_SIZE) * s_cb + (slot % BLOCK_SIZE) * s_cn + h * s_ch + j
    kc = tl.load(KC_PTRS + layer).to(tl.pointer_type(CACHE_DTYPE))
    vc = tl.load(VC_PTRS + layer).to(tl.pointer_type(CACHE_DTYPE))
    tl.store(kc + dst, out.to(CACHE_DTYPE), mask=live)
    v = tl.load(V + layer * s_vl + row * s_vn + h * s_vh + j, mask=live)
    tl.store(vc + dst, v.to(CACHE_DTYPE), mask=live)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def rotate_and_scatter(
    k: torch.Tensor,
    v: torch.Tensor,
    deltas: torch.Tensor,
    slots: torch.Tensor,
    table: RopeTable,
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
) -> None:
    """Write ``k`` rotated by ``deltas`` and ``v`` (``[layers, n, heads, head_dim]``) to ``slots``
    of every layer's cache, in one launch.

    ``key_caches``/``value_caches`` hold one ``[blocks, block_size, heads, head_dim]`` view per
    layer, all with the same strides and unit stride on the last axis.
    """
    layers, n, heads, dim = k.shape
    if n == 0:
        return
    if table.max_delta < int(deltas.abs().max()):
        raise ValueError("position delta exceeds the rotary table")
    ref = key_caches[0]
    for c in (*key_caches, *value_caches):
        if c.stride() != ref.stride() or c.dtype != ref.dtype or c.stride(-1) != 1:
            raise ValueError("paged cache views differ in layout")
    k, v = k.contiguous(), v.contiguous()
    kc_ptrs = torch.tensor([c.data_ptr() for c in key_caches], dtype=torch.int64, device=k.device)
    vc_ptrs = torch.tensor([c.data_ptr() for c in value_caches], dtype=torch.int64, device=k.device)
    _rotate_scatter[(n, layers)](
        k, v, deltas, slots, table.cos, table.sin, kc_ptrs, vc_ptrs,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        ref.stride(0), ref.stride(1), ref.stride(2),
        BLOCK_SIZE=ref.shape[1], H=heads, D=dim, ROT=table.rotary_dim, NEOX=table.is_neox_style,
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim),
        CACHE_DTYPE=_TL_DTYPES[ref.dtype],
    )
