"""The values that cross InferScale's API: what a prompt resolves to and what generation returns.

Kept apart from :mod:`inferscale_engine.engine` so the store, the integrations and the server can
name them without importing vLLM (seconds) or the engine's internals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from inferscale_engine.handles import Handle
    from inferscale_engine.kv import FactKV

__all__ = ["FactSource", "GenerationResult", "Messages", "Mode", "Segment", "Span", "StreamDelta", "Usage"]

Mode = Literal["inject", "prompt"]
Messages = Sequence[dict[str, Any]]  # "role", "content" (str); "tool_calls" on assistant messages


@dataclass(frozen=True)
class Span:
    """Tokens whose KV is injected rather than computed."""

    key: str  # identifies the KV content: equal keys must mean equal KV
    token_ids: tuple[int, ...]
    kv: FactKV
    text: str = ""

    def __post_init__(self) -> None:
        if self.kv.num_tokens != len(self.token_ids):
            raise ValueError(f"span {self.key}: {len(self.token_ids)} tokens but KV for {self.kv.num_tokens}")


class TextFact(list[int]):
    """A memory served as its token ids, prefilled like prompt text: its KV was still being
    encoded and a chat does not wait behind ingestion for it. Everything after it in the prompt
    is prefilled too (injected KV is a prefix)."""


Segment = Span | Sequence[int]


class FactSource(Protocol):
    """Turns the handles of a request of ``user_id`` into the spans to inject (the memory store).
    A source with only ``resolve(handle, user_id) -> Span`` is asked handle by handle."""

    def resolve_many(self, handles: Sequence[Handle], user_id: str) -> Sequence[Span | TextFact]: ...


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    injected_tokens: int  # prompt tokens whose KV was injected instead of prefilled
    cached_tokens: int  # prompt tokens vLLM's prefix cache already held
    memories_as_text: int = 0  # memories prefilled as text: their KV was not encoded yet

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage
    ttft_s: float  # from the start of the request's preparation (layout, plan) to its first token
    latency_s: float
    prompt_token_ids: list[int] = field(repr=False, default_factory=list)
    #: Log-probabilities of the first generated token ({token id: logprob}) when asked for.
    first_logprobs: dict[int, float] | None = field(repr=False, default=None)


@dataclass
class StreamDelta:
    """One piece of a streamed generation; the last one carries the whole result."""

    text: str
    result: GenerationResult | None = None
