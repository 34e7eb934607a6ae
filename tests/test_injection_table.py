"""The per-step injection table: every row's source address, cache slot and rotation."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import numpy as np
import pytest
import torch

from inferscale_engine.connector.exchange import Geometry, Location
from inferscale_engine.connector.plan import (
    InjectionPlan,
    LoadPieces,
    LoadRequest,
    SharedKV,
    SpanRef,
    parse_params,
)
from inferscale_engine.connector.table import InjectionTable, SpanColumns, SpanRows
from inferscale_engine.errors import ConnectorError
from inferscale_engine.kv import FactKV, layouts

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


def span_addresses(table: InjectionTable) -> np.ndarray:
    """Per span ``[K address, V address, K/V layer strides, K/V row strides, delta]`` (7 x spans)."""
    return table.data.cpu().numpy()[3 * table.rows :].reshape(7, table.spans)


def assert_rows_addressed(table: InjectionTable, parts: list[SpanRows]) -> None:
    """Every row of every layer resolves, through the table, to the tensors' own row addresses."""
    data, n = table.data.numpy(), table.rows
    span_of_row, row_in_span, cols = data[:n], data[n : 2 * n], span_addresses(table)
    for r in range(n):
        s, i = span_of_row[r], row_in_span[r]
        kv, row = parts[s].kv, parts[s].row
        es = kv.k.element_size()
        for layer in range(kv.k.shape[0]):
            assert cols[0, s] + (layer * cols[2, s] + i * cols[4, s]) * es == kv.k[layer, row + i].data_ptr()
            assert cols[1, s] + (layer * cols[3, s] + i * cols[5, s]) * es == kv.v[layer, row + i].data_ptr()


def test_layout_is_read_once_and_reused():
    span = kv(6, position=3)
    first = span.layout()
    assert span.layout() is first  # cached, not read again
    addresses, dtype, is_cuda, num_layers = first
    assert (dtype, is_cuda, num_layers) == (torch.float32, False, L)
    k_addr, v_addr, kl, vl, kr, vr = np.frombuffer(addresses, dtype=np.int64)
    assert (k_addr, v_addr) == (span.k.data_ptr(), span.v.data_ptr())
    assert (kl, kr, vl, vr) == (*span.k.stride()[:2], *span.v.stride()[:2])

    parts = [SpanRows(span, 1, 4, 5), SpanRows(span, 0, 1, -1)]
    slots = np.arange(20, 25, dtype=np.int64)
    once, twice = (InjectionTable.build(parts, slots, torch.device("cpu")) for _ in range(2))
    assert torch.equal(once.data, twice.data)
    assert_rows_addressed(twice, parts)


def test_rows_view_gets_its_own_addresses():
    span = kv(8, position=10)
    span.layout()  # the parent's layout is cached before the view is taken
    view = span.rows(3, 7)
    assert view.position == 13
    k_addr, v_addr = np.frombuffer(view.layout()[0], dtype=np.int64)[:2]
    assert (k_addr, v_addr) == (span.k[:, 3].data_ptr(), span.v[:, 3].data_ptr())
    assert k_addr != np.frombuffer(span.layout()[0], dtype=np.int64)[0]

    parts = [SpanRows(view, 1, 3, 0), SpanRows(span, 0, 2, 4)]
    table = InjectionTable.build(parts, np.arange(5, dtype=np.int64), torch.device("cpu"))
    assert_rows_addressed(table, parts)
    assert span_addresses(table)[0, 0] == span.k[:, 4].data_ptr()  # view row 1 is parent row 4


