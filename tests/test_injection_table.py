"""The per-step injection table: every row's source address, cache slot and rotation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inferscale_engine.connector.table import InjectionTable, SpanRows
from inferscale_engine.kv import FactKV

L, H, D = 3, 2, 4


def kv(n: int, position: int = 0, dtype=torch.float32) -> FactKV:
    return FactKV(torch.randn(L, n, H, D).to(dtype), torch.randn(L, n, H, D).to(dtype), position)


def test_rows_address_their_span_where_it_lies():
    plain = kv(5, position=10)
    block = torch.randn(2, L, 12, H, D)  # a tier's [2, layers, rows, heads, dim] block: strided views
    paged = FactKV(block[0, :, 4:11], block[1, :, 4:11], 0)
    parts = [SpanRows(plain, 1, 3, 7), SpanRows(paged, 0, 7, -2), SpanRows(plain, 4, 1, 0)]
    slots = np.arange(100, 111, dtype=np.int64)[::-1].copy()
    table = InjectionTable.build(parts, slots, torch.device("cpu"))

    assert (table.rows, table.spans, table.max_delta, table.keepalive) == (11, 3, 7, [])
    data = table.data.numpy()
    n, p = table.rows, table.spans
    span_of_row, row_in_span, slot = data[:n], data[n : 2 * n], data[2 * n : 3 * n]
    cols = data[3 * n :].reshape(7, p)
    assert list(span_of_row) == [0] * 3 + [1] * 7 + [2]
    assert list(row_in_span) == [0, 1, 2, *range(7), 0]
    assert list(slot) == list(slots)
    assert list(cols[6]) == [7, -2, 0]
    es = plain.k.element_size()
    for r in range(n):
        part = parts[span_of_row[r]]
        for layer in range(L):
            k_addr = cols[0, span_of_row[r]] + (layer * cols[2, span_of_row[r]] + row_in_span[r] * cols[4, span_of_row[r]]) * es
            v_addr = cols[1, span_of_row[r]] + (layer * cols[3, span_of_row[r]] + row_in_span[r] * cols[5, span_of_row[r]]) * es
            assert k_addr == part.kv.k[layer, part.row + row_in_span[r]].data_ptr()
            assert v_addr == part.kv.v[layer, part.row + row_in_span[r]].data_ptr()


def test_bad_tables_are_refused():
    with pytest.raises(ValueError, match="dtype"):
        InjectionTable.build([SpanRows(kv(2), 0, 2, 0), SpanRows(kv(2, dtype=torch.bfloat16), 0, 2, 0)],
                             np.arange(4), torch.device("cpu"))
    with pytest.raises(ValueError, match="slots"):
        InjectionTable.build([SpanRows(kv(2), 0, 2, 0)], np.arange(3), torch.device("cpu"))
    heads_apart = FactKV(torch.randn(L, 2, D, H).transpose(2, 3), torch.randn(L, 2, H, D), 0)
    with pytest.raises(ValueError, match="contiguous"):
        InjectionTable.build([SpanRows(heads_apart, 0, 2, 0)], np.arange(2), torch.device("cpu"))
