"""Injection writes overlapped with the forward pass vs written up front (diagnostic, A/B).

usage: python scripts/h200_overlap.py CONFIG_DIR
One engine; per k, 40 pairs of KV-injected requests, one of each pair with the side-stream
overlap and one with every write queued up front on the forward pass's stream, in alternating
order: the median of the paired differences cancels the machine's drift.
"""

import sys

from inferscale_engine.bench.common import SyntheticWorkload, median
from inferscale_engine.connector import compat
from inferscale_engine.engine import InferScaleEngine

real = compat.runs_layer_hooks
eng = InferScaleEngine(model=sys.argv[1], device="cuda", dtype="bfloat16", load_format="dummy",
                       skip_tokenizer_init=True, max_model_len=16384)
work = SyntheticWorkload.build(eng, pool=400)
for k in (50, 200):
    times = {"overlap": [], "upfront": []}
    for rep in range(45):
        for mode in ("overlap", "upfront") if rep % 2 else ("upfront", "overlap"):
            compat.runs_layer_hooks = real if mode == "overlap" else (lambda fc: False)
            # Fresh facts each time: the same ones again would come from vLLM's prefix cache.
            segs = work.inject_segments(work.sample(k), work.question())
            t = eng.generate_segments(segs, max_tokens=1, mode="inject").ttft_s
            if rep >= 5:
                times[mode].append(1e3 * t)
    diff = [a - b for a, b in zip(times["overlap"], times["upfront"])]
    print(f"k={k}: overlap {median(times['overlap']):.2f} ms, up front {median(times['upfront']):.2f} ms, "
          f"paired difference median {median(diff):+.2f} ms", flush=True)
eng.close()
