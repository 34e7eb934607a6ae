"""Tensor parallelism's share of a span carried by reference, on the CPU: the connector's worker
half on rank r of R reads KV heads [r*H/R, (r+1)*H/R) of the very rows the tiers handed out
(views of one block, as ``FactKV.rows_of`` makes them), and the addresses the fused writer reads
follow from that view. The two-rank engine test (test_tensor_parallel.py) covers spans in shared
memory end to end."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from inferscale_engine.connector.exchange import Geometry
from inferscale_engine.connector.plan import LoadPieces
from inferscale_engine.connector.worker import rank_heads
from inferscale_engine.kv import FactKV
from inferscale_engine.testing import rank_span_kvs

LAYERS, TOKENS, DIM = 3, 40, 8


def _block(heads: int) -> torch.Tensor:
    """A ``[2, layers, tokens, heads, dim]`` block whose every element is distinct."""
    return torch.arange(2 * LAYERS * TOKENS * heads * DIM, dtype=torch.float32).view(2, LAYERS, TOKENS, heads, DIM)


@pytest.mark.parametrize(("heads", "ranks"), [(4, 1), (4, 2), (4, 4), (8, 2), (8, 4)])
def test_each_rank_takes_exactly_its_heads_of_a_span_by_reference(heads, ranks):
    block = _block(heads)
    rows = [(0, 28, 5), (32, 7, 100)]  # (first row, rows, position): facts with page padding between
    ready = object()
    kvs = FactKV.rows_of(block, rows, ready)
    pieces = LoadPieces(keys=["a", "b"], row=np.zeros(2, dtype=np.int64), position=np.array([70, 98]),
                        count=np.array([n for _, n, _ in rows]), kvs=kvs)
    geometry = Geometry(LAYERS, heads, DIM, "float32")
    local = heads // ranks
    seen = torch.zeros(heads, dtype=torch.int64)
    for rank in range(ranks):
        first, last = rank_heads(heads, local, rank, ranks)
        assert (first, last) == (rank * heads // ranks, (rank + 1) * heads // ranks)
        seen[first:last] += 1
        read = rank_span_kvs(pieces, geometry, rank, ranks)  # what the worker on this rank injects
        assert len(read) == len(rows)
        for mine, (start, n, position) in zip(read, rows):
            assert torch.equal(mine.k, block[0, :, start : start + n, first:last])
            assert torch.equal(mine.v, block[1, :, start : start + n, first:last])
            assert mine.position == position and mine.ready is ready and mine.num_tokens == n
            # What the fused writer reads: this rank's first head of the span's first row, and
            # the block's strides (a row of all heads, a layer of all rows).
            addresses, dtype, is_cuda, num_layers = mine.layout()
            assert addresses is not None, "a rank's heads of a row are one contiguous run"
            row_bytes = heads * DIM * block.element_size()
            head_bytes = DIM * block.element_size()
            k0 = block[0].data_ptr() + start * row_bytes + first * head_bytes
            v0 = block[1].data_ptr() + start * row_bytes + first * head_bytes
            assert struct.unpack("=6q", addresses) == (k0, v0, TOKENS * heads * DIM, TOKENS * heads * DIM,
                                                       heads * DIM, heads * DIM)
            assert (dtype, is_cuda, num_layers) == (block.dtype, False, LAYERS)
    assert seen.tolist() == [1] * heads  # every head on exactly one rank


def test_more_ranks_than_heads_replicate_one_head_each():
    # vLLM replicates KV heads when R > H: ranks 0-1 hold head 0, ranks 2-3 head 1.
    assert [rank_heads(2, 1, rank, 4) for rank in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    block = _block(2)
    kvs = FactKV.rows_of(block, [(3, 10, 0)])
    pieces = LoadPieces(keys=["a"], row=np.zeros(1, dtype=np.int64), position=np.array([5]), count=np.array([10]), kvs=kvs)
    for rank in range(4):
        (mine,) = rank_span_kvs(pieces, Geometry(LAYERS, 2, DIM, "float32"), rank, 4)
        assert torch.equal(mine.k, block[0, :, 3:13, rank // 2 : rank // 2 + 1])
        assert torch.equal(mine.v, block[1, :, 3:13, rank // 2 : rank // 2 + 1])
