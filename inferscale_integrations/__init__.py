"""Framework integrations of InferScale (LangChain, LangGraph, LlamaIndex).

Import the framework's subpackage (``inferscale_integrations.langchain``,
``inferscale_integrations.langgraph`` or ``inferscale_integrations.llamaindex``); this package
itself only exposes the shared engine factory, which imports no framework.
"""

from inferscale_integrations._common import expand_handles, get_engine, register_engine

__all__ = ["expand_handles", "get_engine", "register_engine"]
