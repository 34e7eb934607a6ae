"""The HTTP API: OpenAI-compatible completions plus the Mem0 platform's memory API.

Routes::

    POST /v1/chat/completions     OpenAI chat (SSE streaming or not, tools and structured output);
                                  handles in messages are injected as KV for the request's user
                                  (``user``, ``safety_identifier`` or ``X-User-Id``)
    POST /v1/completions          OpenAI legacy completions (a prompt or a list of prompts)
    GET  /v1/models[/{id}]        the served model                      (server/openai_api.py)
    /v1/ping/, /v1/memories/..., /v2/..., /v3/..., /v1/entities/
                                  the Mem0 platform API                 (server/mem0_api.py)
    GET  /health, GET /metrics    (never behind the API key)            (server/ops.py)

Every error is a JSON body ``{"error": {"message", "type", "param", "code"}}`` as OpenAI sends
it (plus Mem0's ``detail`` on memory routes); bad input is a 4xx, never a 500 with a traceback
(server/errors.py).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from fastapi import FastAPI

from inferscale_apps.server import mem0_api, openai_api, ops
from inferscale_apps.server.errors import install_error_handlers
from inferscale_apps.server.metrics import Metrics
from inferscale_apps.server.middleware import AuthAndCount, BodyLimit
from inferscale_apps.server.state import ServerState
from inferscale_engine import __version__
from inferscale_engine.errors import ReplicaMismatchError
from inferscale_engine.runtime import warm_up

logger = logging.getLogger(__name__)

#: Largest request body taken (413 above it, before any of it is parsed). Far above any prompt
#: the context can hold; without it a 32 MB body took a minute to refuse and kept 1.7 GB.
MAX_BODY_BYTES = 8 << 20


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
    metrics = Metrics()
    state = ServerState(engine=engine, metrics=metrics, model_name=model_name, accepted=frozenset(accepted),
                        max_model_len=int(engine.max_model_len), default_max_tokens=default_max_tokens,
                        serve_as_text_after=serve_as_text_after)

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
            state.memory_error = f"memory store unavailable: {exc.__class__.__name__}: {exc}"
            logger.warning("memory endpoints disabled: %s", state.memory_error)

    app = FastAPI(title="InferScale", version=__version__, description="Personalized LLM serving: memory without prefill.")
    app.state.server = state
    install_error_handlers(app, metrics)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    app.add_middleware(AuthAndCount, api_key=api_key, metrics=metrics)  # outermost: counts the 413s too
    for router in (openai_api.router, ops.router, mem0_api.router):
        app.include_router(router)
    return app


def _default_model_name(engine: Any) -> str:
    name = str(getattr(engine.config, "model", "") or getattr(engine, "model_path", "model"))
    if os.path.isdir(name):
        return os.path.basename(os.path.normpath(name))
    return name
