"""Host time of a host-tier promotion, by copy path (diagnostic, not a benchmark).

usage: python scripts/h200_promote.py [K] [--cprofile | --split]

K facts of the Llama-3.1-8B shape (32 layers, 28 tokens, 8 KV heads, 128 dims, bf16) sit in the
host tier; per copy path (one cudaMemcpyBatchAsync for the batch, one cudaMemcpyAsync per range,
the torch ``copy_`` fallback), medians of 10 ``get_many`` calls: the host time (what a request
waits for) and the time until every copy has landed, next to a ``get_many`` of the same facts
already on the device tier. Also the host time of the same copies issued bare, checked byte for
byte. ``--cprofile``: a promotion's host time per function (cProfile); ``--split``: per method of
the tiers (``time.perf_counter`` around each, far less overhead than a profiler's), a host-tier
and a device-tier read, right away and after 50 ms idle.
"""

import sys
import tempfile
import time

import numpy as np
import torch

from inferscale_engine.kv import FactKV
from inferscale_engine.memory.kv import dma
from inferscale_engine.memory.kv.device_tier import DeviceTier
from inferscale_engine.memory.kv.pages import PagedTier, PageMover
from inferscale_engine.memory.kv.tiers import KVTiers


def median(xs):
    return sorted(xs)[len(xs) // 2]


def main(k: int) -> None:
    fp = "fp"
    t = KVTiers(tempfile.mkdtemp(), device="cuda", device_bytes=4 << 30, host_bytes=4 << 30, page_tokens=16)
    keys = [(f"{i:016x}", 1) for i in range(k)]
    for key in keys:
        kv = torch.randn(32, 28, 8, 128, dtype=torch.bfloat16)
        t.put(key, FactKV(kv, kv.clone(), 0), fp)

    def run(label: str, tier: str = "host") -> None:
        host, landed = [], []
        for _ in range(12):
            for key in keys:
                if tier == "host":
                    t.evict(key, to="host")
                else:
                    t.get(key, fp)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            got = t.get_many(keys, fp)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            host.append(t1 - t0)
            landed.append(t2 - t0)
            del got
        print(f"k={k} {label}: host {1e3 * median(host[2:]):.2f} ms, landed {1e3 * median(landed[2:]):.2f} ms", flush=True)

    if "--split" in sys.argv:
        split(t, keys, fp)
        return

    if "--cprofile" in sys.argv:  # where the host time of a promotion goes, per function
        import cProfile
        import pstats

        prof = cProfile.Profile()
        n = 10
        for i in range(n + 2):
            for key in keys:
                t.evict(key, to="host")
            torch.cuda.synchronize()
            if i >= 2:
                prof.enable()
            got = t.get_many(keys, fp)
            prof.disable()
            torch.cuda.synchronize()
            del got
        rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:25]
        print("per promotion: own ms, cumulative ms, calls, function")
        for (file, line, name), (_, calls, own, cum, _) in rows:
            print(f"{1e3 * own / n:7.3f} {1e3 * cum / n:7.3f} {calls // n:5d}  {file.split('/')[-1]}:{line}({name})")
        return

    def copier(mode: str) -> dma.ByteCopier:
        return dma.ByteCopier(t._side_stream(), path="auto" if mode == "batch" else mode)

    runtime = dma._cudart()
    print(f"CUDA runtime batch copies: {runtime is not None and runtime.batch is not None}", flush=True)
    # Twice each, alternating: the first configuration timed on a machine runs slower.
    for mode in ("per-range", "batch", "per-range", "batch"):
        t._copiers[t._side_stream()] = copier(mode)
        run(mode)
        run("device tier, for scale", tier="device")
    t._copiers[t._side_stream()] = copier("torch")
    run("torch copy_")

    src = torch.empty(k * 4 << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    for mode in ("batch", "per-range"):
        c = copier(mode)
        for n in (k, 4 * k):
            size = src.nbytes // n
            offsets = np.arange(n, dtype=np.int64) * size
            sizes = np.full(n, size, dtype=np.int64)
            times = []
            for _ in range(12):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                c.copy(dma.Sources.of([dst] * n), offsets, dma.Sources.of([src] * n), offsets, sizes)
                times.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            assert torch.equal(dst.cpu(), src), "copies landed wrong"
            print(f"{n} bare copies of {size >> 10} KiB, {mode}: host {1e3 * median(times[2:]):.2f} ms", flush=True)


def split(t: KVTiers, keys: list, fp: str) -> None:
    """Host time of ``get_many`` per method of the tiers (and of the copier), per request."""
    from inferscale_engine.memory.kv import pages as pages_module

    spent: dict[str, float] = {}  # seconds per method over the timed requests
    timing = False  # the untimed moves between requests call the same methods

    def timed(owner: object, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if timing:
                    spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0

        setattr(owner, name, wrapper)

    for owner, name in [(KVTiers, "_promote"), (KVTiers, "_make_room"), (PageMover, "wait_written"),
                        (PageMover, "copy"), (PageMover, "_dma"), (DeviceTier, "read"), (DeviceTier, "_gather"),
                        (PagedTier, "hand_out"), (PageMover, "index"), (PageMover, "after_side"),
                        (PageMover, "mark_caller")]:
        timed(owner, name, f"{owner.__name__}.{name}")
    timed(dma.ByteCopier, "copy", "ByteCopier.copy")
    timed(pages_module, "page_ranges", "page_ranges")
    for idle in (0.0, 0.05):
        for tier in ("host", "device"):
            total = []
            spent.clear()
            for i in range(14):
                for key in keys:  # puts the facts in the tier under test
                    if tier == "host":
                        t.evict(key, to="host")
                    else:
                        t.get(key, fp)
                torch.cuda.synchronize()
                time.sleep(idle)
                timing = i >= 2
                t0 = time.perf_counter()
                got = t.get_many(keys, fp)
                elapsed = time.perf_counter() - t0
                timing = False
                torch.cuda.synchronize()
                del got
                if i >= 2:
                    total.append(elapsed)
            print(f"k={len(keys)} {tier} tier, {1e3 * idle:.0f} ms idle: get_many {1e3 * median(total):.3f} ms host time",
                  flush=True)
            for label, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
                print(f"    {label:20s} {1e3 * seconds / len(total):7.3f} ms a request (mean)", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 50)
