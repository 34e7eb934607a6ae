"""Fused GPU path of :func:`inferscale_engine.rope.rotate`: rotate keys by their position delta
and scatter keys and values straight into a paged KV cache, reading every span where it lies.

Same math as the torch version (fp32 rotation, table from :class:`RopeTable`); the torch version
stays the reference and the CPU path. Sources are addressed through a per-span pointer table
(:class:`~inferscale_engine.connector.table.InjectionTable`), so spans are never gathered into
one buffer first. The cache must be viewable as ``[blocks, block_size, heads, head_dim]`` per K and V
(``compat.paged_kv_views`` finds those views, whatever their strides).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from inferscale_engine.connector.table import InjectionTable
from inferscale_engine.rope import RopeTable


# Row and span counts change with every step: specialising on them (divisibility by 16) would
# compile a new variant mid-serving.
@triton.jit(do_not_specialize=["N", "P", "LAYER0"])
def _inject_rows(
    TABLE, N, P, LAYER0,
    COS, SIN, KC_PTRS, VC_PTRS,
    s_cb, s_cn, s_ch,
    BLOCK_SIZE: tl.constexpr, H: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, SRC_DTYPE: tl.constexpr, CACHE_DTYPE: tl.constexpr,
):
    # One program moves one token row of one layer, all heads. TABLE: InjectionTable's layout.
    row = tl.program_id(0)
    layer = LAYER0 + tl.program_id(1)
    span = tl.load(TABLE + row)
    src_row = tl.load(TABLE + N + row)
    slot = tl.load(TABLE + 2 * N + row)
    spans = TABLE + 3 * N + span
    k_src = tl.load(spans + 0 * P).to(tl.pointer_type(SRC_DTYPE))
    v_src = tl.load(spans + 1 * P).to(tl.pointer_type(SRC_DTYPE))
    k_src += layer * tl.load(spans + 2 * P) + src_row * tl.load(spans + 4 * P)
    v_src += layer * tl.load(spans + 3 * P) + src_row * tl.load(spans + 5 * P)
    delta = tl.load(spans + 6 * P)
    dist = tl.abs(delta)
    sign = tl.where(delta < 0, -1.0, 1.0)
    half: tl.constexpr = ROT // 2

    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_D)[None, :]
    live = (h < H) & (j < D)
    x = tl.load(k_src + h * D + j, mask=live, other=0.0).to(tl.float32)
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
    xp = tl.load(k_src + h * D + partner, mask=live & rotating, other=0.0).to(tl.float32)
    c = tl.load(COS + dist * half + freq, mask=rotating, other=1.0)
    s = tl.load(SIN + dist * half + freq, mask=rotating, other=0.0) * sign
    out = tl.where(rotating, x * c + turn * xp * s, x)
    out = tl.where(delta == 0, x, out)  # unmoved rows keep their exact bits

    dst = (slot // BLOCK_SIZE) * s_cb + (slot % BLOCK_SIZE) * s_cn + h * s_ch + j
    kc = tl.load(KC_PTRS + layer).to(tl.pointer_type(CACHE_DTYPE))
    vc = tl.load(VC_PTRS + layer).to(tl.pointer_type(CACHE_DTYPE))
    tl.store(kc + dst, out.to(CACHE_DTYPE), mask=live)
    v = tl.load(v_src + h * D + j, mask=live)
    tl.store(vc + dst, v.to(CACHE_DTYPE), mask=live)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def inject_rows(
    table: InjectionTable,
    rope: RopeTable,
    key_caches: torch.Tensor,
    value_caches: torch.Tensor,
    cache_view: torch.Tensor,
    layers: tuple[int, int] | None = None,
) -> None:
    """Rotate and write ``table``'s rows into the paged cache's ``layers`` (``[start, stop)``,
    default all), in one launch.

    ``key_caches``/``value_caches`` are int64 device tensors of each layer's K/V view address;
    ``cache_view`` is one such ``[blocks, block_size, heads, head_dim]`` view (all share its
    strides, dtype and unit stride on the last axis).
    """
    start, stop = layers or (0, len(key_caches))
    if table.rows == 0 or stop <= start:
        return
    if rope.max_delta < table.max_delta:
        raise ValueError("position delta exceeds the rotary table")
    _, block_size, heads, dim = cache_view.shape
    _inject_rows[(table.rows, stop - start)](
        table.data, table.rows, table.spans, start,
        rope.cos, rope.sin, key_caches, value_caches,
        cache_view.stride(0), cache_view.stride(1), cache_view.stride(2),
        BLOCK_SIZE=block_size, H=heads, D=dim, ROT=rope.rotary_dim, NEOX=rope.is_neox_style,
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim),
        SRC_DTYPE=_TL_DTYPES[table.src_dtype], CACHE_DTYPE=_TL_DTYPES[cache_view.dtype],
    )


def cache_pointers(views: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Addresses of per-layer cache views, checked to share one layout, for :func:`inject_rows`."""
    ref = views[0]
    for c in views:
        if c.stride() != ref.stride() or c.dtype != ref.dtype or c.stride(-1) != 1:
            raise ValueError("paged cache views differ in layout")
    return torch.tensor([c.data_ptr() for c in views], dtype=torch.int64, device=device)
