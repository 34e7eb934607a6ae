"""The per-step injection table: which stored rows go to which cache slots, and where they lie.

Built on the host once per engine step, moved to the device in one copy, read by the fused
Triton writer (:mod:`inferscale_engine.connector.rope_triton`). Spans are addressed where they lie in
device memory (strided views included), never gathered into one buffer first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from inferscale_engine.kv import FactKV, layouts

# Layout of ``InjectionTable.data`` (int64): three row columns of ``rows`` entries (span index,
# row inside the span, cache slot), then seven span columns of ``spans`` entries (K address,
# V address, K/V layer strides, K/V row strides in elements, rotation delta).
_DELTA = 6
_SPAN_COLS = 7
_ADDRESS_COLS = 6  # per span in KVLayout's addresses: K, V base addresses, K/V layer and row strides


class SpanRows(NamedTuple):
    """Rows ``[row, row + count)`` of ``kv``, served ``delta`` positions after they were encoded."""

    kv: FactKV
    row: int
    count: int  # type: ignore[assignment]  # shadows tuple.count: the field reads better
    delta: int


class SpanColumns(NamedTuple):
    """Many :class:`SpanRows` as columns: span ``i`` is rows ``[row[i], row[i] + count[i])`` of
    ``kv[i]``, served ``delta[i]`` positions after they were encoded. Hundreds of spans a step
    come this way, without a record per span."""

    kv: Sequence[FactKV]
    row: np.ndarray  # int64, as are count and delta
    count: np.ndarray  # type: ignore[assignment]  # shadows tuple.count, as SpanRows does
    delta: np.ndarray

    @classmethod
    def of(cls, parts: Sequence[SpanRows]) -> SpanColumns:
        kvs, rows, counts, deltas = zip(*parts) if parts else ((), (), (), ())
        return cls(kvs, _int64(rows), _int64(counts), _int64(deltas))


def _int64(values: Sequence[int]) -> np.ndarray:
    return np.array(values, dtype=np.int64)


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
    def build(cls, parts: Sequence[SpanRows], slots: np.ndarray, device: torch.device) -> InjectionTable:
        """``parts`` in row order; ``slots`` the cache slot of every row (``sum(count)`` of them).
        Sources must be on ``device`` (others are copied there first, and kept alive here)."""
        return cls.build_columns(SpanColumns.of(parts), slots, device)

    @classmethod
    def build_columns(cls, spans: SpanColumns, slots: np.ndarray, device: torch.device) -> InjectionTable:
        """:meth:`build` from spans given as columns."""
        kvs = spans.kv
        # Per span its FactKV's layout (torch is read once per FactKV, then it is cached); the
        # arithmetic is numpy's, over all spans at once.
        read = layouts(kvs)
        addresses, dtypes, is_cuda, _ = zip(*read) if read else ((), (), (), ())
        on_cuda = device.type == "cuda"
        keepalive: list[torch.Tensor] = []
        if is_cuda.count(not on_cuda):  # sources elsewhere: copied to the device for this launch
            kvs = [kv if there == on_cuda else kv.to(device) for kv, there in zip(kvs, is_cuda)]
            keepalive = [t for kv, old in zip(kvs, spans.kv) if kv is not old for t in (kv.k, kv.v)]
            addresses, dtypes, _, _ = zip(*layouts(kvs))
        dtype = dtypes[0] if dtypes else torch.float32
        if dtype is None or dtypes.count(dtype) != len(dtypes):
            raise ValueError("spans of one injection must share a dtype")
        if None in addresses:
            raise ValueError("span KV rows must be contiguous [heads, head_dim]")
        counts = spans.count
        n = int(counts.sum())
        if len(slots) != n:
            raise ValueError(f"{n} rows but {len(slots)} slots")

        span_cols = np.empty((_SPAN_COLS, len(kvs)), dtype=np.int64)
        if len(kvs):
            base = np.frombuffer(b"".join(addresses), dtype=np.int64).reshape(len(kvs), _ADDRESS_COLS).T
            first_row = spans.row * dtype.itemsize  # each span's address is that of its first row
            span_cols[0] = base[0] + first_row * base[4]
            span_cols[1] = base[1] + first_row * base[5]
            span_cols[2:6] = base[2:6]
            span_cols[_DELTA] = spans.delta
        starts = np.cumsum(counts) - counts
        span_of_row = np.repeat(np.arange(len(kvs), dtype=np.int64), counts)
        row_in_span = np.arange(n, dtype=np.int64) - np.repeat(starts, counts)
        packed = np.concatenate([span_of_row, row_in_span, slots.astype(np.int64), span_cols.reshape(-1)])
        data = torch.from_numpy(packed)
        if on_cuda:  # pinned, so the copy does not wait for the work already queued
            data = data.pin_memory().to(device, non_blocking=True)
        max_delta = int(np.abs(span_cols[_DELTA]).max()) if len(kvs) else 0
        return cls(data, n, len(kvs), dtype, max_delta, keepalive)
