"""A ``vllm serve`` of another process as the engine's vLLM: requests go over its HTTP API.

The server runs InferScale's connector (``--kv-transfer-config '{"kv_connector":
"InferScaleConnector", "kv_connector_module_path": "inferscale_engine.connector",
"kv_role": "kv_both"}'``) on this host. This process keeps the facts: it stages their KV in
shared memory and sends token-id prompts whose ``kv_transfer_params`` say where it lies; fact
encoding is a request whose ``kv_transfer_params`` ask for capture. vLLM's OpenAI completion
API carries ``kv_transfer_params`` both ways (the injected token count comes back in a
non-streamed response only, so requests are not streamed: a whole reply arrives at once).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.request
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from inferscale_engine.errors import EngineSettingsError, InferScaleError
from inferscale_engine.loop import Listener, ThreadedAsyncLoop

if TYPE_CHECKING:
    from vllm import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Logprob:
    logprob: float


@dataclass
class _Completion:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, _Logprob]] | None = None


@dataclass
class RemoteOutput:
    """The fields of vLLM's ``RequestOutput`` the engine reads, from a completion response."""

    request_id: str
    outputs: list[_Completion]
    kv_transfer_params: dict[str, Any] | None
    num_cached_tokens: int = 0
    finished: bool = True
    prompt_token_ids: list[int] = field(default_factory=list)


def server_info(url: str, timeout: float = 10.0) -> dict[str, Any]:
    """The served model's id and context length, from ``GET /v1/models``."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/v1/models", timeout=timeout) as reply:
            models = json.load(reply)["data"]
    except (OSError, ValueError, KeyError) as exc:
        raise EngineSettingsError(f"no vLLM server answers at {url}: {exc}") from None
    if not models:
        raise EngineSettingsError(f"the vLLM server at {url} serves no model")
    return {"id": models[0]["id"], "max_model_len": int(models[0].get("max_model_len") or 0)}


class RemoteLoop(ThreadedAsyncLoop):
    """Sends requests to a vLLM OpenAI server from an event loop of its own thread."""

    def __init__(self, url: str, model_id: str, name: str = "inferscale-remote") -> None:
        super().__init__(name)
        self.url = url.rstrip("/")
        self.model_id = model_id
        self._session: Any = None

    def _request(self, request_id: str, prompt: dict[str, Any], params: SamplingParams) -> dict[str, Any]:
        """The OpenAI completions body of one request."""
        body: dict[str, Any] = {
            "model": self.model_id,
            "prompt": list(prompt["prompt_token_ids"]),
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "seed": params.seed,
            "stop": list(params.stop or []),
            "stop_token_ids": list(params.stop_token_ids or []),
            "ignore_eos": params.ignore_eos,
            "min_tokens": params.min_tokens,
            "presence_penalty": params.presence_penalty,
            "frequency_penalty": params.frequency_penalty,
            "repetition_penalty": params.repetition_penalty,
            "skip_special_tokens": params.skip_special_tokens,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        if params.top_k and params.top_k > 0:
            body["top_k"] = params.top_k
        if params.logprobs is not None:
            body["logprobs"] = params.logprobs
        if prompt.get("cache_salt"):
            body["cache_salt"] = prompt["cache_salt"]
        transfer = (params.extra_args or {}).get("kv_transfer_params")
        if transfer:
            body["kv_transfer_params"] = transfer
        return body

    async def _run(self, request_id: str, work: Any, listener: Listener) -> None:
        import aiohttp

        try:
            if self._session is None:
                self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
            async with self._session.post(f"{self.url}/v1/completions", json=work) as reply:
                data = await reply.json(content_type=None)
                if reply.status != 200:
                    message = (data.get("error") or {}).get("message") if isinstance(data, dict) else data
                    raise InferScaleError(f"vLLM server refused the request ({reply.status}): {message}")
        except (InferScaleError, asyncio.CancelledError):  # cancelled: closing the connection aborts it there
            raise
        except Exception as exc:
            raise InferScaleError(f"vLLM server at {self.url} failed: {exc!r}") from None
        listener(_output(request_id, data), time.perf_counter())  # type: ignore[arg-type]  # RequestOutput's fields

    async def _shutdown(self) -> None:
        if self._session is not None:
            await self._session.close()


def _output(request_id: str, data: dict[str, Any]) -> RemoteOutput:
    choice = data["choices"][0]
    logprobs = None
    top = (choice.get("logprobs") or {}).get("top_logprobs")
    if top:
        # return_tokens_as_token_ids: keys are "token_id:<id>".
        logprobs = [{int(t.rpartition(":")[2]): _Logprob(lp) for t, lp in step.items()} for step in top if step]
    usage = data.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return RemoteOutput(
        request_id,
        [_Completion(choice.get("text") or "", list(choice.get("token_ids") or []), choice.get("finish_reason"), logprobs)],
        data.get("kv_transfer_params"),
        int(cached),
        prompt_token_ids=list(choice.get("prompt_token_ids") or []),
    )
