"""What travels from the engine to the connector, and from its scheduler half to its worker half.

Requests carry an :class:`InjectionPlan` or a :class:`CapturePlan` inside
``kv_transfer_params``: as plain JSON (what vLLM's OpenAI server and
``SamplingParams.extra_args`` both take, and what crosses to vLLM's engine-core process), or,
for a request that never leaves this process (``multiprocess=False``), as the plan object
itself (``to_params(inline=True)``), which is never encoded or parsed again. Each plan says
where its KV lies in shared memory (:class:`SharedKV`). The scheduler half turns them into
:class:`InferScaleConnectorMetadata` once per step.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from inferscale_engine.connector.exchange import Geometry, Location, SharedKV

if TYPE_CHECKING:
    from inferscale_engine.kv import FactKV

PARAMS_KEY = "inferscale"


class SpanRef(NamedTuple):
    """Stored span ``key`` served at prompt positions ``[position, position + length)``: one span
    of an :class:`InjectionPlan` as a record (JSON; the plan itself keeps columns)."""

    key: str
    position: int
    length: int

    @property
    def end(self) -> int:
        return self.position + self.length


@dataclass(frozen=True, slots=True, eq=False)
class InjectionPlan:
    """Prompt tokens ``[0, end)`` come from stored spans that tile them exactly: span ``i``,
    stored as ``keys[i]``, at positions ``[bounds[i], bounds[i + 1])``. Made by :meth:`tiling`
    or :meth:`of_spans`, which refuse spans that do not tile the prefix.

    Columns, not a record per span: hundreds of spans a request go from the engine through the
    scheduler half to the worker half as arrays, sliced and offset by numpy."""

    keys: tuple[str, ...]
    #: int64, ``len(keys) + 1`` entries, from 0 and increasing (read-only once planned).
    bounds: np.ndarray
    kv: SharedKV
    #: Let vLLM's prefix cache keep this request's blocks (``EngineConfig.prefix_cache_injected``).
    keep_cached: bool = False
    #: Injected positions whose KV the worker computes again after injecting them
    #: (``EngineConfig.recompute_tokens``): int64, increasing, inside ``[0, end)``; None: none.
    recompute: np.ndarray | None = None
    #: Of ``recompute``, the share kept from the model's second layer on: those whose K/V there
    #: deviate most from the injected rows (CacheBlend's selection); None: all of them.
    recompute_keep: float | None = None

    def __post_init__(self) -> None:
        # Only the shape: the values were checked where the bounds were made (no numpy pass on
        # every request; a cold one costs tens of µs on a CPU busy with the forward pass).
        if self.bounds.dtype != np.int64 or self.bounds.shape != (len(self.keys) + 1,):
            raise ValueError(f"{len(self.keys)} spans need {len(self.keys) + 1} int64 bounds")
        if self.kv.spans is not None and len(self.kv.spans) != len(self.keys):
            raise ValueError(f"{len(self.keys)} spans but KV for {len(self.kv.spans)}")
        self.bounds.flags.writeable = False
        if self.recompute is not None:
            r = self.recompute
            if (r.dtype != np.int64 or r.ndim != 1 or (len(r) and (r[0] < 0 or r[-1] >= self.bounds[-1]))
                    or np.any(np.diff(r) <= 0)):
                raise ValueError("positions to recompute must be increasing int64 inside the injected prefix")
            r.flags.writeable = False
        if self.recompute_keep is not None and not 0 < self.recompute_keep <= 1:
            raise ValueError(f"the share of rows to keep must be in (0, 1], got {self.recompute_keep!r}")

    @classmethod
    def tiling(cls, keys: Sequence[str], lengths: Sequence[int], kv: SharedKV, keep_cached: bool = False,
               recompute: Sequence[int] | None = None, recompute_keep: float | None = None) -> InjectionPlan:
        """Spans ``keys`` of ``lengths`` tokens, one after the other from position 0; the
        positions ``recompute`` (increasing) computed again once injected (``recompute_keep``
        of them past the first layer)."""
        if lengths and min(lengths) <= 0:
            raise ValueError("injected spans must tile the prompt prefix without gaps")
        bounds = np.fromiter(itertools.accumulate(lengths, initial=0), np.int64, len(keys) + 1)
        rows = None if recompute is None else np.asarray(recompute, dtype=np.int64)
        return cls(tuple(keys), bounds, kv, keep_cached, rows, recompute_keep)

    @classmethod
    def of_spans(cls, spans: Sequence[SpanRef], kv: SharedKV, keep_cached: bool = False,
                 recompute: Sequence[int] | None = None, recompute_keep: float | None = None) -> InjectionPlan:
        """From records (JSON): refused unless they tile the prefix from 0, in order."""
        plan = cls.tiling([s.key for s in spans], [s.length for s in spans], kv, keep_cached, recompute,
                          recompute_keep)
        if [s.position for s in spans] != plan.bounds[:-1].tolist():
            raise ValueError("injected spans must tile the prompt prefix without gaps")
        return plan

    @property
    def spans(self) -> tuple[SpanRef, ...]:
        """The spans as records (JSON, tests; not on a request's path)."""
        bounds = self.bounds.tolist()
        return tuple(map(SpanRef, self.keys, bounds[:-1], [b - a for a, b in zip(bounds, bounds[1:])]))

    @property
    def end(self) -> int:
        return int(self.bounds[-1])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, InjectionPlan):
            return NotImplemented
        return ((self.keys, self.kv, self.keep_cached) == (other.keys, other.kv, other.keep_cached)
                and np.array_equal(self.bounds, other.bounds)
                and _same_rows(self.recompute, other.recompute) and self.recompute_keep == other.recompute_keep)

    def to_params(self, inline: bool = False) -> dict[str, Any]:
        """``kv_transfer_params`` for this plan: JSON, or with ``inline`` the plan itself (for a
        request that never leaves this process: nothing to encode or parse again)."""
        if inline:
            return {PARAMS_KEY: self}
        ours: dict[str, Any] = {"inject": [list(s) for s in self.spans], "kv": self.kv.to_json(),
                                "keep_cached": self.keep_cached}
        if self.recompute is not None:
            ours["recompute"] = self.recompute.tolist()
            if self.recompute_keep is not None:
                ours["recompute_keep"] = self.recompute_keep
        return {PARAMS_KEY: ours}

    def pieces(self, start: int, stop: int) -> LoadPieces:
        """What loads prompt positions ``[start, stop)`` (``0 <= start < stop <= end``): a piece
        per span they overlap, in order, whole but for the first and the last."""
        end = self.end
        if not 0 <= start < stop <= end:
            raise ValueError(f"positions [{start}, {stop}) are not inside the injected [0, {end})")
        bounds = self.bounds
        if start == 0 and stop == end:
            # The whole plan: how a request that bypasses vLLM's prefix cache loads it. Half the
            # numpy calls of a cut: each costs µs in the scheduler, cold after a forward pass (the
            # scheduler's hook 49-52 -> 28-30 µs a k=5 request on a CPU).
            position = bounds[:-1]
            return LoadPieces(self.keys, np.zeros(len(self.keys), dtype=np.int64), position, bounds[1:] - position,
                              self.kv.spans)
        # Spans tile the prefix in order: bisection finds the spans of the first and the last
        # position, with no scan of them all (one call: few numpy calls a request).
        first, last = (bounds.searchsorted((start, stop - 1), "right") - 1).tolist()
        position = bounds[first : last + 1].copy()
        count = bounds[first + 1 : last + 2] - position
        row = np.zeros_like(position)
        row[0] = start - position[0]
        position[0] = start
        count[0] -= row[0]
        count[-1] -= bounds[last + 1] - stop
        spans = self.kv.spans
        return LoadPieces(self.keys[first : last + 1], row, position, count,
                          None if spans is None else spans[first : last + 1])


