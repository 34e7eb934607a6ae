"""Where a host-tier request's extra time goes, next to a device-tier one (diagnostic).

usage: python scripts/h200_hosttier.py CONFIG_DIR [K]

K facts (default 50) of the bench workload sit in a KVTiers store; per repeat, in alternating
order, variants of one injected request (``max_tokens=1``), medians of 20:

* ``device``: the facts on the device tier (one gather);
* ``host``: promoted from the host tier (the default path);
* ``host-landed``: promoted, then the host waits for every copy before the request, so the
  engine part never waits for PCIe.

Per variant: ``get_many`` host time, the engine's TTFT, and per-function host times (promotion
stages, engine preparation, vLLM intake/scheduling, the connector's injection, the worker's
execute). With $OUT set, torch.profiler tables of five requests per tier go to
$OUT/trace-hosttier-<tier>.txt.
"""

import os
import sys
import tempfile
import time
from collections import defaultdict

import torch

from inferscale_engine.connector.worker import ConnectorWorker
from inferscale_engine.memory.kv import dma
from inferscale_engine.memory.kv.device_tier import DeviceTier
from inferscale_engine.memory.kv.pages import PageMover
from inferscale_engine.memory.kv.tiers import KVTiers

timings: dict[str, list[float]] = defaultdict(list)


def timed(owner, name, label):
    fn = getattr(owner, name)

    def wrapper(*a, **kw):
        t = time.perf_counter()
        out = fn(*a, **kw)
        timings[label].append(1e3 * (time.perf_counter() - t))
        return out

    setattr(owner, name, wrapper)


def patch():
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.worker.gpu_worker import Worker

    from inferscale_engine.engine import InferScaleEngine

    for owner, name, label in [
        (KVTiers, "_promote", "tiers.promote"), (PageMover, "copy", "tiers.copy"), (KVTiers, "_evict", "tiers.evict"),
        (DeviceTier, "read", "tiers.read_device"), (dma.ByteCopier, "copy", "dma.copy"),
        (ConnectorWorker, "_inject", "conn.inject"),
        (InferScaleEngine, "_prepare", "engine.prepare"), (LLMEngine, "add_request", "add_request"),
        (Scheduler, "schedule", "schedule"), (Worker, "execute_model", "worker.execute"),
    ]:
        timed(owner, name, label)
    if hasattr(Worker, "sample_tokens"):
        timed(Worker, "sample_tokens", "worker.sample")
    if torch.cuda.is_available():
        from inferscale_engine.connector import rope_triton

        timed(rope_triton, "inject_rows", "inject_rows")
        timed(rope_triton._inject_rows, "run", "triton.run")


def main(model: str, k: int) -> None:
    patch()
    from inferscale_apps.bench.common import SyntheticWorkload, median
    from inferscale_engine.engine import InferScaleEngine
    from inferscale_engine.types import Span

    cuda = torch.cuda.is_available()  # the CPU runs it too (real weights), to check the script
    device = "cuda" if cuda else "cpu"
    options = dict(dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True) if cuda else {}
    eng = InferScaleEngine(model=model, device=device, max_model_len=8192, **{"recompute": 0, **options})
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    work = SyntheticWorkload.build(eng, pool=max(2 * k, 16))
    fp = eng.fingerprint
    tiers = KVTiers(tempfile.mkdtemp(), device=device, device_bytes=4 << 30, host_bytes=4 << 30, page_tokens=16)
    keys = [(f"{i:016x}", 1) for i in range(k)]
    for key, span in zip(keys, work.facts):
        tiers.put(key, span.kv, fp)
    ids = work.fact_ids[:k]
    serial = 0

    def request(variant: str) -> tuple[float, float, float]:
        nonlocal serial
        for key in keys:
            if variant.startswith("device"):
                tiers.get(key, fp)
            elif tiers.where(key) != "host":
                tiers.evict(key, to="host")
        sync()
        eng.generate_segments([work.head + work.question()], max_tokens=1, mode="prompt")  # as bench tiers
        timings.clear()
        t0 = time.perf_counter()
        kvs = tiers.get_many(keys, fp)
        t1 = time.perf_counter()
        if variant.startswith("host-landed"):
            sync()
        t2 = time.perf_counter()
        serial += 1
        spans = [Span(f"h:{serial}:{i}", tuple(t), kv) for i, (t, kv) in enumerate(zip(ids, kvs))]
        r = eng.generate_segments([work.head, *spans, work.question()], max_tokens=1, mode="inject")
        return 1e3 * (t1 - t0), 1e3 * (t2 - t1), 1e3 * r.ttft_s

    variants = ["device", "host", "host-landed"]
    got: dict[str, dict[str, list[float]]] = {v: defaultdict(list) for v in variants}
    for rep in range(int(os.environ.get("REPS", 25))):
        for variant in variants if rep % 2 == 0 else variants[::-1]:
            promote, wait, ttft = request(variant)
            if rep < 5:
                continue
            m = got[variant]
            m["get_many"].append(promote)
            m["landed_wait"].append(wait)
            m["engine_ttft"].append(ttft)
            m["total"].append(promote + wait + ttft)
            for key, v in timings.items():
                m[key].append(sum(v))
    for variant in variants:
        m = got[variant]
        head = ", ".join(f"{key} {median(m[key]):.2f}" for key in ("total", "get_many", "landed_wait", "engine_ttft"))
        rest = ", ".join(f"{key} {median(v):.2f}" for key, v in sorted(m.items())
                         if key not in ("total", "get_many", "landed_wait", "engine_ttft"))
        print(f"k={k} {variant}: {head} | {rest}", flush=True)

    out = os.environ.get("OUT")
    if out:
        from torch.profiler import ProfilerActivity, profile

        for variant in ("device", "host"):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    request(variant)
                sync()
            table = prof.key_averages()
            with open(os.path.join(out, f"trace-hosttier-{variant}.txt"), "w") as f:
                f.write(f"# 5 requests (each after a short one), k={k}, {variant} tier\n")
                f.write(table.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=80))
                f.write(table.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=80))
    eng.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 50)
