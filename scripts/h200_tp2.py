"""Tensor parallelism: KV injection with TP=2 on two GPUs, exactness and TTFT.

Every rank runs the whole engine in its own process (vLLM's ``external_launcher`` executor under
torchrun), so the in-process connector bridge holds on each rank; each rank captures and injects
only its own KV heads, which is how stored KV splits across tensor-parallel ranks.

usage: torchrun --nproc-per-node=2 scripts/h200_tp2.py CONFIG_DIR OUT.json
"""

import json
import os
import sys

import torch.distributed as dist

from inferscale_apps.bench.common import environment
from inferscale_apps.bench.exactness import random_case, run_case
from inferscale_apps.bench.ttft import run_ttft
from inferscale_engine.engine import InferScaleEngine

if __name__ == "__main__":
    rank = int(os.environ.get("RANK", "0"))
    engine = InferScaleEngine(
        model=sys.argv[1], device="cuda", dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True,
        tensor_parallel_size=2, distributed_executor_backend="external_launcher", max_logprobs=20, recompute=0,
    )
    heads = engine.vllm_config.model_config.get_num_kv_heads(engine.vllm_config.parallel_config)
    exact = run_case(engine, *random_case(engine, k=8))
    ttft = run_ttft(engine, [5, 50], repeats=20)
    if rank == 0:
        out = {"bench": "tp2", "env": {**environment(engine), "tensor_parallel_size": 2, "kv_heads_per_rank": heads},
               "results": {"exactness": exact, "ttft": ttft}}
        with open(sys.argv[2], "w") as f:
            json.dump(out, f, indent=2)
        print(json.dumps(out["results"], indent=1))
    engine.close()
    if dist.is_initialized():
        dist.destroy_process_group()
