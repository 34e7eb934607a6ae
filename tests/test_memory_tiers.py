"""KV tiers of the memory store: paged device slab, host tier, disk tier (no engine needed)."""

from __future__ import annotations

import os
import stat
import threading
import time

import pytest
import torch

from inferscale_engine.errors import StaleKVError
from inferscale_engine.kv import FactKV
from inferscale_engine.memory.kv.tiers import KVMissingError, KVTiers
from inferscale_engine.testing import kv_digest, spin_gpu

LAYERS, HEADS, DIM, PT = 3, 2, 8, 4
FP = "fp-current"


def make_kv(n: int, seed: int, dtype: torch.dtype = torch.float32, position: int = 5) -> FactKV:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(LAYERS, n, HEADS, DIM, generator=g).to(dtype)
    v = torch.randn(LAYERS, n, HEADS, DIM, generator=g).to(dtype)
    return FactKV(k, v, position)


def page_bytes(dtype: torch.dtype = torch.float32) -> int:
    return LAYERS * 2 * PT * HEADS * DIM * torch.empty((), dtype=dtype).element_size()


def fact_bytes(n: int, dtype: torch.dtype = torch.float32) -> int:
    return 2 * LAYERS * n * HEADS * DIM * torch.empty((), dtype=dtype).element_size()


def key(i: int, version: int = 1) -> tuple[str, int]:
    return (f"{i:016x}", version)


def assert_same(a: FactKV, b: FactKV) -> None:
    assert a.k.dtype == b.k.dtype and a.k.shape == b.k.shape
    assert torch.equal(a.k.cpu(), b.k.cpu()) and torch.equal(a.v.cpu(), b.v.cpu())
    assert a.position == b.position


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_every_tier_is_bit_exact(tmp_path, dtype):
    tiers = KVTiers(tmp_path, device_bytes=page_bytes(dtype) * 64, host_bytes=1 << 20, page_tokens=PT)
    kvs = {key(i): make_kv(n, i, dtype) for i, n in enumerate([1, 3, 4, 5, 8, 17])}
    for k, kv in kvs.items():
        tiers.put(k, kv, FP)
        assert tiers.where(k) == "device"
        assert_same(tiers.get(k, FP), kv)  # device
        tiers.evict(k, to="host")
        assert tiers.where(k) == "host"
        assert_same(tiers.get(k, FP), kv)  # host -> device
        assert tiers.where(k) == "device"
        tiers.evict(k, to="disk")
        assert tiers.where(k) == "disk"
        assert_same(tiers.get(k, FP), kv)  # disk -> device
        assert tiers.where(k) == "device"
    # A fresh instance (restart) reads the same bytes from disk, and caches them on the device.
    again = KVTiers(tmp_path, device_bytes=page_bytes(dtype) * 64, page_tokens=PT)
    for k, kv in kvs.items():
        assert_same(again.get(k, FP), kv)
        assert again.where(k) == "device"


def test_returned_kv_is_a_copy(tmp_path):
    tiers = KVTiers(tmp_path, device_bytes=page_bytes() * 8, page_tokens=PT)
    kv = make_kv(6, 0)
    tiers.put(key(0), kv, FP)
    got = tiers.get(key(0), FP)
    got.k.zero_()
    kv.v.zero_()  # the caller's tensors are not aliased either
    fresh = tiers.get(key(0), FP)
    assert not torch.equal(fresh.k, got.k)
    assert torch.equal(fresh.k, make_kv(6, 0).k) and torch.equal(fresh.v, make_kv(6, 0).v)


def test_get_many_reads_every_tier_in_one_batch(tmp_path):
    tiers = KVTiers(tmp_path, device_bytes=page_bytes() * 64, host_bytes=1 << 20, page_tokens=PT)
    kvs = {key(i): make_kv(n, i, position=i) for i, n in enumerate([1, 4, 5, 9, 3])}
    for k, kv in kvs.items():
        tiers.put(k, kv, FP)
    tiers.evict(key(1), to="host")
    tiers.evict(key(3), to="disk")
    order = [key(3), key(0), key(1), key(4), key(2), key(0)]  # repeats and every tier
    got = tiers.get_many(order, FP)
    for k, kv in zip(order, got):
        assert_same(kv, kvs[k])
    # Device hits and the promoted host hit are views of one fresh buffer, not of the slab.
    memory_hits = got[1:]
    assert len({kv.k.untyped_storage().data_ptr() for kv in memory_hits}) == 1
    slab = tiers.device_tier.slab.untyped_storage().data_ptr()
    assert all(kv.k.untyped_storage().data_ptr() != slab for kv in got)
    # Host and disk hits were promoted on the way.
    assert {tiers.where(k) for k in order} == {"device"}
    s = tiers.stats()
    assert s["host_to_device"] == 1 and s["disk_reads"] == 1
    got[2].k.zero_()  # handed-out KV is not the slab's
    assert_same(tiers.get(key(1), FP), kvs[key(1)])


