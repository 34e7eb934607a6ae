"""The per-step injection table: which stored rows go to which cache slots, and where they lie.

Built on the host once per engine step, moved to the device in one copy, read by the fused
Triton writer (:mod:`inferscale_engine.rope_triton`). Spans are addressed where they lie (device
memory, or pinned host memory that the device reads over PCIe), never gathered into one buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from inferscale_engine.kv import FactKV

# Layout of ``InjectionTable.data`` (int64): three row columns of ``rows`` entries (span index,
# row inside the span, cache slot), then seven span columns of ``spans`` entries (K address,
# V address, K/V layer strides, K/V row strides in elements, rotation delta).
_DELTA = 6
_SPAN_COLS = 7


@dataclass(frozen=True)
class SpanRows:
    """Rows ``[row, row + count)`` of ``kv``, served ``delta`` positions after they were encoded."""

    kv: FactKV
    row: int
    count: int
    delta: int  # serving position minus encode position of these rows


@dataclass
class InjectionTable:
    """Everything one injection launch reads, in one int64 device tensor: per row its span,
    its row inside that span and its cache slot; per span its K/V addresses, strides and delta."""

    data: torch.Tensor
    rows: int
    spans: int
    src_dtype: torch.dtype
    max_delta: int
    reads_host: bool  # some span is read from pinned host memory over PCIe
    keepalive: list[torch.Tensor]  # sources copied for this launch

    @classmethod
    def build(cls, parts: Sequence[SpanRows], slots: np.ndarray, device: torch.device) -> InjectionTable:
        """``parts`` in row order; ``slots`` the cache slot of every row (``sum(count)`` of them)."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        cols = np.empty((_SPAN_COLS, len(parts)), dtype=np.int64)
        counts = np.empty(len(parts), dtype=np.int64)
        dtype = None
        reads_host, keepalive = False, []
        for i, p in enumerate(parts):
            k, v = p.kv.k, p.kv.v
            if dtype is None:
                dtype = k.dtype
            if k.dtype != dtype or v.dtype != dtype:
                raise ValueError("spans of one injection must share a dtype")
            if k.device != device:
                if k.is_pinned() and v.is_pinned():
                    reads_host = True
                else:  # pageable memory cannot be read by the device: copy it over first
                    k, v = k.to(device), v.to(device)
                    keepalive += [k, v]
            (kl, kr, kh, kd), (vl, vr, vh, vd) = k.stride(), v.stride()
            d = k.shape[-1]
            if kd != 1 or vd != 1 or kh != d or vh != d:
                raise ValueError("span KV rows must be contiguous [heads, head_dim]")
            es = k.element_size()
            cols[:, i] = (k.data_ptr() + p.row * kr * es, v.data_ptr() + p.row * vr * es, kl, vl, kr, vr, p.delta)
            counts[i] = p.count
        n = int(counts.sum())
        if len(slots) != n:
            raise ValueError(f"{n} rows but {len(slots)} slots")
        starts = np.cumsum(counts) - counts
        span_of_row = np.repeat(np.arange(len(parts), dtype=np.int64), counts)
        row_in_span = np.arange(n, dtype=np.int64) - np.repeat(starts, counts)
        packed = np.concatenate([span_of_row, row_in_span, slots.astype(np.int64), cols.reshape(-1)])
        data = torch.from_numpy(packed).to(device, non_blocking=True)
        max_delta = int(np.abs(cols[_DELTA]).max()) if len(parts) else 0
        return cls(data, n, len(parts), dtype or torch.float32, max_delta, reads_host, keepalive)
