"""``ChatInferScale``: a LangChain chat model served by the co-located InferScale engine.

Modelled on ``langchain_openai.ChatOpenAI``: the same standard parameters (``model``,
``temperature``, ``max_tokens``, ``stop``, ``streaming``...), sync and async invoke / batch /
stream, and ``usage_metadata`` on every answer. Memory handles (``<<mem:…>>``) anywhere in the
messages are resolved for ``user_id`` and their facts' KV is injected instead of prefilled.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.chat_models import (
    BaseChatModel,
    LangSmithParams,
    agenerate_from_stream,
    generate_from_stream,
)
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from inferscale_integrations._common import EngineRef, check_arguments, pydantic_fields
from inferscale_integrations.langchain._messages import (
    parse_tool_calls,
    to_engine_messages,
)

if TYPE_CHECKING:
    from inferscale_engine import GenerationResult, InferScaleEngine

PROVIDER = "inferscale"
#: kwargs LangChain itself may pass down to ``_generate`` that are not sampling parameters.
_FRAMEWORK_KWARGS = ("ls_structured_output_format", "response_format", "parallel_tool_calls", "strict")


def usage_metadata(result: GenerationResult) -> UsageMetadata:
    """LangChain usage from the engine's; the input details split the prompt tokens not prefilled.

    ``input_token_details["injected"]``: prompt tokens whose KV was injected from memory facts
    (and the static text around them). ``input_token_details["cache_read"]``: the other prompt
    tokens vLLM's prefix cache already held. vLLM counts injected KV among its cached tokens, so
    ``cache_read = cached - injected``; the two add up to the tokens that cost no prefill and
    never exceed ``input_tokens``.
    """
    u = result.usage
    injected = int(u.injected_tokens)
    details = InputTokenDetails(cache_read=max(0, int(u.cached_tokens) - injected))
    details["injected"] = injected  # type: ignore[typeddict-unknown-key]
    return UsageMetadata(
        input_tokens=int(u.prompt_tokens),
        output_tokens=int(u.completion_tokens),
        total_tokens=int(u.prompt_tokens + u.completion_tokens),
        input_token_details=details,
    )


def response_metadata(result: GenerationResult, model_name: str) -> dict[str, Any]:
    return {
        "model_name": model_name,
        "model_provider": PROVIDER,
        "finish_reason": result.finish_reason,
        "injected_tokens": result.usage.injected_tokens,
        "cached_tokens": result.usage.cached_tokens,
        "ttft_s": result.ttft_s,
        "latency_s": result.latency_s,
    }


class ChatInferScale(BaseChatModel):
    """Chat model on a co-located InferScale engine (vLLM + KV injection of memory facts).

    Example:
        ```python
        from inferscale_integrations.langchain import ChatInferScale

        llm = ChatInferScale(model="smollm2", user_id="alice", max_tokens=64)
        llm.invoke("Hello!")
        ```

    Args:
        model: model alias or local folder; engines are shared per model per process.
        engine: an existing ``InferScaleEngine`` (wins over ``model``).
        user_id: whose memory handles this model may resolve (per call: ``invoke(..., user_id=)``).
        mode: ``"inject"`` (facts' KV injected) or ``"prompt"`` (same tokens, prefilled: the
            text-pasting baseline).
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    model_name: str = Field(default="smollm2", alias="model")
    """Model alias (``"smollm2"``) or local model folder."""
    engine_options: dict[str, Any] = Field(default_factory=dict)
    """Options for building the engine (``max_model_len``, ``window``...) when this class builds it."""
    user_id: str = "default"
    mode: Literal["inject", "prompt"] = "inject"
    recompute: int | None = Field(default=None, ge=0)
    """The quality knob: the last ``recompute`` memories of a prompt are prefilled as text after
    the injected ones (None: the engine's default). More costs prefill and answers closer to
    pasted memories; at least the prompt's memory count reproduces them exactly."""
    temperature: float = 0.0
    max_tokens: int | None = Field(default=256, alias="max_completion_tokens")
    """Most tokens to generate (None: 256)."""
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra vLLM ``SamplingParams`` (``min_tokens``, ``repetition_penalty``...)."""
    streaming: bool = False
    """Accepted for ChatOpenAI compatibility: every answer is generated through ``_stream``
    (callbacks see every token)."""
    timeout: float | None = None
    """Accepted for ChatOpenAI compatibility; a co-located engine has no network timeout."""
    max_retries: int = 0
    """Accepted for ChatOpenAI compatibility; local generation is not retried."""
    api_key: SecretStr | None = None
    """Accepted for ChatOpenAI compatibility and ignored (there is no API)."""

    @model_validator(mode="before")
    @classmethod
    def _check_arguments(cls, data: Any) -> Any:
        check_arguments(cls, data, pydantic_fields(cls))
        return data

    _engine: EngineRef = PrivateAttr()

    def __init__(self, *, engine: InferScaleEngine | None = None, **kwargs: Any) -> None:
        """``engine``: an ``InferScaleEngine`` to use instead of the shared engine of ``model``."""
        super().__init__(**kwargs)
        self._engine = EngineRef(engine, self.model_name, self.engine_options)

    # ------------------------------------------------------------------ LangChain plumbing

    @property
    def _llm_type(self) -> str:
        return "inferscale-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return identifying_params(self, self._engine.model_name, recompute=self.recompute)

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return ls_params(self, "chat", self._engine.model_name, stop, kwargs)

    def get_engine(self, model: str | None = None) -> InferScaleEngine:
        """The engine this model generates with (built or shared on first use); ``model``: the
        shared engine of another model (a per-call ``model=``)."""
        return self._engine.get(model)

    # ------------------------------------------------------------------ requests

    def _request(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> tuple[InferScaleEngine, list[dict[str, str]], dict[str, Any], list[str], str]:
        kwargs = dict(kwargs)
        for key in _FRAMEWORK_KWARGS:
            kwargs.pop(key, None)
        model = kwargs.pop("model", None)
        tools = kwargs.pop("tools", None) or []
        tool_choice = kwargs.pop("tool_choice", None)
        engine = self.get_engine(model)
        sampling = sampling_options(self, stop, kwargs)
        engine_messages = to_engine_messages(messages, tools=tools, tool_choice=tool_choice)
        tool_names = [(t.get("function") or t).get("name") for t in tools]
        return engine, engine_messages, sampling, tool_names, model or self._engine.model_name

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return _with_llm_output(generate_from_stream(self._stream(messages, stop=stop, run_manager=run_manager, **kwargs)))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        stream = self._astream(messages, stop=stop, run_manager=run_manager, **kwargs)
        return _with_llm_output(await agenerate_from_stream(stream))

    def _final_chunk(self, text: str, result: GenerationResult, tool_names: list[str], model_name: str) -> ChatGenerationChunk:
        chunk = AIMessageChunk(
            content=text,
            usage_metadata=usage_metadata(result),
            response_metadata=response_metadata(result, model_name),
            chunk_position="last",
        )
        return ChatGenerationChunk(message=chunk, generation_info={"finish_reason": result.finish_reason})

    def _tool_chunk(self, result: GenerationResult, tool_names: list[str], model_name: str) -> ChatGenerationChunk:
        """With tools bound, the answer is parsed whole and sent as one last chunk."""
        import json

        text, calls = parse_tool_calls(result.text, tool_names)
        chunk = AIMessageChunk(
            content=text,
            tool_call_chunks=[
                tool_call_chunk(name=c["name"], args=json.dumps(c["args"]), id=c["id"], index=i)
                for i, c in enumerate(calls)
            ],
            usage_metadata=usage_metadata(result),
            response_metadata=response_metadata(result, model_name),
            chunk_position="last",
        )
        return ChatGenerationChunk(message=chunk, generation_info={"finish_reason": result.finish_reason})

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        engine, msgs, sampling, tool_names, model_name = self._request(messages, stop, kwargs)
        if tool_names:
            chunk = self._tool_chunk(engine.generate(msgs, **sampling), tool_names, model_name)
            if run_manager:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk
            return
        for delta in engine.stream(msgs, **sampling):
            if delta.result is not None:
                chunk = self._final_chunk(delta.text, delta.result, tool_names, model_name)
            elif delta.text:
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta.text))
            else:
                continue
            if run_manager:
                run_manager.on_llm_new_token(delta.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        engine, msgs, sampling, tool_names, model_name = await asyncio.to_thread(self._request, messages, stop, kwargs)
        if tool_names:
            chunk = self._tool_chunk(await engine.agenerate(msgs, **sampling), tool_names, model_name)
            if run_manager:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk
            return
        async for delta in engine.astream(msgs, **sampling):
            if delta.result is not None:
                chunk = self._final_chunk(delta.text, delta.result, tool_names, model_name)
            elif delta.text:
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta.text))
            else:
                continue
            if run_manager:
                await run_manager.on_llm_new_token(delta.text, chunk=chunk)
            yield chunk

    # ------------------------------------------------------------------ tools

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: dict | str | bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Prompt-based tool calling (see :mod:`._messages`): schemas go in a system message and
        ``<tool_call>`` blocks in the answer become ``AIMessage.tool_calls``.

        ``tool_choice`` (``"auto"``, ``"any"``/``"required"``, a tool name, ``"none"``) is an
        instruction to the model, not a constraint on decoding: a small model may ignore it.
        """
        formatted = [convert_to_openai_tool(t) for t in tools]
        if tool_choice is not None:
            kwargs["tool_choice"] = tool_choice
        return super().bind(tools=formatted, **kwargs)


