"""All single-GPU benchmark tables in one device call (one engine start per model shape).

usage: python scripts/h200_bench.py OUT_DIR MODEL   (one process per model: vLLM frees GPU memory on exit)
Writes ttft-<model>.json/.png, exactness-<model>.json, throughput-llama-3.1-8b.json in the
``{"bench", "env", "results"}`` shape of ``inferscale bench``.
"""

import sys
from pathlib import Path

from inferscale_apps.bench import common
from inferscale_apps.bench.exactness import random_case, run_case
from inferscale_apps.bench.plots import plot_ttft
from inferscale_apps.bench.throughput import run_throughput
from inferscale_apps.bench.ttft import run_ttft, summarize
from inferscale_engine.engine import InferScaleEngine

PLAN = {
    "llama-3.1-8b": {"ks": [0, 5, 10, 20, 50, 100, 200], "throughput": [1, 10, 50, 100]},
    "qwen2.5-7b": {"ks": [0, 5, 50, 200]},
    "mistral-7b": {"ks": [0, 5, 50, 200]},
}

if __name__ == "__main__":
    out, name = Path(sys.argv[1]), sys.argv[2]
    plan = PLAN[name]
    engine = InferScaleEngine(model=str(out / "models" / name), device="cuda", dtype="bfloat16",
                              load_format="dummy", skip_tokenizer_init=True, max_model_len=16384, recompute=0)
    env = common.environment(engine)
    rows = run_case(engine, *random_case(engine, k=8))
    common.write_json(out / f"exactness-{name}.json", "exactness", env, rows)
    common.print_table(rows, ["mode", "arch", "dtype", "greedy_match", "max_logit_diff", "first_divergence"])
    retriever = common.SyntheticRetriever("cuda", k=max(plan["ks"]))
    rows = run_ttft(engine, plan["ks"], repeats=20, retriever=retriever)
    common.write_json(out / f"ttft-{name}.json", "ttft", env, rows)
    plot_ttft(rows, str(out / f"ttft-{name}.png"), title=f"TTFT vs k, H200, random {name} (bf16)")
    print(name)
    common.print_table(rows, ["mode", "k", "prompt_tokens", "ttft_ms_p50", "ttft_ms_p95", "retrieval_ms_p50", "engine_ms_p50"])
    common.print_table(summarize(rows), ["k", "prompt_over_inject", "engine_prompt_over_inject", "inject_over_floor"])
    if "throughput" in plan:
        rows = run_throughput(engine, plan["throughput"], k=50)
        common.write_json(out / f"throughput-{name}.json", "throughput", env, rows)
        common.print_table(rows, ["mode", "users", "k", "req_per_s", "tok_per_s", "ttft_ms_p50", "ttft_ms_p95"])
    engine.close()
