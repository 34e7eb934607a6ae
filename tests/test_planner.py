"""The cost model's arithmetic (no engine): where the split goes for given rates, and what
``plan`` reads, waits for and promotes. The engine-level behaviour is in test_cold_memories."""

from __future__ import annotations

import time

import pytest
import torch

from inferscale_engine.kv import FactKV
from inferscale_engine.planner import ObservedReads, Rates, plan
from inferscale_engine.types import ColdFact, MemoryMix, Span, TextFact

# 1 ms per 10 tokens past a 10 ms floor; a fact of 10 tokens, 1 MB of KV.
PREFILL = ((10, 0.010), (100, 0.019), (1000, 0.109))


class Read:
    """A cold fact's read that records what the planner asked of it."""

    def __init__(self, span: Span, nbytes: int = 1_000_000, in_page_cache: bool = False) -> None:
        self.span, self.nbytes, self.in_page_cache = span, nbytes, in_page_cache
        self.calls: list[str] = []
        self.probes = 0  # page-cache probes: a few syscalls each, on the request's path

    @property
    def cached(self) -> bool:
        self.probes += 1
        return self.in_page_cache

    def start(self) -> None:
        self.calls.append("start")

    def wait(self) -> Span | TextFact:
        self.calls.append("wait")
        return self.span

    def promote(self) -> None:
        self.calls.append("promote")


def _span(i: int) -> Span:
    kv = torch.zeros(1, 10, 1, 2)
    return Span(f"s{i}", tuple(range(10)), FactKV(kv, kv, 0))


def _prompt(kinds: str) -> tuple[list, list[Read]]:
    """Head, then one memory per letter (``w``arm span / ``c``old / ``t``ext not encoded), then a question."""
    segs: list = [[1] * 10]
    reads = []
    for i, kind in enumerate(kinds):
        if kind == "w":
            segs.append(_span(i))
        elif kind == "c":
            read = Read(_span(i))
            reads.append(read)
            segs.append(ColdFact(list(range(10)), read))
        else:
            segs.append(TextFact(range(10)))
    segs.append([2] * 10)
    return segs, reads


def _rates(disk_bps: float, latency: float = 0.0, *, file_s: float = 0.0, inject_token_s: float = 0.0) -> Rates:
    return Rates(PREFILL, disk_bps, latency, disk_file_s=file_s, inject_token_s=inject_token_s)


def test_prefill_curve_interpolates_and_extrapolates():
    r = _rates(1e9)
    assert r.prefill_s(5) == pytest.approx(0.010)
    assert r.prefill_s(55) == pytest.approx(0.0145)
    assert r.prefill_s(1000) == pytest.approx(0.109)
    assert r.prefill_s(2000) == pytest.approx(0.209)  # the last slope, 1e-4 s a token


def test_slow_disk_recomputes_and_promotes():
    segs, reads = _prompt("cccc")
    out, mix, promote = plan(segs, 0, _rates(1e7))  # 0.1 s a fact against 1 ms of prefill
    assert mix == MemoryMix(0, 0, 4)
    assert all(r.calls == [] for r in reads)  # nothing read during the request's prefill
    assert promote is not None
    promote()  # the engine's call once the first token is out
    assert all(r.calls == ["promote"] for r in reads)
    assert out == segs


def test_the_page_cache_is_probed_only_where_the_split_search_reaches():
    segs, reads = _prompt("cccc")
    _, mix, _ = plan(segs, 0, _rates(1e7))  # the first cold read already costs more than all prefill
    assert mix == MemoryMix(0, 0, 4)
    assert [r.probes > 0 for r in reads] == [True, False, False, False]
    # A file in the page cache is read like a memory tier: it costs nothing and counts as injected.
    segs, reads = _prompt("cccc")
    reads[0].in_page_cache = True
    _, mix, _ = plan(segs, 0, _rates(1e7))
    assert mix == MemoryMix(1, 0, 3)
    assert reads[0].calls == ["start", "wait"] and [r.probes > 0 for r in reads] == [True, True, False, False]


def test_rates_are_asked_only_for_a_file_outside_the_page_cache():
    asked = []

    def rates() -> Rates:  # the engine's may wait for its start-up measurement
        asked.append(1)
        return _rates(1e7)

    segs, reads = _prompt("cc")
    for r in reads:
        r.in_page_cache = True
    _, mix, _ = plan(segs, 0, rates)
    assert mix == MemoryMix(2, 0, 0) and asked == []
    segs, _ = _prompt("cc")
    _, mix, _ = plan(segs, 0, rates)
    assert mix == MemoryMix(0, 0, 2) and asked == [1]


def test_fast_disk_reads_all_in_parallel():
    segs, reads = _prompt("cccc")
    out, mix, promote = plan(segs, 0, _rates(1e12))
    assert mix == MemoryMix(0, 4, 0)
    assert promote is None  # nothing prefilled, nothing to promote
    assert all(r.calls == ["start", "wait"] for r in reads)
    assert all(isinstance(s, Span) for s in out[1:5])


