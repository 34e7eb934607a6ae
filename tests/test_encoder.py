"""Fact encoding inside the serving engine: context windows, sliding chunks, bad input."""

from __future__ import annotations

import time

import pytest
import torch

from inferscale_engine import InferScaleEngine
from inferscale_engine.errors import ContextOverflowError, MalformedHandleError
from inferscale_engine.memory.text.context import Chunk, ContextBuilder
from inferscale_engine.types import EncodeWindow

TURNS = [
    "Caroline: I adopted a dog last spring.",
    "Melanie: What is the dog's name?",
    "Caroline: His name is Rex, he is a beagle.",
    "Melanie: Does he like the park?",
    "Caroline: He loves it, we go every morning.",
    "Melanie: I should bring my cat some day.",
    "Caroline: Rex would chase it, careful!",
    "Melanie: Ha, fair point.",
]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with InferScaleEngine(model=tiny_llama, device="cpu", dtype="float32", max_model_len=1024, recompute=0) as engine:
        yield engine


def test_capture_keeps_only_the_fact_rows_with_their_positions(engine):
    ctx, fact = engine.tokenize(TURNS[0] + "\n"), engine.tokenize(TURNS[1])
    kv = engine.encode_fact(fact, ctx)
    assert kv.position == len(ctx)
    assert kv.num_tokens == len(fact)
    layers = engine.vllm_config.model_config.hf_config.num_hidden_layers
    assert kv.k.shape[:2] == (layers, len(fact))
    # Encoding the same window twice is deterministic; another context changes the KV.
    assert torch.equal(engine.encode_fact(fact, ctx).v, kv.v)
    assert not torch.allclose(engine.encode_fact(fact, []).v, kv.v)


def test_sliding_chunks_equal_per_fact_encoding_with_the_same_context(engine):
    builder = ContextBuilder(engine.tokenize, engine.max_model_len, window=0)
    turns = [engine.tokenize(t) for t in TURNS]
    # One chunk of every turn: turn i is encoded after turns[:i] ("\n"-separated).
    contexts, (chunk,) = builder.sliding([], TURNS, turns, group=len(turns))
    assert chunk.facts == tuple(range(len(turns)))
    sliding = engine.encode([chunk.window])[0]
    for i, kv in enumerate(sliding):
        alone = engine.encode([EncodeWindow.single(turns[i], contexts[i].ids)])[0][0]
        assert kv.position == alone.position == len(contexts[i].ids)
        assert torch.allclose(kv.k, alone.k, atol=1e-4) and torch.allclose(kv.v, alone.v, atol=1e-4)


def test_sliding_chunk_encoding_costs_fewer_prefill_tokens(engine):
    builder = ContextBuilder(engine.tokenize, engine.max_model_len, window=5)
    texts = TURNS * 4
    turns = [engine.tokenize(t) for t in texts]
    per_fact = [c.window for c in Chunk.per_fact([c.ids for c in builder.for_new([], texts, turns)], turns)]
    chunked = [c.window for c in builder.sliding([], texts, turns, group=8)[1]]
    tokens = lambda ws: sum(len(w.token_ids) for w in ws)  # noqa: E731
    assert tokens(chunked) < tokens(per_fact) / 2
    t0 = time.perf_counter()
    engine.encode(per_fact)
    t1 = time.perf_counter()
    engine.encode(chunked)
    t2 = time.perf_counter()
    print(f"\nw=5, {len(turns)} turns: per-fact {tokens(per_fact)} tokens {t1 - t0:.3f}s; "
          f"sliding(8) {tokens(chunked)} tokens {t2 - t1:.3f}s")


def test_bad_input_gets_clear_errors(engine):
    with pytest.raises(ValueError, match="at least one token"):
        engine.encode([EncodeWindow((1, 2), ((2, 0),))])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.encode([EncodeWindow.single([5] * 1024)])
    with pytest.raises(ValueError, match="one entry per range"):
        engine.encode([EncodeWindow.single([5, 6])], keys=[["a", "b"]])
    with pytest.raises(ContextOverflowError, match="exceeds the model's context"):
        engine.generate("hello " * 600, max_tokens=600)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.generate("hello", max_tokens=0)
    with pytest.raises(MalformedHandleError):
        engine.generate("remember <<mem:nothex:zz>> please")
    with pytest.raises(ValueError, match="role"):
        engine.generate([{"role": "user"}])
    # The engine is still healthy after all of that.
    assert engine.generate("hello", max_tokens=3).usage.completion_tokens == 3
