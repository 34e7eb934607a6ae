"""The HTTP API: OpenAI-compatible completions plus the Mem0 platform's memory API.

Routes::

    POST /v1/chat/completions     OpenAI chat (SSE streaming or not, tools and structured output);
                                  handles in messages are injected as KV for the request's user
                                  (``user``, ``safety_identifier`` or ``X-User-Id``)
    POST /v1/completions          OpenAI legacy completions (a prompt or a list of prompts)
    GET  /v1/models[/{id}]        the served model
    /v1/ping/, /v1/memories/..., /v2/..., /v3/..., /v1/entities/
                                  the Mem0 platform API (server/mem0_api.py)
    GET  /health, GET /metrics    (never behind the API key)

Every error is a JSON body ``{"error": {"message", "type", "param", "code"}}`` as OpenAI sends
it (plus Mem0's ``detail`` on memory routes); bad input is a 4xx, never a 500 with a traceback.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import json
import logging
import os
import re
import sqlite3
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferscale_apps.server import mem0_api
from inferscale_apps.server.headers import HeaderEncodingError, user_id_header
from inferscale_apps.server.metrics import CONTENT_TYPE_LATEST, Metrics
from inferscale_apps.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    misspelled,
    unsupported,
)
from inferscale_apps.server.tools import ToolRequestError, chat_messages, openai_tool_calls, tool_use
from inferscale_engine import __version__
from inferscale_engine.errors import (
    ConnectorError,
    ContextOverflowError,
    DatabaseUnavailableError,
    EngineClosedError,
    EngineSettingsError,
    FactNotFoundError,
    ForgedHandleError,
    HandleError,
    HandleOwnerError,
    InferScaleError,
    InvalidSchemaError,
    KVMissingError,
    KVNotReadyError,
    MalformedHandleError,
    MissingUserError,
    ModelNotFoundError,
    ModelPreparationError,
    NonFiniteKVError,
    RefusedRequestError,
    ReplicaMismatchError,
    SchemaVersionError,
    SecretError,
    StaleKVError,
    StorageFullError,
    StorageUnavailableError,
    StoreDamagedError,
    TooLargeError,
)
from inferscale_engine.handles import HANDLE_PATTERN
from inferscale_engine.memory.validation import RESERVED_USER_PREFIXES
from inferscale_engine.prompting import (
    memory_context,
    openai_usage,
    structured_options,
    total_usage,
    with_memories,
)
from inferscale_engine.runtime import warm_up
from inferscale_engine.tool_calls import ToolUse, template_renders_tools
from inferscale_engine.types import DEFAULT_USER

logger = logging.getLogger(__name__)

#: How often a non-streaming generation checks that its client is still connected.
DISCONNECT_POLL_S = 0.25
#: Largest request body taken (413 above it, before any of it is parsed). Far above any prompt
#: the context can hold; without it a 32 MB body took a minute to refuse and kept 1.7 GB.
MAX_BODY_BYTES = 8 << 20

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_UNWRITABLE_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


def storage_error(exc: BaseException) -> APIError | None:
    """The response for a failure of the store's disk, or ``None`` when ``exc`` is none.

    A full disk is 507 and an unwritable store 503: the client learns it is the server's
    storage, not its request, and the store has written nothing of the call.
    """
    if isinstance(exc, StorageFullError):
        full = True
    elif isinstance(exc, StorageUnavailableError):
        full = False
    elif isinstance(exc, sqlite3.OperationalError):
        text = str(exc).lower()
        if "disk is full" in text or "disk full" in text:
            full = True
        elif "readonly" in text or "read-only" in text or "disk i/o error" in text or "unable to open" in text:
            full = False
        else:
            return None
    elif isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS | _UNWRITABLE_ERRNOS:
        full = exc.errno in _FULL_ERRNOS
    else:
        return None
    logger.error("memory store storage failure: %s: %s", type(exc).__name__, exc)
    if full:
        return APIError(507, f"the memory store's disk is full; nothing was stored ({exc})", "server_error", None,
                        "insufficient_storage")
    return APIError(503, f"the memory store cannot be written (read-only or failing disk); nothing was stored ({exc})",
                    "server_error", None, "storage_unavailable")


class APIError(Exception):
    """An error response: HTTP status plus OpenAI's error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> None:
        # Client text quoted in a message may hold lone surrogates, which JSON cannot encode as UTF-8.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        # Clients branch on ``code``: never null, also where a call site names none.
        code = code or ("invalid_request" if status < 500 else "internal_error")
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, path: str = "") -> JSONResponse:
        body = self.body()
        if _is_mem0_path(path):  # the mem0ai clients show a failure's ``detail``; OpenAI clients read ``error``
            body["detail"] = self.message
        return JSONResponse(body, status_code=self.status)


