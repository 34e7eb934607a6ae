"""``ChatInferScale``: a LangChain chat model served by the co-located InferScale engine.

Modelled on ``langchain_openai.ChatOpenAI``: the same standard parameters (``model``,
``temperature``, ``max_tokens``, ``stop``, ``streaming``...), sync and async invoke / batch /
stream, and ``usage_metadata`` on every answer. Memory handles (``<<mem:…>>``) anywhere in the
messages are resolved for ``user_id`` and their facts' KV is injected instead of prefilled.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from operator import itemgetter
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
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticToolsParser
from langchain_core.output_parsers.pydantic import PydanticOutputParser
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, Field, SecretStr

from inferscale_engine import tool_calls as tc
from inferscale_engine.prompting import structured_options
from inferscale_engine.request import GenerationOptions
from inferscale_integrations._common import Recompute, check_user_id, generation_options
from inferscale_integrations.langchain._base import InferScaleModelBase
from inferscale_integrations.langchain._messages import langchain_call_chunks, openai_message

if TYPE_CHECKING:
    from inferscale_engine import GenerationResult, InferScaleEngine, StreamDelta

PROVIDER = "inferscale"
#: kwargs LangChain itself may pass down to ``_generate`` that are not sampling parameters.
_FRAMEWORK_KWARGS = ("ls_structured_output_format", "strict")


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


class ChatInferScale(InferScaleModelBase, BaseChatModel):
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

    _MODEL_FIELD = "model_name"

    model_name: str = Field(default="smollm2", alias="model")
    """Model alias (``"smollm2"``) or local model folder."""
    mode: Literal["inject", "prompt"] = "inject"
    recompute: Recompute = None
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

    def _request(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> _Request:
        kwargs = dict(kwargs)
        for key in _FRAMEWORK_KWARGS:
            kwargs.pop(key, None)
        model = kwargs.pop("model", None)
        tools = list(kwargs.pop("tools", None) or [])
        tool_choice = kwargs.pop("tool_choice", None)
        parallel = kwargs.pop("parallel_tool_calls", None) is not False
        structured = structured_options(kwargs.pop("response_format", None))
        user, options = call_options(self, stop, kwargs)  # first: a bad option builds no engine
        engine = self.get_engine(model)
        native = tc.template_renders_tools(engine.tokenizer)
        use = tc.use_tools([openai_message(m) for m in messages], tools, tool_choice, parallel=parallel,
                           structured=structured, native=native)
        if use.structured:  # the tools' constraint (a forced call, a response format)
            options = dataclasses.replace(options, structured=use.structured)
        return _Request(engine=engine, use=use, user_id=user, options=options,
                        model_name=model or self._engine.model_name)

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

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        req = self._request(messages, stop, kwargs)
        chunks = _Chunker(req)
        for delta in req.engine.stream(req.use.messages, tools=req.use.tools, user_id=req.user_id, options=req.options):
            chunk = chunks.chunk(delta)
            if chunk is None:
                continue
            if run_manager:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        req = await asyncio.to_thread(self._request, messages, stop, kwargs)
        chunks = _Chunker(req)
        async for delta in req.engine.astream(req.use.messages, tools=req.use.tools, user_id=req.user_id, options=req.options):
            chunk = chunks.chunk(delta)
            if chunk is None:
                continue
            if run_manager:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    # ------------------------------------------------------------------ tools

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: dict | str | bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Tools for the model: the chat template renders them (Qwen2.5, Llama 3.1...; else a
        system message lists them) and the answer's calls become ``AIMessage.tool_calls``.

        ``tool_choice``: ``"auto"`` (default: the model decides), ``"none"``, ``"any"`` /
        ``"required"`` (some tool), or a tool's name / ``{"type": "function", "function":
        {"name": ...}}``. A forced choice is enforced by guided decoding (vLLM structured
        outputs): the answer is then exactly one well-formed call to an allowed tool.
        """
        formatted = [convert_to_openai_tool(t) for t in tools]
        if tool_choice is not None:
            tc.chosen_tools(formatted, tool_choice)  # a choice naming no bound tool fails here, not later
            kwargs["tool_choice"] = tool_choice
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: bool = False,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict | BaseModel]:
        """The answer as ``schema`` (a pydantic class, a ``TypedDict``, a JSON schema or an
        OpenAI tool), guaranteed well-formed by guided decoding.

        ``method``: ``"json_schema"`` (the answer is constrained to the schema),
        ``"function_calling"`` (a forced call of a tool shaped like the schema, through
        :meth:`bind_tools`), ``"json_mode"`` (any JSON object: say which keys in the prompt).
        ``include_raw=True`` returns ``{"raw", "parsed", "parsing_error"}``.
        """
        kwargs.pop("strict", None)  # guided decoding is always strict
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        if schema is None and method != "json_mode":
            raise ValueError(f"schema is needed with method={method!r}")
        ls_format = {"kwargs": {"method": method}, "schema": schema}
        parser: Runnable
        if method == "function_calling":
            assert schema is not None
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, ls_structured_output_format=ls_format, **kwargs)
            parser = (PydanticToolsParser(tools=[schema], first_tool_only=True) if is_pydantic  # type: ignore[list-item]
                      else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        elif method in ("json_schema", "json_mode"):
            if method == "json_schema":
                assert schema is not None
                function = convert_to_openai_tool(schema)["function"]
                response_format = {"type": "json_schema",
                                   "json_schema": {"name": function["name"], "schema": function.get("parameters", {})}}
            else:
                response_format = {"type": "json_object"}
            llm = self.bind(response_format=response_format, ls_structured_output_format=ls_format, **kwargs)
            parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()  # type: ignore[arg-type]
        else:
            raise ValueError(f"method must be 'json_schema', 'function_calling' or 'json_mode', got {method!r}")
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        failed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([failed], exception_key="parsing_error")


@dataclass
class _Request:
    """One generation as the engine takes it."""

    engine: InferScaleEngine
    use: tc.ToolUse  # the messages, tools and output constraint; how the answer is read for calls
    user_id: str
    options: GenerationOptions
    model_name: str


class _Chunker:
    """Engine stream deltas → LangChain chunks: text as it comes (held back where a tool call may
    be starting), then a last chunk with the rest, the tool calls, usage and metadata."""

    def __init__(self, req: _Request) -> None:
        self.req = req
        self.calls = req.use.reader()

    def chunk(self, delta: StreamDelta) -> ChatGenerationChunk | None:
        text = self.calls.feed(delta.text) if self.calls is not None else delta.text
        result = delta.result
        if result is None:
            return ChatGenerationChunk(message=AIMessageChunk(content=text)) if text else None
        found: list[tc.ToolCall] = []
        if self.calls is not None:
            rest, found = self.calls.finish()
            text += rest
        message = AIMessageChunk(
            content=text,
            tool_call_chunks=langchain_call_chunks(found),
            usage_metadata=usage_metadata(result),
            response_metadata=response_metadata(result, self.req.model_name),
            chunk_position="last",
        )
        finish_reason = "tool_calls" if found else result.finish_reason
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": finish_reason})


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


def call_options(model: Any, stop: list[str] | None, kwargs: dict[str, Any]) -> tuple[str, GenerationOptions]:
    """The user and the options of one call of a LangChain InferScale model: its fields, then
    ``model_kwargs``, then per-call kwargs; an explicit ``stop`` wins over both. Both are checked
    here, before any engine is built or looked up."""
    call = dict(kwargs)
    # per call: the rule the model's own user_id was held to
    user = check_user_id(call.pop("user_id")) if "user_id" in call else model.user_id
    if stop is not None:
        call["stop"] = stop
    fields = {"temperature": model.temperature, "max_tokens": model.max_tokens, "mode": model.mode,
              "recompute": model.recompute, "top_p": model.top_p, "seed": model.seed}
    return user, generation_options(fields, model.model_kwargs, call, stop=model.stop)
