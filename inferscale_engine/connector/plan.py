"""What travels from the engine to the connector, and from its scheduler half to its worker half.

Requests carry an :class:`InjectionPlan` or a :class:`CapturePlan` inside
``kv_transfer_params``: as plain JSON (what vLLM's OpenAI server and
``SamplingParams.extra_args`` both take), or, for a request made in this process, as the plan
object itself (``to_params(inline=True)``), which is never encoded or parsed again.
The scheduler half turns them into :class:`InferScaleConnectorMetadata` once per step.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Literal, NamedTuple

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

PARAMS_KEY = "inferscale"


class SpanRef(NamedTuple):  # a tuple: hundreds are built per request, on the scheduler's path
    """Stored span ``key`` served at prompt positions ``[position, position + length)``."""

    key: str
    position: int
    length: int

    @property
    def end(self) -> int:
        return self.position + self.length


@dataclass(frozen=True, slots=True)
class InjectionPlan:
    """Prompt tokens ``[0, end)`` come from stored spans that tile them exactly."""

    spans: tuple[SpanRef, ...]

    def __post_init__(self) -> None:
        cursor = 0
        for s in self.spans:
            if s.position != cursor or s.length <= 0:
                raise ValueError("injected spans must tile the prompt prefix without gaps")
            cursor = s.end

    @property
    def end(self) -> int:
        return self.spans[-1].end if self.spans else 0

    def to_params(self, inline: bool = False) -> dict[str, Any]:
        """``kv_transfer_params`` for this plan: JSON, or with ``inline`` the plan itself (for a
        request that never leaves this process: nothing to encode or parse again)."""
        if inline:
            return {PARAMS_KEY: self}
        return {PARAMS_KEY: {"inject": [[s.key, s.position, s.length] for s in self.spans]}}

    def pieces(self, start: int, stop: int) -> list[LoadPiece]:
        """What loads prompt positions ``[start, stop)`` (``0 <= start < stop <= end``): a piece
        per span they overlap, in order, whole but for the first and the last."""
        if not 0 <= start < stop <= self.end:
            raise ValueError(f"positions [{start}, {stop}) are not inside the injected [0, {self.end})")
        spans = self.spans
        # Spans tile the prefix in order: bisection finds the two ends, with no scan of them all.
        first = bisect.bisect_right(spans, start, key=_position) - 1
        last = bisect.bisect_left(spans, stop, key=_position) - 1
        pieces = [LoadPiece(key, 0, position, length) for key, position, length in spans[first : last + 1]]
        head, tail = spans[first], spans[last]
        pieces[0] = LoadPiece(head.key, start - head.position, start, min(head.end, stop) - start)
        if last > first:
            pieces[-1] = LoadPiece(tail.key, 0, tail.position, stop - tail.position)
        return pieces


_position = attrgetter("position")


@dataclass(frozen=True, slots=True)
class CaptureRange:
    """Keep the KV of prompt tokens ``[start, start + length)`` under ``capture_id``."""

    capture_id: str
    start: int
    length: int


@dataclass(frozen=True, slots=True)
class CapturePlan:
    ranges: tuple[CaptureRange, ...]

    def to_params(self, inline: bool = False) -> dict[str, Any]:
        """As :meth:`InjectionPlan.to_params`."""
        if inline:
            return {PARAMS_KEY: self}
        return {PARAMS_KEY: {"capture": [[r.capture_id, r.start, r.length] for r in self.ranges]}}


#: In a finished request's output ``kv_transfer_params``: prompt tokens the connector injected.
INJECTED_KEY = "inferscale_injected_tokens"


def injected_tokens(output_params: dict[str, Any] | None) -> int:
    """Prompt tokens whose KV was injected into a finished request, from its output
    ``kv_transfer_params`` (0 when none was: no plan, or vLLM's prefix cache held them all)."""
    return int((output_params or {}).get(INJECTED_KEY, 0))


def plan_kind(params: dict[str, Any] | None) -> Literal["inject", "capture"] | None:
    """Which plan a request's ``kv_transfer_params`` carry, without parsing them (vLLM asks for
    every block of every request)."""
    ours = (params or {}).get(PARAMS_KEY)
    if isinstance(ours, InjectionPlan) or (isinstance(ours, dict) and "inject" in ours):
        return "inject"
    if isinstance(ours, CapturePlan) or (isinstance(ours, dict) and "capture" in ours):
        return "capture"
    return None


def parse_params(params: dict[str, Any] | None) -> InjectionPlan | CapturePlan | None:
    """Read our part of a request's ``kv_transfer_params``; ``None`` when there is none."""
    ours = (params or {}).get(PARAMS_KEY)
    if isinstance(ours, (InjectionPlan, CapturePlan)):  # inline: validated when it was made
        return ours
    if not ours:
        return None
    if "inject" in ours:
        return InjectionPlan(tuple(SpanRef(str(k), int(p), int(n)) for k, p, n in ours["inject"]))
    if "capture" in ours:
        return CapturePlan(tuple(CaptureRange(str(c), int(s), int(n)) for c, s, n in ours["capture"]))
    raise ValueError(f"unknown inferscale kv_transfer_params: {sorted(ours)}")


class LoadPiece(NamedTuple):
    """Rows ``[row, row + count)`` of span ``key`` go to prompt position ``position``."""

    key: str
    row: int
    position: int
    count: int  # type: ignore[assignment]  # shadows tuple.count: the field reads better


@dataclass(slots=True)
class LoadRequest:
    """Write ``pieces`` (in order) to prompt positions ``[start, stop)`` of a request whose
    cache blocks are ``block_ids``; the worker turns positions into slots on the device."""

    block_ids: list[int]
    start: int
    stop: int
    pieces: list[LoadPiece]

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