def test_strided_views_address_where_they_lie():
    block = torch.randn(2, L, 20, 3, D, dtype=torch.bfloat16)  # a tier's block, three heads
    paged = FactKV(block[0, :, 5:12], block[1, :, 5:12], 0)
    one_head = FactKV(block[0, :, 12:16, 1:2], block[1, :, 12:16, 2:3], 7)  # a tensor-parallel rank's slice
    last_layers = FactKV(block[0, 1:, 2:5], block[1, 1:, 2:5], 11)
    parts = [SpanRows(paged, 2, 5, 1), SpanRows(one_head, 0, 4, -3), SpanRows(paged, 0, 1, 0)]
    table = InjectionTable.build(parts, np.arange(10, dtype=np.int64), torch.device("cpu"))
    assert table.src_dtype == torch.bfloat16
    assert list(span_addresses(table)[6]) == [1, -3, 0]
    assert_rows_addressed(table, parts)
    assert_rows_addressed(InjectionTable.build([SpanRows(last_layers, 1, 2, 0)], np.arange(2), torch.device("cpu")),
                          [SpanRows(last_layers, 1, 2, 0)])


def test_rows_of_a_block_get_the_layouts_their_views_would_have_and_views_only_when_read():
    block = torch.randn(2, L, 30, H, D, dtype=torch.bfloat16)  # a tier's read: facts along tokens
    rows = [(0, 5, 0), (8, 7, 10), (16, 1, 20), (20, 9, 30)]  # each fact's rows, page padding between
    facts = FactKV.rows_of(block, rows, ready="event")
    for fact, (start, n, position) in zip(facts, rows):
        assert "k" not in fact.__dict__ and fact.num_tokens == n  # nothing viewed yet
        alone = FactKV(block[0, :, start : start + n], block[1, :, start : start + n], position)
        assert fact.layout() == alone.layout()
        assert fact.position == position and fact.ready == "event"
        assert torch.equal(fact.k, alone.k) and torch.equal(fact.v, alone.v)  # viewed on first read
        assert fact.k.data_ptr() == alone.k.data_ptr() and fact.v.stride() == alone.v.stride()
    parts = [SpanRows(f, 0, f.num_tokens, 1) for f in FactKV.rows_of(block, rows)]
    assert_rows_addressed(InjectionTable.build(parts, np.arange(sum(n for _, n, _ in rows)), torch.device("cpu")), parts)
    for other in (copy.deepcopy(facts[1]), pickle.loads(pickle.dumps(FactKV.rows_of(block, rows)[1]))):
        assert torch.equal(other.k, facts[1].k) and torch.equal(other.v, facts[1].v) and other.position == 10
        assert np.frombuffer(other.layout()[0], dtype=np.int64)[0] == other.k.data_ptr()
    assert FactKV.rows_of(block, []) == []
    with pytest.raises(ValueError, match="contiguous"):
        FactKV.rows_of(block[:, :, :10:2], [(0, 1, 0)])
    with pytest.raises(ValueError, match="outside"):
        FactKV.rows_of(block, [(25, 9, 0)])
    with pytest.raises(AttributeError, match="nope"):
        facts[0].nope  # noqa: B018


def test_copies_never_inherit_a_cached_layout():
    span = kv(4)
    span.layout()
    for other in (copy.deepcopy(span), pickle.loads(pickle.dumps(span)), dataclasses.replace(span, k=span.k.clone())):
        assert torch.equal(other.k, span.k) and other.position == span.position  # same KV, new memory
        assert np.frombuffer(other.layout()[0], dtype=np.int64)[0] == other.k.data_ptr() != span.k.data_ptr()
        if other.v is not span.v:
            assert np.frombuffer(other.layout()[0], dtype=np.int64)[1] == other.v.data_ptr() != span.v.data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_sources_elsewhere_are_copied_to_the_device_and_kept_alive():
    on_host, on_gpu = kv(3), kv(2).to("cuda")
    parts = [SpanRows(on_host, 1, 2, 0), SpanRows(on_gpu, 0, 2, 3)]
    table = InjectionTable.build(parts, np.arange(4), torch.device("cuda"))
    copied_k, copied_v = table.keepalive
    assert copied_k.is_cuda and torch.equal(copied_k.cpu(), on_host.k) and torch.equal(copied_v.cpu(), on_host.v)
    cols = span_addresses(table)
    assert (cols[0, 0], cols[1, 0]) == (copied_k[:, 1].data_ptr(), copied_v[:, 1].data_ptr())
    assert (cols[0, 1], cols[1, 1]) == (on_gpu.k.data_ptr(), on_gpu.v.data_ptr())
    assert on_host.layout()[2] is False  # the host copy's own layout is untouched


