"""LangChain integration of InferScale: memory facts reach the model as injected KV.

* :class:`ChatInferScale` / :class:`InferScaleLLM`: chat and completion models on the
  co-located engine; handles in prompts are resolved for ``user_id`` and injected.
* :class:`InferScaleMemory`: drop-in for ``ConversationBufferMemory`` (recalled turns as handles).
* :class:`InferScaleChatMessageHistory`: ``BaseChatMessageHistory`` for ``RunnableWithMessageHistory``.
* :class:`InferScaleRetriever`: ``Document(page_content=handle)`` per relevant fact.
* :class:`InferScaleMemoryMiddleware`: memory for ``langchain.agents.create_agent`` (needs ``langchain``).
* :class:`HandleExpander`: handles → text in front of a model that is not InferScale.

See docs/langchain.md.
"""

from inferscale_integrations._common import get_engine, register_engine
from inferscale_integrations.langchain.chat_history import InferScaleChatMessageHistory
from inferscale_integrations.langchain.chat_models import ChatInferScale
from inferscale_integrations.langchain.handles import HandleExpander
from inferscale_integrations.langchain.llms import InferScaleLLM
from inferscale_integrations.langchain.memory import InferScaleMemory
from inferscale_integrations.langchain.retrievers import InferScaleRetriever

__all__ = [
    "ChatInferScale",
    "HandleExpander",
    "InferScaleChatMessageHistory",
    "InferScaleLLM",
    "InferScaleMemory",
    "InferScaleMemoryMiddleware",
    "InferScaleRetriever",
    "get_engine",
    "register_engine",
]


def __getattr__(name: str):  # the middleware needs the optional `langchain` package
    if name == "InferScaleMemoryMiddleware":
        from inferscale_integrations.langchain.middleware import (
            InferScaleMemoryMiddleware,
        )

        return InferScaleMemoryMiddleware
    raise AttributeError(name)
