"""Multiprocess (vLLM's AsyncLLM + engine core; fact KV to the worker through CUDA IPC) against
in-process InferScale on one H200: exactness, TTFT at k=5/50/200 and, multiprocess only, 100-user
throughput at k=50, each against prompt injection on the same engine. One engine per mode.

usage (scripts/h200_core.sh, STEPS=mp): python3 scripts/h200_mp.py MODEL_DIR OUT_DIR [MODES]
MODES: comma-separated of multiprocess, inprocess, inprocess+throughput (default: multiprocess,inprocess)
Diagnostics (environment): MP_KS (default 5,50,200), MP_REPEATS (10), MP_THROUGHPUT=0 skips the
throughput wave, MP_SERVE_POOL=1 serves every pool fact once before timing (run_ttft's
serve_pool_first), MP_STAGED_GIB sets the engine's staged_kv_gib (staged KV kept for reuse).
"""

import json
import os
import sys
import time

from inferscale_apps.bench.common import SyntheticRetriever, environment
from inferscale_apps.bench.exactness import random_case, run_case
from inferscale_apps.bench.throughput import run_throughput
from inferscale_apps.bench.ttft import run_ttft, summarize
from inferscale_engine.engine import InferScaleEngine

if __name__ == "__main__":
    model, out = sys.argv[1], sys.argv[2]
    for mode in (sys.argv[3] if len(sys.argv) > 3 else "multiprocess,inprocess").split(","):
        multiprocess = mode == "multiprocess"
        name = mode.split("+")[0]
        t0 = time.perf_counter()
        with InferScaleEngine(model=model, device="cuda", dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True,
                              max_model_len=16384, max_logprobs=20, recompute=0, multiprocess=multiprocess,
                              staged_kv_gib=float(os.environ["MP_STAGED_GIB"]) if "MP_STAGED_GIB" in os.environ else None
                              ) as engine:
            started = time.perf_counter() - t0
            ks = [int(k) for k in os.environ.get("MP_KS", "5,50,200").split(",")]
            repeats = int(os.environ.get("MP_REPEATS", "10"))
            results: dict = {"start_s": started, "exactness": run_case(engine, *random_case(engine, k=8))}
            print(name, "start", round(started, 1), "s; exactness", [(r["mode"], r["greedy_match"], r["max_logit_diff"])
                                                                   for r in results["exactness"]], flush=True)
            rows = [] if mode.endswith("+throughput") else run_ttft(engine, ks, repeats=repeats, serve_pool_first=os.environ.get("MP_SERVE_POOL") == "1", retriever=SyntheticRetriever("cuda", k=200))
            results["ttft"], results["ttft_summary"] = rows, summarize(rows) if rows else []
            for r in rows:
                if r["mode"] in ("prompt", "inject"):
                    print(name, r["mode"], "k", r["k"], "ttft_ms_p50", round(r["ttft_ms_p50"], 2), flush=True)
            for s in results["ttft_summary"]:
                print(name, "k", s["k"], "prompt_over_inject", round(s["prompt_over_inject"], 2), flush=True)
            if (multiprocess or mode.endswith("+throughput")) and os.environ.get("MP_THROUGHPUT") != "0":
                results["throughput"] = run_throughput(engine, [100], k=50)
                for r in results["throughput"]:
                    print(name, "throughput", r["mode"], r["users"], "users", round(r["req_per_s"], 1), "req/s",
                          "ttft p50", round(r["ttft_ms_p50"], 1), flush=True)
            env = environment(engine)
        with open(f"{out}/mp-{mode}.json", "w") as f:
            json.dump({"bench": "h200_mp", "env": {**env, "multiprocess": multiprocess}, "results": results}, f, indent=1)