def test_get_many_promoting_more_than_the_slab_holds(tmp_path):
    # 4 device pages, 3 host facts of 2 pages each: one batch promotes the first two and leaves
    # the third on the host (it never evicts a fact of its own batch); all three are served.
    tiers = KVTiers(tmp_path, device_bytes=page_bytes() * 4, host_bytes=1 << 20, page_tokens=PT)
    kvs = {key(i): make_kv(6, i) for i in range(3)}
    for k, kv in kvs.items():
        tiers.put(k, kv, FP)
        tiers.evict(k, to="host")
    got = tiers.get_many(list(kvs), FP)
    for (_k, kv), g in zip(kvs.items(), got):
        assert_same(g, kv)
    assert [tiers.where(k) for k in kvs] == ["device", "device", "host"]
    for k, kv in kvs.items():
        assert_same(tiers.get(k, FP), kv)


def test_promoting_facts_of_mixed_page_counts(tmp_path):
    # Page counts 1, 2, 1, 3, 2, 1 (PT=4) in an order whose runs of equal counts interleave; the
    # slab has room for 7 of the 10 pages, so the last fact in batch order stays on the host.
    lengths = [1, 6, 3, 9, 5, 2]
    tiers = KVTiers(tmp_path, device_bytes=page_bytes() * 7, host_bytes=1 << 20, page_tokens=PT)
    kvs = {key(i): make_kv(n, i, position=i) for i, n in enumerate(lengths)}
    for k, kv in kvs.items():
        tiers.put(k, kv, FP)
        tiers.evict(k, to="host")
    got = tiers.get_many(list(kvs), FP)
    for g, kv in zip(got, kvs.values()):
        assert_same(g, kv)
    where = [tiers.where(k) for k in kvs]
    assert where.count("device") == 4 and tiers.stats()["device_pages_used"] == 7, where
    # What the slab cached is exact too: read it back from the device tier alone.
    for k, kv in kvs.items():
        if tiers.where(k) == "device":
            assert_same(tiers.get_many([k], FP)[0], kv)
    tiers.drop_memory()
    for k, kv in kvs.items():
        assert_same(tiers.get(k, FP), kv)


def test_promotion_never_evicts_a_fact_its_own_batch_serves(tmp_path):
    # 4 device pages, facts of 2 pages: b and c on the device, a on the host. Serving all three
    # leaves no page a could take without evicting b or c, which the same batch reads: a is
    # served from the host and stays there.
    tiers = KVTiers(tmp_path, device_bytes=page_bytes() * 4, host_bytes=1 << 20, page_tokens=PT)
    kvs = {key(i): make_kv(6, i, position=i) for i in range(3)}
    for k, kv in kvs.items():
        tiers.put(k, kv, FP)  # the third put evicts the first to the host
    assert [tiers.where(k) for k in kvs] == ["host", "device", "device"]
    order = [key(2), key(1), key(0)]
    for k, got in zip(order, tiers.get_many(order, FP)):
        assert_same(got, kvs[k])
    assert [tiers.where(k) for k in kvs] == ["host", "device", "device"]


@pytest.mark.parametrize("device", ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
def test_host_tier_pins_chunks_as_it_fills_and_facts_may_span_them(tmp_path, monkeypatch, device):
    from inferscale_engine.memory.kv import host_tier

    monkeypatch.setattr(host_tier, "HOST_CHUNK_BYTES", 2 * page_bytes())  # two pages a chunk
    tiers = KVTiers(tmp_path, device=device, device_bytes=page_bytes() * 3, host_bytes=1 << 30, page_tokens=PT)
    kvs = {key(i): make_kv(n, i, position=i) for i, n in enumerate([9, 3, 6, 12, 1])}  # 3, 1, 2, 3, 1 pages
    for k, kv in kvs.items():
        tiers.put(k, kv, FP)
        tiers.evict(k, to="host")
    s = tiers.stats()
    assert s["host_bytes"] == 10 * page_bytes() and s["host_bytes_allocated"] == 10 * page_bytes()  # not 1 GiB
    for k, kv in kvs.items():  # each promotion evicts the one before: pages move both ways
        assert_same(tiers.get(k, FP), kv)
    tiers.drop_memory()
    for k, kv in kvs.items():
        assert_same(tiers.get(k, FP), kv)


def test_page_runs_merge_only_pages_that_follow_each_other_on_both_sides():
    import numpy as np

    from inferscale_engine.memory.kv.pages import page_runs

    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 30))
        # Mostly consecutive pages, with jumps and tensor changes on either side.
        dst_which, src_which = np.cumsum(rng.random(n) < 0.1), np.cumsum(rng.random(n) < 0.1)
        dst_index = np.cumsum(np.where(rng.random(n) < 0.2, rng.integers(2, 5, n), 1))
        src_index = np.cumsum(np.where(rng.random(n) < 0.2, rng.integers(-3, 5, n), 1)) + 10
        starts, lengths = page_runs(dst_which, dst_index, src_which, src_index)
        assert starts[0] == 0 and lengths.sum() == n
        covered = []
        for s, m in zip(starts.tolist(), lengths.tolist()):  # a run is one range on both sides
            covered += range(s, s + m)
            assert len(set(dst_which[s : s + m])) == 1 and len(set(src_which[s : s + m])) == 1
            assert list(dst_index[s : s + m]) == list(range(dst_index[s], dst_index[s] + m))
            assert list(src_index[s : s + m]) == list(range(src_index[s], src_index[s] + m))
        assert covered == list(range(n))
        for s in starts[1:].tolist():  # and no two runs could have been one
            assert (dst_which[s], src_which[s], dst_index[s], src_index[s]) != (
                dst_which[s - 1], src_which[s - 1], dst_index[s - 1] + 1, src_index[s - 1] + 1)