def test_columns_build_the_same_table():
    a, b = kv(5, position=2), kv(3, position=9)
    parts = [SpanRows(a, 1, 4, 6), SpanRows(b, 0, 3, -9)]
    slots = np.arange(40, 47, dtype=np.int64)
    columns = SpanColumns([a, b], np.array([1, 0]), np.array([4, 3]), np.array([6, -9]))
    by_rows = InjectionTable.build(parts, slots, torch.device("cpu"))
    by_columns = InjectionTable.build_columns(columns, slots, torch.device("cpu"))
    assert torch.equal(by_rows.data, by_columns.data)
    assert (by_columns.rows, by_columns.spans, by_columns.max_delta) == (7, 2, 9)
    empty = InjectionTable.build([], np.zeros(0, dtype=np.int64), torch.device("cpu"))
    assert (empty.rows, empty.spans, empty.max_delta, empty.data.numel()) == (0, 0, 0, 0)


def test_keys_and_values_of_different_dtypes_are_refused():
    mixed = FactKV(torch.randn(L, 2, H, D), torch.randn(L, 2, H, D).to(torch.bfloat16), 0)
    assert mixed.layout()[1] is None
    with pytest.raises(ValueError, match="spans of one injection must share a dtype"):
        InjectionTable.build([SpanRows(mixed, 0, 2, 0)], np.arange(2), torch.device("cpu"))
    with pytest.raises(ValueError, match="spans of one injection must share a dtype"):
        InjectionTable.build([SpanRows(kv(2), 0, 2, 0), SpanRows(mixed, 0, 2, 0)], np.arange(4), torch.device("cpu"))



def test_layouts_of_many_spans_read_each_one_once():
    """``layouts`` hands out the layouts FactKVs cached (rows of a tier's block, spans served
    before) and reads the others' from torch: each equal to ``FactKV.layout``."""
    block = torch.randn(2, L, 10, H, D)
    tier = FactKV.rows_of(block, [(0, 4, 0), (4, 6, 3)])
    fresh = [kv(3), kv(2, position=5)]
    mixed = [tier[0], fresh[0], tier[1], fresh[1]]
    assert layouts(mixed) == [f.layout() for f in mixed]
    assert layouts(mixed) == layouts(mixed[::-1])[::-1]  # cached now: the same again
    assert layouts([]) == []

def reference_pieces(plan: InjectionPlan, start: int, stop: int) -> list[tuple[str, int, int, int]]:
    """Every span scanned, as the scheduler did before bisecting: (key, row, position, count)."""
    pieces = []
    for span in plan.spans:
        lo, hi = max(span.position, start), min(span.end, stop)
        if lo < hi:
            pieces.append((span.key, lo - span.position, lo, hi - lo))
    return pieces


def shared(*keys: str) -> SharedKV:
    """Where a plan's KV would lie (the plan's own tests read no KV)."""
    geometry = Geometry(2, 2, 8, "float32")
    at = {key: Location(SEGMENT, 1024 * i, 0, 4) for i, key in enumerate(keys)}
    return SharedKV(geometry, at, {SEGMENT: {"name": SEGMENT, "size": 1 << 20}})


SEGMENT = "inferscale-" + "0" * 32


