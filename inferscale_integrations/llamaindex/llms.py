"""``InferScaleLLM``: a LlamaIndex ``CustomLLM`` served by the co-located InferScale engine.

``chat`` renders messages with the model's own chat template (``is_chat_model=True``), so
LlamaIndex's query and chat engines send chat messages; ``complete`` sends the prompt as one
user message through that template too (``raw_completion=True`` sends it untouched). Memory
handles anywhere in a prompt or message are resolved for ``user_id`` and injected as KV.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.llm import LLMChatStartEvent, LLMCompletionStartEvent
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from inferscale_engine.errors import (
    ForgedHandleError,
    HandleOwnerError,
    InferScaleError,
    MissingUserError,
    RefusedRequestError,
)
from inferscale_engine.handles import HANDLE_PATTERN
from inferscale_engine.prompting import engine_role, usage_dict
from inferscale_engine.request import GenerationOptions
from inferscale_engine.types import DEFAULT_USER
from inferscale_integrations._common import Recompute, check_user_id, generation_options, warn_foreign_handles
from inferscale_integrations.llamaindex._base import InferScaleComponent
from inferscale_integrations.llamaindex.retrievers import issued_to

if TYPE_CHECKING:
    from inferscale_engine import GenerationResult, InferScaleEngine


@contextmanager
def _refusals_raised() -> Iterator[None]:
    """The engine's refusals as errors LlamaIndex lets through to the user (its synthesizers
    answer "Empty Response" for any ``ValueError``)."""
    try:
        yield
    except ForgedHandleError as exc:
        raise HandleOwnerError(str(exc)) from exc
    except InferScaleError as exc:
        if isinstance(exc, (ValueError, TypeError)):
            raise RefusedRequestError(f"{type(exc).__name__}: {exc}") from exc
        raise


def _extra(result: GenerationResult, model_name: str) -> dict[str, Any]:
    return {
        "model_name": model_name,
        "finish_reason": result.finish_reason,
        "usage": usage_dict(result.usage),
        "ttft_s": result.ttft_s,
        "latency_s": result.latency_s,
    }


def to_engine_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    out = []
    for m in messages:
        role = m.role.value if isinstance(m.role, MessageRole) else str(m.role)
        out.append({"role": engine_role(role), "content": m.content or ""})
    return out


class InferScaleLLM(InferScaleComponent, CustomLLM):
    """LlamaIndex LLM on a co-located InferScale engine.

    Example:
        ```python
        from llama_index.core import Settings
        from inferscale_integrations.llamaindex import InferScaleLLM

        Settings.llm = InferScaleLLM(model="smollm2", user_id="alice", max_tokens=64)
        ```
    """

    model_name: str = Field(default="smollm2", description="Model alias or local model folder.")
    user_id: str | None = Field(
        default=None,
        description="Whose memory handles may be resolved. None: the user an InferScale retriever or memory of "
                    "the same engine recalled the prompt's handles for (set it in apps that serve several users).",
    )
    mode: Literal["inject", "prompt"] = Field(default="inject", description="inject KV, or prefill (baseline).")
    recompute: Recompute = Field(
        default=None,
        description="The quality knob: the last N memories of a prompt are prefilled as text after the injected "
                    "ones (None: the engine's default); at least the prompt's memory count equals pasted memories.",
    )
    temperature: float = Field(default=0.0, ge=0.0)
    max_tokens: int = Field(default=256, gt=0, description="Most tokens generated (metadata.num_output).")
    context_window: int | None = Field(default=None, description="Defaults to the engine's max_model_len.")
    stop: list[str] | None = Field(default=None)
    raw_completion: bool = Field(default=False, description="complete() without the chat template.")
    sampling_kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra vLLM SamplingParams.")

    # user_id=None has a rule of its own here: the user the recalled handles were issued to.
    _WARN_NO_USER = False
    _NAME_FROM_ENGINE = True
    __init__ = InferScaleComponent.__init__  # so that type checkers know engine=, model=

    @classmethod
    def class_name(cls) -> str:
        return "InferScaleLLM"

    def get_engine(self) -> InferScaleEngine:
        """The engine this LLM generates with (built or shared on first use)."""
        return self._engine.get()

    @property
    def metadata(self) -> LLMMetadata:
        window = self.context_window
        if window is None:
            window = int(self.engine_options.get("max_model_len") or 0) or int(self.get_engine().max_model_len)
        return LLMMetadata(
            context_window=window,
            num_output=self.max_tokens,
            is_chat_model=True,
            is_function_calling_model=False,
            model_name=self._engine.model_name,
            system_role=MessageRole.SYSTEM,
        )

    # ------------------------------------------------------------------ requests

    def _user_for(self, payload: Any, user_id: str | None) -> str:
        """Whose handles the request may resolve: ``user_id`` (per call, else the LLM's), checked
        against the users an InferScale retriever or memory recalled the prompt's handles for;
        with none set, the one user they were recalled for."""
        user = self.user_id if user_id is None else check_user_id(user_id)
        texts = [payload] if isinstance(payload, str) else [m["content"] for m in payload]
        handles = [m.group(0) for t in texts for m in HANDLE_PATTERN.finditer(t)]
        if not handles:
            return DEFAULT_USER if user is None else user  # nothing in the prompt is scoped by user
        users = issued_to(self.get_engine().memory, handles)
        if user is not None:
            others = sorted(u for u in users if u is not None and u != user)
            if others:
                # Named in full: this is the app's own retriever, in its own process.
                raise HandleOwnerError(
                    f"InferScaleLLM(user_id={user!r}) got memory handles that an InferScale retriever or memory "
                    f"recalled for user_id {', '.join(map(repr, others))}: give the LLM and the retriever (or "
                    "memory) the same user_id, or leave the LLM's user_id unset to serve the user they recalled for"
                )
            return user
        if len(users) == 1 and None not in users:
            return next(iter(users))  # type: ignore[return-value]
        # Not a ValueError: LlamaIndex's response synthesizers swallow those into "Empty Response".
        raise MissingUserError(
            "InferScaleLLM has no user_id, and the memory handles in its prompt were not all recalled for one "
            "user by an InferScale retriever or memory of this engine: pass InferScaleLLM(user_id=...)"
        )

    def _request(self, kwargs: dict[str, Any], payload: Any) -> tuple[str, GenerationOptions]:
        """The user and the options of one call: the options first, so a bad one is refused
        before the store is read for the prompt's handles."""
        call = {k: v for k, v in kwargs.items() if k not in ("formatted", "tools", "tool_choice")}
        user_id = call.pop("user_id", None)
        fields = {"temperature": self.temperature, "max_tokens": self.max_tokens, "mode": self.mode,
                  "recompute": self.recompute}
        options = generation_options(fields, self.sampling_kwargs, call, stop=self.stop)
        return self._user_for(payload, user_id), options

    def _completion_payload(self, prompt: str, formatted: bool) -> Any:
        if self.raw_completion or formatted:
            return prompt
        return [{"role": "user", "content": prompt}]

    def _completion_response(self, text: str, result: GenerationResult | None, delta: str | None = None) -> CompletionResponse:
        """A completion so far; usage and raw details ride on the one with the final result."""
        return CompletionResponse(
            text=text,
            delta=delta,
            raw=_extra(result, self.metadata.model_name) if result else None,
            additional_kwargs=usage_dict(result.usage) if result else {},
        )

    # ------------------------------------------------------------------ chat

    def _chat_response(self, text: str, result: GenerationResult | None, delta: str | None = None) -> ChatResponse:
        """A chat response so far; usage and raw details ride on the one with the final result."""
        return ChatResponse(
            message=ChatMessage(role=MessageRole.ASSISTANT, content=text),
            delta=delta,
            raw=_extra(result, self.metadata.model_name) if result else None,
            additional_kwargs=usage_dict(result.usage) if result else {},
        )

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        payload = to_engine_messages(messages)
        with _refusals_raised():
            user, options = self._request(kwargs, payload)
            result = self.get_engine().generate(payload, user_id=user, options=options)
        return self._chat_response(result.text, result)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        payload = to_engine_messages(messages)
        with _refusals_raised():
            user, options = self._request(kwargs, payload)
        engine = self.get_engine()

        def gen() -> ChatResponseGen:
            text = ""
            with _refusals_raised():
                for delta in engine.stream(payload, user_id=user, options=options):
                    text += delta.text
                    yield self._chat_response(text, delta.result, delta.text)

        return gen()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        payload = to_engine_messages(messages)
        with _refusals_raised():
            user, options = await asyncio.to_thread(self._request, kwargs, payload)
            engine = await asyncio.to_thread(self.get_engine)
            result = await engine.agenerate(payload, user_id=user, options=options)
        return self._chat_response(result.text, result)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        payload = to_engine_messages(messages)
        with _refusals_raised():
            user, options = await asyncio.to_thread(self._request, kwargs, payload)
        engine = await asyncio.to_thread(self.get_engine)

        async def gen() -> ChatResponseAsyncGen:
            text = ""
            with _refusals_raised():
                async for delta in engine.astream(payload, user_id=user, options=options):
                    text += delta.text
                    yield self._chat_response(text, delta.result, delta.text)

        return gen()

    # ------------------------------------------------------------------ completion

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        payload = self._completion_payload(prompt, formatted)
        with _refusals_raised():
            user, options = self._request(kwargs, payload)
            result = self.get_engine().generate(payload, user_id=user, options=options)
        return self._completion_response(result.text, result)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        payload = self._completion_payload(prompt, formatted)
        with _refusals_raised():
            user, options = self._request(kwargs, payload)
        engine = self.get_engine()

        def gen() -> CompletionResponseGen:
            text = ""
            with _refusals_raised():
                for delta in engine.stream(payload, user_id=user, options=options):
                    text += delta.text
                    yield self._completion_response(text, delta.result, delta.text)

        return gen()

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        payload = self._completion_payload(prompt, formatted)
        with _refusals_raised():
            user, options = await asyncio.to_thread(self._request, kwargs, payload)
            engine = await asyncio.to_thread(self.get_engine)
            result = await engine.agenerate(payload, user_id=user, options=options)
        return self._completion_response(result.text, result)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        payload = self._completion_payload(prompt, formatted)
        with _refusals_raised():
            user, options = await asyncio.to_thread(self._request, kwargs, payload)
        engine = await asyncio.to_thread(self.get_engine)

        async def gen() -> CompletionResponseAsyncGen:
            text = ""
            with _refusals_raised():
                async for delta in engine.astream(payload, user_id=user, options=options):
                    text += delta.text
                    yield self._completion_response(text, delta.result, delta.text)

        return gen()


class HandleGuard(BaseEventHandler):
    """Warns when memory handles reach an LLM that is not InferScale (once per LLM class): such
    an LLM (``MockLLM``, ``OpenAI``…) receives the raw ``<<mem:…>>`` strings without a word."""

    @classmethod
    def class_name(cls) -> str:
        return "InferScaleHandleGuard"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, LLMChatStartEvent):
            texts = [str(m.content) for m in event.messages]
        elif isinstance(event, LLMCompletionStartEvent):
            texts = [event.prompt]
        else:
            return
        name = str(event.model_dict.get("class_name") or "an LLM")
        if name != InferScaleLLM.class_name():
            warn_foreign_handles(name, texts, "Expand them first (inferscale_integrations.expand_handles)")


def register_handle_guard() -> None:
    """Watch every LLM call of the process (LlamaIndex's root instrumentation dispatcher)."""
    dispatcher = get_dispatcher()
    if not any(isinstance(h, HandleGuard) for h in dispatcher.event_handlers):
        dispatcher.add_event_handler(HandleGuard())
