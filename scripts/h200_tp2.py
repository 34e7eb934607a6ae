"""Tensor parallelism: KV injection with TP=2 on two GPUs, exactness and TTFT against prompt injection.

vLLM's standard multiprocess executor: one worker process per GPU, each mapping the staged fact KV
through CUDA IPC and injecting (and capturing) only its own KV heads. Run with NCCL_DEBUG=INFO
(NVLink multicast stays off: NCCL_NVLS_ENABLE=0 as the machine sets it) to diagnose the earlier
NCCL failure in vLLM's logits all-gather (docs/scaling.md).

usage (device kind nvidia-h200-x2): NCCL_DEBUG=INFO python3 scripts/h200_tp2.py CONFIG_DIR OUT.json
"""

import json
import sys

from inferscale_apps.bench.common import environment
from inferscale_apps.bench.exactness import random_case, run_case
from inferscale_apps.bench.ttft import run_ttft, summarize
from inferscale_engine.engine import InferScaleEngine

if __name__ == "__main__":
    with InferScaleEngine(
        model=sys.argv[1], device="cuda", dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True,
        tensor_parallel_size=2, max_logprobs=20, recompute=0, max_model_len=16384,
    ) as engine:
        exact = run_case(engine, *random_case(engine, k=8))
        print(json.dumps(exact), flush=True)
        ttft = run_ttft(engine, [5, 50, 200], repeats=20)
        out = {"bench": "tp2", "env": {**environment(engine), "tensor_parallel_size": 2},
               "results": {"exactness": exact, "ttft": ttft, "summary": summarize(ttft)}}
    with open(sys.argv[2], "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps(out["results"]["summary"], indent=1))
