"""What the routes of one app share: its engine, metrics and settings, as :class:`ServerState`
on ``app.state.server``, and the dependencies that hand it (or a request's caller) to a route."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Request

from inferscale_apps.server.errors import APIError
from inferscale_apps.server.headers import HeaderEncodingError, user_id_header
from inferscale_apps.server.metrics import Metrics
from inferscale_engine.prompting import memory_context

if TYPE_CHECKING:
    from inferscale_engine.memory import MemoryStore


@dataclass
class ServerState:
    """One app's engine and settings, built by :func:`~inferscale_apps.server.create_app`."""

    engine: Any
    metrics: Metrics
    #: The ``model`` id clients send and ``/v1/models`` lists.
    model_name: str
    #: Every name a request's ``model`` may give (the served name, the model's path and folder).
    accepted: frozenset[str]
    max_model_len: int
    #: The cap for requests that give no ``max_tokens``.
    default_max_tokens: int
    #: Seconds a chat waits for a memory still being encoded before prefilling it as text.
    serve_as_text_after: float | None
    #: Why the store did not open at start-up: the memory routes answer 503 with it.
    memory_error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _head_context: list[list[str] | None] = field(default_factory=list, repr=False)

    def check_model(self, name: str) -> None:
        """404 unless ``name`` is the served model."""
        if name not in self.accepted:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_name}'.",
                           "not_found_error", "model", "model_not_found")

    def store(self) -> MemoryStore:
        """The engine's memory store, opened on first use; a 503 when there is none."""
        if self.memory_error:
            raise APIError(503, self.memory_error, "server_error", None, "memory_unavailable")
        try:
            memory = self.engine.memory
        except ImportError as exc:
            raise APIError(503, f"memory store unavailable: {exc}", "server_error", None, "memory_unavailable") from exc
        memory.serve_as_text_after = self.serve_as_text_after  # a store opened late (preload_memory=False)
        return memory

    def default_context(self) -> list[str] | None:
        """The system head memories are recalled under (``memory_k``, ``inferscale chat``): the
        text a fact added without a ``context`` is encoded after."""
        if not self._head_context:
            self._head_context.append(memory_context(self.engine))
        return self._head_context[0]


async def server_state(request: Request) -> ServerState:
    """The dependency of every route: its app's :class:`ServerState`."""
    state: ServerState = request.app.state.server
    return state


def header_user(request: Request) -> str | None:
    """The ``X-User-Id`` header (UTF-8, so that every route reads the same user); a 400 when it
    is not valid UTF-8."""
    try:
        return user_id_header(request)
    except HeaderEncodingError as exc:
        raise APIError(400, str(exc), param=exc.header, code="invalid_header") from None


State = Annotated[ServerState, Depends(server_state)]
