"""What travels from the engine to the connector, and from its scheduler half to its worker half.

Requests carry an :class:`InjectionPlan` or a :class:`CapturePlan` as plain JSON inside
``kv_transfer_params`` (the OpenAI server and ``SamplingParams.extra_args`` both take it).
The scheduler half turns them into :class:`InferScaleConnectorMetadata` once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

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

    def to_params(self) -> dict[str, Any]:
        return {PARAMS_KEY: {"inject": [[s.key, s.position, s.length] for s in self.spans]}}


@dataclass(frozen=True, slots=True)
class CaptureRange:
    """Keep the KV of prompt tokens ``[start, start + length)`` under ``capture_id``."""

    capture_id: str
    start: int
    length: int


@dataclass(frozen=True, slots=True)
class CapturePlan:
    ranges: tuple[CaptureRange, ...]

    def to_params(self) -> dict[str, Any]:
        return {PARAMS_KEY: {"capture": [[r.capture_id, r.start, r.length] for r in self.ranges]}}


def parse_params(params: dict[str, Any] | None) -> InjectionPlan | CapturePlan | None:
    """Read our part of a request's ``kv_transfer_params``; ``None`` when there is none."""
    ours = (params or {}).get(PARAMS_KEY)
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
    count: int


@dataclass(slots=True)
class LoadRequest:
    """Write ``pieces`` (in order) to prompt positions ``[start, stop)`` of a request whose
    cache blocks are ``block_ids``; the worker turns positions into slots on the device."""

    block_ids: list[int]
    start: int
    stop: int
    pieces: list[LoadPiece]


@dataclass(slots=True)
class CaptureSlots:
    """Slots (``block * block_size + offset``) of a capture range's rows known so far."""

    capture_id: str
    length: int
    slots: list[int]


@dataclass
class InferScaleConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadRequest] = field(default_factory=list)
    captures: list[CaptureSlots] = field(default_factory=list)
