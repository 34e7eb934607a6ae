"""Every error response of the server, in one place: the error body, the mapping from InferScale's
exceptions to HTTP statuses, and the app's exception handlers.

Every error is a JSON body ``{"error": {"message", "type", "param", "code"}}`` as OpenAI sends it
(plus Mem0's ``detail`` on memory routes), ``code`` never null; bad input is a 4xx, never a 500
with a traceback.
"""

from __future__ import annotations

import errno
import logging
import sys
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferscale_apps.server.metrics import Metrics
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
    InvalidOptionError,
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

logger = logging.getLogger(__name__)

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_UNWRITABLE_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}
_OPENAI_PATHS = ("/v1/chat/", "/v1/completions", "/v1/models")


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


class ClientGone(InferScaleError):
    """The client hung up before its answer: there is no one to answer (counted as 499). Never
    leaves the app: its own handler answers it."""


def _is_mem0_path(path: str) -> bool:
    return path.startswith(("/v1/", "/v2/", "/v3/")) and not path.startswith(_OPENAI_PATHS)


def _storage_error(exc: BaseException) -> APIError | None:
    """The response for a failure of the store's disk, or ``None`` when ``exc`` is none.

    A full disk is 507 and an unwritable store 503: the client learns it is the server's
    storage, not its request, and the store has written nothing of the call. The store raises
    its database's failures typed (:class:`StorageFullError`, :class:`StorageUnavailableError`);
    a file it writes itself fails with the ``OSError`` of its ``errno``.
    """
    if isinstance(exc, StorageFullError):
        full = True
    elif isinstance(exc, StorageUnavailableError):
        full = False
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


#: The response to each error class of :mod:`inferscale_engine.errors`: (class, status, type,
#: param, code). The first class an error is an instance of wins, so subclasses come before their
#: bases; a disk failure (``StorageFullError``...) is :func:`_storage_error`'s.
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
    (InvalidOptionError, 400, "invalid_request_error", None, "invalid_value"),  # param: the option it names
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
    stored = _storage_error(exc)
    if stored is not None:
        return stored
    for cls, status, kind, param, code in _ERRORS:
        if isinstance(exc, cls):
            if status < 500:
                return APIError(status, msg, kind, param or getattr(exc, "option", None), code)
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


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Answer every exception a route raises with its error body, counting each by its code."""

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

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        # Nobody reads it (the server drops it): the status is for the request counter, no error.
        return Response(status_code=499)
