"""Where the time of one KV-injected request goes, on the GPU (diagnostic, not a benchmark).

usage: python scripts/h200_profile.py CONFIG_DIR [fused|unfused] [KEY=VALUE engine options...]
With $OUT set, also writes torch.profiler tables of five k=50 requests per mode to
$OUT/trace-k{50,200}-<mode>.txt: what the GPU and the host do differently for an injected
request and for the floor.
"""

import os
import sys
import time
from collections import defaultdict

import torch

from inferscale_engine.connector.scheduler import ConnectorScheduler
from inferscale_engine.connector.worker import ConnectorWorker

timings: dict[str, list[float]] = defaultdict(list)


def timed(name, fn, sync=False):
    def wrapper(*a, **kw):
        if sync:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn(*a, **kw)
        if sync:
            torch.cuda.synchronize()
        timings[name].append(1e3 * (time.perf_counter() - t))
        return out
    return wrapper


def patch():
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    from inferscale_engine.engine import InferScaleEngine

    ConnectorWorker._inject = timed("inject(sync)", ConnectorWorker._inject, sync=True)
    ConnectorScheduler.get_num_new_matched_tokens = timed("sched.match", ConnectorScheduler.get_num_new_matched_tokens)
    ConnectorScheduler.update_state_after_alloc = timed("sched.alloc", ConnectorScheduler.update_state_after_alloc)
    InferScaleEngine._prepare = timed("engine.prepare", InferScaleEngine._prepare)
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.engine.llm_engine import LLMEngine

    Scheduler.schedule = timed("schedule", Scheduler.schedule)
    # vLLM's per-block work: an injected prefix's blocks are allocated, hashed and cached where
    # the floor's are found cached.
    KVCacheManager.get_computed_blocks = timed("kv.lookup", KVCacheManager.get_computed_blocks)
    KVCacheManager.allocate_slots = timed("kv.allocate", KVCacheManager.allocate_slots)
    KVCacheManager.free = timed("kv.free", KVCacheManager.free)
    LLMEngine.add_request = timed("add_request", LLMEngine.add_request)
    Scheduler.update_from_output = timed("update_from_output", Scheduler.update_from_output)
    EngineCore.step = timed("core.step", EngineCore.step)
    if hasattr(EngineCore, "step_with_batch_queue"):
        EngineCore.step_with_batch_queue = timed("core.step_bq", EngineCore.step_with_batch_queue)
    from vllm.v1.worker.gpu_worker import Worker

    Worker.execute_model = timed("worker.execute", Worker.execute_model)
    if hasattr(Worker, "sample_tokens"):
        Worker.sample_tokens = timed("worker.sample", Worker.sample_tokens)


def trace(eng, work, k, out_dir):
    """torch.profiler over five requests per mode, after the timed runs (warm)."""
    from torch.profiler import ProfilerActivity, profile

    for mode in ("inject", "floor"):
        reqs = []
        for _ in range(5):
            picks, q = work.sample(k), work.question()
            if mode == "floor":
                eng.generate_segments(work.prompt_segments(picks, q), max_tokens=1, mode="prompt")
                reqs.append((work.prompt_segments(picks, work.question()), "prompt"))
            else:
                reqs.append((work.inject_segments(picks, q), "inject"))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for segs, m in reqs:
                eng.generate_segments(segs, max_tokens=1, mode=m)
            torch.cuda.synchronize()
        table = prof.key_averages()
        with open(os.path.join(out_dir, f"trace-k{k}-{mode}.txt"), "w") as f:
            f.write(f"# 5 requests, k={k}, mode={mode}\n")
            f.write(table.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90))
            f.write("\n")
            f.write(table.table(sort_by="self_cpu_time_total", row_limit=60, max_name_column_width=90))


if __name__ == "__main__":
    patch()
    from inferscale_apps.bench.common import SyntheticWorkload, median
    from inferscale_engine.config import engine_option
    from inferscale_engine.engine import InferScaleEngine

    fused = "unfused" not in sys.argv[2:]
    options = dict(engine_option(a) for a in sys.argv[2:] if "=" in a)  # as bench's --engine-option
    eng = InferScaleEngine(model=sys.argv[1], device="cuda", dtype="bfloat16", load_format="dummy",
                           skip_tokenizer_init=True, fused_rope=fused, **{"recompute": 0, **options})
    print(f"block size {eng.vllm_config.cache_config.block_size}", flush=True)
    work = SyntheticWorkload.build(eng, pool=400)
    for k in (50, 200):
        for mode in ("inject", "floor", "prompt"):
            ttfts = []
            measured: dict[str, list[float]] = defaultdict(list)
            for rep in range(25):
                picks, q = work.sample(k), work.question()
                segs = work.inject_segments(picks, q) if mode == "inject" else work.prompt_segments(picks, q)
                if mode == "floor":
                    eng.generate_segments(segs, max_tokens=1, mode="prompt")
                    # As bench ttft does: a short request takes the slowdown after a long prefill.
                    eng.generate_segments([work.head + work.question()], max_tokens=1, mode="prompt")
                    segs = work.prompt_segments(picks, work.question())
                timings.clear()
                r = eng.generate_segments(segs, max_tokens=1, mode="inject" if mode == "inject" else "prompt")
                ttfts.append(1e3 * r.ttft_s)
                if rep >= 5:
                    for key, v in timings.items():
                        measured[key].append(sum(v))
                        measured[key + " calls"].append(len(v))
            parts = ", ".join(f"{key} {median(v):.2f}" for key, v in sorted(measured.items()))
            print(f"fused={fused} k={k} {mode}: ttft p50 {median(ttfts[5:]):.2f} ms | {parts}", flush=True)
    if os.environ.get("OUT"):
        for k in (50, 200):
            trace(eng, work, k, os.environ["OUT"])
    eng.close()