def test_split_where_reading_stops_paying():
    # Warm memories first, cold ones after: reading a cold one (2 ms) costs more than
    # prefilling it (1 ms), so the split lands after the warm ones.
    segs, reads = _prompt("wwcc")
    _, mix, _ = plan(segs, 0, _rates(5e8))
    assert mix == MemoryMix(2, 0, 2)
    # A cold memory in front of warm ones is read when that saves their prefill.
    segs, reads = _prompt("cwww")
    _, mix, _ = plan(segs, 0, _rates(5e8))
    assert mix == MemoryMix(3, 1, 0)


def test_each_files_own_read_work_is_weighed():
    """Reads of many small files cost their host work per file (checks, parsing: the reader
    threads share it), not only bytes: past what that saves, the memories are prefilled."""
    segs, _ = _prompt("cccc")
    _, mix, _ = plan(segs, 0, _rates(1e12))
    assert mix == MemoryMix(0, 4, 0)
    segs, _ = _prompt("cccc")
    _, mix, _ = plan(segs, 0, _rates(1e12, file_s=0.002))  # 2 ms a file against 1 ms of prefill
    assert mix == MemoryMix(0, 0, 4)


def test_injecting_is_weighed_where_it_costs_more_than_prefill():
    """On a model whose prefill is nearly free (a tiny one on a CPU), writing injected KV can
    cost more than computing it: then even a fast disk's memories are prefilled."""
    segs, _ = _prompt("wccw")
    _, mix, _ = plan(segs, 0, _rates(1e12, inject_token_s=1e-6))  # 10 µs a memory: injecting pays
    assert mix == MemoryMix(2, 2, 0)
    segs, reads = _prompt("wccw")
    out, mix, promote = plan(segs, 0, _rates(1e12, inject_token_s=2e-4))  # 2 ms a memory, 1 ms of prefill
    assert mix == MemoryMix(0, 0, 4)
    assert all(r.calls == [] for r in reads) and promote is not None
    # The memory in front, whose KV was at hand, is prefilled with the rest: the engine's layout
    # injects only up to the first memory served as text.
    assert type(out[1]) is TextFact and list(out[1]) == list(segs[1].token_ids)
    assert [list(s) if not isinstance(s, Span) else s for s in out] == [
        list(s.token_ids) if isinstance(s, Span) else list(s) for s in segs]


def test_the_knob_and_pending_text_bound_the_split():
    segs, reads = _prompt("cccc")
    _, mix, promote = plan(segs, 2, _rates(1e12))
    assert mix == MemoryMix(0, 2, 2)
    assert promote is not None
    promote()
    assert [r.calls for r in reads] == [["start", "wait"]] * 2 + [["promote"]] * 2
    segs, reads = _prompt("ctcc")
    _, mix, _ = plan(segs, 0, _rates(1e12))
    assert mix == MemoryMix(0, 1, 3)
    # The first memory still being encoded bounds the split; later ones are memories all the same.
    segs, reads = _prompt("cctwtc")
    _, mix, _ = plan(segs, 0, _rates(1e12))
    assert mix == MemoryMix(0, 2, 4)


def test_no_rates_reads_as_before():
    segs, reads = _prompt("cc")
    _, mix, _ = plan(segs, 0, None)
    assert mix == MemoryMix(0, 2, 0)


class SlowRead(Read):
    """A read that really takes ``seconds`` to wait for, as a read sharing the cores with its
    request can take longer than the calibration's bare file read."""

    def __init__(self, span: Span, seconds: float) -> None:
        super().__init__(span)
        self.seconds = seconds

    def wait(self) -> Span | TextFact:
        time.sleep(self.seconds)
        return super().wait()


def _slow_prompt(k: int, seconds: float) -> tuple[list, list[Read]]:
    segs, _ = _prompt("c" * k)
    reads = [SlowRead(s.read.span, seconds) for s in segs if isinstance(s, ColdFact)]
    it = iter(reads)
    return [ColdFact(list(s), next(it)) if isinstance(s, ColdFact) else s for s in segs], reads


def test_reads_slower_than_calibrated_teach_the_model_to_prefill():
    """Rates price four 1 MB reads at 2 ms in all, where they save 5 ms of prefill. The reads
    really take 4 x 10 ms on the request's path: after waiting for them once, the model
    prefills the next cold request's memories and reads nothing."""
    rates = _rates(2e9)
    observed = ObservedReads()
    segs, reads = _slow_prompt(4, 0.010)
    _, mix, _ = plan(segs, 0, rates, observed)
    assert mix == MemoryMix(0, 4, 0)
    assert observed.samples == 1 and observed.scale == pytest.approx(ObservedReads.CLAMP)  # 40 ms waited, 2 ms priced
    segs, reads = _slow_prompt(4, 0.010)
    _, mix, _ = plan(segs, 0, rates, observed)
    assert mix == MemoryMix(0, 0, 4) and all(r.calls == [] for r in reads)
    # Without the correction the same rates read again.
    segs, _ = _slow_prompt(4, 0.0)
    _, mix, _ = plan(segs, 0, rates)
    assert mix == MemoryMix(0, 4, 0)


