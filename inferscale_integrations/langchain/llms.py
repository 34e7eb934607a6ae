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
from pydantic import Field

from inferscale_engine.prompting import usage_dict
from inferscale_integrations._common import Recompute
from inferscale_integrations.langchain._base import InferScaleModelBase
from inferscale_integrations.langchain.chat_models import (
    call_options,
    identifying_params,
    ls_params,
    usage_metadata,
)

if TYPE_CHECKING:
    from inferscale_engine import InferScaleEngine, StreamDelta
    from inferscale_engine.request import GenerationOptions


class InferScaleLLM(InferScaleModelBase, LLM):
    """Completion LLM on a co-located InferScale engine.

    Example:
        ```python
        from inferscale_integrations.langchain import InferScaleLLM

        llm = InferScaleLLM(model="smollm2", chat_template=True, max_tokens=32)
        llm.invoke("Name a colour.")
        ```
    """

    _MODEL_FIELD = "model_name"

    model_name: str = Field(default="smollm2", alias="model")
    """Model alias (``"smollm2"``) or local model folder."""
    mode: Literal["inject", "prompt"] = "inject"
    recompute: Recompute = None
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

    @property
    def _llm_type(self) -> str:
        return "inferscale"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return identifying_params(self, self._engine.model_name, chat_template=self.chat_template)

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return ls_params(self, "llm", self._engine.model_name, stop, kwargs)

    def get_engine(self, model: str | None = None) -> InferScaleEngine:
        """The engine this model generates with (built or shared on first use)."""
        return self._engine.get(model)

    def _request(self, prompt: str, stop: list[str] | None,
                 kwargs: dict[str, Any]) -> tuple[InferScaleEngine, Any, str, GenerationOptions]:
        """The engine, the payload, the user and the options of one prompt."""
        kwargs = dict(kwargs)
        model = kwargs.pop("model", None)
        user, options = call_options(self, stop, kwargs)  # first: a bad option builds no engine
        payload: Any = [{"role": "user", "content": prompt}] if self.chat_template else prompt
        return self.get_engine(model), payload, user, options

    def _chunk(self, delta: StreamDelta) -> GenerationChunk | None:
        """A streamed piece; the last one carries the generation info, empty pieces are skipped."""
        result = delta.result
        if result is None:
            return GenerationChunk(text=delta.text) if delta.text else None
        return GenerationChunk(
            text=delta.text,
            generation_info={
                "finish_reason": result.finish_reason,
                "usage_metadata": usage_metadata(result),
                "injected_tokens": result.usage.injected_tokens,
                "ttft_s": result.ttft_s,
                "latency_s": result.latency_s,
                "token_usage": usage_dict(result.usage),
            },
        )

    def _llm_output(self, generations: list[Generation]) -> dict[str, Any]:
        usages = [(g.generation_info or {}).get("token_usage") or {} for g in generations]
        keys = ("prompt_tokens", "completion_tokens", "total_tokens", "injected_tokens", "cached_tokens",
                "memories_injected", "memories_recomputed")
        return {
            "model_name": self._engine.model_name,
            "token_usage": {k: sum(int(u.get(k, 0)) for u in usages) for k in keys},
        }

    def _call(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> str:
        return _added_up(self._stream(prompt, stop=stop, run_manager=run_manager, **kwargs)).text

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        def one(prompt: str) -> Generation:
            return _added_up(self._stream(prompt, stop=stop, run_manager=run_manager, **kwargs))

        # Submitting every prompt at once lets vLLM batch them in one engine loop.
        if len(prompts) == 1:
            generations = [one(prompts[0])]
        else:
            with ThreadPoolExecutor(max_workers=min(len(prompts), 32)) as pool:
                generations = list(pool.map(one, prompts))
        return LLMResult(generations=[[g] for g in generations], llm_output=self._llm_output(generations))

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        async def one(prompt: str) -> Generation:
            chunks = [c async for c in self._astream(prompt, stop=stop, run_manager=run_manager, **kwargs)]
            return _added_up(iter(chunks))

        generations = list(await asyncio.gather(*(one(p) for p in prompts)))
        return LLMResult(generations=[[g] for g in generations], llm_output=self._llm_output(generations))

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        engine, payload, user, options = self._request(prompt, stop, kwargs)
        for delta in engine.stream(payload, user_id=user, options=options):
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
        engine, payload, user, options = await asyncio.to_thread(self._request, prompt, stop, kwargs)
        async for delta in engine.astream(payload, user_id=user, options=options):
            chunk = self._chunk(delta)
            if chunk is None:
                continue
            if run_manager:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk


def _added_up(chunks: Iterator[GenerationChunk]) -> Generation:
    """One generation from its streamed pieces (the last carries the generation info)."""
    final: GenerationChunk | None = None
    for chunk in chunks:
        final = chunk if final is None else final + chunk
    if final is None:
        return Generation(text="")
    return Generation(text=final.text, generation_info=final.generation_info)
