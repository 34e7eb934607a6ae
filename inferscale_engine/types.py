"""The values that cross InferScale's API: what a prompt resolves to and what generation returns.

Kept apart from :mod:`inferscale_engine.engine` so the store, the integrations and the server can
name them without importing vLLM (seconds) or the engine's internals.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from inferscale_engine.errors import ContextOverflowError

#: The user of a request, memory or class that names none. Its memories are shared by every such
#: caller (the integrations warn when they fall back to it).
DEFAULT_USER = "default"

if TYPE_CHECKING:
    from inferscale_engine.handles import Handle
    from inferscale_engine.kv import FactKV

__all__ = ["AnySource", "ColdFact", "ColdRead", "EncodeWindow", "FactSource", "MemoryMix", "GenerationResult", "Messages", "Mode", "ResolvesMany", "ResolvesOne", "Segment", "Span", "StreamDelta", "Usage"]

Mode = Literal["inject", "prompt"]
Messages = Sequence[dict[str, Any]]  # "role", "content" (str); "tool_calls" on assistant messages


@dataclass(frozen=True)
class Span:
    """Tokens whose KV is injected rather than computed.

    ``kv`` is ``None`` for a *held* span: the consumer that resolved it (the engine's
    :class:`~inferscale_engine.connector.exchange.KVExchange`, through ``held=`` of
    :meth:`FactSource.resolve_many`) held KV under its key already, so none was read.
    ``reread`` resolves it again with its KV, for when the consumer gave that KV up meanwhile
    (possibly as a new version of the fact, or as a :class:`TextFact`)."""

    key: str  # identifies the KV content: equal keys must mean equal KV
    token_ids: tuple[int, ...]
    kv: FactKV | None
    text: str = ""
    reread: Callable[[], Span | TextFact] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kv is None:
            if self.reread is None:
                raise ValueError(f"span {self.key}: no KV and no way to read it (reread)")
        elif self.kv.num_tokens != len(self.token_ids):
            raise ValueError(f"span {self.key}: {len(self.token_ids)} tokens but KV for {self.kv.num_tokens}")

    @classmethod
    def stored(cls, key: str, token_ids: tuple[int, ...], kv: FactKV, text: str = "") -> Span:
        """A span of KV a memory store serves, made without ``__post_init__``'s check. Trusted:
        the store checked the KV's token count against the fact's tokens where the KV entered it
        (encoded, before it was stored; a file is only served under the key it was stored
        under), so a request does not check it again: ~0.7 µs less for each memory of every
        request. Everything else builds spans the checked way."""
        span = object.__new__(cls)
        # Frozen (its __setattr__ refuses): the fields go straight into the instance dict, as the
        # dataclass __init__ puts them there through object.__setattr__, at a third of the cost.
        span.__dict__.update(key=key, token_ids=token_ids, kv=kv, text=text, reread=None)
        return span

    def with_kv(self) -> Span | TextFact:
        """This span if it has its KV; a held one resolved again (:attr:`reread`)."""
        if self.kv is not None:
            return self
        assert self.reread is not None  # __post_init__
        return self.reread()


class TextFact(list[int]):
    """A memory served as its token ids, prefilled like prompt text: its KV was still being
    encoded and a chat does not wait behind ingestion for it. Everything after it in the prompt
    is prefilled too (injected KV is a prefix)."""


class ColdRead(Protocol):
    """The read of one cold memory's KV file (the memory store makes them)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the file (asked only of the memories the cost model weighs reading)."""

    @property
    def cached(self) -> bool:
        """Whether the whole file sits in the OS page cache, so a read would not wait for the disk
        (asked only of the memories the cost model weighs reading: a probe is a few syscalls)."""

    def start(self) -> None:
        """Queue the read now, on the pool that serves requests (reads started together run in
        parallel); idempotent."""

    def wait(self) -> Span | TextFact:
        """The span to inject once read (started if it was not); a ``TextFact`` when the file
        turned out unusable and the KV is being re-encoded."""

    def promote(self) -> None:
        """Read it in the background into a memory tier, for the next request (the memory is
        prefilled in this one)."""


class ColdFact(TextFact):
    """A memory whose KV is only in a disk file (outside the page cache, unless ``read.cached``).

    The engine's cost model (:mod:`inferscale_engine.planner`) either reads it and injects the
    KV, or prefills the memory as text, which is what a :class:`TextFact` is (so anything that
    does not plan treats it that way) and promotes it: read in the background into a memory
    tier, so the next request injects it.
    """

    def __init__(self, token_ids: Sequence[int], read: ColdRead) -> None:
        super().__init__(token_ids)
        self.read = read


Segment = Span | Sequence[int]


@dataclass(frozen=True)
class EncodeWindow:
    """One prefill of ``token_ids``, keeping the KV of each ``(start, length)`` range: what the
    store asks its encoder for, and the engine runs."""

    token_ids: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def single(cls, fact_ids: Sequence[int], context_ids: Sequence[int] = ()) -> EncodeWindow:
        return cls(tuple(context_ids) + tuple(fact_ids), ((len(context_ids), len(fact_ids)),))