def _with_llm_output(result: ChatResult) -> ChatResult:
    """``llm_output`` as ``ChatOpenAI`` gives it, from the message the stream added up to."""
    message = result.generations[0].message
    result.llm_output = {
        "model_name": message.response_metadata.get("model_name"),
        "token_usage": getattr(message, "usage_metadata", None),
    }
    return result


def identifying_params(model: Any, model_name: str, **extra: Any) -> dict[str, Any]:
    """``_identifying_params`` of a LangChain InferScale model (``extra``: its own settings)."""
    return {
        "model_name": model_name,
        "mode": model.mode,
        **extra,
        "temperature": model.temperature,
        "max_tokens": model.max_tokens,
        "top_p": model.top_p,
        "seed": model.seed,
        "stop": model.stop,
        **model.model_kwargs,
    }


def ls_params(model: Any, model_type: Literal["chat", "llm"], model_name: str, stop: list[str] | None,
              kwargs: dict[str, Any]) -> LangSmithParams:
    """``_get_ls_params`` of a LangChain InferScale model: per-call kwargs win over its fields."""
    params = LangSmithParams(
        ls_provider=PROVIDER,
        ls_model_name=kwargs.get("model") or model_name,
        ls_model_type=model_type,
        ls_temperature=kwargs.get("temperature", model.temperature),
    )
    max_tokens = kwargs.get("max_tokens", model.max_tokens)
    if max_tokens is not None:
        params["ls_max_tokens"] = max_tokens
    stop = stop or kwargs.get("stop") or model.stop
    if stop:
        params["ls_stop"] = stop
    return params


def sampling_options(model: Any, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Engine keyword arguments: the model's fields, then ``model_kwargs``, then per-call kwargs;
    an explicit ``stop`` wins over both."""
    sampling: dict[str, Any] = {
        "temperature": model.temperature,
        "max_tokens": model.max_tokens if model.max_tokens is not None else 256,
        "user_id": model.user_id,
        "mode": model.mode,
    }
    if model.recompute is not None:
        sampling["recompute"] = model.recompute
    if model.top_p is not None:
        sampling["top_p"] = model.top_p
    if model.seed is not None:
        sampling["seed"] = model.seed
    sampling.update(model.model_kwargs)
    sampling.update(kwargs)
    stops = stop if stop is not None else sampling.pop("stop", None) or model.stop
    sampling.pop("stop", None)
    if stops:
        sampling["stop"] = list(stops)
    return sampling