def test_page_ranges_one_range_or_many_cover_every_page_once():
    """A copy that is one range both ways (a promotion of facts lying together) skips the numpy
    pass; either way the ranges are what pages one after the other in one tensor make."""
    import random

    from inferscale_engine.memory.kv.dma import Sources
    from inferscale_engine.memory.kv.pages import page_ranges

    rng = random.Random(0)
    slab = Sources.of([torch.empty(40, 2)])
    chunks = Sources.of([torch.empty(8, 2), torch.empty(8, 2), torch.empty(5, 2)])  # the last one smaller
    for _ in range(300):
        n = rng.randint(1, 12)
        d0, s0 = rng.randint(0, 40 - n), rng.randint(0, 20 - n)
        dst, src = list(range(d0, d0 + n)), list(range(s0, s0 + n))
        if rng.random() < 0.5:  # not one range: another order, or a jump
            src = rng.sample(src, n) if rng.random() < 0.5 else src[: n // 2] + [p + 1 for p in src[n // 2 :]]
        r = page_ranges(slab, dst, chunks, src)
        pages = []
        for dw, d, sw, s_, m in zip(r.dst_which.tolist(), r.dst_index.tolist(), r.src_which.tolist(),
                                    r.src_index.tolist(), r.lengths.tolist()):
            assert dw == 0 and 0 < m and s_ + m <= chunks.tensors[sw].shape[0]
            pages += [(d + i, 8 * sw + s_ + i) for i in range(m)]
        assert pages == list(zip(dst, src))
        breaks = sum(dst[i] != dst[i - 1] + 1 or src[i] != src[i - 1] + 1 or src[i] // 8 != src[i - 1] // 8
                     for i in range(1, n))
        assert len(r.lengths) == breaks + 1


def test_a_facts_pages_and_a_batchs_pages_lie_one_after_the_other(tmp_path):
    """Pages taken together are consecutive in both memory tiers, so a batch copies about one
    range per fact rather than one per page (the copies' count is what costs host time)."""
    import numpy as np

    from inferscale_engine.memory.kv.pages import page_runs

    tiers = KVTiers(tmp_path, device_bytes=page_bytes() * 64, host_bytes=page_bytes() * 64, page_tokens=PT)
    keys = [key(i) for i in range(6)]
    for i, k in enumerate(keys):
        tiers.put(k, make_kv(3 * PT - 1, i), FP)  # three pages each
    for k in keys:
        pages = tiers.device_tier.pages(k)
        assert pages == list(range(pages[0], pages[0] + 3))
        tiers.evict(k, to="host")
    hosts = [p for k in keys for p in tiers.host_tier.pages(k)]
    tiers.get_many(keys, FP)  # one promotion of all six
    slabs = [p for k in keys for p in tiers.device_tier.pages(k)]
    _, lengths = page_runs(np.zeros(18, dtype=np.int64), np.array(slabs), np.zeros(18, dtype=np.int64), np.array(hosts))
    assert len(lengths) <= len(keys) and lengths.sum() == 18


def test_facts_prefetched_together_are_promoted_in_one_copy_whatever_order_a_request_names_them(tmp_path):
    """A prefetch's parallel reads land in the host tier in completion order; a request then
    names the facts in its own order. The promotion copies by where they lie, not by that order:
    one range for the whole batch instead of one per fact (each range costs host time)."""
    import random

    tiers = KVTiers(tmp_path, device_bytes=page_bytes() * 64, host_bytes=page_bytes() * 64, page_tokens=PT)
    keys = [key(i) for i in range(12)]
    kvs = {k: make_kv(2 * PT - 3, i) for i, k in enumerate(keys)}  # two pages each
    for k, kv in kvs.items():
        tiers.put(k, kv, FP)
        tiers.evict(k, to="disk")
    assert tiers.prefetch(keys, FP) == len(keys)
    deadline = time.monotonic() + 30
    while set(tiers.where_many(keys)) != {"host"}:
        assert time.monotonic() < deadline, "prefetch did not finish"
        time.sleep(0.001)
    order = keys[:]
    random.Random(0).shuffle(order)
    before = tiers.stats()["host_to_device_copies"]
    got = tiers.get_many(order, FP)
    assert tiers.stats()["host_to_device_copies"] - before == 1
    assert tiers.where_many(keys) == ["device"] * len(keys)
    for k, kv in zip(order, got):  # every fact still gets its own KV
        assert_same(kv, kvs[k])
    for k in keys:  # and so do later reads, from the slab pages it was copied into
        assert_same(tiers.get(k, FP), kvs[k])


def _cuda_facts(layers: int, lengths: list[int]) -> dict[tuple[str, int], FactKV]:
    g = torch.Generator().manual_seed(0)
    kvs = {}
    for i, n in enumerate(lengths):
        k = torch.randn(layers, n, 8, 128, generator=g).to(torch.bfloat16)
        kvs[key(i)] = FactKV(k, (k * 3).contiguous(), i)
    return kvs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_promotion_is_exact_without_a_host_wait(tmp_path):
    kvs = _cuda_facts(9, [5, 28, 17, 1, 40])
    tiers = KVTiers(tmp_path, device="cuda", device_bytes=64 << 20, host_bytes=64 << 20, page_tokens=16)
    for k, kv in kvs.items():
        tiers.put(k, kv, FP)
        tiers.evict(k, to="host")
    torch.cuda.synchronize()
    spin_gpu(20_000_000)  # the caller's stream is busy: the promotion must not wait for it
    got = tiers.get_many(list(kvs), FP)  # copies queued, not landed: readers wait in stream order
    assert {tiers.where(k) for k in kvs} == {"device"}
    for gkv, kv in zip(got, kvs.values()):
        assert gkv.k.is_cuda and torch.equal(gkv.k.cpu(), kv.k) and torch.equal(gkv.v.cpu(), kv.v)
    for gkv, kv in zip(tiers.get_many(list(kvs), FP), kvs.values()):
        assert torch.equal(gkv.k.cpu(), kv.k) and torch.equal(gkv.v.cpu(), kv.v)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_promotion_waits_for_a_queued_read_of_the_pages_it_reuses(tmp_path):
    kvs = _cuda_facts(4, [28, 28, 28, 28])  # 2 pages each; the slab holds two facts
    a, b, c, d = kvs
    page = 4 * 2 * 16 * 8 * 128 * 2
    tiers = KVTiers(tmp_path, device="cuda", device_bytes=4 * page, host_bytes=64 << 20, page_tokens=16)
    for k in (c, d):
        tiers.put(k, kvs[k], FP)
        tiers.evict(k, to="host")
    for k in (a, b):
        tiers.put(k, kvs[k], FP)
    torch.cuda.synchronize()
    spin_gpu(50_000_000)  # ~25 ms: the gather of a and b below runs after it
    got = tiers.get_many([a, b], FP)
    tiers.delete_key(a)  # frees their pages without a device sync ...
    tiers.delete_key(b)
    later = tiers.get_many([c, d], FP)  # ... and c and d are copied into them on the side stream
    for gkv, k in zip([*got, *later], [a, b, c, d]):
        assert torch.equal(gkv.k.cpu(), kvs[k].k) and torch.equal(gkv.v.cpu(), kvs[k].v)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("path", ["auto", "per-range", "torch"])
def test_cuda_byte_copier_lands_every_range(path):
    import numpy as np

    from inferscale_engine.memory.kv.dma import ByteCopier, Sources

    copier = ByteCopier(torch.cuda.Stream(), path=path)
    srcs = Sources.of([torch.randint(0, 255, (n,), dtype=torch.uint8).pin_memory() for n in (4096, 100, 7)])
    dst = torch.zeros(8192, dtype=torch.uint8, device="cuda")
    src_offsets, sizes = np.array([100, 0, 3]), np.array([3000, 100, 4])
    dst_offsets = np.array([0, 5000, 8188])
    copier.copy(Sources.of([dst] * 3), dst_offsets, srcs, src_offsets, sizes)
    copier.stream.synchronize()
    want = torch.zeros(8192, dtype=torch.uint8)
    for src, d, s, n in zip(srcs.tensors, dst_offsets, src_offsets, sizes):
        want[d : d + n] = src[s : s + n]
    assert torch.equal(dst.cpu(), want)
    # And back down, into two pinned tensors.
    down = [torch.zeros(3000, dtype=torch.uint8).pin_memory(), torch.zeros(8, dtype=torch.uint8).pin_memory()]
    copier.copy(Sources.of(down), np.array([0, 4]), Sources.of([dst, dst]), np.array([0, 8188]), np.array([3000, 4]))
    copier.stream.synchronize()
    assert torch.equal(down[0], want[:3000]) and torch.equal(down[1][4:], want[8188:])
    with pytest.raises(ValueError, match="outside"):  # one byte past the end of dst
        copier.copy(Sources.of([dst]), np.array([8189]), Sources.of(srcs.tensors[:1]), np.array([0]), np.array([4]))


def test_get_many_fails_whole_on_a_missing_key(tmp_path):
    tiers = KVTiers(tmp_path, device_bytes=page_bytes() * 8, page_tokens=PT)
    tiers.put(key(0), make_kv(3, 0), FP)
    with pytest.raises(KVMissingError):
        tiers.get_many([key(0), key(9)], FP)


def test_lru_eviction_and_promotion_under_tiny_capacities(tmp_path):
    # Device: 4 pages (each fact below takes 2 pages -> 2 facts). Host: room for 2 facts (the
    # host keeps whole pages' worth of rows too).
    tiers = KVTiers(tmp_path, device_bytes=page_bytes() * 4, host_bytes=page_bytes() * 4, page_tokens=PT)
    kvs = {key(i): make_kv(6, i) for i in range(6)}
    for k, kv in kvs.items():
        tiers.put(k, kv, FP)
    where = [tiers.where(key(i)) for i in range(6)]
    assert where == ["disk", "disk", "host", "host", "device", "device"]
    s = tiers.stats()
    assert s["device_pages_used"] == 4 and s["device_pages_total"] == 4
    assert s["host_bytes"] <= page_bytes() * 4
    # Using the oldest fact promotes it to the device; the LRU device fact goes to the host,
    # and the host drops its LRU fact (still on disk).
    assert_same(tiers.get(key(0), FP), kvs[key(0)])
    assert [tiers.where(key(i)) for i in range(6)] == ["device", "disk", "disk", "host", "host", "device"]
    # Touch 5 so that 0 is now the device's LRU.
    tiers.get(key(5), FP)
    assert_same(tiers.get(key(2), FP), kvs[key(2)])
    assert [tiers.where(key(i)) for i in range(6)] == ["host", "disk", "device", "disk", "host", "device"]
    for k, kv in kvs.items():  # everything still exact wherever it lives
        assert_same(tiers.get(k, FP), kv)
    s = tiers.stats()
    assert s["device_pages_used"] == 4 and s["host_to_device"] >= 1 and s["disk_reads"] >= 1


@pytest.mark.parametrize("device", ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
def test_a_promoted_fact_keeps_its_host_pages_until_the_host_needs_them(tmp_path, device):
    # Device: 2 facts of 2 pages. Host: 4 facts. A working set of 4 facts bounces between them.
    tiers = KVTiers(tmp_path, device=device, device_bytes=page_bytes() * 4, host_bytes=page_bytes() * 8, page_tokens=PT)
    kvs = {key(i): make_kv(6, i) for i in range(4)}
    for k, kv in kvs.items():
        tiers.put(k, kv, FP)
    assert [tiers.where(key(i)) for i in range(4)] == ["host", "host", "device", "device"]
    tiers.get_many([key(0), key(1)], FP)  # promoted from the host: 2 and 3 are copied down
    s = tiers.stats()
    assert s["device_to_host"] == 4 and s["device_to_host_kept"] == 0
    assert s["host_backup_bytes"] == 4 * page_bytes()  # 0 and 1 still lie on the host too
    got = tiers.get_many([key(2), key(3)], FP)  # 0 and 1 go back to their host pages: no copy
    s = tiers.stats()
    assert s["device_to_host"] == 6 and s["device_to_host_kept"] == 2
    for k, kv in zip((key(2), key(3)), got):
        assert_same(kv, kvs[k])
    for k, kv in kvs.items():  # every tier hands out the same bytes, kept pages included
        assert_same(tiers.get(k, FP), kv)
    tiers.drop_memory()  # every cached copy goes, kept host pages included
    s = tiers.stats()
    assert s["host_bytes"] == 0 and s["host_backup_bytes"] == 0 and s["device_pages_used"] == 0


@pytest.mark.parametrize("device", ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
def test_the_host_takes_kept_pages_back_when_it_needs_room(tmp_path, device):
    # Device: 3 facts of 2 pages. Host: 2 facts.
    tiers = KVTiers(tmp_path, device=device, device_bytes=page_bytes() * 6, host_bytes=page_bytes() * 4, page_tokens=PT)
    kvs = {key(i): make_kv(6, i) for i in range(6)}
    for i in range(5):
        tiers.put(key(i), kvs[key(i)], FP)
    assert [tiers.where(key(i)) for i in range(5)] == ["host", "host", "device", "device", "device"]
    tiers.get_many([key(0), key(1)], FP)  # promoted; 2 and 3 find the host full of their pages
    assert tiers.stats()["host_backup_bytes"] == 4 * page_bytes() and tiers.stats()["host_facts"] == 0
    # 4 (no host copy) must go down for 5: the fact promoted longest ago (0) gives its kept
    # pages back, and 4 is copied there.
    tiers.put(key(5), kvs[key(5)], FP)
    assert [tiers.where(key(i)) for i in range(6)] == ["device", "device", "disk", "disk", "host", "device"]
    s = tiers.stats()
    assert s["host_backup_bytes"] == 2 * page_bytes() and s["host_bytes"] == 2 * page_bytes()
    # Kept pages go before any fact of the host's own: 0 is copied into the pages 1 kept, and 4
    # stays. Only then does the host drop a fact (4, for 1).
    tiers.evict(key(0))
    assert [tiers.where(key(i)) for i in range(6)] == ["host", "device", "disk", "disk", "host", "device"]
    tiers.evict(key(1))
    assert [tiers.where(key(i)) for i in range(6)] == ["host", "host", "disk", "disk", "disk", "device"]
    assert tiers.stats()["device_to_host_kept"] == 0 and tiers.stats()["host_backup_bytes"] == 0
    for k, kv in kvs.items():
        assert_same(tiers.get(k, FP), kv)


def test_fact_larger_than_the_slab_is_served_from_host_or_disk(tmp_path):
    tiers = KVTiers(tmp_path, device_bytes=page_bytes() * 2, host_bytes=fact_bytes(40), page_tokens=PT)
    big = make_kv(20, 1)  # 5 pages > 2
    tiers.put(key(1), big, FP)
    assert tiers.where(key(1)) == "host"
    assert_same(tiers.get(key(1), FP), big)
    huge = make_kv(60, 2)  # larger than the host tier too: disk only
    tiers.put(key(2), huge, FP)
    assert tiers.where(key(2)) == "disk"
    assert_same(tiers.get(key(2), FP), huge)
    assert tiers.where(key(2)) == "disk"


def test_no_device_tier_at_all(tmp_path):
    tiers = KVTiers(tmp_path, device_bytes=0, host_bytes=0, page_tokens=PT)
    kv = make_kv(5, 3)
    tiers.put(key(3), kv, FP)
    assert tiers.where(key(3)) == "disk"
    assert_same(tiers.get(key(3), FP), kv)


def test_delete_frees_every_tier(tmp_path):
    tiers = KVTiers(tmp_path, device_bytes=page_bytes() * 4, host_bytes=fact_bytes(6) * 2, page_tokens=PT)
    for i in range(6):
        tiers.put(key(i), make_kv(6, i), FP)
    tiers.put(key(0, 2), make_kv(6, 10), FP)  # a second version of fact 0
    placed = {tiers.where(key(i)) for i in range(6)}
    assert placed == {"device", "host", "disk"}
    for i in range(6):
        tiers.delete(key(i)[0])
        assert tiers.where(key(i)) is None
        with pytest.raises(KVMissingError):
            tiers.get(key(i), FP)
    assert tiers.where(key(0, 2)) is None
    s = tiers.stats()
    assert s["device_pages_used"] == 0 and s["device_facts"] == 0
    assert s["host_facts"] == 0 and s["host_bytes"] == 0
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_delete_key_frees_one_version(tmp_path):
    tiers = KVTiers(tmp_path, device_bytes=page_bytes() * 8, page_tokens=PT)
    tiers.put(key(1, 1), make_kv(3, 1), FP)
    tiers.put(key(1, 2), make_kv(3, 2), FP)
    tiers.delete_key(key(1, 1))
    assert tiers.where(key(1, 1)) is None and tiers.where(key(1, 2)) == "device"


def test_fingerprint_mismatch_is_refused_in_every_tier(tmp_path):
    tiers = KVTiers(tmp_path, device_bytes=page_bytes() * 8, host_bytes=1 << 20, page_tokens=PT)
    kv = make_kv(5, 0)
    tiers.put(key(0), kv, "fp-old")
    for tier in ("device", "host", "disk"):
        tiers.put(key(0), kv, "fp-old")
        if tier != "device":
            tiers.evict(key(0), to=tier)  # type: ignore[arg-type]
        assert tiers.where(key(0)) == tier
        with pytest.raises(StaleKVError, match="fp-old"):
            tiers.get(key(0), FP)
    # The file itself carries the fingerprint.
    assert tiers.read_metadata(key(0))["fingerprint"] == "fp-old"
    # Re-encoding under the current fingerprint replaces it.
    tiers.put(key(0), kv, FP)
    tiers.drop_memory()
    assert_same(tiers.get(key(0), FP), kv)
    assert tiers.read_metadata(key(0))["fingerprint"] == FP


def test_disk_file_is_atomic_private_and_self_describing(tmp_path):
    tiers = KVTiers(tmp_path, device_bytes=0, page_tokens=PT)
    kv = make_kv(7, 4, position=11)
    tiers.put(key(4), kv, FP)
    path = tiers.path(key(4))
    assert path.exists() and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not list(tmp_path.rglob("*.tmp"))
    meta = tiers.read_metadata(key(4))
    assert meta.pop("sha256") == kv_digest(kv.k.cpu(), kv.v.cpu())  # checked on every read from disk
    assert meta == {
        "format": "inferscale-kv/1", "fingerprint": FP, "fact_id": key(4)[0], "kv_version": "1",
        "position": "11", "num_tokens": "7",
    }


def test_corrupt_or_misplaced_file_is_missing_not_served(tmp_path):
    tiers = KVTiers(tmp_path, device_bytes=0, host_bytes=0, page_tokens=PT)
    tiers.put(key(1), make_kv(4, 1), FP)
    tiers.path(key(1)).write_bytes(b"garbage")
    with pytest.raises(KVMissingError):
        tiers.get(key(1), FP)
    # A valid file of another fact copied under this name is refused too.
    tiers.put(key(2), make_kv(4, 2), FP)
    os.replace(tiers.path(key(2)), tiers.path(key(1)))
    with pytest.raises(KVMissingError):
        tiers.get(key(1), FP)


def test_where_many_without_the_filesystem_learns_missing_files_from_reads(tmp_path):
    """A request's resolve asks the filesystem nothing: a key in no memory tier is on disk until
    a read finds its file gone; a put makes it whole again."""
    tiers = KVTiers(tmp_path, device_bytes=page_bytes() * 8, page_tokens=PT)
    kv = make_kv(5, 0)
    tiers.put(key(0), kv, FP)
    tiers.evict(key(0), to="disk")
    assert tiers.where_many([key(0)], check_disk=False) == ["disk"]
    tiers.path(key(0)).unlink()
    assert tiers.where_many([key(0)], check_disk=False) == ["disk"]  # nothing asked yet
    assert tiers.where_many([key(0)]) == [None]
    with pytest.raises(KVMissingError):
        tiers.get(key(0), FP)
    assert tiers.where_many([key(0)], check_disk=False) == [None]
    tiers.put(key(0), kv, FP)
    tiers.evict(key(0), to="disk")
    assert tiers.where_many([key(0)], check_disk=False) == ["disk"]
    # A failed background read (a promotion, a prefetch) marks it too.
    tiers.path(key(0)).unlink()
    tiers.prefetch([key(0)], FP)
    tiers.close()  # waits for the read
    assert tiers.where_many([key(0)], check_disk=False) == [None]


def test_file_bytes_without_a_stat_once_the_geometry_is_known(tmp_path):
    tiers = KVTiers(tmp_path, device_bytes=page_bytes() * 8, page_tokens=PT)
    tiers.put(key(0), make_kv(5, 0), FP)
    size = tiers.path(key(0)).stat().st_size
    assert tiers.file_bytes(key(0), 5) == fact_bytes(5)  # the KV, without the file's header
    assert 0 < size - fact_bytes(5) < 4096
    fresh = KVTiers(tmp_path, device_bytes=page_bytes() * 8, page_tokens=PT)  # a reopened store
    assert fresh.file_bytes(key(0), 5) == size


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise")
def test_cached_follows_the_page_cache(tmp_path):
    tiers = KVTiers(tmp_path, device_bytes=0, host_bytes=0, page_tokens=PT)
    tiers.put(key(0), make_kv(400, 0), FP)
    path = tiers.path(key(0))
    path.read_bytes()
    assert tiers.disk.cached(key(0))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert not tiers.disk.cached(key(0))
    assert not tiers.disk.cached(key(9))  # no file


def test_sweep_removes_temp_files_and_orphans(tmp_path):
    tiers = KVTiers(tmp_path, device_bytes=0, page_tokens=PT)
    for i in range(4):
        tiers.put(key(i), make_kv(3, i), FP)
    tiers.put(key(0, 2), make_kv(3, 9), FP)
    tmp = tiers.path(key(1)).parent / f".{key(1)[0]}-1.deadbeef.tmp"
    tmp.write_bytes(b"partial")
    (tmp_path / "README").write_text("not ours")  # unrelated files at the top are left alone
    kept, removed = tiers.sweep({key(0)[0]: 2, key(1)[0]: 1, key(2)[0]: 1})  # fact 3 is gone, fact 0 is at v2
    assert kept == {key(0, 2), key(1), key(2)}
    assert removed == 3  # tmp, fact 0 v1, fact 3
    assert not tmp.exists() and not tiers.path(key(3)).exists() and not tiers.path(key(0)).exists()
    assert (tmp_path / "README").exists()


def test_concurrent_puts_and_gets(tmp_path):
    tiers = KVTiers(tmp_path, device_bytes=page_bytes() * 6, host_bytes=fact_bytes(5) * 3, page_tokens=PT)
    kvs = {key(i): make_kv(5, i) for i in range(24)}
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            mine = list(kvs.items())[offset::4]
            for k, kv in mine:
                tiers.put(k, kv, FP)
            for _ in range(3):
                for k, kv in list(kvs.items()):
                    if tiers.where(k) is not None:
                        assert_same(tiers.get(k, FP), kv)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k, kv in kvs.items():
        assert_same(tiers.get(k, FP), kv)
    s = tiers.stats()
    assert s["device_pages_used"] <= 6 and s["host_bytes"] <= fact_bytes(5) * 3


def test_geometry_mismatch_rejected(tmp_path):
    tiers = KVTiers(tmp_path, device_bytes=page_bytes() * 4, page_tokens=PT)
    tiers.put(key(0), make_kv(3, 0), FP)
    bad = FactKV(torch.zeros(LAYERS + 1, 3, HEADS, DIM), torch.zeros(LAYERS + 1, 3, HEADS, DIM), 0)
    with pytest.raises(ValueError, match="geometry"):
        tiers.put(key(1), bad, FP)


def _full_slab_and_one_on_host(tmp_path):
    """Tiers whose slab holds two facts, a and b, with a third, c, on the host; copies landed."""
    kvs = _cuda_facts(4, [28, 28, 28])  # 2 pages each
    a, b, c = kvs
    page = 4 * 2 * 16 * 8 * 128 * 2
    tiers = KVTiers(tmp_path, device="cuda", device_bytes=4 * page, host_bytes=64 << 20, page_tokens=16)
    tiers.put(c, kvs[c], FP)
    tiers.evict(c, to="host")
    for k in (a, b):
        tiers.put(k, kvs[k], FP)
    torch.cuda.synchronize()
    return tiers, kvs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_eviction_does_not_wait_for_the_callers_queued_work(tmp_path):
    tiers, kvs = _full_slab_and_one_on_host(tmp_path)
    a, b, c = kvs
    spin_gpu(100_000_000)  # ~50 ms of work queued on the caller's stream
    slept = torch.cuda.Event()
    slept.record()
    got = tiers.get_many([c], FP)  # evicts a to the host and promotes c into its pages
    assert not slept.query(), "get_many waited for the caller's queued work"
    assert [tiers.where(k) for k in (a, b, c)] == ["host", "device", "device"]
    assert torch.equal(got[0].k.cpu(), kvs[c].k) and torch.equal(got[0].v.cpu(), kvs[c].v)
    for k in (a, b, c):
        kv = tiers.get(k, FP)
        assert torch.equal(kv.k.cpu(), kvs[k].k) and torch.equal(kv.v.cpu(), kvs[k].v)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_promotion_into_evicted_pages_does_not_wait_for_their_copy_to_the_host(tmp_path):
    tiers, kvs = _full_slab_and_one_on_host(tmp_path)
    a, b, c = kvs
    out = tiers.mover.out_stream()
    with torch.cuda.stream(out):
        spin_gpu(100_000_000)  # ~50 ms: the eviction's copy to the host queues behind it
    busy = torch.cuda.Event()
    busy.record(out)
    got = tiers.get_many([c], FP)  # evicts a to the host, promotes c into a's slab pages
    torch.cuda.current_stream().synchronize()  # c is readable ...
    assert not busy.query(), "the promotion waited for the eviction's copy to the host"  # ... a still in flight
    assert torch.equal(got[0].k.cpu(), kvs[c].k) and torch.equal(got[0].v.cpu(), kvs[c].v)
    # a comes back before its copy to the host has landed: the promotion waits for that copy.
    back = tiers.get_many([a], FP)
    assert torch.equal(back[0].k.cpu(), kvs[a].k) and torch.equal(back[0].v.cpu(), kvs[a].v)
    for k in (a, b, c):
        kv = tiers.get(k, FP)
        assert torch.equal(kv.k.cpu(), kvs[k].k) and torch.equal(kv.v.cpu(), kvs[k].v)


def test_a_fact_seen_prefetched_and_evicted_at_once_is_prefetched_again(tmp_path):
    """The moment a prefetch's fact shows in the host tier, its read is over: evicting it and
    prefetching it again starts a new read. A read that still counted as running there (bench
    tiers' cost-model row did exactly this in CI) made the prefetch skip the fact, which then
    never left the disk. Threads switch as often as they can, to open any such window."""
    import sys

    tiers = KVTiers(tmp_path, device_bytes=page_bytes() * 64, host_bytes=page_bytes() * 64, page_tokens=PT)
    k = key(0)
    tiers.put(k, make_kv(PT + 1, 0), FP)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(1000):
            tiers.evict(k, to="disk")
            assert tiers.prefetch([k], FP) == 1, "the prefetch skipped a fact on disk"
            deadline = time.monotonic() + 30
            while tiers.where(k) != "host":
                assert time.monotonic() < deadline, "prefetch did not finish"
    finally:
        sys.setswitchinterval(interval)
        tiers.close()
