"""InferScale's vLLM KV connector; ``kv_connector_module_path="inferscale_engine.connector"``
finds :class:`~inferscale_engine.connector.connector.InferScaleConnector` here (imported on
first use: the plan and exchange modules must not pay for the connector's imports)."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "InferScaleConnector":
        from inferscale_engine.connector.connector import InferScaleConnector

        return InferScaleConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