def test_plan_pieces_cover_every_range_as_a_scan_would():
    rng = np.random.default_rng(0)
    for lengths in ([5], [1, 1, 1], [3, 7, 1, 4, 2], rng.integers(1, 6, 12).tolist()):
        spans, position = [], 0
        for i, n in enumerate(lengths):
            spans.append(SpanRef(f"s{i}", position, n))
            position += n
        plan = InjectionPlan.of_spans(spans, shared(*(s.key for s in spans)))
        assert plan.spans == tuple(spans)
        for start in range(plan.end):
            for stop in range(start + 1, plan.end + 1):
                got = plan.pieces(start, stop)
                columns = (got.row, got.position, got.count)
                assert all(c.dtype == np.int64 for c in columns) and got.kvs is None
                rows = list(zip(got.keys, *(c.tolist() for c in columns)))
                assert rows == reference_pieces(plan, start, stop), (lengths, start, stop)
                assert int(got.count.sum()) == stop - start
    with pytest.raises(ValueError, match="not inside"):
        plan.pieces(0, plan.end + 1)
    with pytest.raises(ValueError, match="not inside"):
        plan.pieces(3, 3)


def test_plans_refuse_spans_that_do_not_tile_the_prefix():
    for spans in ([SpanRef("a", 1, 3)], [SpanRef("a", 0, 3), SpanRef("b", 4, 2)], [SpanRef("a", 0, 0)],
                  [SpanRef("a", 0, 3), SpanRef("b", 3, -1)]):
        with pytest.raises(ValueError, match="tile"):
            InjectionPlan.of_spans(spans, shared(*(s.key for s in spans)))
    with pytest.raises(ValueError, match="int64 bounds"):  # bounds of another dtype, or one too few
        InjectionPlan(("a",), np.array([0, 3], dtype=np.int32), shared("a"))
    with pytest.raises(ValueError, match="int64 bounds"):
        InjectionPlan(("a", "b"), np.array([0, 3], dtype=np.int64), shared("a", "b"))
    plan = InjectionPlan.tiling(["a"], [3], shared("a"))
    with pytest.raises(ValueError, match="read-only"):  # a plan's spans never move once planned
        plan.bounds[1] = 5


def test_a_plan_that_carries_its_kv_hands_each_piece_its_spans_own():
    """An owner in the workers' process stages nothing: the plan carries the FactKVs, and the
    pieces of any range get exactly those of their spans, by reference."""
    facts = (kv(4), kv(3, position=9), kv(5, position=2))
    carried = SharedKV(Geometry(L, H, D, "float32"), {}, {}, spans=facts)
    plan = InjectionPlan.tiling(["a", "b", "c"], [4, 3, 5], carried)
    got = plan.pieces(2, 10)
    assert got.kvs is not None and [id(f) for f in got.kvs] == [id(f) for f in facts]
    assert (got.row.tolist(), got.position.tolist(), got.count.tolist()) == ([2, 0, 0], [2, 4, 7], [2, 3, 3])
    got = plan.pieces(5, 6)
    assert got.kvs is not None and len(got.kvs) == 1 and got.kvs[0] is facts[1]
    assert parse_params(plan.to_params(inline=True)) is plan
    with pytest.raises(ConnectorError, match="cannot leave its process"):
        plan.to_params()
    with pytest.raises(ValueError, match="3 spans but KV for 2"):
        InjectionPlan.tiling(["a", "b", "c"], [4, 3, 5], SharedKV(carried.geometry, {}, {}, spans=facts[:2]))


NO_PIECES = LoadPieces((), np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))