def _same_rows(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return a is b or (a is not None and b is not None and np.array_equal(a, b))


@dataclass(frozen=True, slots=True)
class CaptureRange:
    """Keep the KV of prompt tokens ``[start, start + length)`` under ``capture_id``."""

    capture_id: str
    start: int
    length: int


@dataclass(frozen=True, slots=True)
class CapturePlan:
    ranges: tuple[CaptureRange, ...]
    kv: SharedKV  # where each range's rows go, by capture id

    def to_params(self, inline: bool = False) -> dict[str, Any]:
        """As :meth:`InjectionPlan.to_params`."""
        if inline:
            return {PARAMS_KEY: self}
        return {PARAMS_KEY: {"capture": [[r.capture_id, r.start, r.length] for r in self.ranges],
                             "kv": self.kv.to_json()}}


#: In a finished request's output ``kv_transfer_params``: prompt tokens the connector injected.
INJECTED_KEY = "inferscale_injected_tokens"
#: Beside it: whether the request bypassed vLLM's prefix cache (asked to, and the connector could
#: keep it out): then every token vLLM counts as cached was injected.
BYPASSED_KEY = "inferscale_bypassed_prefix_cache"


def injected_tokens(output_params: dict[str, Any] | None) -> int:
    """Prompt tokens whose KV was injected into a finished request, from its output
    ``kv_transfer_params`` (0 when none was: no plan, or vLLM's prefix cache held them all)."""
    return int((output_params or {}).get(INJECTED_KEY, 0))


def bypasses_prefix_cache(params: dict[str, Any] | None) -> bool:
    """Whether vLLM's prefix cache should neither serve nor keep a request's blocks.

    Captures always bypass it: their rows must be computed, and no window is encoded twice.
    Injected prompts do unless their plan says ``keep_cached``: their blocks could only serve
    the same user asking with the same memories in the same order, and caching them costs every
    request 1–2 ms at k=200 and pushes out blocks plain prompts would hit.
    """
    ours = (params or {}).get(PARAMS_KEY)
    if isinstance(ours, InjectionPlan):
        return not ours.keep_cached
    if isinstance(ours, CapturePlan):
        return True
    if isinstance(ours, dict):
        return "capture" in ours or ("inject" in ours and not ours.get("keep_cached"))
    return False


def parse_params(params: dict[str, Any] | None) -> InjectionPlan | CapturePlan | None:
    """Read our part of a request's ``kv_transfer_params``; ``None`` when there is none.
    ``ValueError`` for anything malformed: they come from any client of a vLLM server, and the
    scheduler half must refuse them, not fail on them (a raise there stops vLLM's engine core)."""
    ours = (params or {}).get(PARAMS_KEY)
    if isinstance(ours, (InjectionPlan, CapturePlan)):  # inline: validated when it was made
        return ours
    if not ours:
        return None
    try:
        return _parse(ours)
    except (KeyError, TypeError, AttributeError, IndexError) as exc:
        raise ValueError(f"malformed inferscale kv_transfer_params ({type(exc).__name__}: {exc})") from None


def _parse(ours: Any) -> InjectionPlan | CapturePlan:
    if not isinstance(ours, dict):
        raise ValueError(f"inferscale kv_transfer_params must be an object, got {type(ours).__name__}")
    if "inject" in ours:
        spans = [SpanRef(str(k), int(p), int(n)) for k, p, n in ours["inject"]]
        recompute = ours.get("recompute")
        return InjectionPlan.of_spans(spans, _shared(ours, [s.key for s in spans]), bool(ours.get("keep_cached", False)),
                                      None if recompute is None else [int(p) for p in recompute],
                                      None if ours.get("recompute_keep") is None else float(ours["recompute_keep"]))
    if "capture" in ours:
        ranges = tuple(CaptureRange(str(c), int(s), int(n)) for c, s, n in ours["capture"])
        return CapturePlan(ranges, _shared(ours, [r.capture_id for r in ranges]))
    raise ValueError(f"unknown inferscale kv_transfer_params: {sorted(ours)}")


def _shared(ours: dict[str, Any], keys: list[str]) -> SharedKV:
    if "kv" not in ours:
        raise ValueError("inferscale kv_transfer_params need 'kv': where the KV lies")
    kv = SharedKV.from_json(ours["kv"])
    missing = [k for k in keys if k not in kv.at]
    if missing:
        raise ValueError(f"no KV location for {missing[:3]}")
    unknown = kv.described() - set(kv.segments)
    if unknown:
        raise ValueError(f"KV locations in undescribed segments {sorted(unknown)[:3]}")
    return kv


@dataclass(frozen=True, slots=True)
class LoadPieces:
    """Rows ``[row[i], row[i] + count[i])`` of span ``keys[i]`` go to prompt positions from
    ``position[i]`` (int64 arrays, one entry per span). ``kvs``: those spans' KV itself where the
    plan carries it (:attr:`SharedKV.spans`), else ``None``: it lies where the plan's
    :attr:`SharedKV.at` says."""

    keys: Sequence[str]
    row: np.ndarray
    position: np.ndarray
    count: np.ndarray
    kvs: Sequence[FactKV] | None = None


@dataclass(slots=True)
class LoadRequest:
    """Write ``pieces`` (in order) to prompt positions ``[start, stop)`` of a request whose
    cache blocks are ``block_ids``; the worker turns positions into slots on the device."""

    block_ids: list[int]
    start: int
    stop: int
    pieces: LoadPieces
    #: The owner's event (ring, slot) that orders the writes after the copies staging the KV.
    ready: tuple[str, int] | None = None
    #: Positions in ``[start, stop)`` whose KV the worker computes again once injected
    #: (:mod:`inferscale_engine.connector.blend`), and their prompt token ids; None: none.
    recompute: np.ndarray | None = None
    recompute_ids: np.ndarray | None = None
    recompute_keep: float | None = None  # as InjectionPlan.recompute_keep

    def slots(self, block_size: int) -> np.ndarray:
        """Cache slot (``block * block_size + offset``) of every position in ``[start, stop)``."""
        # Positions are consecutive: lay out every slot of the blocks they touch and cut
        # [start, stop) out of those, rather than divide position by position.
        first, end = self.start // block_size, -(-self.stop // block_size)
        if end > len(self.block_ids):
            raise ValueError(f"positions up to {self.stop} need {end} blocks, the request has {len(self.block_ids)}")
        blocks = np.asarray(self.block_ids[first:end], dtype=np.int64)
        every = (blocks[:, None] * block_size + np.arange(block_size)).reshape(-1)
        offset = self.start - first * block_size
        return every[offset : offset + self.stop - self.start]


def position_slots(block_ids: Sequence[int], positions: np.ndarray, block_size: int) -> np.ndarray:
    """Cache slot (``block * block_size + offset``) of each prompt position of a request."""
    blocks = np.asarray(block_ids, dtype=np.int64)
    return blocks[positions // block_size] * block_size + positions % block_size


@dataclass(slots=True)
class CaptureSlots:
    """Slots (``block * block_size + offset``) of the rows of a capture range that vLLM computes
    in this step: rows ``[first_row, first_row + len(slots))`` of a range of ``length`` rows."""

    capture_id: str
    length: int
    first_row: int
    slots: list[int]


@dataclass
class InferScaleConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadRequest] = field(default_factory=list)
    captures: list[CaptureSlots] = field(default_factory=list)
    #: Where the KV of this step's span keys and capture ids lies.
    at: dict[str, Location] = field(default_factory=dict)
    geometry: Geometry | None = None
    #: Segments the workers have not been told of yet.
    segments: dict[str, dict[str, Any]] = field(default_factory=dict)
