"""Why retrieval takes longer inside `bench ttft` than alone (diagnostic): the retriever timed
right after a k=200 injected request, and after each candidate cause is taken away; then alone
after an idle pause and after a busy one (the thread asleep, or its CPU kept running).

usage: python scripts/h200_retrieval_after.py CONFIG_DIR
"""

import gc
import sys
import time

import torch

from inferscale_apps.bench.common import SyntheticRetriever, SyntheticWorkload, median
from inferscale_engine import InferScaleEngine

engine = InferScaleEngine(model=sys.argv[1], device="cuda", dtype="bfloat16", max_model_len=16384,
                          load_format="dummy", skip_tokenizer_init=True, recompute=0)
work = SyntheticWorkload.build(engine, pool=400, fact_tokens=28, head_tokens=64, question_tokens=24)
retriever = SyntheticRetriever("cuda", k=200)


def request() -> None:
    engine.generate_segments(work.inject_segments(work.sample(200), work.question()), max_tokens=1, mode="inject")


def after(settle, first=request) -> float:
    times = []
    for _ in range(25):
        first()
        settle()
        times.append(1e3 * retriever(work.question()))
    return median(times[5:])


def spin(seconds: float = 0.005) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


print(f"alone, back to back          {median([1e3 * retriever(work.question()) for _ in range(25)][5:]):.3f} ms")
print(f"right after a request        {after(lambda: None):.3f} ms")
print(f"after cuda synchronize       {after(torch.cuda.synchronize):.3f} ms")
print(f"after 5 ms sleep             {after(lambda: time.sleep(0.005)):.3f} ms")
print(f"after gc.collect()           {after(gc.collect):.3f} ms")
gc.disable()
print(f"right after, gc disabled     {after(lambda: None):.3f} ms")
gc.enable()
print(f"right after, again           {after(lambda: None):.3f} ms")
print(f"after a 5 ms busy wait       {after(spin):.3f} ms")
print(f"alone, after 5 ms sleep      {after(lambda: time.sleep(0.005), first=lambda: None):.3f} ms")
print(f"alone, after 5 ms busy wait  {after(spin, first=lambda: None):.3f} ms")
print(f"alone, after 20 ms sleep     {after(lambda: time.sleep(0.02), first=lambda: None):.3f} ms")
engine.close()
