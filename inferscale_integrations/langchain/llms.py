"""``InferScaleLLM``: a LangChain text-completion LLM served by the co-located InferScale engine.

Prompts go to the model as they are (no chat template) unless ``chat_template=True``, which
sends each prompt as one user message; memory handles in a prompt are resolved for ``user_id``
and injected as KV. ``batch`` submits all prompts at once so vLLM batches them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models.llms import LLM, LangSmithParams
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import ConfigDict, Field, model_validator

from inferscale_integrations._common import check_arguments, model_name_of, pydantic_fields
from inferscale_integrations.langchain.chat_models import (
    PROVIDER,
    engine_for,
    sampling_options,
    usage_metadata,
)

if TYPE_CHECKING:
    from inferscale_engine import GenerationResult, InferScaleEngine, StreamDelta


class InferScaleLLM(LLM):
    """Completion LLM on a co-located InferScale engine.

    Example:
        ```python
        from inferscale_integrations.langchain import InferScaleLLM

        llm = InferScaleLLM(model="smollm2", chat_template=True, max_tokens=32)
        llm.invoke("Name a colour.")
        ```
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    model_name: str = Field(default="smollm2", alias="model")
    engine: Any = Field(default=None, exclude=True)
    engine_options: dict[str, Any] = Field(default_factory=dict)
    user_id: str = "default"
    mode: Literal["inject", "prompt"] = "inject"
    recompute: int | None = Field(default=None, ge=0)
    """The quality knob: the last ``recompute`` memories of a prompt are prefilled as text after
    the injected ones (None: the engine's default). More costs prefill and answers closer to
    pasted memories; at least the prompt's memory count reproduces them exactly."""
    chat_template: bool = False
    """Send each prompt as a single user message through the model's chat template."""
    temperature: float = 0.0
    max_tokens: int = 256
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra vLLM ``SamplingParams``."""
    streaming: bool = False

    @model_validator(mode="before")
    @classmethod
    def _check_arguments(cls, data: Any) -> Any:
        check_arguments(cls, data, pydantic_fields(cls))
        return data

    @property
    def _llm_type(self) -> str:
        return "inferscale"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": model_name_of(self.engine, self.model_name),
            "mode": self.mode,
            "chat_template": self.chat_template,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": self.stop,
            **self.model_kwargs,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider=PROVIDER,
            ls_model_name=kwargs.get("model") or model_name_of(self.engine, self.model_name),
            ls_model_type="llm",
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_tokens", self.max_tokens),
        )
        stop = stop or self.stop
        if stop:
            params["ls_stop"] = stop
        return params

    def get_engine(self, model: str | None = None) -> InferScaleEngine:
        """The engine this model generates with (built or shared on first use)."""
        return engine_for(self, model)

    def _request(self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
        kwargs = dict(kwargs)
        engine = self.get_engine(kwargs.pop("model", None))
        sampling = sampling_options(self, stop, kwargs)
        payload: Any = [{"role": "user", "content": prompt}] if self.chat_template else prompt
        return engine, payload, sampling

    def _generation(self, result: GenerationResult) -> Generation:
        return Generation(
            text=result.text,
            generation_info={
                "finish_reason": result.finish_reason,
                "usage_metadata": usage_metadata(result),
                "injected_tokens": result.usage.injected_tokens,
                "ttft_s": result.ttft_s,
                "latency_s": result.latency_s,
            },
        )

    def _chunk(self, delta: StreamDelta) -> GenerationChunk | None:
        """A streamed piece; the last one carries the generation info, empty pieces are skipped."""
        if delta.result is not None:
            return GenerationChunk(text=delta.text, generation_info=self._generation(delta.result).generation_info)
        return GenerationChunk(text=delta.text) if delta.text else None

    def _llm_output(self, results: list[GenerationResult]) -> dict[str, Any]:
        return {
            "model_name": model_name_of(self.engine, self.model_name),
            "token_usage": {
                "prompt_tokens": sum(r.usage.prompt_tokens for r in results),
                "completion_tokens": sum(r.usage.completion_tokens for r in results),
                "total_tokens": sum(r.usage.total_tokens for r in results),
                "injected_tokens": sum(r.usage.injected_tokens for r in results),
                "cached_tokens": sum(r.usage.cached_tokens for r in results),
            },
        }

    def _call(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> str:
        engine, payload, sampling = self._request(prompt, stop, kwargs)
        return engine.generate(payload, **sampling).text

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        if self.streaming:
            return super()._generate(prompts, stop=stop, run_manager=run_manager, **kwargs)

        def one(prompt: str) -> GenerationResult:
            engine, payload, sampling = self._request(prompt, stop, kwargs)
            return engine.generate(payload, **sampling)

        # Submitting every prompt at once lets vLLM batch them in one engine loop.
        if len(prompts) == 1:
            results = [one(prompts[0])]
        else:
            with ThreadPoolExecutor(max_workers=min(len(prompts), 32)) as pool:
                results = list(pool.map(one, prompts))
        return LLMResult(generations=[[self._generation(r)] for r in results], llm_output=self._llm_output(results))

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        if self.streaming:
            return await super()._agenerate(prompts, stop=stop, run_manager=run_manager, **kwargs)

        async def one(prompt: str) -> GenerationResult:
            engine, payload, sampling = await asyncio.to_thread(self._request, prompt, stop, kwargs)
            return await engine.agenerate(payload, **sampling)

        results = list(await asyncio.gather(*(one(p) for p in prompts)))
        return LLMResult(generations=[[self._generation(r)] for r in results], llm_output=self._llm_output(results))

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        engine, payload, sampling = self._request(prompt, stop, kwargs)
        for delta in engine.stream(payload, **sampling):
            chunk = self._chunk(delta)
            if chunk is None:
                continue
            if run_manager:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        engine, payload, sampling = await asyncio.to_thread(self._request, prompt, stop, kwargs)
        async for delta in engine.astream(payload, **sampling):
            chunk = self._chunk(delta)
            if chunk is None:
                continue
            if run_manager:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk
