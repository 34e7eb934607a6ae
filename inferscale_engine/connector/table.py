"""The per-step injection table: which stored rows go to which cache slots, and where they lie.

Built on the host once per engine step, moved to the device in one copy, read by the fused
Triton writer (:mod:`inferscale_engine.rope_triton`). Spans are addressed where they lie in
device memory (strided views included), never gathered into one buffer first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from inferscale_engine.kv import FactKV

# Layout of ``InjectionTable.data`` (int64): three row columns of ``rows`` entries (span index,
# row inside the span, cache slot), then seven span columns of ``spans`` entries (K address,
# V address, K/V layer strides, K/V row strides in elements, rotation delta).
_DELTA = 6
_SPAN_COLS = 7


class SpanRows(NamedTuple):
    """Rows ``[row, row + count)`` of ``kv``, served ``delta`` positions after they were encoded."""

    kv: FactKV
    row: int
    count: int
    delta: int


@dataclass
class InjectionTable:
    """Everything one injection launch reads, in one int64 device tensor: per row its span,
    its row inside that span and its cache slot; per span its K/V addresses, strides and delta."""

    data: torch.Tensor
    rows: int
    spans: int
    src_dtype: torch.dtype
    max_delta: int
    keepalive: list[torch.Tensor]  # sources copied to the device for this launch

    @classmethod
    def build(cls, parts: Sequence[SpanRows], slots: np.ndarray, device: torch.device) -> "InjectionTable":
        """``parts`` in row order; ``slots`` the cache slot of every row (``sum(count)`` of them).
        Sources must be on ``device`` (others are copied there first, and kept alive here)."""
        cols, counts, keepalive = [], [], []
        dtype = parts[0].kv.k.dtype if parts else torch.float32
        on_cuda = device.type == "cuda"
        for kv, row, count, delta in parts:  # hundreds per step: keep it to attribute reads
            k, v = kv.k, kv.v
            if k.is_cuda != on_cuda:
                k, v = k.to(device), v.to(device)
                keepalive += [k, v]
            if k.dtype != dtype or v.dtype != dtype:
                raise ValueError("spans of one injection must share a dtype")
            (kl, kr, kh, kd), (vl, vr, vh, vd) = k.stride(), v.stride()
            if kd != 1 or vd != 1 or kh != k.shape[-1] or vh != v.shape[-1]:
                raise ValueError("span KV rows must be contiguous [heads, head_dim]")
            es = k.element_size()
            cols.append((k.data_ptr() + row * kr * es, v.data_ptr() + row * vr * es, kl, vl, kr, vr, delta))
            counts.append(count)
        counts_np = np.asarray(counts, dtype=np.int64)
        n = int(counts_np.sum())
        if len(slots) != n:
            raise ValueError(f"{n} rows but {len(slots)} slots")
        starts = np.cumsum(counts_np) - counts_np
        span_of_row = np.repeat(np.arange(len(parts), dtype=np.int64), counts_np)
        row_in_span = np.arange(n, dtype=np.int64) - np.repeat(starts, counts_np)
        span_cols = np.asarray(cols, dtype=np.int64).reshape(len(parts), _SPAN_COLS).T
        packed = np.concatenate([span_of_row, row_in_span, slots.astype(np.int64), span_cols.reshape(-1)])
        data = torch.from_numpy(packed)
        if on_cuda:  # pinned, so the copy does not wait for the work already queued
            data = data.pin_memory().to(device, non_blocking=True)
        max_delta = int(np.abs(span_cols[_DELTA]).max()) if len(parts) else 0
        return cls(data, n, len(parts), dtype, max_delta, keepalive)