class FactSource(Protocol):
    """Turns the handles of a request of ``user_id`` into the spans to inject (the memory store
    is one): everything the engine asks of a source, which it calls directly on every request.

    A source of the caller's own may have less: ``resolve_many`` alone, or only ``resolve(handle,
    user_id)`` (:class:`ResolvesOne`, asked handle by handle). The engine completes it once, when
    it is assigned (:func:`as_fact_source`), with the defaults documented here."""

    #: ``resolve_many(..., defer_cold=True)`` returns :class:`ColdFact` for memories whose KV is
    #: only on disk (default ``False``).
    defers_cold: bool
    #: ``resolve_many(..., held=pred)`` returns a held :class:`Span` (no KV, see there) for each
    #: fact whose span key ``pred`` says the engine holds, and reads no KV for it (default ``False``).
    skips_held: bool
    #: ``resolve_many(..., room=Room(...))`` refuses memories that do not fit the context
    #: (:meth:`Room.check`) before it reads or encodes any KV (default ``False``).
    checks_room: bool

    def resolve_many(self, handles: Sequence[Handle], user_id: str, *, defer_cold: bool = False,
                     held: Callable[[str], bool] | None = None, room: Room | None = None) -> Sequence[Span | TextFact]:
        """The span of every handle, in order. The engine passes only the options whose flag
        above is set (default: the source's ``resolve`` of each handle, no option)."""
        ...

    def prefetch(self, user_id: str, *, limit: int = 256) -> int:
        """Start moving ``user_id``'s ``limit`` most recent memories' KV up to a memory tier, for a
        session about to start; how many reads started (default: none, ``0``)."""
        ...


class ResolvesMany(Protocol):
    """A source of the caller's own that resolves a request's handles together."""

    def resolve_many(self, handles: Sequence[Handle], user_id: str) -> Sequence[Span | TextFact]: ...


class ResolvesOne(Protocol):
    """A source of the caller's own that resolves one handle at a time."""

    def resolve(self, handle: Handle, user_id: str) -> Span | TextFact: ...


#: What ``InferScaleEngine.fact_source`` takes: a :class:`FactSource`, or less.
AnySource = FactSource | ResolvesMany | ResolvesOne

_OPTIONAL = ("defers_cold", "skips_held", "checks_room", "prefetch")


def as_fact_source(source: AnySource) -> FactSource:
    """``source`` itself if it has all of :class:`FactSource`, else ``source`` completed with its
    defaults: once, where it is assigned, so the request path asks no source what it has."""
    if hasattr(source, "resolve_many") and all(hasattr(source, name) for name in _OPTIONAL):
        return source  # type: ignore[return-value]
    return _Completed(source)


class _Completed:
    """A source of the caller's own with :class:`FactSource`'s defaults for what it lacks; every
    other attribute is the source's own (a store's ``tier_speeds`` for the cost model...)."""

    def __init__(self, source: AnySource) -> None:
        self.source = source
        self.defers_cold = bool(getattr(source, "defers_cold", False))
        self.skips_held = bool(getattr(source, "skips_held", False))
        self.checks_room = bool(getattr(source, "checks_room", False))
        many = getattr(source, "resolve_many", None)
        if many is None:
            one = getattr(source, "resolve", None)
            if one is None:
                raise TypeError(f"a fact source needs resolve_many(handles, user_id) or resolve(handle, user_id); "
                                f"{type(source).__name__} has neither")
            many = functools.partial(_each, one)
        self.resolve_many: Callable[..., Sequence[Span | TextFact]] = many
        self.prefetch: Callable[..., int] = getattr(source, "prefetch", _none_prefetched)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)


def _each(resolve: Callable[[Handle, str], Span | TextFact], handles: Sequence[Handle], user_id: str) -> list[Span | TextFact]:
    return [resolve(h, user_id) for h in handles]


def _none_prefetched(user_id: str, *, limit: int = 256) -> int:
    return 0


@dataclass(frozen=True)
class Room:
    """The context a request leaves its memories: its text's tokens and ``max_tokens`` come first."""

    text_tokens: int
    max_tokens: int
    max_model_len: int

    def check(self, from_memory: int) -> None:
        """:class:`ContextOverflowError` unless ``from_memory`` tokens of memories fit too."""
        n = self.text_tokens + from_memory
        if n + self.max_tokens > self.max_model_len:
            raise ContextOverflowError(f"prompt of {n} tokens ({from_memory} from memory) plus max_tokens="
                                       f"{self.max_tokens} exceeds the model's context of {self.max_model_len}")


@dataclass(frozen=True)
class MemoryMix:
    """Where a request's memories came from (the cost model's choice, see docs/engine.md)."""

    injected: int = 0  # KV injected from the device or host tier (or a warm disk file)
    from_disk: int = 0  # KV read from a cold disk file for this request, then injected
    recomputed: int = 0  # prefilled as text: chosen by the cost model or the quality knob, or not encoded yet


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    injected_tokens: int  # prompt tokens whose KV was injected instead of prefilled
    cached_tokens: int  # prompt tokens vLLM's prefix cache already held
    memories_injected: int = 0  # memories whose KV was injected (from a memory tier or disk)
    memories_recomputed: int = 0  # memories prefilled as text (the quality knob's last ones among them)
    memories_as_text: int = 0  # of those, the ones prefilled for want of KV at hand: not encoded yet, cold or cheaper to prefill
    memory_mix: MemoryMix | None = None  # per memory: injected, read from disk, or recomputed

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
