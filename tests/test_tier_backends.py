"""Every KV tier honours the one interface (``memory/kv/backend.py``) the same way: put, get,
contains, remove, each tier on its own, with real tensors (no engine needed)."""

from __future__ import annotations

import pytest
import torch

from inferscale_engine.errors import KVMissingError, StaleKVError
from inferscale_engine.kv import FactKV
from inferscale_engine.memory.kv.backend import TierBackend, TierConfig
from inferscale_engine.memory.kv.tiers import KVTiers

LAYERS, HEADS, DIM, PT = 2, 2, 4, 4
FP = "fp-current"
PAGE_BYTES = LAYERS * 2 * PT * HEADS * DIM * 2  # bfloat16


def make_kv(n: int, seed: int, position: int = 3) -> FactKV:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(LAYERS, n, HEADS, DIM, generator=g).to(torch.bfloat16)
    return FactKV(k, torch.randn(LAYERS, n, HEADS, DIM, generator=g).to(torch.bfloat16), position)


def backends(tmp_path, pages: int = 8) -> tuple[TierBackend, ...]:
    """The tiers one store's config builds, fastest first."""
    return KVTiers(tmp_path, device_bytes=pages * PAGE_BYTES, host_bytes=pages * PAGE_BYTES, page_tokens=PT).backends


def assert_same(got: FactKV, kv: FactKV) -> None:
    assert got.k.dtype == kv.k.dtype and got.k.shape == kv.k.shape and got.position == kv.position
    assert torch.equal(got.k.cpu(), kv.k) and torch.equal(got.v.cpu(), kv.v)


def test_the_tiers_are_device_host_disk_built_from_one_config(tmp_path):
    tiers = KVTiers(tmp_path, device_bytes=PAGE_BYTES, page_tokens=PT)
    assert [b.name for b in tiers.backends] == ["device", "host", "disk"]
    assert tiers.backends == (tiers.device_tier, tiers.host_tier, tiers.disk)
    assert all(isinstance(b, TierBackend) for b in tiers.backends)
    assert tiers.config.page_tokens == PT and tiers.disk.root == tiers.config.root == tmp_path


@pytest.mark.parametrize("bad", [{"page_tokens": 0}, {"device_bytes": -1}, {"host_bytes": -1},
                                 {"read_threads": 0}, {"disk_read_bps": 0}])
def test_a_config_is_checked_however_it_is_made(tmp_path, bad):
    """One set of checks, in the config itself: the tiers, ``TierConfig.of`` and the dataclass
    made directly all refuse the same settings."""
    for make in (KVTiers, TierConfig.of, lambda root, **kw: TierConfig(root=root, **kw)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            make(tmp_path, **bad)
    assert KVTiers(tmp_path, device="cpu").config == TierConfig.of(tmp_path)  # the defaults live in one place


@pytest.mark.parametrize("tier", [0, 1, 2], ids=["device", "host", "disk"])
def test_put_get_contains_remove_the_same_way_in_every_tier(tmp_path, tier):
    backend = backends(tmp_path)[tier]
    a, b, kv = ("0" * 16, 1), ("1" * 16, 1), make_kv(6, 0)  # two pages
    assert not backend.contains(a)
    with pytest.raises(KVMissingError):
        backend.get(a, FP)
    assert backend.put(a, kv, FP) is True
    assert backend.contains(a) and not backend.contains(b)
    assert_same(backend.get(a, FP), kv)
    assert_same(backend.get(a, FP), kv)  # a get leaves it there
    with pytest.raises(StaleKVError, match="fp-old"):
        backend.get(a, "fp-old")  # ... and refuses it under another fingerprint
    # A second put of the key replaces its KV.
    other = make_kv(9, 1, position=7)  # three pages
    assert backend.put(a, other, FP) is True
    assert_same(backend.get(a, FP), other)
    assert backend.put(b, kv, FP) is True
    assert backend.remove(a) is True
    assert not backend.contains(a) and backend.contains(b)
    with pytest.raises(KVMissingError):
        backend.get(a, FP)
    assert backend.remove(a) is False
    assert_same(backend.get(b, FP), kv)  # the other key is untouched


@pytest.mark.parametrize("tier", [0, 1, 2], ids=["device", "host", "disk"])
def test_a_fact_larger_than_the_tier_is_refused_not_half_stored(tmp_path, tier):
    backend = backends(tmp_path, pages=2)[tier]
    big = make_kv(3 * PT, 2)  # three pages: the memory tiers hold two
    stored = backend.put(("2" * 16, 1), big, FP)
    assert stored is (backend.name == "disk")  # the disk is unbounded
    assert backend.contains(("2" * 16, 1)) is stored
    if stored:
        assert_same(backend.get(("2" * 16, 1), FP), big)


def test_a_full_device_tier_says_so_and_the_host_tier_drops_its_oldest(tmp_path):
    """A put never moves a fact to another tier: the device refuses what it has no room for
    (making room is the coordinator's), the host makes room by dropping (the disk has them)."""
    device, host, _ = backends(tmp_path, pages=4)
    keys = [(f"{i:016x}", 1) for i in range(3)]
    kvs = [make_kv(2 * PT, i) for i in range(3)]  # two pages each
    assert [device.put(k, kv, FP) for k, kv in zip(keys, kvs)] == [True, True, False]
    assert [device.contains(k) for k in keys] == [True, True, False]
    assert [host.put(k, kv, FP) for k, kv in zip(keys, kvs)] == [True, True, True]
    assert [host.contains(k) for k in keys] == [False, True, True]
    assert host.stats()["host_drops"] == 1
    for k, kv in zip(keys[1:], kvs[1:]):
        assert_same(host.get(k, FP), kv)


def test_stats_name_each_tier_apart(tmp_path):
    tiers = backends(tmp_path)
    for backend in tiers:
        backend.put(("3" * 16, 1), make_kv(5, 3), FP)
    names = [set(b.stats()) for b in tiers]
    assert all(names) and not (names[0] & names[1] or names[0] & names[2] or names[1] & names[2])
    assert tiers[0].stats()["device_facts"] == tiers[1].stats()["host_facts"] == 1
    assert tiers[2].stats()["disk_writes"] == 1
