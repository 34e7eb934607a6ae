"""``bench tiers``: time to first token at ``k`` facts whose KV comes from the device, host or
disk tier of a memory store's :class:`~inferscale_engine.memory.kv.tiers.KVTiers`.

Per repeat and tier: every fact is moved down to the tier under test, then the clock runs over
``tiers.get_many`` of the ``k`` facts (what a store's ``resolve_many`` does: host facts copied
into the device slab asynchronously, then one gather from the slab that waits for those copies
on the device) plus an injected request of those spans (``max_tokens=1``). Spans get fresh keys every time so
vLLM's prefix cache never serves them: each request really injects.

``host-slab-full`` is the host tier in steady state: the device slab holds exactly ``k`` facts,
all of them other facts, so the promotion first evicts ``k`` facts to the host.

``disk-cost-model`` is the disk tier (cold) as the engine serves it: the reads start, and the
cost model (:mod:`inferscale_engine.planner`, rates calibrated at the start of the run) waits for
the first ``j`` facts and prefills the rest as text, ``j`` its choice; ``mix`` says how many
facts were injected from memory / read from disk / recomputed (the most common mix over the
repeats; the facts are in a fresh order each repeat, so vLLM's prefix cache cannot serve what is
prefilled; the background reads of recomputed facts finish before the next request). ``after-prefetch`` is
the disk tier after a prefetch (``tiers.prefetch``, as ``MemoryStore.prefetch(user_id)`` starts
it) moved the facts to the host tier; ``prefetch_ms`` is how long that took.

Every row's request follows :data:`IDLE_S` seconds without requests, then an untimed short one
(the after-prefetch row's idle is its prefetch): rows differ only in where their facts are.

``disk`` reads are cold by default: each fact file's pages are dropped from the OS page cache
(``posix_fadvise(DONTNEED)``, per file, harmless to other processes) before the timed read;
``warm_disk=True`` keeps them cached (a disk tier that fits in RAM).
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import tempfile
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from inferscale_apps.bench.common import SyntheticWorkload, median, percentile
from inferscale_engine.kv import FactKV
from inferscale_engine.memory.kv.tiers import KVTiers
from inferscale_engine.types import Span

if TYPE_CHECKING:
    from inferscale_engine.engine import InferScaleEngine

TIERS = ("device", "host", "disk")
#: The host tier when the slab is full of other facts: each promotion evicts as many.
HOST_SLAB_FULL = "host-slab-full"
#: Row of the same prompt with the facts pasted as text (prefilled, nothing injected): the baseline.
PROMPT = "prompt"
#: Cold disk tier served through the cost model; the disk tier after a prefetch to the host.
COST_MODEL = "disk-cost-model"
AFTER_PREFETCH = "after-prefetch"
#: Seconds without requests before every row's short request: what a user's request follows, and
#: as long as the after-prefetch row's prefetch (~0.2 s at k=50 on the H200), whose wait is its idle.
#: The host's first work after an idle gap runs slower (scripts/tiers_promotion.py: a promotion's
#: host time +0.7 ms after 50 ms), so rows with unequal gaps would differ by that alone.
IDLE_S = 0.25
#: Longest wait for background reads (a promotion, a prefetch) that take milliseconds.
WAIT_S = 60.0


class _Read:
    """A cold fact's read, as the store makes them (``ColdRead``), on the bench's own tiers."""

    def __init__(self, tiers: KVTiers, fingerprint: str, key: tuple[str, int], span_key: str, ids: list[int]) -> None:
        self.tiers, self.fingerprint, self.key, self.span_key, self.ids = tiers, fingerprint, key, span_key, ids
        self.future: Future[FactKV] | None = None

    @functools.cached_property
    def nbytes(self) -> int:
        return self.tiers.file_bytes(self.key, len(self.ids))

    @functools.cached_property
    def cached(self) -> bool:
        return self.tiers.disk.cached(self.key)

    def start(self) -> None:
        if self.future is None:
            self.future = self.tiers.read_async([self.key], self.fingerprint)[0]

    def wait(self) -> Span:
        self.start()
        return Span(self.span_key, tuple(self.ids), self.future.result())  # type: ignore[union-attr]

    def promote(self) -> None:
        if self.future is None:
            self.tiers.prefetch([self.key], self.fingerprint)


def _wait_for(tiers: KVTiers, keys: list[tuple[str, int]], wanted: set[str]) -> None:
    """Poll until background reads (a promotion, a prefetch) put every key in a ``wanted``
    tier: they take milliseconds, so one that never gets there is a bug, said, not a hang."""
    deadline = time.perf_counter() + WAIT_S
    while not set(tiers.where_many(keys)) <= wanted:
        if time.perf_counter() > deadline:
            where = sorted(map(str, set(tiers.where_many(keys))))
            raise RuntimeError(f"facts meant for the {'/'.join(sorted(wanted))} tier still sit in {where} "
                               f"after {WAIT_S:.0f} s")
        time.sleep(0.0005)


def _drop_page_cache(path: os.PathLike) -> None:
    if not hasattr(os, "posix_fadvise"):  # pragma: no cover - not on Linux
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_tiers(
    engine: InferScaleEngine,
    ks: list[int],
    *,
    repeats: int = 10,
    warmup: int = 2,
    fact_tokens: int = 28,
    head_tokens: int = 64,
    question_tokens: int = 24,
    warm_disk: bool = False,
    root: str | os.PathLike | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Rows ``{tier, k, ttft_ms_p50, ttft_ms_p95, promote_ms_p50, inject_ms_p50, over_prompt_p50,
    cached_tokens_p50, tier_answers_differ, tier_max_logprob_diff}``.

    ``ttft_ms`` = reading the facts (``get_many``, what a store's ``resolve_many`` does; its
    host time is ``promote_ms``) + the engine's time to first token; ``tier_answers_differ`` counts repeats whose greedy token was
    not the same from every tier (must be 0), ``tier_max_logprob_diff`` the largest difference
    of a top-5 first-token logprob from the device tier's (must be 0: same bytes). Tiers interleave per repeat so
    drift hits them alike, each after a short request. ``tier="host-slab-full"`` is the host tier with a slab full of other
    facts (each promotion evicts ``k``). An extra ``tier="prompt"`` row is the baseline: the same number of
    facts pasted as text and prefilled (no tier, nothing injected); ``over_prompt_p50`` is the
    median over repeats of a row's TTFT over the baseline's in the same repeat. The cost-model row's
    ``promote_ms`` is the planner's choice alone: the cold facts it weighs are what the store's
    resolve hands it, whose counterpart (the facts' text) the prompt row does not count either.
    """
    import torch

    from inferscale_engine import planner
    from inferscale_engine.memory.kv.bandwidth import measure
    from inferscale_engine.types import ColdFact, TextFact

    kmax = max(ks)
    # Twice the facts needed: the prompt baseline samples k of them in random order, so vLLM's
    # prefix cache cannot serve its facts from an earlier repeat, and the full slab is filled
    # with the other half.
    work = SyntheticWorkload.build(engine, pool=max(2 * kmax, 16), fact_tokens=fact_tokens, head_tokens=head_tokens,
                                   question_tokens=question_tokens, seed=seed)
    device = "cuda" if engine.config.device == "cuda" else "cpu"
    cuda = device == "cuda"
    page_tokens = 16
    kv0 = work.facts[0].kv
    assert kv0 is not None  # the workload's own spans: encoded, never held
    bytes_per_token = 2 * kv0.k.nbytes // kv0.num_tokens
    fact_bytes = math.ceil(fact_tokens / page_tokens) * page_tokens * bytes_per_token
    # Room for every fact in each memory tier (plus slack): no LRU eviction during a measurement.
    capacity = 2 * kmax * fact_bytes + (8 << 20)
    tmp = tempfile.mkdtemp(prefix="inferscale-tiers-", dir=root)
    tiers = KVTiers(tmp, device=device, device_bytes=capacity, host_bytes=capacity, page_tokens=page_tokens)
    fp = engine.fingerprint
    keys = [(f"{i:016x}", 1) for i in range(2 * kmax)]
    for key, span in zip(keys, work.facts):
        assert span.kv is not None
        tiers.put(key, span.kv, fp)
    fillers = keys[kmax:]
    keys = keys[:kmax]
    speeds = measure(tiers)
    rates = planner.measure_rates(engine, speeds)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def move_to(tier: str, picked: list[tuple[str, int]]) -> None:
        for key in picked:
            if tier == "device":
                tiers.get(key, fp)  # promotes if it is not there yet
            else:
                tiers.evict(key, to=tier)  # type: ignore[arg-type]
                if tier == "disk" and not warm_disk:
                    _drop_page_cache(tiers.path(key))
        sync()
        where = {tiers.where(key) for key in picked}
        if where != {tier}:
            raise RuntimeError(f"facts meant for the {tier} tier sit in {sorted(map(str, where))}")

    def fill_slab(k: int) -> KVTiers:
        """Tiers over the same files whose slab holds exactly ``k`` facts: the fillers, with the
        measured facts on the host."""
        full = KVTiers(tmp, device=device, device_bytes=k * fact_bytes, host_bytes=capacity, page_tokens=page_tokens)
        full.get_many(keys[:k], fp)
        full.get_many(fillers[:k], fp)
        return full

    rows = []
    serial = 0
    try:
        for k in ks:
            picked_keys = keys[:k]
            picked_ids = work.fact_ids[:k]
            names = (*TIERS, HOST_SLAB_FULL, COST_MODEL, AFTER_PREFETCH, PROMPT)
            ttft: dict[str, list[float]] = {t: [] for t in names}
            promote: dict[str, list[float]] = {t: [] for t in names}
            prefetch_s: list[float] = []
            mixes: dict[str, list[tuple[int, int, int]]] = {t: [] for t in names}
            cached: dict[str, list[int]] = {t: [] for t in names}  # prompt tokens vLLM's prefix cache held
            full = fill_slab(k)
            mismatches = 0
            worst = 0.0  # largest top-5 logprob difference of any tier from the device tier
            def settle(idle_since: float | None = None) -> None:
                """:data:`IDLE_S` without requests (counted from ``idle_since``), then an untimed
                no-memory request: the next one starts with the GPU awake, no long prefill just
                behind it, after the same idle as every row."""
                start = time.perf_counter() if idle_since is None else idle_since
                time.sleep(max(0.0, IDLE_S - (time.perf_counter() - start)))
                engine.generate_segments([work.head + work.question()], max_tokens=1, mode="prompt")

            for rep in tqdm(range(warmup + repeats), desc=f"tiers k={k}", leave=False):
                # The request right after a long prefill runs slower whatever it is (bench ttft's
                # after_prefill_ms_p50): an untimed short one takes that, so every row follows
                # the same idle and a short request (settle); device and host alternate which
                # goes first, and so do the cost model and the prompt baseline, which run back to
                # back: the cost model's all-prefill choice is the baseline's very request, so
                # only the pair shows what choosing costs.
                question = work.question()
                answers = set()
                logprobs: dict[str, dict[int, float]] = {}
                order = (*TIERS, HOST_SLAB_FULL) if rep % 2 == 0 else ("host", "device", *TIERS[2:], HOST_SLAB_FULL)
                paired = (COST_MODEL, PROMPT) if rep % 2 == 0 else (PROMPT, COST_MODEL)
                for tier in (*order, *paired, AFTER_PREFETCH):
                    store = full if tier == HOST_SLAB_FULL else tiers
                    if tier == PROMPT:  # k facts pasted as text, settled as every row
                        settle()
                        segs = work.prompt_segments(work.sample(k), work.question())
                        result = engine.generate_segments(segs, max_tokens=1, mode="prompt")
                        if rep >= warmup:
                            ttft[PROMPT].append(result.ttft_s)
                            promote[PROMPT].append(0.0)
                            cached[PROMPT].append(result.usage.cached_tokens)
                        continue
                    if tier == COST_MODEL:
                        move_to("disk", picked_keys)
                        settle()
                        serial += 1
                        # A fresh order each repeat, as the prompt row: vLLM's prefix cache must
                        # not serve the facts this request prefills.
                        order_i = work.rng.sample(range(k), k)
                        # The store's resolve makes these (prompt injection's text lookup is its
                        # counterpart, which the prompt row does not count either): not timed.
                        cold = [ColdFact(picked_ids[i], _Read(tiers, fp, picked_keys[i], f"tiers:{serial}:{i}",
                                                              picked_ids[i])) for i in order_i]
                        t0 = time.perf_counter()
                        segs, mix, promote_later = planner.plan([work.head, *cold, question], 0, rates)
                        t_promote = time.perf_counter() - t0
                        # What the engine would prefill (its planner sees no cold fact left).
                        segs = [TextFact(s) if isinstance(s, ColdFact) else s for s in segs]
                        # No logprobs (its answer is not compared): with nothing injected, the prompt row's request.
                        result = engine.generate_segments(segs, max_tokens=1, mode="inject")
                        if promote_later is not None:
                            promote_later()  # as the engine does once the first token is out
                        # Promotions of the prefilled facts finish before the next request.
                        _wait_for(tiers, picked_keys, {"device", "host"})
                        # Recomputed facts are prefilled after the injected ones, their KV is not
                        # the w=0 KV of the other rows: its answer is not compared with theirs.
                        if rep >= warmup:
                            ttft[tier].append(t_promote + result.ttft_s)
                            promote[tier].append(t_promote)
                            mixes[tier].append((mix.injected, mix.from_disk, mix.recomputed))
                            cached[tier].append(result.usage.cached_tokens)
                        continue
                    if tier == AFTER_PREFETCH:
                        move_to("disk", picked_keys)
                        t0 = time.perf_counter()
                        tiers.prefetch(picked_keys, fp)
                        _wait_for(tiers, picked_keys, {"host"})
                        if rep >= warmup:
                            prefetch_s.append(time.perf_counter() - t0)
                        settle(idle_since=t0)  # the prefetch's wait is this row's idle
                    elif tier == HOST_SLAB_FULL:
                        full.get_many(fillers[:k], fp)  # evicts the measured facts to the host
                        sync()
                        if {full.where(key) for key in picked_keys} != {"host"}:
                            raise RuntimeError("facts meant for the host tier of a full slab are elsewhere")
                        settle()
                    else:
                        move_to(tier, picked_keys)
                        settle()
                    t0 = time.perf_counter()
                    kvs = store.get_many(picked_keys, fp)  # host copies may still be in flight: no sync
                    t_promote = time.perf_counter() - t0
                    serial += 1
                    spans = [Span(f"tiers:{serial}:{i}", tuple(ids), kv) for i, (ids, kv) in enumerate(zip(picked_ids, kvs))]
                    result = engine.generate_segments([work.head, *spans, question], max_tokens=1, mode="inject",
                                                      first_logprobs=5)
                    if result.usage.injected_tokens < k * fact_tokens:
                        raise RuntimeError(f"only {result.usage.injected_tokens} tokens injected for {k} facts")
                    answers.add(tuple(result.token_ids))
                    logprobs[tier] = result.first_logprobs or {}
                    if rep >= warmup:
                        ttft[tier].append(t_promote + result.ttft_s)
                        promote[tier].append(t_promote)
                        mixes[tier].append((k, 0, 0))
                        cached[tier].append(result.usage.cached_tokens)
                # Same KV bytes from every tier: the same greedy token, or a tier serves wrong KV.
                mismatches += len(answers) > 1
                for tier in (*TIERS[1:], HOST_SLAB_FULL, AFTER_PREFETCH):
                    worst = max(worst, max((abs(logprobs[tier].get(t, math.inf) - lp)
                                            for t, lp in logprobs[TIERS[0]].items()), default=0.0))
            for tier in names:
                common = max(set(mixes[tier]), key=mixes[tier].count) if mixes[tier] else (0, 0, k)
                rows.append({
                    "tier": tier, "k": k,
                    "ttft_ms_p50": 1e3 * median(ttft[tier]), "ttft_ms_p95": 1e3 * percentile(ttft[tier], 95),
                    "promote_ms_p50": 1e3 * median(promote[tier]),
                    "inject_ms_p50": 1e3 * median([a - b for a, b in zip(ttft[tier], promote[tier])]),
                    "over_prompt_p50": median([a / b for a, b in zip(ttft[tier], ttft[PROMPT])]),
                    "cached_tokens_p50": median(cached[tier]),
                    "fact_tokens": fact_tokens, "kv_bytes_per_fact": int(bytes_per_token * fact_tokens),
                    "device": device, "disk_cache": "warm" if warm_disk else "cold",
                    "tier_answers_differ": mismatches, "tier_max_logprob_diff": worst,
                    "mix": "/".join(map(str, common)),
                    "mixes": {"/".join(map(str, m)): mixes[tier].count(m) for m in set(mixes[tier])},
                    "prefetch_ms_p50": 1e3 * median(prefetch_s) if tier == AFTER_PREFETCH else None,
                    "rates": rates.as_dict(), "disk_measured_cold": speeds.disk_cold,
                })
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows
