"""The per-request cost model: where each memory's KV comes from, so that a cold memory never
makes a request slower than prefilling it would.

A memory in a prompt is injected from where its KV is (device or host tier, or a disk file
still in the page cache: all cheap; the page cache is probed only for the memories the split
search reaches), read from a cold disk file and injected, or recomputed:
prefilled as text, exactly as prompt injection does. The connector injects only a *prefix* of
the prompt, so the choice is one split: the first ``j`` memories are injected (cold ones among
them are waited for), everything after memory ``j`` is prefilled, in prompt order — the same
layout as the quality knob ``recompute=R``, whose last ``R`` memories are always prefilled
(the split never goes past ``k - R``). Order is never changed, so every mix is the same prompt;
with exact-context KV every mix gives the same answer.

For each split the model adds the time to read the cold files in the prefix (in parallel:
``latency + bytes / bandwidth`` plus each file's own host work, which the reader threads share),
the time to inject the prefix (the connector writes every injected token's KV: next to nothing
on a GPU, a gather, rotation and copy per layer on a CPU) and the time to prefill everything
after the split (a curve of measured prefill times), and takes the cheapest; ties go to
injecting more (prefill is compute every other request shares). Only then do reads start: the
prefix's on the request pool, the recomputed memories' on a small background pool (their Python
work would otherwise compete for the GIL with the request) that leaves their KV in the host
tier: the next request injects them.

Rates are measured, never assumed: prefill time of this engine at a few prompt lengths and what
injecting costs it per token (cached per engine and machine, since it takes seconds on a CPU), and
the store's disk and host-to-device speeds (:mod:`inferscale_engine.memory.kv.bandwidth`, measured
when the store is attached). What reads on requests' paths then really take corrects the read
estimates (:class:`ObservedReads`).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import platform
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from inferscale_engine.types import ColdFact, ColdRead, GenerationResult, MemoryMix, Segment, Span, TextFact

if TYPE_CHECKING:
    from inferscale_engine.config import EngineConfig
    from inferscale_engine.kv import FactKV
    from inferscale_engine.memory.kv.bandwidth import TierSpeeds

logger = logging.getLogger(__name__)

#: Prompt lengths whose prefill time is measured (capped by the model's context).
PREFILL_POINTS = (16, 64, 256, 512, 1024, 2048, 4096)
#: Tokens injected (at most) to measure what injecting one costs.
INJECT_POINT = 1024
#: Measured prefill curves are reused this long (engine fingerprint and machine in the key).
CACHE_MAX_AGE_S = 7 * 24 * 3600


class MeasuredEngine(Protocol):
    """What the calibration asks of the engine it measures (:class:`~inferscale_engine.engine.
    InferScaleEngine`, named by what it has: the engine imports this module)."""

    config: EngineConfig
    fingerprint: str
    max_model_len: int
    vocab_size: int
    #: vLLM's ``VllmConfig`` (its CUDA graph mode is part of the measurement's cache key).
    vllm_config: Any

    @property
    def closed(self) -> bool: ...

    def generate_segments(self, segments: Sequence[Segment], *, user_id: str = ..., **kwargs: Any) -> GenerationResult: ...

    def encode_fact(self, fact_ids: Sequence[int], context_ids: Sequence[int] = ...) -> FactKV: ...


class MeasuredStore(Protocol):
    """What the calibration asks of the store whose reads it prices (the memory store)."""

    def tier_speeds(self, *, refresh: bool = False) -> TierSpeeds: ...


@dataclass(frozen=True)
class Rates:
    """What the cost model weighs: prefill seconds by prompt length, and tier speeds."""

    #: ``(prompt tokens, seconds to first token)``, measured, increasing in tokens.
    prefill: tuple[tuple[int, float], ...]
    disk_bytes_per_s: float
    disk_latency_s: float
    host_to_device_bytes_per_s: float | None = None
    #: Host seconds each file of a parallel read adds (its checks and parsing share the cores).
    disk_file_s: float = 0.0
    #: Seconds injecting one token's KV adds to a request (the connector's write of it).
    inject_token_s: float = 0.0

    @functools.cached_property
    def _tokens(self) -> list[int]:
        return [n for n, _ in self.prefill]

    def prefill_s(self, tokens: int) -> float:
        """Seconds to prefill ``tokens``: linear between measured points, past the last one at
        the slope of the last two."""
        points = self.prefill
        xs = self._tokens
        i = bisect.bisect_left(xs, tokens)
        if i < len(points) and xs[i] == tokens:
            return points[i][1]
        if i == 0:
            return points[0][1]
        if i == len(points):
            (n0, t0), (n1, t1) = points[-2] if len(points) > 1 else (0, 0.0), points[-1]
            return t1 + (tokens - n1) * max(0.0, (t1 - t0) / max(1, n1 - n0))
        (n0, t0), (n1, t1) = points[i - 1], points[i]
        return t0 + (t1 - t0) * (tokens - n0) / (n1 - n0)

    def disk_s(self, nbytes: int, files: int = 1) -> float:
        """Seconds to read ``files`` files of ``nbytes`` in all, in parallel."""
        return self.disk_latency_s + nbytes / self.disk_bytes_per_s + files * self.disk_file_s

    def inject_s(self, tokens: int) -> float:
        return tokens * self.inject_token_s

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Plan:
    """The cost model's choice for one request: memories ``[0, injected)`` are injected."""

    injected: int
    memories: int
    expected_s: float  # what the model expects the chosen split to cost
    prompt_s: float  # what prefilling every memory would cost (the bound never to exceed)


class ObservedReads:
    """How long cold reads on requests' paths take against what the rates predict.

    The calibration times bare file reads on an idle store. On a request's path a read also
    lands in a memory tier and is handed out, and it shares the cores with the request and with
    the other reads in flight: on the 2-core CPU box, 50 reads took about twice the calibrated
    time. Each request that waits for cold reads records what they took against the prediction;
    the model scales its read estimates by a running geometric mean of that ratio (the first few
    averaged, then weighted towards the latest), so its next choices follow what reads cost on
    this machine under its load. A model that overestimates reads reads less, and so learns
    less: it errs towards prefilling, which is never slower than prompt injection.
    """

    #: Weight of the latest ratio once a few are in.
    WEIGHT = 0.25
    #: No ratio counts for more than this factor either way (one read stalled by a page fault
    #: storm must not switch reading off for good).
    CLAMP = 16.0

    def __init__(self) -> None:
        self._log_ratio = 0.0
        self.samples = 0

    @property
    def scale(self) -> float:
        """What the rates' read estimates are multiplied by."""
        return math.exp(self._log_ratio)

    def record(self, predicted_s: float, observed_s: float) -> None:
        """A request waited ``observed_s`` for reads the rates priced at ``predicted_s``."""
        if predicted_s <= 0 or observed_s <= 0:
            return
        ratio = min(max(observed_s / predicted_s, 1 / self.CLAMP), self.CLAMP)
        weight = max(self.WEIGHT, 1 / (self.samples + 1))
        # Requests record concurrently: a lost update only drops one sample.
        self._log_ratio += weight * (math.log(ratio) - self._log_ratio)
        self.samples += 1


def plan(
    segments: Sequence[Segment],
    recompute: int,
    rates: Rates | Callable[[], Rates | None] | None,
    observed: ObservedReads | None = None,
) -> tuple[list[Segment], MemoryMix, Callable[[], None] | None]:
    """Segments with the cold memories the cost model injects loaded (waited for), the mix of
    the request, and what moves the prefilled cold memories up a tier for the next request
    (``None``: no cold memory is prefilled): the caller runs it once the request's first token
    is out, since reads running during the prefill compete with vLLM's host work (GIL, memory
    bandwidth). The rest stay text (``TextFact``) and, with the quality knob's last
    ``recompute`` memories, form the prefilled tail laid out by the engine. ``rates`` may be
    what returns them: it is asked only when a file the split could reach is not in the page
    cache (the engine's may wait for its start-up measurement). ``observed`` scales the read
    estimates, and learns from the reads this request waits for."""
    # One pass over the segments (on every injected request's path): where the memories
    # are, which are cold, and the first one still waiting to be encoded.
    facts: list[int] = []
    cold: list[int] = []
    waiting = None
    for i, seg in enumerate(segments):
        kind = type(seg)
        if kind is ColdFact:
            cold.append(len(facts))
        elif kind is TextFact:
            if waiting is None:
                waiting = len(facts)
        elif kind is not Span:
            continue
        facts.append(i)
    limit = max(0, len(facts) - recompute)
    if waiting is not None:  # not encoded yet: prefilled, and everything after it
        limit = min(limit, waiting)
    reads: dict[int, ColdRead] = {j: cast(ColdFact, segments[facts[j]]).read for j in cold}
    reachable = [j for j in cold if j < limit]
    if reachable and not all(reads[j].cached for j in reachable):
        if callable(rates):
            rates = rates()
        if rates is None:  # nothing measured (no store speeds): load, as before the cost model
            split = limit
        else:
            chosen = choose(segments, facts, limit, rates, observed.scale if observed is not None else 1.0)
            split = chosen.injected
            logger.debug("cost model: %d of %d memories injected (%d cold), expected %.1f ms, all prefilled %.1f ms",
                         split, len(facts), len(cold), 1e3 * chosen.expected_s, 1e3 * chosen.prompt_s)
    else:
        split = limit
    out = list(segments)
    prefix = [j for j in cold if j < split]
    # The prefix's files outside the page cache, asked before the reads put them there (the
    # split search probed them already, but where no rates were asked for).
    uncached = [j for j in prefix if not reads[j].cached]
    started = time.perf_counter()
    for j in prefix:  # queued together: read in parallel
        reads[j].start()
    for j in prefix:
        loaded = reads[j].wait()
        out[facts[j]] = loaded
        if not isinstance(loaded, Span):  # the file was unusable: the prefix ends here
            split = j
            break
    else:
        # Files in the page cache are priced at nothing: a prefix of only those teaches nothing.
        if observed is not None and uncached and isinstance(rates, Rates):
            priced = rates.disk_s(sum(reads[j].nbytes for j in uncached), len(uncached))
            observed.record(priced, time.perf_counter() - started)
    # The split may fall before memories whose KV is at hand (injecting costs more than
    # prefilling them): those are prefilled too, as everything after the split is.
    for j in range(split, limit):
        seg = out[facts[j]]
        if type(seg) is Span:
            out[facts[j]] = TextFact(seg.token_ids)
    later = [reads[j] for j in cold if j >= split]

    def promote() -> None:  # prefilled now; in a memory tier for the next request
        for read in later:
            read.promote()

    # A file the page cache held was read like a memory tier.
    from_disk = sum(1 for j in uncached if j < split)
    mix = MemoryMix(injected=split - from_disk, from_disk=from_disk, recomputed=len(facts) - split)
    return out, mix, promote if later else None


def choose(segments: Sequence[Segment], facts: list[int], limit: int, rates: Rates, read_scale: float = 1.0) -> Plan:
    """The cheapest split ``j <= limit`` (see the module docstring); ``read_scale`` multiplies
    every read estimate (:class:`ObservedReads`)."""
    lengths = [len(s.token_ids) if isinstance(s, Span) else len(s) for s in segments]
    everything = total = sum(lengths)
    prompt_s = rates.prefill_s(total)
    best_j, best_s = 0, prompt_s
    # No split prefills in less than the curve's first point, and reading and injecting only
    # grow with the prefix: once the reads plus that cost more than the best split so far, no
    # longer prefix can win. A cold request's planning then looks at the few memories a read
    # could pay for, not at all k of them (nor at their file sizes).
    shortest_s = rates.prefill[0][1]
    cold_bytes = cold_files = 0
    disk_s = 0.0
    done = 0  # segments [0, done) come before the split: injected
    for j in range(1, limit + 1):
        end = facts[j - 1]
        seg = segments[end]
        if isinstance(seg, ColdFact) and not seg.read.cached:
            cold_bytes += seg.read.nbytes
            cold_files += 1
            disk_s = read_scale * rates.disk_s(cold_bytes, cold_files)
            if disk_s + shortest_s > best_s:
                break
        # Injecting memories [0, j) prefills everything after memory j - 1 (for j = 0 everything:
        # the head is injected only in front of a memory).
        total -= sum(lengths[done : end + 1])
        done = end + 1
        cost = disk_s + rates.inject_s(everything - total) + rates.prefill_s(total)
        if cost <= best_s:
            best_j, best_s = j, cost
    return Plan(best_j, len(facts), best_s, prompt_s)


class Calibration:
    """The engine's :class:`Rates`, measured in the background when a store is attached; the
    prefill curve is cached on disk per engine fingerprint and machine."""

    def __init__(self, engine: MeasuredEngine, store: MeasuredStore, *, refresh: bool = False) -> None:
        self._engine = engine
        #: The store whose tier speeds these are.
        self.store = store
        self._refresh = refresh
        self._rates: Rates | None = None
        #: What this store's reads take on requests' paths, against these rates.
        self.observed = ObservedReads()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="inferscale-calibration", daemon=True)
        self._thread.start()

    def rates(self, timeout: float | None = None) -> Rates | None:
        """The rates, waiting for the measurement; ``None`` if it failed (logged)."""
        self._thread.join(timeout)
        return self._rates

    def _run(self) -> None:
        try:
            # Measured with the store's encoding held back: ingestion right after start-up would
            # make the engine and the disk look slower than they are, for as long as it is cached.
            pause = getattr(self.store, "encoding_paused", None)
            with pause() if pause is not None else contextlib.nullcontext():
                speeds = self.store.tier_speeds(refresh=self._refresh)
                self._rates = measure_rates(self._engine, speeds, refresh=self._refresh)
            logger.info("cost model rates: %s", self._rates)
        except Exception as exc:  # an engine or store closed meanwhile, a read-only store
            self._error = exc
            closed = self._engine.closed or bool(getattr(self.store, "closed", False))
            (logger.debug if closed else logger.warning)(
                "could not measure the cost model's rates (%s); cold memories are read from disk", exc)


def measure_rates(engine: MeasuredEngine, speeds: TierSpeeds, *, refresh: bool = False) -> Rates:
    """:class:`Rates` of ``engine`` (:func:`engine_costs`) with a store's measured tier
    ``speeds`` (:class:`~inferscale_engine.memory.kv.bandwidth.TierSpeeds`)."""
    prefill, inject_token_s = engine_costs(engine, refresh=refresh)
    return Rates(prefill, speeds.disk_bytes_per_s, speeds.disk_latency_s, speeds.host_to_device_bytes_per_s,
                 speeds.disk_file_s, inject_token_s)


def engine_costs(engine: MeasuredEngine, *, refresh: bool = False) -> tuple[tuple[tuple[int, float], ...], float]:
    """What requests cost ``engine``: seconds to first token of plain prompts of
    :data:`PREFILL_POINTS` tokens (fresh random tokens each, so no cache serves them; the best
    of two after a warm-up), and the seconds injecting one token adds (a span of random tokens
    injected in front of a short prompt, against that prompt alone; the best of three). Read
    from the cache when measured on this machine for this engine in the last week."""
    cache = _cache_path()
    key = _curve_key(engine)
    stored = _read_cache(cache)
    hit = stored.get(key)
    if hit and not refresh and time.time() - hit.get("measured_at", 0) < CACHE_MAX_AGE_S and "inject_token_s" in hit:
        return tuple((int(n), float(t)) for n, t in hit["points"]), float(hit["inject_token_s"])
    rng = random.Random(0)
    hi = min(engine.vocab_size, 32000) - 1
    lo = min(1000, hi // 2)  # past the low ids, where special tokens usually live

    def tokens(n: int) -> list[int]:
        return [rng.randint(lo, hi) for _ in range(n)]

    def run(segments: list[Any], mode: str = "prompt") -> GenerationResult:
        # recompute=0: the quality knob would prefill the span the injection is measured with.
        return engine.generate_segments(segments, max_tokens=1, mode=mode, recompute=0, user_id="inferscale-calibration")

    def ttft(segments: list[Any]) -> float:
        return float(run(segments).ttft_s)

    cap = engine.max_model_len - 2
    # A CPU prefill of thousands of tokens takes seconds: past 512 the curve is extrapolated.
    largest = 512 if engine.config.device == "cpu" else cap
    sizes = [n for n in PREFILL_POINTS if n <= min(cap, largest)] or [cap]
    points = []
    ttft([tokens(sizes[0])])
    for n in sizes:
        points.append((n, min(ttft([tokens(n)]) for _ in range(2))))
    # A measurement is noisy; the curve the model interpolates must not go down.
    for i in range(1, len(points)):
        points[i] = (points[i][0], max(points[i][1], points[i - 1][1]))
    inject_token_s = _inject_token_cost(engine, run, tokens, sizes)
    stored[key] = {"points": points, "inject_token_s": inject_token_s, "measured_at": time.time()}
    _write_cache(cache, stored)
    return tuple(points), inject_token_s


def _inject_token_cost(engine: MeasuredEngine, run: Callable[..., GenerationResult], tokens: Callable[[int], list[int]],
                       sizes: list[int]) -> float:
    """Seconds one injected token adds: a span of the largest measured size (at most
    :data:`INJECT_POINT`) injected in front of a prompt of the smallest, against that prompt
    alone (each the best of three, alternating)."""
    n, tail = min(sizes[-1], INJECT_POINT), sizes[0]
    if n <= tail:
        return 0.0
    ids = tokens(n)
    span = Span(f"calibration:{engine.fingerprint}:{n}", tuple(ids), engine.encode_fact(ids, ()))
    injected, alone = [], []
    for i in range(4):  # the first, a warm-up
        result = run([span, tokens(tail)], "inject")
        if result.usage.injected_tokens < n:  # vLLM's prefix cache held it (prefix_cache_injected)
            logger.info("could not time an injection; the cost model counts injecting as free")
            return 0.0
        if i:
            injected.append(result.ttft_s)
            alone.append(run([tokens(tail)]).ttft_s)
    return max(0.0, min(injected) - min(alone)) / n


def _cache_path() -> Path:
    base = os.environ.get("INFERSCALE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "inferscale")
    return Path(base) / "prefill-calibration.json"


def _curve_key(engine: MeasuredEngine) -> str:
    """Engine and machine: what the prefill time of a prompt depends on."""
    import torch

    cfg = engine.config
    machine = torch.cuda.get_device_name(0) if cfg.device == "cuda" else f"{platform.processor()}x{os.cpu_count()}"
    graphs = str(engine.vllm_config.compilation_config.cudagraph_mode)
    src = json.dumps([engine.fingerprint, machine, cfg.device, cfg.enforce_eager, graphs, cfg.max_num_seqs,
                      engine.max_model_len, sorted(map(str, cfg.vllm_options.items()))])
    return hashlib.sha256(src.encode()).hexdigest()[:20]


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, data: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home: measured again next start
        logger.info("could not cache the prefill calibration: %s", exc)
