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
    K, V, DELTA, SLOT, COS, SIN, KC, VC,
    s_kn, s_kh, s_vn, s_vh,
    s_kcb, s_kcn, s_kch, s_vcb, s_vcn, s_vch,
    BLOCK_SIZE: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, NEOX: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(SLOT + row)
    delta = tl.load(DELTA + row)
    dist = tl.abs(delta)
    sign = tl.where(delta < 0, -1.0, 1.0)
    half: tl.constexpr = ROT // 2

    j = tl.arange(0, BLOCK_D)
    in_d = j < D
    x = tl.load(K + row * s_kn + head * s_kh + j, mask=in_d, other=0.0).to(tl.float32)
    if NEOX:
        first = j < half
        partner = tl.where(first, j + half, j - half)
        freq = tl.where(first, j, j - half)
        turn = tl.where(first, -1.0, 1.0)
    else:
        first = (j % 2) == 0
        partner = tl.where(first, j + 1, j - 1)
        freq = j // 2
        turn = tl.where(first, -1.0, 1.0)
    rotating = j < ROT
    xp = tl.load(K + row * s_kn + head * s_kh + partner, mask=rotating, other=0.0).to(tl.float32)
    c = tl.load(COS + dist * half + freq, mask=rotating, other=1.0)
    s = tl.load(SIN + dist * half + freq, mask=rotating, other=0.0) * sign
    out = tl.where(rotating, x * c + turn * xp * s, x)
    out = tl.where(delta == 0, x, out)  # unmoved rows keep their exact bits

    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    kc = KC + block * s_kcb + offset * s_kcn + head * s_kch + j
    tl.store(kc, out.to(KC.dtype.element_ty), mask=in_d)
    v = tl.load(V + row * s_vn + head * s_vh + j, mask=in_d)
    vc = VC + block * s_vcb + offset * s_vcn + head * s_vch + j
    tl.store(vc, v.to(VC.dtype.element_ty), mask=in_d)


def rotate_and_scatter(
    k: torch.Tensor,
    v: torch.Tensor,
    deltas: torch.Tensor,
    slots: torch.Tensor,
    table: RopeTable,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
) -> None:
    """Write ``k`` rotated by ``deltas`` and ``v`` (``[n, heads, head_dim]``) to ``slots``.

    ``key_cache``/``value_cache`` are ``[blocks, block_size, heads, head_dim]`` views with
    unit stride on the last axis.
    """
    n, heads, dim = k.shape
    if n == 0:
        return
    if table.max_delta < int(deltas.abs().max()):
        raise ValueError("position delta exceeds the rotary table")
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1
    grid = (n, heads)
    _rotate_scatter[grid](
        k, v, deltas, slots, table.cos, table.sin, key_cache, value_cache,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        BLOCK_SIZE=key_cache.shape[1], D=dim, ROT=table.rotary_dim, NEOX=table.is_neox_style,
        BLOCK_D=triton.next_power_of_2(dim),
    )
