"""A ``vllm serve`` of another process as the engine's vLLM: requests go over its HTTP API.

The server runs InferScale's connector (``--kv-transfer-config '{"kv_connector":
"InferScaleConnector", "kv_connector_module_path": "inferscale_engine.connector",
"kv_role": "kv_both"}'``) on this host. This process keeps the facts: it stages their KV in
shared memory and sends token-id prompts to ``/v1/completions`` whose ``kv_transfer_params`` say
where it lies; fact encoding is a request whose ``kv_transfer_params`` ask for capture.

Generation streams (server-sent events), so tokens reach callers as the server makes them.
vLLM puts a request's output ``kv_transfer_params`` (the connector's count of injected tokens)
in whole replies only, so two kinds of request are not streamed: captures, and an injected
prompt whose count a stream cannot give exactly. A stream's last chunk has the usage, and its
``cached_tokens`` are vLLM's prompt tokens not computed: prefix-cache hits plus injected
tokens. Where the prompt bypassed the server's prefix cache (the default: the plan does not
``keep_cached``), there are no hits, so they are exactly the injected tokens. Whether the
server can bypass it and reports cached tokens (``--enable-prompt-tokens-details``) the loop
learns from whole replies, captures first; until both are shown, injected prompts go whole.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from inferscale_engine import vllm_compat as compat
from inferscale_engine.connector.plan import BYPASSED_KEY, INJECTED_KEY, PARAMS_KEY, bypasses_prefix_cache
from inferscale_engine.errors import EngineSettingsError, InferScaleError
from inferscale_engine.loop import Listener, ThreadedAsyncLoop, tell

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
    """The fields of vLLM's ``RequestOutput`` the engine reads, from a completion reply
    (cumulative, as vLLM's own)."""

    request_id: str
    outputs: list[_Completion]
    kv_transfer_params: dict[str, Any] | None
    num_cached_tokens: int = 0
    finished: bool = True
    prompt_token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Work:
    body: dict[str, Any]  # the OpenAI completions request
    stream: bool
    injects: bool  # the prompt carries an injection plan
    bypasses: bool  # it asks to bypass the server's prefix cache


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
        # What the server's whole replies showed; None until one did. Written on the loop's
        # thread, read by callers': a stale read only sends one more request whole.
        self._server_bypasses: bool | None = None
        self._server_reports_cached: bool | None = None

    @property
    def streams_injected(self) -> bool:
        """Whether injected prompts that bypass the prefix cache are streamed now (the server
        has shown it can keep them out of its prefix cache, and that it reports cached tokens)."""
        return bool(self._server_bypasses and self._server_reports_cached)

    def _request(self, request_id: str, prompt: dict[str, Any], params: SamplingParams) -> _Work:
        """The OpenAI completions body of one request, and how it is sent."""
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
        structured = compat.structured_output_request(params)
        if structured:
            body["structured_outputs"] = structured
        transfer = (params.extra_args or {}).get("kv_transfer_params")
        if transfer:
            body["kv_transfer_params"] = transfer
        ours = (transfer or {}).get(PARAMS_KEY) or {}
        injects, bypasses = "inject" in ours, bypasses_prefix_cache(transfer)
        stream = not ours or (injects and bypasses and self.streams_injected)
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return _Work(body, stream, injects, bypasses)

    async def _run(self, request_id: str, work: _Work, listener: Listener) -> None:
        import aiohttp

        try:
            if self._session is None:
                self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
            async with self._session.post(f"{self.url}/v1/completions", json=work.body) as reply:
                if reply.status != 200:
                    data = await reply.json(content_type=None)
                    message = (data.get("error") or {}).get("message") if isinstance(data, dict) else data
                    raise InferScaleError(f"vLLM server refused the request ({reply.status}): {message}")
                if work.stream:
                    await self._relay(request_id, work, reply, listener)
                    return
                data = await reply.json(content_type=None)
        except (InferScaleError, asyncio.CancelledError):  # cancelled: closing the connection aborts it there
            raise
        except Exception as exc:
            raise InferScaleError(f"vLLM server at {self.url} failed: {exc!r}") from None
        out = _output(request_id, data)
        self._learn(work, data.get("usage"), out.kv_transfer_params)
        tell(listener, out, request_id)  # type: ignore[arg-type]  # RequestOutput's fields

    async def _relay(self, request_id: str, work: _Work, reply: Any, listener: Listener) -> None:
        """Hand the listener a cumulative output per streamed chunk, and the usage at the end."""
        text = ""
        token_ids: list[int] = []
        prompt_ids: list[int] = []
        logprobs: list[dict[int, _Logprob]] | None = None
        finish_reason = None
        usage: dict[str, Any] = {}
        async for event in _events(reply.content):
            if "error" in event:  # vLLM's stream ends with its error as an event
                raise InferScaleError(f"vLLM server failed the request: {(event['error'] or {}).get('message')}")
            usage = event.get("usage") or usage
            for choice in event.get("choices") or ():
                text += choice.get("text") or ""
                token_ids += choice.get("token_ids") or ()
                prompt_ids = choice.get("prompt_token_ids") or prompt_ids
                finish_reason = choice.get("finish_reason") or finish_reason
                steps = _logprobs(choice)
                if steps is not None:
                    logprobs = logprobs or []
                    logprobs += steps
                # Every chunk's output shares the growing token and logprob lists, as a long reply
                # would copy them quadratically; a listener reads a chunk's new text (a str of its
                # own) and whether any token came, and the lists whole only once finished.
                completion = _Completion(text, token_ids, finish_reason, logprobs)
                tell(listener, RemoteOutput(request_id, [completion], None, finished=False,  # type: ignore[arg-type]
                                            prompt_token_ids=prompt_ids), request_id)
        self._learn(work, usage, None)
        cached = _cached_tokens(usage)
        if work.injects and not self._server_reports_cached:  # a server restarted without the flag
            logger.warning("vLLM server at %s no longer reports cached tokens: request %s reports 0 injected "
                           "(run vllm serve with --enable-prompt-tokens-details)", self.url, request_id)
        # Streamed only where every token vLLM counts as cached was injected (see the module).
        params = {INJECTED_KEY: cached} if work.injects else None
        final = RemoteOutput(request_id, [_Completion(text, token_ids, finish_reason, logprobs)], params, cached,
                             prompt_token_ids=prompt_ids)
        tell(listener, final, request_id)  # type: ignore[arg-type]

    def _learn(self, work: _Work, usage: dict[str, Any] | None, params: dict[str, Any] | None) -> None:
        """What a reply shows of the server: whether it reports cached tokens, and (a whole reply
        to a request that asked to bypass its prefix cache) whether it could."""
        if usage:
            self._server_reports_cached = usage.get("prompt_tokens_details") is not None
        if work.bypasses and params is not None and BYPASSED_KEY in params:
            self._server_bypasses = bool(params[BYPASSED_KEY])

    async def _shutdown(self) -> None:
        if self._session is not None:
            await self._session.close()


async def _events(content: Any) -> AsyncIterator[dict[str, Any]]:
    """The JSON of each ``data:`` event of a server-sent event stream, up to ``[DONE]``."""
    buffer = b""
    # Not line by line: aiohttp's line reader refuses a line over twice its read buffer (512 KiB
    # by default), and the first event carries the prompt's token ids.
    async for piece in content.iter_any():
        buffer += piece
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            for line in event.splitlines():
                if line.startswith(b"data:"):
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    yield json.loads(data)
    raise InferScaleError("the vLLM server closed the stream before its end")


def _logprobs(choice: dict[str, Any]) -> list[dict[int, _Logprob]] | None:
    top = (choice.get("logprobs") or {}).get("top_logprobs")
    if top is None:
        return None
    # return_tokens_as_token_ids: keys are "token_id:<id>".
    return [{int(t.rpartition(":")[2]): _Logprob(lp) for t, lp in step.items()} for step in top if step]


def _cached_tokens(usage: dict[str, Any] | None) -> int:
    return int(((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _output(request_id: str, data: dict[str, Any]) -> RemoteOutput:
    choice = data["choices"][0]
    return RemoteOutput(
        request_id,
        [_Completion(choice.get("text") or "", list(choice.get("token_ids") or []), choice.get("finish_reason"),
                     _logprobs(choice) or None)],
        data.get("kv_transfer_params"),
        _cached_tokens(data.get("usage")),
        prompt_token_ids=list(choice.get("prompt_token_ids") or []),
    )
