"""A promotion's host time from the host tier, with room on the slab, with a full slab (each
promotion then evicts as many facts) and after a prefetch moved the facts from disk to the host
(parallel reads, landing in completion order), right away and after 50 ms idle, on the tiers alone: no engine (diagnostic),
and how many copies (ranges of pages adjacent on both sides) each took.

usage: python scripts/tiers_promotion.py [cpu|cuda] [K]   (SmolLM2-135M's KV shape, 28-token facts)
"""

import statistics
import sys
import tempfile
import time

import torch

from inferscale_engine.kv import FactKV
from inferscale_engine.memory.kv.tiers import KVTiers

LAYERS, HEADS, DIM, TOKENS, PAGE_TOKENS = 30, 3, 64, 28, 16


def main(device: str, k: int, repeats: int = 40, warmup: int = 5) -> None:
    kvs = [FactKV(torch.randn(LAYERS, TOKENS, HEADS, DIM).to(torch.bfloat16),
                  torch.randn(LAYERS, TOKENS, HEADS, DIM).to(torch.bfloat16), 0) for _ in range(2 * k)]
    page = LAYERS * 2 * PAGE_TOKENS * HEADS * DIM * 2
    pages = -(-TOKENS // PAGE_TOKENS)
    tiers = KVTiers(tempfile.mkdtemp(), device=device, device_bytes=k * pages * page, host_bytes=4 * k * pages * page,
                    page_tokens=PAGE_TOKENS)
    keys = [(f"{i:016x}", 1) for i in range(2 * k)]
    for key, kv in zip(keys, kvs):
        tiers.put(key, kv, "fp")
    measured, fillers = keys[:k], keys[k:]
    copies: dict[str, list[int]] = {}
    times: dict[str, list[float]] = {"host, slab full": [], "host, room on the slab": [],
                                     "host, room on the slab, 50 ms later": [], "after prefetch": [],
                                     "after prefetch, 50 ms later": []}

    def promote(case: str) -> None:
        before = tiers.stats()["host_to_device_copies"]
        t0 = time.perf_counter()
        tiers.get_many(measured, "fp")
        times[case].append(time.perf_counter() - t0)
        copies.setdefault(case, []).append(tiers.stats()["host_to_device_copies"] - before)

    for _ in range(warmup + repeats):
        tiers.get_many(fillers, "fp")  # the measured facts go down to the host, the slab is full
        promote("host, slab full")
        for case, pause in (("host, room on the slab", 0.0), ("host, room on the slab, 50 ms later", 0.05)):
            for key in measured:
                tiers.evict(key)
            time.sleep(pause)  # idle as long as after the prefetch below
            promote(case)
        for case, pause in (("after prefetch", 0.0), ("after prefetch, 50 ms later", 0.05)):
            for key in measured:
                tiers.evict(key, to="disk")
            tiers.prefetch(measured, "fp")
            while {tiers.where(key) for key in measured} != {"host"}:
                time.sleep(0.0005)
            time.sleep(pause)  # the readers' threads done with their callbacks, the host idle
            promote(case)
        if device == "cuda":
            torch.cuda.synchronize()
    for name, values in times.items():
        print(f"k={k} {name}: {1e3 * statistics.median(values[warmup:]):.2f} ms host time, "
              f"{statistics.median(copies[name][warmup:]):.0f} copies")
    print("evictions that kept their host pages:", tiers.stats()["device_to_host_kept"], "of",
          tiers.stats()["device_to_host"])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cpu", int(sys.argv[2]) if len(sys.argv) > 2 else 50)
