"""The shared-memory KV exchange between the process holding facts and vLLM's workers (CPU).

A worker is another process: the spans staged here are read there by descriptor alone, and
what it writes into a capture's room comes back here, bit for bit.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from inferscale_engine.connector.exchange import ExchangeReader, Geometry, KVExchange, Location, NotHeldError
from inferscale_engine.errors import ConnectorError
from inferscale_engine.kv import FactKV
from inferscale_engine.testing import segment_free_ranges, staged_refs

GEOMETRY = Geometry(layers=3, heads=2, head_dim=8, dtype="bfloat16")


def _fact(n: int, seed: int, position: int = 0) -> FactKV:
    g = torch.Generator().manual_seed(seed)
    shape = (GEOMETRY.layers, n, GEOMETRY.heads, GEOMETRY.head_dim)
    return FactKV(torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16(), position)


def _worker(descriptors, spans, room, heads, out) -> None:
    """In another process: read spans, and fill a capture room's ``heads`` with 1s."""
    reader = ExchangeReader()
    reader.map(descriptors)
    out.put([tuple(t.float().numpy().copy() for t in reader.views(loc, GEOMETRY)) for loc in spans])  # not torch's fd-shared pickles
    k, v, filled = reader.views(room, GEOMETRY, flags=True)
    k[:, :, heads], v[:, :, heads] = 1, 2
    filled[:, :, heads] = 1
    out.put("done")


def _in_worker(descriptors, spans, room, heads) -> list:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(descriptors, spans, room, heads, out))
    proc.start()
    read, done = out.get(timeout=120), out.get(timeout=120)
    proc.join(timeout=60)
    assert done == "done" and proc.exitcode == 0
    return read


def test_another_process_reads_staged_spans_and_fills_capture_rooms():
    exchange = KVExchange(GEOMETRY, "cpu", segment_bytes=1 << 16)
    try:
        facts = {"a": _fact(5, 0, position=7), "b": _fact(40, 1), "c": _fact(300, 2)}  # c: a segment of its own
        shared = exchange.stage(list(facts.items()))
        at = shared.at
        assert shared.ready is None and set(shared.segments) == {loc.segment for loc in at.values()}
        assert len({loc.segment for loc in at.values()}) == 2 and at["a"].position == 7
        room = exchange.reserve_capture(4)
        names = {loc.segment for loc in [*at.values(), room]}
        read = _in_worker(exchange.descriptors(names), [at[k] for k in facts], room, slice(0, 2))
        for (k, v), fact in zip(read, facts.values()):
            assert torch.equal(torch.from_numpy(k), fact.k.float()) and torch.equal(torch.from_numpy(v), fact.v.float())
        captured = exchange.take_capture(room, position=3)
        assert captured.position == 3 and bool((captured.k == 1).all()) and bool((captured.v == 2).all())
    finally:
        exchange.close()


def test_a_capture_missing_rows_of_a_rank_is_refused():
    exchange = KVExchange(GEOMETRY, "cpu", segment_bytes=1 << 16)
    try:
        room = exchange.reserve_capture(4)
        _in_worker(exchange.descriptors({room.segment}), [], room, slice(0, 1))  # one of two heads
        with pytest.raises(ConnectorError, match="capture incomplete"):
            exchange.take_capture(room, position=0)
    finally:
        exchange.close()


def test_staging_counts_references_and_frees_room_for_reuse():
    exchange = KVExchange(GEOMETRY, "cpu", segment_bytes=1 << 16, retain_bytes=0)
    try:
        fact = _fact(10, 0)
        first = exchange.stage([("a", fact), ("a", fact)]).at["a"]
        exchange.unstage(["a"])
        assert exchange.stage([("b", _fact(10, 1))]).at["b"] != first  # "a" still staged once
        exchange.unstage(["a", "b"])
        # Everything freed and merged: one range as large as the segment again.
        assert list(segment_free_ranges(exchange).values()) == [[(0, 1 << 16)]]
        with pytest.raises(ConnectorError, match="does not fit the served model"):
            exchange.stage([("x", FactKV(torch.zeros(3, 2, 1, 8), torch.zeros(3, 2, 1, 8), 0))])
    finally:
        exchange.close()


