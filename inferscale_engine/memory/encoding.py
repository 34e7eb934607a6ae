"""What the memory store needs from a model, so that it never imports the engine.

The store only tokenizes facts and encodes windows of token ids into KV; anything with these
members will do (:class:`~inferscale_engine.engine.InferScaleEngine` does, structurally, and
so does a test double wrapping it). LLM extraction (``add(..., infer=True)``) needs a chat
model as well: that is a separate, optional :data:`ChatGenerate` callable, so a store can
encode with one model and extract with another, or not extract at all.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from inferscale_engine.config import EngineConfig
from inferscale_engine.kv import FactKV
from inferscale_engine.types import EncodeWindow, GenerationResult, Messages, Mode

#: ``generate(messages, user_id) -> reply text``: the model that extracts facts (``infer=True``).
ChatGenerate = Callable[[list[dict[str, str]], str], str]


class Encoder(Protocol):
    """Tokenizes facts and encodes them into the KV the engine injects."""

    #: Identifies the KV this encoder makes: KV made under another fingerprint is never served.
    fingerprint: str
    max_model_len: int

    def tokenize(self, text: str) -> Sequence[int]: ...

    def encode(
        self, windows: Sequence[EncodeWindow], *, keys: Sequence[Sequence[str | None]] | None = None
    ) -> list[list[FactKV]]:
        """KV of every range of every window; ``keys``: the span key each range's KV will be
        served under (an encoder may keep it ready for that)."""
        ...


class ServingEngine(Encoder, Protocol):
    """An encoder that also chats: what a store built for an engine needs of it
    (:meth:`~inferscale_engine.memory.store.MemoryStore.for_engine`, :func:`engine_generate`)."""

    config: EngineConfig
    tokenizer: Any

    def generate(self, prompt_or_messages: str | Messages, *, user_id: str = ..., max_tokens: int = ...,
                 temperature: float = ..., mode: Mode = ...) -> GenerationResult: ...


def kv_fingerprint(encoder: Encoder | None, window: int, context_prefix: str) -> str | None:
    """What a store's KV depends on besides the fact: the model, the window and the prefix.
    KV stored under another fingerprint is re-encoded, never served."""
    if encoder is None:
        return None
    fingerprint = f"{encoder.fingerprint}-w{window}"
    if context_prefix:
        fingerprint += "-p" + hashlib.sha256(context_prefix.encode()).hexdigest()[:12]
    return fingerprint


def describe(encoder: Any, window: int, context_prefix: str) -> str:
    """The model and settings a store's KV is made under, in words: ``smollm2 (bfloat16, window 5)``."""
    model = getattr(getattr(encoder, "config", None), "model", None) or getattr(encoder, "model_path", None)
    dtype = str(getattr(encoder, "dtype", "") or "").removeprefix("torch.")
    settings = [s for s in (dtype, f"window {window}", "a context prefix" if context_prefix else "") if s]
    return f"{model or type(encoder).__name__} ({', '.join(settings)})"


def device_of(encoder: Any) -> str:
    """Where an encoder's KV lives (``config.device`` of an engine), so the tiers sit beside it."""
    config = getattr(encoder, "config", None)
    return str(getattr(config, "device", None) or "cpu")


def engine_generate(engine: ServingEngine, *, max_tokens: int = 512) -> ChatGenerate:
    """The :data:`ChatGenerate` of a serving engine: a greedy, plain-prompt generation."""

    def generate(messages: list[dict[str, str]], user_id: str) -> str:
        # Conversation text must not be taken for handles by the engine.
        clean = [{"role": m["role"], "content": m["content"].replace("<<mem:", "<< mem:")} for m in messages]
        if getattr(engine.tokenizer, "chat_template", None):
            prompt: Any = clean
        else:
            prompt = "\n\n".join(m["content"] for m in clean) + "\n\nReply:\n"
        return engine.generate(prompt, user_id=user_id, max_tokens=max_tokens, temperature=0.0, mode="prompt").text

    return generate
