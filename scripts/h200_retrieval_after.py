"""Why retrieval takes longer inside `bench ttft` than alone (diagnostic): the retriever timed
right after a k=200 injected request, and after each candidate cause is taken away.

usage: python scripts/h200_retrieval_after.py CONFIG_DIR
"""

import gc
import sys
import time

import torch

from inferscale_engine import InferScaleEngine
from inferscale_engine.bench.common import SyntheticRetriever, SyntheticWorkload, median

engine = InferScaleEngine(model=sys.argv[1], device="cuda", dtype="bfloat16", max_model_len=16384,
                          load_format="dummy", skip_tokenizer_init=True)
work = SyntheticWorkload.build(engine, pool=400, fact_tokens=28, head_tokens=64, question_tokens=24)
retriever = SyntheticRetriever("cuda", k=200)


def request() -> None:
    engine.generate_segments(work.inject_segments(work.sample(200), work.question()), max_tokens=1, mode="inject")


def after(settle) -> float:
    times = []
    for i in range(25):
        request()
        settle()
        times.append(1e3 * retriever(work.question()))
    return median(times[5:])


print(f"alone, back to back          {median([1e3 * retriever(work.question()) for _ in range(25)][5:]):.3f} ms")
print(f"right after a request        {after(lambda: None):.3f} ms")
print(f"after cuda synchronize       {after(torch.cuda.synchronize):.3f} ms")
print(f"after 5 ms sleep             {after(lambda: time.sleep(0.005)):.3f} ms")
print(f"after gc.collect()           {after(gc.collect):.3f} ms")
gc.disable()
print(f"right after, gc disabled     {after(lambda: None):.3f} ms")
gc.enable()
print(f"right after, again           {after(lambda: None):.3f} ms")
engine.close()