def test_spans_no_request_uses_stay_staged_until_their_room_is_needed():
    """A key served again is not copied again (same location, so workers reuse their views);
    once segments reach retain_bytes, the least recently used retained span gives up its room."""
    span_bytes = 2 * GEOMETRY.kv_bytes(5)  # 960: 4 to a 4 KiB segment (256-byte aligned: 1024 each)
    exchange = KVExchange(GEOMETRY, "cpu", segment_bytes=1 << 12, retain_bytes=1 << 12)
    try:
        a = exchange.stage([("a", _fact(5, 0))]).at["a"]
        exchange.unstage(["a"])
        again = exchange.stage([("a", _fact(5, 1))]).at["a"]  # another tensor: "a" names the KV staged
        assert again == a
        reader = ExchangeReader()
        reader.map(exchange.descriptors({a.segment}))
        assert torch.equal(reader.views(a, GEOMETRY)[0], _fact(5, 0).k)
        exchange.unstage(["a"])
        for key in "bcd":
            exchange.stage([(key, _fact(5, 2))])
            exchange.unstage([key])
        assert len(segment_free_ranges(exchange)) == 1 and span_bytes <= 1024
        # The segment is full of retained spans and may not grow: "a", the oldest, makes room.
        e = exchange.stage([("e", _fact(5, 3))]).at["e"]
        assert e.offset == a.offset and len(segment_free_ranges(exchange)) == 1
        assert exchange.stage([("b", _fact(5, 4))]).at["b"].segment == a.segment  # still retained
    finally:
        exchange.close()


def test_held_keys_stage_without_kv_until_given_up():
    """holds(): staged or retained keys may be staged without their KV (same location, no
    copy); saying yes makes a retained key the most recently used; a key given up since is
    refused with NotHeldError, and nothing of that call is staged."""
    exchange = KVExchange(GEOMETRY, "cpu", segment_bytes=1 << 12, retain_bytes=1 << 12)  # 4 spans of 5 tokens
    try:
        assert not exchange.holds("a")
        a = exchange.stage([("a", _fact(5, 0))]).at["a"]
        assert exchange.holds("a")  # staged, in flight
        exchange.unstage(["a"])
        assert exchange.holds("a")  # retained
        assert exchange.stage([("a", None)]).at["a"] == a
        exchange.unstage(["a"])
        for key in "bcd":
            exchange.stage([(key, _fact(5, 1))])
            exchange.unstage([key])
        # "a" is the oldest retained span; holds() makes it the newest, so "b" gives up its room.
        assert exchange.holds("a")
        exchange.stage([("e", _fact(5, 2))])
        assert not exchange.holds("b") and exchange.holds("a")
        with pytest.raises(NotHeldError) as refused:
            exchange.stage([("f", _fact(5, 3)), ("a", None), ("b", None)])
        assert refused.value.keys == ["b"]
        assert set(staged_refs(exchange)) == {"e"} and not exchange.holds("f")  # nothing of it counted
    finally:
        exchange.close()


def test_a_request_does_not_give_up_its_own_held_spans():
    """A new span's room never comes from a retained span the same call stages (held keys are
    taken first), even when that span comes later in the request."""
    exchange = KVExchange(GEOMETRY, "cpu", segment_bytes=1 << 12, retain_bytes=1 << 12)
    try:
        for key in "abcd":
            exchange.stage([(key, _fact(5, 0))])
            exchange.unstage([key])
        at = exchange.stage([("e", _fact(5, 1)), ("a", None), ("b", None)]).at  # "a", "b": the oldest
        assert len({loc.offset for loc in at.values()}) == 3 and not exchange.holds("c")
    finally:
        exchange.close()


def test_an_owner_in_the_workers_process_hands_spans_over_by_reference():
    """In-process (``local=True``): nothing is copied and nothing is booked per span; the plan
    carries the FactKVs themselves, in order (a key twice, twice), and cannot leave the process.
    A span without its KV is refused: a local owner holds nothing."""
    exchange = KVExchange(GEOMETRY, "cpu", local=True)
    try:
        fact, other = _fact(6, 0, position=4), _fact(2, 1)
        shared = exchange.stage([("a", fact), ("b", other), ("a", fact)])
        assert shared.spans is not None and [id(kv) for kv in shared.spans] == [id(fact), id(other), id(fact)]
        assert not shared.at and not shared.segments and not segment_free_ranges(exchange)
        assert not exchange.holds("a") and not staged_refs(exchange)
        with pytest.raises(ConnectorError, match="cannot leave its process"):
            shared.to_json()
        exchange.unstage(["a", "b", "a"])  # nothing to drop: the plan held them
        with pytest.raises(NotHeldError) as refused:
            exchange.stage([("a", fact), ("c", None)])
        assert refused.value.keys == ["c"]
    finally:
        exchange.close()


