"""The quality knob, ``recompute``: the last R memories of a prompt are prefilled as text.

SmolLM2-135M-Instruct (real weights, bf16) through the public API: memories added to the store
with ``window=0`` (each encoded alone, so injected KV really differs from a prefill), served in
a chat prompt as handles. At its maximum the knob must give prompt injection's answer exactly;
at 0 the answer must differ measurably, so a knob that did nothing would fail here.
"""

from __future__ import annotations

import pytest

from inferscale_engine import InferScaleEngine

pytestmark = pytest.mark.timeout(600)

FACTS = [
    "Caroline adopted a grey cat named Pixel in March.",
    "Caroline works as a nurse at the city hospital.",
    "Caroline's brother Tom lives in Lisbon and teaches maths.",
    "Caroline ran her first marathon on 7 May 2023.",
    "Caroline is learning to play the cello.",
    "Caroline's favourite food is mushroom risotto.",
]
QUESTION = "When did Caroline run her first marathon, and what is her cat called?"


@pytest.fixture(scope="module")
def engine(smollm2_path, tmp_path_factory):
    with InferScaleEngine(model=smollm2_path, device="cpu", dtype="bfloat16", max_model_len=2048, window=0,
                          store_path=tmp_path_factory.mktemp("knob-store")) as eng:
        for fact in FACTS:
            eng.memory.add(fact, user_id="caroline")
        eng.memory.wait_for_encoding()
        yield eng


@pytest.fixture(scope="module")
def messages(engine):
    handles = [item.handle for item in engine.memory.get_all(user_id="caroline")]
    assert len(handles) == len(FACTS)
    return [
        {"role": "system", "content": "You remember these facts about the user:\n" + "\n".join(handles)},
        {"role": "user", "content": QUESTION},
    ]


def _ask(engine, messages, **kw):
    return engine.generate(messages, user_id="caroline", max_tokens=24, first_logprobs=20, **kw)


def _max_logprob_diff(a, b) -> float:
    shared = set(a.first_logprobs) & set(b.first_logprobs)
    assert shared
    return max(abs(a.first_logprobs[t] - b.first_logprobs[t]) for t in shared)


def test_full_recompute_reproduces_prompt_injection_and_zero_does_not(engine, messages):
    prompt = _ask(engine, messages, mode="prompt")
    injected = _ask(engine, messages, recompute=0)
    full = _ask(engine, messages, recompute=len(FACTS))
    more = _ask(engine, messages, recompute=100)

    # The knob must matter: memories encoded alone are not what a prefill computes.
    assert injected.usage.injected_tokens > 0
    assert _max_logprob_diff(injected, prompt) > 1e-2, "recompute=0 already equals the prompt: the test cannot fail"
    # At its maximum, exactly the pasted-memories answer: same tokens, same logprobs, nothing injected.
    for got in (full, more):
        assert got.usage.injected_tokens == 0
        assert got.prompt_token_ids == prompt.prompt_token_ids
        assert got.token_ids == prompt.token_ids
        assert got.first_logprobs == prompt.first_logprobs


def test_partial_recompute_prefills_the_last_memories(engine, messages):
    by_r = {r: _ask(engine, messages, recompute=r) for r in (0, 1, 3)}
    fact_tokens = [len(engine.tokenize(f)) for f in FACTS]
    # Same prompt every time; only where injection stops moves.
    assert len({tuple(res.prompt_token_ids) for res in by_r.values()}) == 1
    injected = {r: res.usage.injected_tokens for r, res in by_r.items()}
    assert injected[0] > injected[1] > injected[3] > 0
    # Recomputing r memories takes at least their tokens out of the injected prefix.
    assert injected[0] - injected[3] >= sum(fact_tokens[-3:])


def test_engine_default_and_per_request_override(engine, messages):
    default = engine.config.recompute
    assert default == 4
    assert _ask(engine, messages).usage.injected_tokens == _ask(engine, messages, recompute=4).usage.injected_tokens
    engine.config.recompute = len(FACTS)
    try:
        assert _ask(engine, messages).usage.injected_tokens == 0
        assert _ask(engine, messages, recompute=0).usage.injected_tokens > 0
    finally:
        engine.config.recompute = default


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_bad_recompute_is_refused_before_any_work(engine, messages, bad):
    with pytest.raises(ValueError, match="recompute must be an integer >= 0"):
        _ask(engine, messages, recompute=bad)
