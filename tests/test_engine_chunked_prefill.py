"""Exactness when vLLM splits prompts over several steps (chunked prefill).

With a 32-token step budget, every exact-context encode window (head + the facts before it +
the fact) runs over several steps, so a fact's rows are captured a few at a time, and the
prompt-injected reference is prefilled in chunks too. On CUDA (when there is one) the captures
come back from the paged cache after each forward pass, full CUDA graphs included; on the CPU
from the wrapped KV write.
"""

from __future__ import annotations

import pytest
import torch

from inferscale_apps.bench.exactness import run_case, text_case
from inferscale_engine import InferScaleEngine

pytestmark = pytest.mark.timeout(600)

STEP_TOKENS = 32
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CUDA build of vLLM runs no CPU engine


def test_spans_captured_over_several_steps_inject_exactly(tiny_llama):
    # FlashAttention (whose cache layout InferScale reads back) has no float32.
    dtype, tolerance = ("float32", 1e-4) if DEVICE == "cpu" else ("bfloat16", 1e-2)
    with InferScaleEngine(
        model=tiny_llama, device=DEVICE, dtype=dtype, max_model_len=2048, max_logprobs=1000,
        max_num_batched_tokens=STEP_TOKENS, max_num_seqs=4, recompute=0,
    ) as engine:
        head, facts, tail = text_case(engine)
        assert len(head) + sum(map(len, facts)) > 3 * STEP_TOKENS  # windows really span steps
        exact, w0 = run_case(engine, head, facts, tail, max_tokens=16, logprobs=1000)
    assert exact["injected_tokens"] == len(head) + sum(map(len, facts))
    assert exact["greedy_match"], exact
    assert exact["max_logit_diff"] < tolerance, exact
    assert w0["max_logit_diff"] > exact["max_logit_diff"]
