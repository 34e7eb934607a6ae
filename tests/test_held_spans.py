"""Held spans: a multiprocess engine does not read KV its exchange already holds.

SmolLM2-135M-Instruct (real weights, bf16) with vLLM's engine core and worker in processes of
their own (``multiprocess=True``, as under ``vllm serve``), through the public API and the
engine's own memory store. A memory served before is still staged in the shared-memory
exchange (retained), and so is one just encoded (the room the worker captured it into is kept
under its span key): the store hands its span over without KV and reads nothing from its
tiers. A held span whose room another request gave up before this one staged it is resolved
again, with its KV: the answer never depends on that timing.

Every memory is encoded after exactly the prompt text before it (explicit ``context=``), so
injection computes what prompt injection does, and both must give the same greedy tokens.
"""

from __future__ import annotations

import pytest

from inferscale_engine import InferScaleEngine
from inferscale_engine.types import Span

pytestmark = pytest.mark.timeout(900)

HEAD = "Facts:"
FACTS = {
    "caroline": [
        "Caroline adopted a grey cat named Pixel in March.\n",
        "Caroline ran her first marathon on 7 May 2023.\n",
        "Caroline is learning to play the cello.\n",
    ],
    "melanie": [
        "Melanie keeps bees in her garden in Porto.\n",
        "Melanie's daughter is called Ines.\n",
        "Melanie paints the sea every Sunday.\n",
    ],
}
QUESTIONS = {
    "caroline": "Question: When did Caroline run her first marathon, and what is her cat called?\nAnswer:",
    "melanie": "Question: Where does Melanie keep bees, and what is her daughter called?\nAnswer:",
}
QUESTIONS["carla"] = QUESTIONS["caroline"]  # Caroline's memories again, encoded with nothing kept staged


@pytest.fixture(scope="module")
def engine(smollm2_path, tmp_path_factory):
    with InferScaleEngine(model=smollm2_path, device="cpu", dtype="bfloat16", max_model_len=1024, recompute=0,
                          multiprocess=True, store_path=tmp_path_factory.mktemp("held-store")) as eng:
        for user, facts in FACTS.items():
            _add(eng, user, facts)
        yield eng


def _add(engine, user, facts):
    for i, fact in enumerate(facts):
        # Encoded after exactly the text it follows in the prompt (the store appends the "\n"
        # that ends a context).
        engine.memory.add_texts([fact], user_id=user, context=[(HEAD + "\n" + "".join(facts[:i]))[:-1]])
    engine.memory.wait_for_encoding()


def _prompt(engine, user):
    handles = "".join(item.handle for item in engine.memory.get_all(user_id=user))
    return f"{HEAD}\n{handles}{QUESTIONS[user]}"


def _tier_reads(engine, monkeypatch) -> list[int]:
    """Fact KVs read from the store's tiers from now on (one entry a call: how many)."""
    tiers = engine.memory.tiers
    reads: list[int] = []
    get_many, get = tiers.get_many, tiers.get

    def counted_many(keys, fingerprint):
        reads.append(len(keys))
        return get_many(keys, fingerprint)

    def counted(key, fingerprint):
        reads.append(1)
        return get(key, fingerprint)

    monkeypatch.setattr(tiers, "get_many", counted_many)
    monkeypatch.setattr(tiers, "get", counted)
    return reads


def _ask(engine, user, **kw):
    return engine.generate(_prompt(engine, user), user_id=user, max_tokens=12, **kw)


def test_a_memory_served_again_is_not_read_again(engine, monkeypatch):
    assert not engine.exchange.local
    # Encoded while the exchange keeps nothing: not staged from its encoding (see the last test).
    with monkeypatch.context() as m:
        m.setattr(engine.exchange, "retain_bytes", 0)
        _add(engine, "carla", FACTS["caroline"])
    reference = _ask(engine, "carla", mode="prompt")
    reads = _tier_reads(engine, monkeypatch)
    first = _ask(engine, "carla")
    assert sum(reads) == len(FACTS["caroline"])
    reads.clear()
    second = _ask(engine, "carla")
    assert sum(reads) == 0  # every memory's span was retained: none read, none copied
    assert first.usage.injected_tokens == second.usage.injected_tokens > 0
    assert second.token_ids == first.token_ids == reference.token_ids, (second.text, first.text, reference.text)


def test_a_held_span_given_up_before_staging_is_read_after_all(engine, monkeypatch):
    """Between resolve (the exchange held the spans) and staging, the request that had them
    staged ends and their room goes (``retain_bytes=0``: nothing is retained): staging refuses
    the held spans and the engine resolves them again, with their KV."""
    user = "melanie"
    reference = _ask(engine, user, mode="prompt")
    monkeypatch.setattr(engine.exchange, "retain_bytes", 0)  # a span no request uses is freed at once
    other = engine.stream(_prompt(engine, user), user_id=user, max_tokens=12)
    next(other)  # in flight: its spans are staged
    segments = engine.resolve(_prompt(engine, user), user_id=user)
    held = [s for s in segments if isinstance(s, Span) and s.kv is None]
    assert len(held) == len(FACTS[user])
    for _ in other:  # it ends: its spans, the held ones, are freed
        pass
    assert not any(engine.exchange.holds(s.key) for s in held)
    reads = _tier_reads(engine, monkeypatch)
    result = engine.generate_segments(segments, user_id=user, max_tokens=12)
    assert sum(reads) == len(FACTS[user])
    assert result.usage.injected_tokens > 0
    assert result.token_ids == reference.token_ids, (result.text, reference.text)


def test_a_memory_is_staged_from_its_encoding(engine, monkeypatch):
    """The store encodes a memory keyed as it will be served, and the engine keeps the room the
    worker captured it into staged under that key: its very first request reads nothing from the
    tiers and copies nothing, and answers as prompt injection does."""
    user = "noor"
    (item,) = engine.memory.add_texts(["Noor's favourite colour is teal.\n"], user_id=user, context=[HEAD])
    engine.memory.wait_for_encoding()
    prompt = f"{HEAD}\n{item.handle}Question: What is Noor's favourite colour?\nAnswer:"
    reads = _tier_reads(engine, monkeypatch)
    first = engine.generate(prompt, user_id=user, max_tokens=12)
    assert sum(reads) == 0
    assert first.usage.injected_tokens > 0
    reference = engine.generate(prompt, user_id=user, max_tokens=12, mode="prompt")
    assert first.token_ids == reference.token_ids, (first.text, reference.text)