class _ClientGone(InferScaleError):
    """The client hung up before its answer: there is no one to answer (counted as 499). Never
    leaves the app: its own handler answers it."""


_OPENAI_PATHS = ("/v1/chat/", "/v1/completions", "/v1/models")
_VERSIONED = re.compile(r"/v\d+(/|$)")


def _is_mem0_path(path: str) -> bool:
    return path.startswith(("/v1/", "/v2/", "/v3/")) and not path.startswith(_OPENAI_PATHS)


#: The response to each error class of :mod:`inferscale_engine.errors`: (class, status, type,
#: param, code). The first class an error is an instance of wins, so subclasses come before their
#: bases; a disk failure (``StorageFullError``...) is :func:`storage_error`'s.
_ERRORS: tuple[tuple[type[Exception], int, str, str | None, str], ...] = (
    (ForgedHandleError, 403, "permission_error", "messages", "forged_handle"),
    (HandleOwnerError, 403, "permission_error", "messages", "forged_handle"),  # LlamaIndex's, never the server's
    (RefusedRequestError, 400, "invalid_request_error", None, "invalid_request"),  # LlamaIndex's too
    (FactNotFoundError, 404, "not_found_error", None, "memory_not_found"),
    (StaleKVError, 409, "conflict_error", None, "stale_kv"),
    (MalformedHandleError, 400, "invalid_request_error", "messages", "malformed_handle"),
    (HandleError, 400, "invalid_request_error", "messages", "invalid_handle"),
    (ContextOverflowError, 400, "invalid_request_error", "max_tokens", "context_length_exceeded"),
    (InvalidSchemaError, 400, "invalid_request_error", "response_format", "invalid_json_schema"),
    (MissingUserError, 400, "invalid_request_error", "user", "user_required"),
    (TooLargeError, 413, "invalid_request_error", None, "too_large"),
    (KVNotReadyError, 503, "server_error", None, "kv_not_ready"),
    (KVMissingError, 503, "server_error", None, "kv_not_ready"),  # unreadable KV: re-encoded on the next try
    (EngineClosedError, 503, "server_error", None, "engine_closed"),
    (DatabaseUnavailableError, 503, "server_error", None, "database_unavailable"),
    # The store does not open (a chat with a handle opens it when start-up could not): its handle
    # secret, database or schema is not the one of its handles, or it belongs to other replicas.
    (SecretError, 503, "server_error", None, "memory_unavailable"),
    (StoreDamagedError, 503, "server_error", None, "memory_unavailable"),
    (SchemaVersionError, 503, "server_error", None, "memory_unavailable"),
    (ReplicaMismatchError, 503, "server_error", None, "memory_unavailable"),
    # The server's own faults, never the request's: a 500 (the ValueErrors among them too).
    (EngineSettingsError, 500, "server_error", None, "internal_error"),
    (ModelNotFoundError, 500, "server_error", None, "internal_error"),
    (ModelPreparationError, 500, "server_error", None, "internal_error"),
    (NonFiniteKVError, 500, "server_error", None, "internal_error"),
    (ConnectorError, 500, "server_error", None, "internal_error"),
    (InferScaleError, 500, "server_error", None, "internal_error"),
)


def _vllm_refused(exc: BaseException) -> bool:
    """Whether vLLM refused the request as the client's fault (its ``VLLMClientError``: the
    grammar compiler's verdict on a JSON schema, for one). Looked up, not imported: the server
    does not load vLLM for it, and an error of vLLM's means it is loaded."""
    refused = getattr(sys.modules.get("vllm.exceptions"), "VLLMClientError", None)
    return refused is not None and isinstance(exc, refused)


