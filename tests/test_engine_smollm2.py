"""KV injection on SmolLM2-135M-Instruct (real weights, bfloat16); see test_engine_exactness.

The plain run prefills the prompt in one batch and the encoder in others, so bf16 GEMMs round
differently; greedy tokens must match, and first-token logprobs (top 20) may differ by no more
than two exact encodings batched differently differ (this CPU's rounding floor) plus one bf16 step
of these logits. The floor depends on the CPU's kernels: with AMX it is 0.23 and the exact gap 0.185
(the fixed bound of 0.1 this replaces held only on machines without AMX); w=0 moves them 0.51.
"""

from __future__ import annotations

import pytest
from probes import assert_decisive

from inferscale_apps.bench.exactness import encode_spans, rounding_floor, run_case, text_case
from inferscale_engine import InferScaleEngine

#: One step of bfloat16 at the magnitude of these logits (16-32).
BF16_STEP = 0.125
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def smollm2_engine(smollm2_path):
    with InferScaleEngine(model=smollm2_path, device="cpu", dtype="bfloat16", max_model_len=2048, recompute=0) as engine:
        yield engine


def test_smollm2_bf16_exactness_and_w0_gap(smollm2_engine, record_property):
    case = text_case(smollm2_engine)
    rows = run_case(smollm2_engine, *case, max_tokens=32, logprobs=20)
    exact, w0 = rows
    floor = rounding_floor(smollm2_engine, *case, logprobs=20)
    record_property("exactness", rows)
    print("\n", rows, f"rounding floor {floor:.3f}")
    assert exact["greedy_match"], exact
    assert exact["max_logit_diff"] <= floor + BF16_STEP, (exact, floor)
    # The w=0 gap on a real model is reported, not asserted away.
    print(f"SmolLM2 w=0: greedy_match={w0['greedy_match']} max_logit_diff={w0['max_logit_diff']:.3f} "
          f"first_divergence={w0['first_divergence']}")


def test_smollm2_answers_from_injected_fact(smollm2_engine):
    head, facts, tail = text_case(smollm2_engine)
    spans = encode_spans(smollm2_engine, head, facts, exact=True, key="answer")
    result = smollm2_engine.generate_segments([head, *spans, tail], max_tokens=16)
    assert "Rex" in result.text
    assert_decisive(smollm2_engine, [head, *spans, tail], "Rex", max_tokens=16)
    assert result.usage.injected_tokens == len(head) + sum(map(len, facts))
