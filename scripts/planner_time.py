"""``planner.plan``'s own time for a request of k cold memories, in a tight loop (diagnostic):
what the cost model costs a cold request without the engine around it. The rates are those the
H200 bench calibrated (tiers-llama-3.1-8b-6c92ec1.json: prefill curve, 0.63 GB/s cold disk), and
each memory a 28-token, 3.67 MB file, so the split search stops after the few reads that could pay.

usage: python scripts/planner_time.py [K]   (default 50; prints the median of 2000 calls in µs)
"""

import functools
import statistics
import sys
import time

from inferscale_engine import planner
from inferscale_engine.types import ColdFact

RATES = planner.Rates(((16, 0.00818), (64, 0.00843), (256, 0.01042), (512, 0.02705), (1024, 0.02705),
                       (2048, 0.04819), (4096, 0.10036)), 629142639.0, 0.00404, 5.4e10)


class _Read:
    """A cold read that is never started: the planner only weighs it (the split stays at 0)."""

    @functools.cached_property
    def nbytes(self) -> int:
        return 3670016

    @functools.cached_property
    def cached(self) -> bool:  # the store's probe is a cachestat call, timed apart (DiskTier.cached)
        return False

    def start(self) -> None:
        raise AssertionError("the cost model should read nothing at these rates")

    def promote(self) -> None:
        pass


def main(k: int, calls: int = 2000) -> None:
    head, question = list(range(64)), list(range(24))
    times = []
    for _ in range(calls):
        cold = [ColdFact(list(range(28)), _Read()) for _ in range(k)]  # fresh, as a store's resolve makes them
        t0 = time.perf_counter()
        _, mix, _ = planner.plan([head, *cold, question], 0, RATES)
        times.append(time.perf_counter() - t0)
    assert mix.recomputed == k, mix
    print(f"k={k}: planner.plan {1e6 * statistics.median(times):.1f} µs (median of {calls})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 50)