def test_workers_refuse_segments_they_were_not_given_or_cannot_map():
    reader = ExchangeReader()
    with pytest.raises(ConnectorError, match="never described"):
        reader.views(Location("inferscale-1-" + "1" * 32, 0, 0, 1), GEOMETRY)
    with pytest.raises(ConnectorError, match="bad KV segment name"):
        reader.map({"../etc/passwd": {"name": "../etc/passwd", "size": 10}})
    with pytest.raises(ConnectorError, match="must run on this host"):
        reader.map({"inferscale-1-" + "2" * 32: {"size": 10}})


def test_segments_of_a_killed_owner_are_removed_by_the_next_one(tmp_path):
    """A SIGKILLed owner never unlinks its /dev/shm segments; the next owner process does, and
    leaves a live owner's alone."""
    import os
    import subprocess
    import sys
    import uuid

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"/dev/shm/inferscale-{dead.pid}-{uuid.uuid4().hex}"
    live = f"/dev/shm/inferscale-{os.getpid()}-{uuid.uuid4().hex}"
    for path in (stale, live):
        open(path, "wb").close()
    try:
        code = ("from inferscale_engine.connector.exchange import Geometry, KVExchange; import torch; "
                "from inferscale_engine.kv import FactKV; "
                "g = Geometry(layers=1, heads=1, head_dim=8, dtype='bfloat16'); "
                "x = KVExchange(g, 'cpu', segment_bytes=1 << 12); "
                "t = torch.zeros(1, 2, 1, 8, dtype=torch.bfloat16); x.stage([('a', FactKV(t, t, 0))])")
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
        assert not os.path.exists(stale)
        assert os.path.exists(live)
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.unlink(path)


def test_how_much_staged_kv_an_engine_keeps_for_reuse_is_its_config():
    from inferscale_engine.config import EngineConfig

    assert EngineConfig(device="cpu").staged_kv_bytes() == 1 << 30  # /dev/shm on the CPU
    assert EngineConfig(device="cpu", staged_kv_gib=0.25).staged_kv_bytes() == 1 << 28
    assert EngineConfig(device="cpu", staged_kv_gib=0).staged_kv_bytes() == 0  # nothing kept
    with pytest.raises(ValueError, match="staged_kv_gib"):
        EngineConfig(device="cpu", staged_kv_gib=-1)


def test_a_capture_kept_as_a_span_is_staged_for_its_first_request():
    """A capture taken with ``keep_as`` leaves its room staged as that span (its K and V lie as
    a span's do): the span's first request copies nothing and another process reads exactly the
    captured rows there. A local exchange, or one that keeps nothing, frees the room."""
    exchange = KVExchange(GEOMETRY, "cpu", segment_bytes=1 << 16)
    try:
        room = exchange.reserve_capture(4)
        _in_worker(exchange.descriptors({room.segment}), [], room, slice(0, 2))
        captured = exchange.take_capture(room, position=3, keep_as="fact:a:1")
        assert exchange.holds("fact:a:1")
        at = exchange.stage([("fact:a:1", None)]).at["fact:a:1"]  # no KV needed: nothing copied
        assert (at.segment, at.offset, at.position, at.tokens) == (room.segment, room.offset, 3, 4)
        (k, v), = _in_worker(exchange.descriptors({at.segment}), [at], exchange.reserve_capture(1), slice(0, 2))
        assert torch.equal(torch.from_numpy(k), captured.k.float()) and torch.equal(torch.from_numpy(v), captured.v.float())
        exchange.unstage(["fact:a:1"])
        assert exchange.holds("fact:a:1")  # retained, as any span no request uses
    finally:
        exchange.close()

    for exchange in (KVExchange(GEOMETRY, "cpu", segment_bytes=1 << 16, local=True),
                     KVExchange(GEOMETRY, "cpu", segment_bytes=1 << 16, retain_bytes=0)):
        try:
            room = exchange.reserve_capture(4)
            _in_worker(exchange.descriptors({room.segment}), [], room, slice(0, 2))
            exchange.take_capture(room, position=0, keep_as="fact:b:1")
            assert not exchange.holds("fact:b:1")
            assert list(segment_free_ranges(exchange).values()) == [[(0, 1 << 16)]]  # the room is free
        finally:
            exchange.close()