def test_observed_reads_average_then_follow_the_latest_and_ignore_nothing_measured():
    observed = ObservedReads()
    assert observed.scale == 1.0
    observed.record(0.010, 0.020)
    assert observed.scale == pytest.approx(2.0)
    observed.record(0.010, 0.005)  # the first two count alike: their geometric mean
    assert observed.scale == pytest.approx(1.0)
    for _ in range(40):
        observed.record(0.010, 0.030)
    assert observed.scale == pytest.approx(3.0, rel=1e-3)
    observed.record(0.0, 0.010)  # nothing priced: nothing learnt
    observed.record(0.010, 10.0)  # one stalled read counts as 16x, not 1000x
    assert observed.samples == 43
    assert observed.scale == pytest.approx(3.0 ** (1 - ObservedReads.WEIGHT) * 16 ** ObservedReads.WEIGHT, rel=1e-3)
    # A prefix served from the page cache (priced at nothing) teaches nothing either.
    observed = ObservedReads()
    segs, reads = _slow_prompt(2, 0.001)
    for r in reads:
        r.in_page_cache = True
    _, mix, _ = plan(segs, 0, _rates(1e9), observed)
    assert mix == MemoryMix(2, 0, 0) and observed.samples == 0


class CountedRead(Read):
    """A read whose file size is counted each time the planner asks for it."""

    def __init__(self, span: Span, nbytes: int) -> None:
        super().__init__(span, nbytes)
        self.size, self.asked = nbytes, 0

    @property  # type: ignore[override]
    def nbytes(self) -> int:
        self.asked += 1
        return self.size

    @nbytes.setter
    def nbytes(self, value: int) -> None:
        self.size = value


def _exhaustive(segs: list, facts: list[int], limit: int, rates: Rates) -> tuple[int, float]:
    """The split ``choose`` must find, by trying every one (ties to the longer prefix)."""
    best = (0, rates.prefill_s(sum(len(s.token_ids) if isinstance(s, Span) else len(s) for s in segs)))
    def tokens(part: list) -> int:
        return sum(len(s.token_ids) if isinstance(s, Span) else len(s) for s in part)

    for j in range(1, limit + 1):
        cold = [segs[i].read.size for i in facts[:j] if isinstance(segs[i], ColdFact)]
        disk = rates.disk_s(sum(cold), len(cold)) if cold else 0.0
        head, tail = segs[: facts[j - 1] + 1], segs[facts[j - 1] + 1 :]
        cost = disk + rates.inject_s(tokens(head)) + rates.prefill_s(tokens(tail))
        if cost <= best[1]:
            best = (j, cost)
    return best


def test_the_split_search_stops_early_and_still_finds_the_cheapest():
    """``choose`` stops once the reads alone cost more than the best split so far: the same
    split as trying them all, on random prompts and speeds, and a cold request over a slow disk
    asks the size of a few files, not of every one."""
    import random

    from inferscale_engine.planner import choose

    rng = random.Random(0)
    for _ in range(300):
        kinds = "".join(rng.choice("wcc") for _ in range(rng.randint(1, 30)))
        segs, _ = _prompt(kinds)
        for i, s in enumerate(segs):
            if isinstance(s, ColdFact):
                segs[i] = ColdFact(list(s), CountedRead(s.read.span, rng.choice([10**5, 10**6, 10**7])))
        facts = [i for i, s in enumerate(segs) if isinstance(s, (Span, TextFact))]
        limit = rng.randint(0, len(facts))
        rates = _rates(rng.choice([1e7, 1e8, 1e9, 1e10]), rng.choice([0.0, 0.001, 0.005]),
                       file_s=rng.choice([0.0, 0.0005, 0.002]), inject_token_s=rng.choice([0.0, 1e-6, 2e-4]))
        chosen = choose(segs, facts, limit, rates)
        j, cost = _exhaustive(segs, facts, limit, rates)
        assert (chosen.injected, chosen.expected_s) == (j, pytest.approx(cost)), kinds

    segs, _ = _prompt("c" * 50)
    segs = [ColdFact(list(s), CountedRead(s.read.span, 10**6)) if isinstance(s, ColdFact) else s for s in segs]
    out, mix, _ = plan(segs, 0, _rates(1e7))  # 0.1 s a file against 0.06 s to prefill them all
    assert mix == MemoryMix(0, 0, 50)
    assert sum(s.read.asked for s in segs if isinstance(s, ColdFact)) == 1
