"""Request bodies of the OpenAI endpoints (the memory endpoints parse theirs in mem0_api.py).

Own pydantic models rather than vLLM's protocol classes: we accept only what the engine can
honour, and every field we do not know is tolerated (clients such as LangChain send extras),
unless it looks like a misspelling of one we know (:func:`misspelled`), while fields we know but
cannot honour (``n>1``, ``logprobs``, the legacy ``functions``...) are refused with a 400 by
:func:`unsupported`. Tools are checked for shape here and for meaning
(a ``tool_choice`` of a tool the request has...) in tools.py.
"""

from __future__ import annotations

import difflib
import functools
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr


class _Lenient(BaseModel):
    # Python's JSON reads NaN, Infinity and 1e309 (as infinity): never a valid number here.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class ContentPart(_Lenient):
    type: StrictStr
    text: StrictStr | None = None


class FunctionCall(_Lenient):
    name: StrictStr
    #: A JSON object as a string, as OpenAI sends it (an object itself is taken too).
    arguments: StrictStr | dict[str, Any]


class MessageToolCall(_Lenient):
    """A call of an earlier assistant message, sent back with the conversation."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Lenient):
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    #: JSON schema of the arguments (none: the function takes none).
    parameters: dict[str, Any] | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class ToolName(_Lenient):
    name: StrictStr


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: ToolName


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        out = []
        for part in self.content:
            if part.type not in ("text", "input_text") or part.text is None:
                raise ValueError(f"content parts of type {part.type!r} are not supported (text only)")
            out.append(part.text)
        return "".join(out)


class StreamOptions(_Lenient):
    include_usage: StrictBool = False


class _SamplingRequest(_Lenient):
    model: StrictStr
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: StrictInt | None = Field(default=None, ge=1)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    user: StrictStr | None = None
    #: OpenAI's newer per-user field; taken as the user when ``user`` is absent.
    safety_identifier: StrictStr | None = None
    logit_bias: dict[str, float] | None = None
    #: InferScale extension, the quality knob: the last N memories of the prompt are prefilled as
    #: text after the injected ones (default: the server's ``--recompute``). Its range is the
    #: engine's one rule (``GenerationOptions``), so HTTP refuses what Python does, in its words.
    recompute: StrictInt | None = None

    def stop_list(self) -> list[str] | None:
        if self.stop is None:
            return None
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s] or None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    #: InferScale extension: recall this many of ``user``'s memories for the last user message
    #: and put their handles into the system message (what ``inferscale chat`` does).
    memory_k: StrictInt | None = Field(default=None, ge=0, le=64)


class CompletionRequest(_SamplingRequest):
    prompt: StrictStr | list[StrictStr]
    echo: StrictBool | None = None
    logprobs: StrictInt | None = None
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None


#: How close an unknown field's name must be to a known one to be taken for a typo of it. Above
#: what the extras of OpenAI's and vLLM's APIs come to (``top_k`` and ``min_tokens`` are 0.8 from
#: ``top_p`` and ``max_tokens``); ``recompte`` is 0.94 from ``recompute``.
_TYPO_CUTOFF = 0.85


def _fold(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


@functools.cache
def _folded_fields(cls: type[BaseModel]) -> dict[str, str]:
    return {_fold(name): name for name in cls.model_fields}


def misspelled(req: BaseModel) -> tuple[str, str] | None:
    """(field, the known field it stands for) for the first unknown field of ``req`` that looks
    like a misspelling of a known one (the same name but for case, ``_`` and ``-``, or a close
    match): ``memory_K`` would otherwise turn memory recall off without a word. Other unknown
    fields stay tolerated."""
    if not req.model_extra:
        return None
    folded = _folded_fields(type(req))
    for name in req.model_extra:
        known = folded.get(_fold(name)) or next(iter(difflib.get_close_matches(name, type(req).model_fields, 1, _TYPO_CUTOFF)), None)
        if known is not None:
            return name, known
    return None


def unsupported(req: ChatCompletionRequest | CompletionRequest) -> tuple[str, str] | None:
    """(param, message) for the first field set to something this server cannot do."""
    if req.n not in (None, 1):
        return "n", "only n=1 is supported"
    if req.logit_bias:
        return "logit_bias", "logit_bias is not supported"
    if isinstance(req, ChatCompletionRequest):
        if req.functions or req.function_call is not None:
            return (("functions" if req.functions else "function_call"),
                    "the legacy 'functions' / 'function_call' parameters are not supported: send 'tools' and 'tool_choice'")
        if req.logprobs:
            return "logprobs", "logprobs are not supported"
    else:
        if req.echo:
            return "echo", "echo is not supported"
        if req.logprobs:
            return "logprobs", "logprobs are not supported"
        if req.suffix:
            return "suffix", "suffix is not supported"
        if req.best_of not in (None, 1):
            return "best_of", "only best_of=1 is supported"
    return None
