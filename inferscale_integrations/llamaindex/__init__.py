"""LlamaIndex integration of InferScale: memory facts reach the LLM as injected KV.

* :class:`InferScaleLLM`: ``CustomLLM`` on the co-located engine (chat/complete, stream, async).
* :class:`InferScaleRetriever`: ``NodeWithScore`` per relevant fact, node text = handle.
* :class:`InferScaleMemory`: ``BaseMemory`` for chat engines, recalled turns as handles.
* :class:`InferScaleMemoryBlock`: long-term block for llama-index's ``Memory`` (agents).

See docs/llamaindex.md.
"""

from inferscale_integrations._common import get_engine, register_engine
from inferscale_integrations.llamaindex.llms import InferScaleLLM, register_handle_guard
from inferscale_integrations.llamaindex.memory import (
    InferScaleMemory,
    InferScaleMemoryBlock,
)
from inferscale_integrations.llamaindex.retrievers import InferScaleRetriever

register_handle_guard()

__all__ = [
    "InferScaleLLM",
    "InferScaleMemory",
    "InferScaleMemoryBlock",
    "InferScaleRetriever",
    "get_engine",
    "register_engine",
]
