"""Where the time of one KV-injected request goes, on the GPU (diagnostic, not a benchmark)."""

import sys
import time

import torch

from inferscale_engine.connector import connector as C

timings: dict[str, list[float]] = {"inject": [], "start_load_kv": []}


def timed(name, fn):
    def wrapper(*a, **kw):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn(*a, **kw)
        torch.cuda.synchronize()
        timings[name].append(1e3 * (time.perf_counter() - t))
        return out
    return wrapper


C.InferScaleConnector._inject = timed("inject", C.InferScaleConnector._inject)
C.InferScaleConnector.start_load_kv = timed("start_load_kv", C.InferScaleConnector.start_load_kv)

if __name__ == "__main__":
    from inferscale_engine.bench.common import SyntheticWorkload, median
    from inferscale_engine.engine import InferScaleEngine

    fused = sys.argv[2] != "unfused"
    eng = InferScaleEngine(model=sys.argv[1], device="cuda", dtype="bfloat16", load_format="dummy",
                           skip_tokenizer_init=True, fused_rope=fused)
    work = SyntheticWorkload.build(eng, pool=200)
    for k in (5, 50):
        for mode in ("inject", "prompt", "floor"):
            for key in timings:
                timings[key].clear()
            ttfts, walls, prep = [], [], []
            for rep in range(25):
                picks, q = work.sample(k), work.question()
                segs = work.inject_segments(picks, q) if mode == "inject" else work.prompt_segments(picks, q)
                if mode == "floor":
                    eng.generate_segments(segs, max_tokens=1, mode="prompt")
                    segs = work.prompt_segments(picks, work.question())
                t = time.perf_counter()
                prepared, params = eng._prepare(segs, "u", max_tokens=1, mode="inject" if mode == "inject" else "prompt")
                eng._unstage(prepared.staged)
                prep.append(1e3 * (time.perf_counter() - t))
                t = time.perf_counter()
                r = eng.generate_segments(segs, max_tokens=1, mode="inject" if mode == "inject" else "prompt")
                walls.append(1e3 * (time.perf_counter() - t))
                ttfts.append(1e3 * r.ttft_s)
            print(f"fused={fused} k={k} {mode}: ttft p50 {median(ttfts[5:]):.2f} ms, wall {median(walls[5:]):.2f}, "
                  f"prepare {median(prep[5:]):.2f}, start_load_kv {median(timings['start_load_kv'][5:]) if timings['start_load_kv'] else 0:.2f}, "
                  f"inject {median(timings['inject'][5:]) if timings['inject'] else 0:.2f}", flush=True)
    eng.close()