def api_error(exc: BaseException) -> APIError:
    """Map an exception from the engine or store to the response a client should get."""
    if isinstance(exc, APIError):
        return exc
    msg = str(exc) or exc.__class__.__name__
    stored = storage_error(exc)
    if stored is not None:
        return stored
    for cls, status, kind, param, code in _ERRORS:
        if isinstance(exc, cls):
            if status < 500:
                return APIError(status, msg, kind, param, code)
            if code != "internal_error":
                logger.error("%s: %s", type(exc).__name__, msg)
                return APIError(status, msg, kind, param, code)
            break
    else:
        if _vllm_refused(exc):
            # Our own checks run first (response_format's schema among them); what vLLM still
            # refuses is most often a schema its grammar compiler cannot take.
            schema = any(w in msg.lower() for w in ("grammar", "schema", "structured output"))
            return APIError(400, msg, "invalid_request_error", "response_format" if schema else getattr(exc, "parameter", None),
                            "invalid_json_schema" if schema else "invalid_request")
        if isinstance(exc, ImportError):  # e.g. the memory extra is not installed
            return APIError(503, f"memory store unavailable: {msg}", "server_error", None, "memory_unavailable")
        if isinstance(exc, (ValueError, TypeError)):  # empty prompts, text that is not UTF-8...
            return APIError(400, msg, "invalid_request_error", None, "invalid_request")
    logger.error("internal error", exc_info=(type(exc), exc, exc.__traceback__))
    return APIError(500, "internal server error (see the server log)", "server_error", None, "internal_error")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "bytes", "any"}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    loc = []
    for p in first.get("loc", ()):
        if p in ("body", "query"):
            continue
        if isinstance(p, str) and (p in _TYPE_TAGS or any(c in p for c in "[(-")):
            break  # pydantic names the union member it tried (``str``, ``list[ContentPart]``)
        loc.append(str(p))
    param = ".".join(loc) or None
    where = f" at '{param}'" if param else ""
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return f"invalid request{where}: {first.get('msg', 'invalid value')}{more}", param


