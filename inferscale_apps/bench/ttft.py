"""``bench ttft``: time to first token vs k for no memory, prompt injection, KV injection, and the
prefix-cache floor (head and facts already in vLLM's cache, only the question computed); with
``recompute``, also KV injection with its last R facts prefilled as text (mode ``inject-rR``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from inferscale_apps.bench.common import SyntheticWorkload, median, percentile

if TYPE_CHECKING:
    from inferscale_engine.engine import InferScaleEngine

MODES = ("none", "prompt", "inject", "floor")


def run_ttft(
    engine: InferScaleEngine,
    ks: list[int],
    *,
    fact_tokens: int = 28,
    head_tokens: int = 64,
    question_tokens: int = 24,
    repeats: int = 20,
    warmup: int = 3,
    retriever: Any = None,
    seed: int = 0,
    recompute: list[int] | None = None,
    serve_pool_first: bool = False,
) -> list[dict[str, Any]]:
    """Rows ``{mode, k, ttft_ms_p50, ttft_ms_p95, retrieval_ms_p50}``; modes interleave per repeat
    so drift hits them alike. ``retriever(question_ids) -> seconds`` adds retrieval to each TTFT.
    ``serve_pool_first``: inject every fact of the pool once, untimed, before timing, as a warm
    server has served its users' memories (a multiprocess engine keeps them staged for vLLM's
    workers, the counterpart of the in-process device tier; see ``EngineConfig.staged_kv_gib``).
    The ``none`` row of each k > 0 also has ``after_prefill_ms_p50``: the same request timed right
    after the prompt-injected one."""
    work = SyntheticWorkload.build(
        engine, pool=max(max(ks) * 2, 16), fact_tokens=fact_tokens, head_tokens=head_tokens,
        question_tokens=question_tokens, seed=seed,
    )

    def ttft(segments: list[Any], mode: str, r: int = 0) -> float:
        return engine.generate_segments(segments, max_tokens=1, mode=mode, recompute=r).ttft_s

    if serve_pool_first:
        pool = list(range(len(work.facts)))
        for first in range(0, len(pool), max(ks)):
            ttft(work.inject_segments(pool[first : first + max(ks)], work.question()), "inject")
    knob = [r for r in sorted(set(recompute or ())) if r > 0]
    modes = (*MODES, *(f"inject-r{r}" for r in knob))
    rows = []
    for k in ks:
        times: dict[str, list[float]] = {m: [] for m in modes}
        retrieval: list[float] = []
        after_prefill: list[float] = []
        for rep in tqdm(range(warmup + repeats), desc=f"ttft k={k}", leave=False):
            picks, q = work.sample(k), work.question()
            r = retriever(q) if retriever else 0.0
            sample = {
                "none": ttft([work.head + q], "prompt"),
                "prompt": ttft(work.prompt_segments(picks, q), "prompt"),
            }
            # Whatever request comes right after a long prefill runs slower (see
            # ``after_prefill_ms_p50``: this same no-memory request, timed there). Injection and
            # the floor both follow a short request instead, as in a server serving only them,
            # in alternating order so neither always goes first.
            settle = ttft([work.head + work.question()], "prompt")
            inject = work.inject_segments(picks, q)
            runs: dict[str, Callable[[], float]] = {
                "inject": functools.partial(ttft, inject, "inject"),
                # Floor: the prompt call above left head+facts in vLLM's prefix cache; a fresh
                # question over them is the best any injection can do in this engine.
                "floor": functools.partial(ttft, work.prompt_segments(picks, work.question()), "prompt"),
                **{f"inject-r{r}": functools.partial(ttft, inject, "inject", r) for r in knob},
            }
            order = list(runs)
            for m in order if rep % 2 == 0 else reversed(order):
                sample[m] = runs[m]()
            if rep >= warmup:
                for m, t in sample.items():
                    times[m].append(t)
                retrieval.append(r)
                after_prefill.append(settle)
        for m in modes:
            if k == 0 and m != "none":
                continue
            # Memory modes pay for retrieval before the engine sees the request; the floor and
            # no-memory rows are the engine alone.
            r = retrieval if m.startswith(("prompt", "inject")) else [0.0] * len(times[m])
            total = [t + dt for t, dt in zip(times[m], r)]
            rows.append({
                "mode": m, "k": k,
                "ttft_ms_p50": 1e3 * median(total), "ttft_ms_p95": 1e3 * percentile(total, 95),
                "retrieval_ms_p50": 1e3 * median(r),
                "engine_ms_p50": 1e3 * median(times[m]), "engine_ms_p95": 1e3 * percentile(times[m], 95),
                "prompt_tokens": head_tokens + (k if m != "none" else 0) * fact_tokens + question_tokens,
            })
            if m == "none" and k > 0:
                rows[-1]["after_prefill_ms_p50"] = 1e3 * median(after_prefill)
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per k: speed-up over prompt injection (both with retrieval) and, engine alone, the
    distance from the prefix-cache floor."""
    total = {(r["mode"], r["k"]): r["ttft_ms_p50"] for r in rows}
    engine = {(r["mode"], r["k"]): r["engine_ms_p50"] for r in rows}
    out = []
    for k in sorted({r["k"] for r in rows if r["k"] > 0}):
        if ("inject", k) in total:
            out.append({
                "k": k,
                "prompt_over_inject": total[("prompt", k)] / total[("inject", k)],
                "engine_prompt_over_inject": engine[("prompt", k)] / engine[("inject", k)],
                "inject_over_floor": engine[("inject", k)] / engine[("floor", k)],
                # What injection's own host and device work adds to a request the prefix cache
                # would otherwise serve: the figure the CI gate bounds.
                "inject_minus_floor_ms": engine[("inject", k)] - engine[("floor", k)],
                **{f"{m}_over_inject": total[(m, k)] / total[("inject", k)]
                   for m, kk in total if kk == k and m.startswith("inject-r")},
                **{f"prompt_over_{m}": total[("prompt", k)] / total[(m, k)]
                   for m, kk in total if kk == k and m.startswith("inject-r")},
            })
    return out


def gate(summary: list[dict[str, Any]], rows: list[dict[str, Any]], *, max_inject_over_floor: float | None,
         max_growth: float | None) -> list[str]:
    """The bounds a run breaks: inject ÷ floor at any k, and the injected TTFT's growth from the
    smallest to the largest k (engine alone, so retrieval's noise stays out). Empty: all kept."""
    broken = []
    if max_inject_over_floor is not None:
        broken += [f"k={s['k']}: inject ÷ floor {s['inject_over_floor']:.3f} > {max_inject_over_floor}"
                   for s in summary if s["inject_over_floor"] > max_inject_over_floor]
    inject = {r["k"]: r["engine_ms_p50"] for r in rows if r["mode"] == "inject"}
    if max_growth is not None and len(inject) > 1:
        lo, hi = min(inject), max(inject)
        if inject[hi] / inject[lo] > max_growth:
            broken.append(f"TTFT(k={hi}) ÷ TTFT(k={lo}) {inject[hi] / inject[lo]:.3f} > {max_growth}")
    return broken


