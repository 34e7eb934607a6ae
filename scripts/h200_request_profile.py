"""Host time of a KV-injected request against the prefix-cache floor, per function, every thread
(diagnostic: yappi, wall time): which Python work an injected request adds.

usage: python scripts/h200_request_profile.py CONFIG_DIR [K] [REPEATS]
       DEVICE=cpu python scripts/h200_request_profile.py TINY_MODEL_DIR [K] [REPEATS]
Needs ``yappi`` (carried as a wheel). Prints, per function, the time per request spent under
inject minus under the floor (own time, all threads), largest first.
"""

from __future__ import annotations

import os
import sys
import time

import yappi

try:  # builds before the applications left the library kept the benchmarks inside it
    from inferscale_engine.bench.common import SyntheticWorkload, median  # type: ignore[import-not-found]
except ImportError:
    from inferscale_apps.bench.common import SyntheticWorkload, median
from inferscale_engine.engine import InferScaleEngine


def profile(run, n):
    yappi.clear_stats()
    yappi.set_clock_type("wall")
    yappi.start(builtins=True)
    t = time.perf_counter()
    for _ in range(n):
        run()
    wall = time.perf_counter() - t
    yappi.stop()
    stats = {}
    for s in yappi.get_func_stats():
        key = f"{s.module.split('site-packages/')[-1].split('/work/')[-1]}:{s.lineno} {s.name}"
        prev = stats.get(key, (0.0, 0.0))
        stats[key] = (prev[0] + s.tsub / n, prev[1] + s.ttot / n)
    return wall / n, stats


def main() -> None:
    model = sys.argv[1]
    k = int(sys.argv[2]) if len(sys.argv) > 2 else 50
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    if os.environ.get("DEVICE") == "cpu":
        options = dict(device="cpu", max_model_len=2048)
    else:
        options = dict(device="cuda", dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True)
    try:
        eng = InferScaleEngine(model=model, recompute=0, **options)
    except (TypeError, ValueError):  # builds before the quality knob injected every memory anyway
        eng = InferScaleEngine(model=model, **options)
    work = SyntheticWorkload.build(eng, pool=max(4 * k, 64))

    def inject():
        picks, q = work.sample(k), work.question()
        return eng.generate_segments(work.inject_segments(picks, q), max_tokens=1, mode="inject").ttft_s

    floor_picks = work.sample(k)
    eng.generate_segments(work.prompt_segments(floor_picks, work.question()), max_tokens=1, mode="prompt")

    def floor():
        return eng.generate_segments(work.prompt_segments(floor_picks, work.question()), max_tokens=1,
                                     mode="prompt").ttft_s

    for _ in range(10):
        inject(), floor()
    ttft = {"inject": median([inject() for _ in range(n)]), "floor": median([floor() for _ in range(n)])}
    print(f"k={k} ttft p50 (no profiler): inject {1e3 * ttft['inject']:.2f} ms, floor {1e3 * ttft['floor']:.2f} ms, "
          f"inject/floor {ttft['inject'] / ttft['floor']:.3f}", flush=True)
    wi, si = profile(inject, n)
    wf, sf = profile(floor, n)
    print(f"k={k} under yappi, wall per request: inject {1e3 * wi:.2f} ms, floor {1e3 * wf:.2f} ms")
    diff = sorted(((si.get(key, (0, 0))[0] - sf.get(key, (0, 0))[0], key) for key in set(si) | set(sf)), reverse=True)
    print("own time per request, inject minus floor (ms), largest 45:")
    for d, key in diff[:45]:
        print(f"  {1e3 * d:+8.3f}  inject {1e3 * si.get(key, (0, 0))[0]:7.3f} (cum {1e3 * si.get(key, (0, 0))[1]:7.3f})  {key}")
    print("inject, largest cumulative (ms/request), 60:")
    for key, (own, cum) in sorted(si.items(), key=lambda kv: -kv[1][1])[:60]:
        print(f"  cum {1e3 * cum:8.3f} own {1e3 * own:7.3f}  {key}")
    eng.close()


if __name__ == "__main__":
    main()
