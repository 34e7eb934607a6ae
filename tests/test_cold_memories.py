"""Cold memories (KV only in disk files outside the page cache): the cost model's choice.

SmolLM2-135M-Instruct (real weights, bf16) through the public API, one engine and its store.
Every memory is encoded after exactly the prompt text that precedes it where it is served
(explicit ``context=``, handles side by side), so injecting a memory and prefilling it compute
the same thing: every mix of injected, read-from-disk and recomputed memories must give prompt
injection's greedy tokens. A slow disk is a real setting (``disk_read_bps``, which the start-up
calibration measures), not a mock: with it the cost model must recompute cold memories, and
their reads must still land in memory so the next request injects them.
"""

from __future__ import annotations

import os
import time

import pytest

from inferscale_engine import InferScaleEngine
from inferscale_engine.types import MemoryMix

pytestmark = pytest.mark.timeout(900)

USER = "caroline"
HEAD = "Facts:"
FACTS = [
    "Caroline adopted a grey cat named Pixel in March.\n",
    "Caroline works as a nurse at the city hospital.\n",
    "Caroline's brother Tom lives in Lisbon and teaches maths.\n",
    "Caroline ran her first marathon on 7 May 2023.\n",
    "Caroline is learning to play the cello.\n",
    "Caroline's favourite food is mushroom risotto.\n",
]
QUESTION = "Question: When did Caroline run her first marathon, and what is her cat called?\nAnswer:"
SLOW_DISK = 2e6  # bytes a second at most: a fact of SmolLM2 (~0.5 MB of KV) then takes ~1/4 s to read


@pytest.fixture(scope="module")
def engine(smollm2_path, tmp_path_factory):
    with InferScaleEngine(model=smollm2_path, device="cpu", dtype="bfloat16", max_model_len=2048, recompute=0,
                          store_path=tmp_path_factory.mktemp("cold-store")) as eng:
        for i, fact in enumerate(FACTS):
            # Served after "Facts:\n" and the facts before it: encoded after exactly that text
            # (the store appends the "\n" that ends a context).
            context = HEAD + "\n" + "".join(FACTS[:i])
            eng.memory.add_texts([fact], user_id=USER, context=[context[:-1]])
        eng.memory.wait_for_encoding()
        yield eng


@pytest.fixture(scope="module")
def prompt(engine):
    handles = "".join(item.handle for item in engine.memory.get_all(user_id=USER))
    return f"{HEAD}\n{handles}{QUESTION}"


@pytest.fixture(scope="module")
def reference(engine, prompt):
    """Prompt injection: every memory prefilled as text."""
    # The test's premise: the prompt's tokens are the contexts' tokens (no merge across a boundary).
    whole = engine.tokenize(HEAD + "\n" + "".join(FACTS), add_special_tokens=True)
    pieces = engine.tokenize(HEAD + "\n", add_special_tokens=True) + [t for f in FACTS for t in engine.tokenize(f)]
    assert whole == pieces
    return _ask(engine, prompt, mode="prompt")


def _ask(engine, prompt, **kw):
    return engine.generate(prompt, user_id=USER, max_tokens=12, **kw)


def _keys(engine):
    return [(item.id, 1) for item in engine.memory.get_all(user_id=USER)]


