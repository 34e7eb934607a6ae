"""LlamaIndex integration of InferScale: memory facts reach the LLM as injected KV.

* :class:`InferScaleLLM`: ``CustomLLM`` on the co-located engine (chat/complete, stream, async).
* :class:`InferScaleRetriever`: ``NodeWithScore`` per relevant fact, node text = handle.
* :class:`InferScaleMemory`: ``BaseMemory`` for chat engines, recalled turns as handles.
* :class:`InferScaleMemoryBlock`: long-term block for llama-index's ``Memory`` (agents).
* :class:`InferScaleVectorStore`: ``BasePydanticVectorStore`` for ingestion
  (``VectorStoreIndex.from_documents``): nodes become facts, queries return handles.
* :class:`InferScaleEmbedding`: the memory store's embedding model (no OpenAI needed).
* :class:`HandleOwnerError`: the LLM's ``user_id`` is not the one the handles were recalled for.

See docs/llamaindex.md.
"""

from inferscale_integrations._common import get_engine, register_engine
from inferscale_integrations.llamaindex.llms import HandleOwnerError, InferScaleLLM, register_handle_guard
from inferscale_integrations.llamaindex.memory import (
    InferScaleMemory,
    InferScaleMemoryBlock,
)
from inferscale_integrations.llamaindex.retrievers import InferScaleRetriever
from inferscale_integrations.llamaindex.vector_store import (
    InferScaleEmbedding,
    InferScaleVectorStore,
)

register_handle_guard()

__all__ = [
    "HandleOwnerError",
    "InferScaleEmbedding",
    "InferScaleLLM",
    "InferScaleMemory",
    "InferScaleMemoryBlock",
    "InferScaleRetriever",
    "InferScaleVectorStore",
    "get_engine",
    "register_engine",
]