def test_load_slots_are_block_times_size_plus_offset():
    rng = np.random.default_rng(1)
    for block_size in (1, 4, 16):
        block_ids = rng.permutation(100)[:12].tolist()
        capacity = 12 * block_size
        ranges = [(0, 1), (0, capacity), (block_size, 5 * block_size), (3, 3 + 2 * block_size + 1)]
        ranges += [sorted(rng.choice(capacity + 1, 2, replace=False).tolist()) for _ in range(20)]
        for start, stop in ranges:
            load = LoadRequest(block_ids, start, stop, NO_PIECES)
            want = [block_ids[p // block_size] * block_size + p % block_size for p in range(start, stop)]
            got = load.slots(block_size)
            assert got.dtype == np.int64 and got.tolist() == want
    with pytest.raises(ValueError, match="need 3 blocks"):
        LoadRequest([4, 9], 0, 9, NO_PIECES).slots(4)


def test_positions_to_recompute_travel_with_the_plan_and_are_checked():
    from inferscale_engine.connector.plan import parse_params

    plan = InjectionPlan.tiling(["head", "fact"], [4, 3], shared("head", "fact"), recompute=[4, 5])
    again = parse_params(plan.to_params())
    assert again == plan and again.recompute.tolist() == [4, 5]
    assert plan != InjectionPlan.tiling(["head", "fact"], [4, 3], shared("head", "fact"))
    assert "recompute" not in InjectionPlan.tiling(["head"], [4], shared("head")).to_params()["inferscale"]
    kept = InjectionPlan.tiling(["head", "fact"], [4, 3], shared("head", "fact"), recompute=[4, 5, 6], recompute_keep=0.15)
    assert parse_params(kept.to_params()).recompute_keep == 0.15 and parse_params(kept.to_params()) == kept
    with pytest.raises(ValueError, match="share of rows"):
        InjectionPlan.tiling(["head", "fact"], [4, 3], shared("head", "fact"), recompute=[4], recompute_keep=1.5)
    for bad in ([5, 4], [4, 4], [-1], [7]):  # not increasing, or outside the injected [0, 7)
        with pytest.raises(ValueError, match="positions to recompute"):
            InjectionPlan.tiling(["head", "fact"], [4, 3], shared("head", "fact"), recompute=bad)


def test_plans_travel_as_json_or_inline():
    from vllm import SamplingParams

    from inferscale_engine.connector.plan import CapturePlan, CaptureRange, parse_params

    plan = InjectionPlan.tiling(["head", "fact"], [4, 3], shared("head", "fact"))
    capture = CapturePlan((CaptureRange("c1", 2, 5),), shared("c1"))
    for p in (plan, capture):
        assert parse_params(p.to_params()) == p  # JSON: rebuilt and validated
        assert parse_params(p.to_params(inline=True)) is p
    # A plan whose KV has no location, or lies in a segment it does not describe, is refused.
    bad = plan.to_params()
    del bad["inferscale"]["kv"]["at"]["fact"]
    with pytest.raises(ValueError, match="no KV location"):
        parse_params(bad)
    bad = plan.to_params()
    bad["inferscale"]["kv"]["segments"] = {}
    with pytest.raises(ValueError, match="undescribed segments"):
        parse_params(bad)
    # Whatever a client of a vLLM server sends is refused with a ValueError, which the connector's
    # scheduler half logs and ignores: anything else raised there would stop vLLM's engine core.
    malformed = [{"inject": [["fact", 0, 3]], "kv": {}}, {"inject": 5}, {"inject": [["fact", 0]], "kv": {}},
                 {"capture": [["c1", "x", 2]], "kv": None}, "inject", ["inject"],
                 {"inject": [["fact", 0, 3]], "kv": {"geometry": [1, 2, 3, "bfloat16"], "at": [], "segments": {}}}]
    for ours in malformed:
        with pytest.raises(ValueError):
            parse_params({"inferscale": ours})
    # The engine's requests carry the plan inline with skip_clone: vLLM's clone must hand the
    # connector that same object, not a deep copy of it.
    params = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": plan.to_params(inline=True)},
                            skip_clone=True)
    assert parse_params(params.clone().extra_args["kv_transfer_params"]) is plan
    assert parse_params(None) is None and parse_params({}) is None


def test_pieces_of_the_whole_plan_cannot_move_its_spans():
    """The whole plan's pieces (a request bypassing vLLM's prefix cache loads it so) read the
    plan's own bounds: what they hand on is read-only, whoever holds them."""
    plan = InjectionPlan.tiling(["a", "b", "c"], [4, 3, 5], shared("a", "b", "c"))
    got = plan.pieces(0, plan.end)
    assert (got.keys, got.row.tolist(), got.position.tolist(), got.count.tolist()) == (
        ("a", "b", "c"), [0, 0, 0], [0, 4, 7], [4, 3, 5])
    with pytest.raises(ValueError, match="read-only"):
        got.position[0] = 1
    assert plan.bounds.tolist() == [0, 4, 7, 12]