def _to_cold_disk(engine, which):
    tiers = engine.memory.tiers
    for key in which:
        tiers.evict(key, to="disk")
        fd = os.open(tiers.path(key), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        assert tiers.where(key) == "disk" and not tiers.disk.cached(key)


def _to_device(engine, which):
    engine.memory.tiers.get_many(list(which), engine.memory.fingerprint)


def _disk(engine, read_bps):
    engine.memory.tiers.disk.read_bps = read_bps
    rates = engine.calibrate(refresh=True)
    assert rates is not None
    return rates


def _slow_disk(engine, reference):
    """A disk on which reading every memory costs what prefilling the whole prompt four times
    does on this machine: how slow that is follows the calibrated prefill, since shared CI cores
    prefill these ~100 tokens in anywhere from 0.05 to 2 s. (Not slower than needed: the
    calibration itself reads ~34 MB through the throttle.)"""
    kv_bytes = sum(engine.memory.tiers.path(key).stat().st_size for key in _keys(engine))
    prompt_tokens = len(reference.prompt_token_ids)
    fast = _disk(engine, None)
    rates = _disk(engine, min(SLOW_DISK, kv_bytes / (4 * fast.prefill_s(prompt_tokens))))
    assert rates.disk_s(kv_bytes, len(FACTS)) > 2 * rates.prefill_s(prompt_tokens), rates  # it saw the slow disk


def _wait_in_memory(engine, keys, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(t in ("device", "host") for t in engine.memory.tiers.where_many(keys)):
            return
        time.sleep(0.05)
    raise AssertionError(f"reads of recomputed memories never landed: {engine.memory.tiers.where_many(keys)}")


def test_slow_disk_recomputes_then_promotes(engine, prompt, reference):
    keys = _keys(engine)
    _slow_disk(engine, reference)
    _to_cold_disk(engine, keys)
    cold = _ask(engine, prompt)
    # Reading the memories costs more than prefilling them: every cold memory is prefilled.
    assert cold.usage.memory_mix == MemoryMix(injected=0, from_disk=0, recomputed=len(FACTS)), cold.usage
    assert cold.token_ids == reference.token_ids
    # Nothing injected: the very request prompt injection sends.
    assert cold.usage.injected_tokens == 0 and cold.prompt_token_ids == reference.prompt_token_ids
    # Their reads went on in the background: the next request injects every memory from memory.
    _wait_in_memory(engine, keys)
    warm = _ask(engine, prompt)
    assert warm.usage.memory_mix == MemoryMix(injected=len(FACTS), from_disk=0, recomputed=0), warm.usage
    assert warm.usage.injected_tokens > 0
    assert warm.token_ids == reference.token_ids


def test_mixed_injected_and_recomputed_give_the_same_answer(engine, prompt, reference):
    keys = _keys(engine)
    _slow_disk(engine, reference)
    _to_device(engine, keys)
    _to_cold_disk(engine, keys[3:])
    mixed = _ask(engine, prompt)
    assert mixed.usage.memory_mix == MemoryMix(injected=3, from_disk=0, recomputed=3), mixed.usage
    assert mixed.token_ids == reference.token_ids
    _wait_in_memory(engine, keys[3:])  # promoted in the background


def test_fast_disk_is_read_and_answers_match(engine, prompt, reference):
    keys = _keys(engine)
    rates = _disk(engine, None)
    # A CPU prefill of ~80 tokens takes tens of ms; reading 3 MB from a local disk, a few.
    assert rates.disk_s(3 << 20) < rates.prefill_s(80), rates
    _to_cold_disk(engine, keys)
    loaded = _ask(engine, prompt)
    assert loaded.usage.memory_mix == MemoryMix(injected=0, from_disk=len(FACTS), recomputed=0), loaded.usage
    assert loaded.token_ids == reference.token_ids
    _to_cold_disk(engine, keys[:2])  # the first two cold, the rest in memory
    partly = _ask(engine, prompt)
    assert partly.usage.memory_mix == MemoryMix(injected=4, from_disk=2, recomputed=0), partly.usage
    assert partly.token_ids == reference.token_ids


def test_files_in_the_page_cache_are_served_as_memory(engine, prompt, reference):
    """A file the page cache holds is read like a memory tier, whatever the disk's speed."""
    keys = _keys(engine)
    _slow_disk(engine, reference)
    tiers = engine.memory.tiers
    for key in keys:
        tiers.evict(key, to="disk")
        tiers.path(key).read_bytes()  # into the page cache
        assert tiers.where(key) == "disk" and tiers.disk.cached(key)
    warm = _ask(engine, prompt)
    assert warm.usage.memory_mix == MemoryMix(injected=len(FACTS), from_disk=0, recomputed=0), warm.usage
    assert warm.token_ids == reference.token_ids


def test_a_file_removed_behind_the_stores_back_is_prefilled_then_re_encoded(engine, prompt, reference):
    """Resolving asks the filesystem nothing: a missing file is found by the read that needed it
    (here the promotion after a recompute), and the next request re-encodes the memory."""
    keys = _keys(engine)
    _slow_disk(engine, reference)
    _to_cold_disk(engine, keys)
    gone = keys[2]
    os.remove(engine.memory.tiers.path(gone))
    first = _ask(engine, prompt)
    assert first.usage.memory_mix == MemoryMix(injected=0, from_disk=0, recomputed=len(FACTS)), first.usage
    assert first.token_ids == reference.token_ids
    _wait_in_memory(engine, [k for k in keys if k != gone])
    deadline = time.monotonic() + 60
    while engine.memory.tiers.where_many([gone], check_disk=False) != [None]:  # the promotion found it missing
        assert time.monotonic() < deadline, "the failed promotion never marked the file missing"
        time.sleep(0.05)
    second = _ask(engine, prompt)
    assert second.usage.memory_mix == MemoryMix(injected=len(FACTS), from_disk=0, recomputed=0), second.usage
    assert second.token_ids == reference.token_ids
    assert engine.memory.tiers.path(gone).exists()  # re-encoded, stored again


def test_all_recomputed_by_the_knob_matches(engine, prompt, reference):
    """The quality knob and the cost model share one layout: all memories prefilled is the prompt."""
    every = _ask(engine, prompt, recompute=len(FACTS))
    assert every.usage.memory_mix == MemoryMix(injected=0, from_disk=0, recomputed=len(FACTS))
    assert every.usage.injected_tokens == 0
    assert every.token_ids == reference.token_ids


def test_prefetch_moves_a_users_memories_up(engine, prompt, reference):
    keys = _keys(engine)
    _disk(engine, None)
    _to_cold_disk(engine, keys)
    assert engine.prefetch(USER) == len(FACTS)
    _wait_in_memory(engine, keys)
    assert engine.prefetch(USER) == 0  # nothing left on disk only
    after = _ask(engine, prompt)
    assert after.usage.memory_mix == MemoryMix(injected=len(FACTS), from_disk=0, recomputed=0), after.usage
    assert after.token_ids == reference.token_ids


def test_search_prefetches_what_it_finds(engine):
    keys = _keys(engine)
    _disk(engine, None)
    _to_cold_disk(engine, keys)
    found = engine.memory.search("Where does Tom live?", user_id=USER, k=2)
    picked = [(item.id, 1) for item in found]
    _wait_in_memory(engine, picked)  # the handles are about to be resolved: their KV moved up
    assert set(engine.memory.tiers.where_many([k for k in keys if k not in picked])) == {"disk"}
