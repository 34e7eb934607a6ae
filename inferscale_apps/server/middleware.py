"""The app's two pure ASGI middlewares: the request body's size limit, and the API key check
with the request counter. Both run before routing, so they also answer paths no route has (a
``/v1`` URL without the key is a 401, not a 404)."""

from __future__ import annotations

import hmac
import re
from collections.abc import Callable
from typing import Any

from inferscale_apps.server.errors import APIError
from inferscale_apps.server.metrics import Metrics

#: The API's paths (``/v1/``, ``/v2/``...): behind the key. ``/health`` and ``/metrics`` are not.
_VERSIONED = re.compile(r"/v\d+(/|$)")


class BodyLimit:
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


class AuthAndCount:
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