def create_app(
    engine: Any,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    default_max_tokens: int = 512,
    preload_memory: bool = True,
    max_body_bytes: int = MAX_BODY_BYTES,
    serve_as_text_after: float | None = 0.5,
) -> FastAPI:
    """Build the FastAPI app around an existing :class:`~inferscale_engine.InferScaleEngine`.

    Args:
        served_model_name: the ``model`` id clients send and ``/v1/models`` lists (default:
            the alias or folder name the engine was built from).
        api_key: when set, ``/v1/*``, ``/v2/*`` and ``/v3/*`` need ``Authorization: Bearer <api_key>``
            or ``Token <api_key>`` (401 otherwise).
        default_max_tokens: the cap for requests that give no ``max_tokens`` (also bounded by
            what is left of the context).
        preload_memory: open the memory store now (loads the embedder) rather than on the
            first memory request.
        max_body_bytes: largest request body accepted; larger ones get 413 before they are parsed.
        serve_as_text_after: seconds a chat waits for a memory that is still being encoded before
            it is prefilled as text instead (``usage.memories_as_text``); ``None``: wait for it.
    """
    model_name = served_model_name or _default_model_name(engine)
    accepted = {model_name, str(getattr(engine.config, "model", model_name)), str(getattr(engine, "model_path", model_name))}
    accepted.add(os.path.basename(str(getattr(engine, "model_path", model_name)).rstrip("/")))
    max_model_len = int(engine.max_model_len)
    metrics = Metrics()
    created = int(time.time())

    app = FastAPI(title="InferScale", version=__version__, description="Personalized LLM serving: memory without prefill.")
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.model_name = model_name

    memory_error: list[str] = []

    def store_stats() -> dict[str, int]:
        store = engine.memory_if_built  # never opens a store just to be scraped
        return store.tiers.stats() if store is not None else {}

    metrics.store_stats = store_stats
    if preload_memory:
        try:
            warm_up(engine.memory)  # open the store and load its embedder before requests race for it
            engine.memory.serve_as_text_after = serve_as_text_after
        except ReplicaMismatchError:
            raise  # a replica that would corrupt the shared store's KV must not start at all
        except Exception as exc:  # noqa: BLE001  (serve completions even without a usable store)
            memory_error.append(f"memory store unavailable: {exc.__class__.__name__}: {exc}")
            logger.warning("memory endpoints disabled: %s", memory_error[0])

    # ------------------------------------------------------------------ plumbing

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        metrics.errors.labels(exc.code or exc.type).inc()
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        metrics.errors.labels("invalid_request").inc()
        return APIError(400, message, param=param, code="invalid_request").response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Clients branch on ``code``; OpenAI's own 404 for an unknown route says "unknown_url".
        kind, code = {404: ("not_found_error", "unknown_url"), 405: ("invalid_request_error", "method_not_allowed")}.get(
            exc.status_code, ("invalid_request_error", "invalid_request"))
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"Unknown request URL: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed for {request.url.path}"
        return APIError(exc.status_code, message, kind, None, code).response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        err = api_error(exc)
        metrics.errors.labels(err.code or err.type).inc()
        return err.response(request.url.path)

    @app.exception_handler(_ClientGone)
    async def _gone(request: Request, exc: _ClientGone) -> Response:
        # Nobody reads it (the server drops it): the status is for the request counter, no error.
        return Response(status_code=499)

    app.add_middleware(_BodyLimit, limit=max_body_bytes)
    app.add_middleware(_AuthAndCount, api_key=api_key, metrics=metrics)  # outermost: counts the 413s too

    def check_model(name: str) -> None:
        if name not in accepted:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{model_name}'.", "not_found_error", "model", "model_not_found")

    def store() -> Any:
        if memory_error:
            raise APIError(503, memory_error[0], "server_error", None, "memory_unavailable")
        try:
            memory = engine.memory
        except ImportError as exc:
            raise APIError(503, f"memory store unavailable: {exc}", "server_error", None, "memory_unavailable") from exc
        memory.serve_as_text_after = serve_as_text_after  # a store opened late (preload_memory=False)
        return memory

    # ------------------------------------------------------------------ generation

    def sampling_of(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
        typo = misspelled(req)
        if typo:
            raise APIError(400, f"unknown parameter {typo[0]!r}: did you mean {typo[1]!r}? (other unknown parameters are "
                                "ignored; this one is refused as it is most likely a misspelling)",
                           param=typo[0], code="unknown_parameter")
        bad = unsupported(req)
        if bad:
            raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")
        s: dict[str, Any] = {"temperature": 1.0 if req.temperature is None else req.temperature}
        if req.top_p is not None:
            s["top_p"] = req.top_p
        if req.seed is not None:
            s["seed"] = req.seed
        if req.stop_list():
            s["stop"] = req.stop_list()
        if req.presence_penalty:
            s["presence_penalty"] = req.presence_penalty
        if req.frequency_penalty:
            s["frequency_penalty"] = req.frequency_penalty
        if req.recompute is not None:
            s["recompute"] = req.recompute
        if isinstance(req, ChatCompletionRequest) and req.response_format is not None:
            try:
                structured = structured_options(req.response_format)
            except InvalidSchemaError as exc:  # before any work: vLLM would refuse it only once staged
                raise api_error(exc) from None
            except ValueError as exc:
                raise APIError(400, str(exc), param="response_format", code="unsupported_parameter") from None
            if structured:
                s["structured"] = structured
        return s

    def too_long(message: str, param: str) -> APIError:
        # OpenAI's and vLLM's wording: litellm and others map it to their context-window error types.
        return APIError(400, f"This model's maximum context length is {max_model_len} tokens. {message}",
                        param=param, code="context_length_exceeded")

    async def prepare(prompt: Any, user: str, requested: int | None, param: str,
                      tools: list[dict[str, Any]] | None = None) -> tuple[list[Any], int]:
        """Render (``tools``: for the chat template), resolve handles once (4xx for bad ones) and
        settle ``max_tokens`` against the context."""
        if requested is not None and requested >= max_model_len:
            raise too_long(f"However, you requested {requested} tokens in the completion ({param}), which leaves no "
                           "room for the messages. Please reduce the length of the completion.", param)
        try:
            # With max_tokens (at least 1 to come), a prompt over the context is refused from the
            # memories' token counts, before any of them is read or encoded (that took minutes).
            segments = await asyncio.to_thread(engine.resolve, prompt, user_id=user, tools=tools,
                                               max_tokens=requested or 1)
        except ContextOverflowError as exc:
            raise too_long(f"However, the {exc}. Please reduce the length of the messages or completion.",
                           "messages" if requested is None else param) from None
        except Exception as exc:
            raise api_error(exc) from exc
        n = sum(len(s.token_ids) if hasattr(s, "token_ids") else len(s) for s in segments)
        left = max_model_len - n
        if left < 1:
            raise too_long(f"However, your messages resulted in {n} tokens (memories included). "
                           "Please reduce the length of the messages.", "messages")
        if requested is None:  # as much as the context leaves, capped by the server default
            requested = min(default_max_tokens, left)
        if requested > left:
            raise too_long(f"However, you requested {n + requested} tokens ({n} in the messages, memories included, "
                           f"{requested} in the completion). Please reduce the length of the messages or completion.", param)
        return segments, requested

    def user_of(req: Any, request: Request, uses_memory: bool) -> str:
        """The user whose memories a request may use: ``user``, ``safety_identifier`` or ``X-User-Id``.

        A request that uses memories (handles, ``memory_k``) without naming its user is refused:
        serving it as some default user would silently read or miss the wrong user's facts. So is
        one naming a store key of agent, run or app memories (``@agent:<id>``...): chats are a
        user's, and such a "user" would recall memories that belong to no user.
        """
        try:
            header = user_id_header(request)  # UTF-8, as the memory routes read it: the same user
        except HeaderEncodingError as exc:
            raise APIError(400, str(exc), param="X-User-Id", code="invalid_header") from None
        given = {k: v for k, v in (("user", req.user), ("safety_identifier", req.safety_identifier),
                                   ("X-User-Id", header)) if v}
        if len(set(given.values())) > 1:
            raise APIError(400, "the request names different users: " + ", ".join(f"{k}={v!r}" for k, v in given.items()),
                           param="user", code="conflicting_user")
        if given:
            name, user = next(iter(given.items()))
            if user.startswith(RESERVED_USER_PREFIXES):
                raise APIError(400, f"{name} {user!r} is reserved: ids starting with "
                                    f"{', '.join(map(repr, RESERVED_USER_PREFIXES))} hold agent, run and app memories, "
                                    "not a user's", param=name, code="reserved_user")
            return user
        if uses_memory:
            raise APIError(400, "this request uses memories (a memory handle or memory_k) but names no user: send "
                                "'user' (or 'safety_identifier') in the body, or an X-User-Id header",
                           param="user", code="user_required")
        return DEFAULT_USER  # nothing in it is scoped by user

    async def run_one(endpoint: str, segments: list[Any], kwargs: dict[str, Any], request: Request) -> Any:
        metrics.in_flight.inc()
        task = asyncio.ensure_future(engine.agenerate_segments(segments, **kwargs))
        try:
            # A client that hung up gets no answer: stop generating it (cancelling the task
            # aborts the vLLM request), or abandoned requests hold the batch for their full length.
            while not task.done():
                await asyncio.wait((task,), timeout=DISCONNECT_POLL_S)
                if not task.done() and await request.is_disconnected():
                    logger.info("client went away: generation aborted")
                    raise _ClientGone  # the task is cancelled below
            result = await task
        except _ClientGone:
            raise
        except Exception as exc:
            raise api_error(exc) from exc
        finally:
            if not task.done():  # this handler was cancelled itself
                task.cancel()
            metrics.in_flight.dec()
        metrics.observe_generation(endpoint, result)
        return result

    async def generate(endpoint: str, segments: list[Any], user: str, req: Any, max_tokens: int,
                       sampling: dict[str, Any], request: Request, use: ToolUse | None = None) -> Response:
        """``use``: a chat's tools, whose calls the answer is read for."""
        rid = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex
        now = int(time.time())
        kwargs = dict(user_id=user, max_tokens=max_tokens, **sampling)
        if not req.stream:
            result = await run_one(endpoint, segments, kwargs, request)
            if endpoint == "chat":
                text, calls = use.read(result.text) if use is not None else (result.text, [])
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if calls:
                    message.update(content=text or None, tool_calls=openai_tool_calls(calls))
                choice = {"index": 0, "message": message, "logprobs": None,
                          "finish_reason": "tool_calls" if calls else result.finish_reason}
                obj = "chat.completion"
            else:
                choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}
                obj = "text_completion"
            return JSONResponse(
                {"id": rid, "object": obj, "created": now, "model": model_name, "choices": [choice], "usage": openai_usage(result.usage), "system_fingerprint": None}
            )

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        agen = engine.astream_segments(segments, **kwargs).__aiter__()
        metrics.in_flight.inc()
        try:
            first = await agen.__anext__()  # resolution and layout errors become a proper status
        except StopAsyncIteration:
            metrics.in_flight.dec()
            raise APIError(500, "generation produced no output", "server_error", None, "internal_error")
        except BaseException as exc:  # noqa: BLE001  (re-raised, mapped when an Exception)
            metrics.in_flight.dec()
            await agen.aclose()
            raise api_error(exc) if isinstance(exc, Exception) else exc
        return StreamingResponse(
            sse(endpoint, rid, now, first, agen, include_usage, use),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def sse(endpoint: str, rid: str, now: int, first: Any, agen: AsyncGenerator[Any, None], include_usage: bool,
                  use: ToolUse | None = None) -> AsyncIterator[str]:
        """The stream's SSE events. With tools, text is held back where a call may start, and the
        calls come at the end, one ``delta.tool_calls`` chunk each (whole, at its ``index``)."""
        obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
        reader = use.reader() if use is not None else None

        def chunk(delta_text: str | None, finish: str | None = None, role: bool = False,
                  tool_call: dict[str, Any] | None = None) -> str:
            if endpoint == "chat":
                delta: dict[str, Any] = {}
                if role:
                    delta["role"] = "assistant"
                if delta_text is not None:
                    delta["content"] = delta_text
                if tool_call is not None:
                    delta["tool_calls"] = [tool_call]
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish}
            body: dict[str, Any] = {"id": rid, "object": obj, "created": now, "model": model_name, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body)}\n\n"

        try:
            if endpoint == "chat":
                yield chunk("", role=True)
            delta, result = first, None
            while True:
                text = reader.feed(delta.text) if reader is not None else delta.text
                if text:
                    yield chunk(text)
                if delta.result is not None:
                    result = delta.result
                    break
                try:
                    delta = await agen.__anext__()
                except StopAsyncIteration:
                    break
            if result is not None:
                finish = result.finish_reason
                if reader is not None:
                    rest, calls = reader.finish()
                    if rest:
                        yield chunk(rest)
                    for i, call in enumerate(openai_tool_calls(calls)):
                        yield chunk(None, tool_call={"index": i, **call})
                    finish = "tool_calls" if calls else finish
                metrics.observe_generation(endpoint, result)
                yield chunk(None if endpoint == "chat" else "", finish=finish)
                if include_usage:
                    yield "data: " + json.dumps({"id": rid, "object": obj, "created": now, "model": model_name, "choices": [], "usage": openai_usage(result.usage)}) + "\n\n"
            yield "data: [DONE]\n\n"
        except Exception as exc:  # noqa: BLE001  (after the 200 went out: report in-band, as OpenAI does)
            err = api_error(exc)
            metrics.errors.labels(err.code or err.type).inc()
            yield f"data: {json.dumps(err.body())}\n\n"
        finally:
            metrics.in_flight.dec()
            await agen.aclose()  # aborts the vLLM request when the client went away

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        check_model(req.model)
        sampling = sampling_of(req)
        try:
            messages = chat_messages(req)
        except ToolRequestError as exc:
            raise APIError(400, str(exc), param=exc.param, code=exc.code) from None
        user = user_of(req, request, bool(req.memory_k) or any(HANDLE_PATTERN.search(m["content"]) for m in messages))
        if req.memory_k:
            query = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
            if query:
                try:
                    found = await asyncio.to_thread(store().search, query, user_id=user, k=req.memory_k)
                except Exception as exc:
                    raise api_error(exc) from exc
                messages = with_memories(messages, [m.handle for m in reversed(found)])  # best last
        # After the memories: a template without tools lists them after the memories' head, so
        # memories are encoded and served after the same text with tools or without.
        try:
            use = tool_use(req, messages, structured=sampling.pop("structured", None),
                           native=template_renders_tools(engine.tokenizer))
        except ToolRequestError as exc:
            raise APIError(400, str(exc), param=exc.param, code=exc.code) from None
        if use.structured:
            sampling["structured"] = use.structured
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        segments, max_tokens = await prepare(use.messages, user, requested, param, use.tools)
        return await generate("chat", segments, user, req, max_tokens, sampling, request, use)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        check_model(req.model)
        sampling = sampling_of(req)
        prompts = req.prompt if isinstance(req.prompt, list) else [req.prompt]
        if not prompts:
            raise APIError(400, "prompt is empty", param="prompt", code="invalid_request")
        for i, p in enumerate(prompts):
            if not p:
                raise APIError(400, "prompt is empty" if len(prompts) == 1 else f"prompt[{i}] is empty", param="prompt",
                               code="invalid_request")
        user = user_of(req, request, any(HANDLE_PATTERN.search(p) for p in prompts))
        if len(prompts) == 1:
            segments, max_tokens = await prepare(prompts[0], user, req.max_tokens, "max_tokens")
            return await generate("completion", segments, user, req, max_tokens, sampling, request)
        if req.stream:
            raise APIError(400, "streaming is supported for one prompt per request; send a list of prompts without "
                                "stream, or one request per prompt", param="stream", code="unsupported_parameter")
        # Every prompt is checked before any is generated, so a bad one costs no generation.
        prepared = [await prepare(p, user, req.max_tokens, "max_tokens") for p in prompts]
        results = await asyncio.gather(*(run_one("completion", seg, dict(user_id=user, max_tokens=mt, **sampling), request)
                                         for seg, mt in prepared))
        usage = openai_usage(total_usage(r.usage for r in results))
        return JSONResponse({
            "id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()), "model": model_name,
            "choices": [{"index": i, "text": r.text, "logprobs": None, "finish_reason": r.finish_reason} for i, r in enumerate(results)],
            "usage": usage, "system_fingerprint": None,
        })

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "inferscale",
                "root": str(getattr(engine, "model_path", model_name)), "max_model_len": max_model_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return model_card()

    @app.get("/health")
    async def health() -> Response:
        if getattr(engine, "closed", False):
            return JSONResponse({"status": "closed"}, status_code=503)
        return JSONResponse({"status": "ok", "model": model_name})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------ memories (Mem0 platform API)

    head_context: list[Any] = []

    def default_context() -> list[str] | None:
        if not head_context:
            head_context.append(memory_context(engine))
        return head_context[0]

    def call(fn: Callable, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except APIError:
            raise
        except Exception as exc:
            raise api_error(exc) from exc

    mem0_api.add_routes(app, engine=engine, store=store, call=call, default_context=default_context, api_error_cls=APIError)

    return app


class _BodyLimit:
    """Pure ASGI middleware: 413 for a body over ``limit`` bytes, before the app parses any of it
    (a declared length is refused unread; a chunked body as soon as it passes the limit)."""

    def __init__(self, app: Any, *, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope.get("headers", []) if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the client's disconnect, as the app expects

        await self.app(scope, replay, send)

    async def _refuse(self, scope: dict, receive: Callable, send: Callable) -> None:
        err = APIError(413, f"request body is larger than the limit of {self.limit} bytes", "invalid_request_error",
                       None, "request_too_large")
        await err.response(scope.get("path", ""))(scope, receive, send)


class _AuthAndCount:
    """Pure ASGI middleware: Bearer check on ``/v1/*`` and request counting by route template.

    (Not ``BaseHTTPMiddleware``: that one re-buffers streamed responses through a task group.)
    """

    def __init__(self, app: Any, *, api_key: str | None, metrics: Metrics) -> None:
        self.app, self.api_key, self.metrics = app, api_key, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method = scope.get("method", "")
        if self.api_key and _VERSIONED.match(scope.get("path", "")):  # the Mem0 API has /v2 and /v3 routes too
            auth = ""
            for k, v in scope.get("headers", []):
                if k == b"authorization":
                    auth = v.decode("latin-1")
            scheme, _, token = auth.partition(" ")
            # "Token" is what the mem0ai clients send; "Bearer" what OpenAI clients send.
            if scheme.lower() not in ("bearer", "token") or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                self.metrics.requests.labels(method, "unauthorized", "401").inc()
                self.metrics.errors.labels("invalid_api_key").inc()
                err = APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>' or 'Token <key>')",
                               "authentication_error", None, "invalid_api_key")
                await err.response(scope.get("path", ""))(scope, receive, send)
                return
        status: list[int | None] = [None]

        async def send_counting(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        except Exception:
            status[0] = status[0] or 500  # answered by the server's error handler, outside this middleware
            raise
        finally:
            # No answer and no error: the client left first (its body unsent, or the handler
            # cancelled): nginx's 499, "client closed request", not a server error.
            route = scope.get("route")
            self.metrics.requests.labels(method, getattr(route, "path", "unmatched"), str(status[0] or 499)).inc()


def _default_model_name(engine: Any) -> str:
    name = str(getattr(engine.config, "model", "") or getattr(engine, "model_path", "model"))
    if os.path.isdir(name):
        return os.path.basename(os.path.normpath(name))
    return name
