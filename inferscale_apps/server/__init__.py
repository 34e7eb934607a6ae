"""OpenAI-compatible HTTP server with Mem0-style memory endpoints (``inferscale serve``).

    from inferscale_engine import InferScaleEngine
    from inferscale_apps.server import create_app
    app = create_app(InferScaleEngine("smollm2"), api_key="secret")   # any ASGI server runs it

or :func:`serve` to build the engine and run uvicorn in one call.
"""

from __future__ import annotations

import logging
from typing import Any

from inferscale_apps.server.app import create_app
from inferscale_apps.server.errors import APIError, api_error

__all__ = ["APIError", "api_error", "create_app", "serve"]

logger = logging.getLogger(__name__)


def local_url(host: str, port: int) -> str:
    """The URL a client on this machine reaches a server bound to ``host`` at."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    default_max_tokens: int = 512,
    log_level: str = "info",
    engine: Any = None,
    **engine_options: Any,
) -> None:
    """Build an engine (unless given one) and serve it with uvicorn until interrupted."""
    import uvicorn

    own = engine is None
    if own:
        from inferscale_engine.engine import InferScaleEngine

        engine = InferScaleEngine(**engine_options)
    try:
        app = create_app(engine, served_model_name=served_model_name, api_key=api_key, default_max_tokens=default_max_tokens)
        store = engine.memory_if_built  # opened by create_app unless it failed
        if store is not None:
            store.advertise(local_url(host, port))
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5, access_log=log_level == "debug")
        uvicorn.Server(config).run()
    finally:
        if own:
            engine.close()
