"""``InferScaleRetriever``: a LlamaIndex retriever over one user's InferScale memories.

Returns ``NodeWithScore`` whose ``TextNode.text`` is the fact's handle (``mode="handles"``), so
``RetrieverQueryEngine`` / ``CondensePlusContextChatEngine`` put handles into the context and an
InferScale LLM injects their KV. Node metadata (``fact_id``, ``score``, ``role``, times...) holds
no fact text and is excluded from what the LLM and embedders see, so the context is the handles
alone. ``mode="text"`` puts the fact text in the node instead, for LLMs that are not InferScale.

Note: LlamaIndex budgets context by counting the tokens of node text; a handle is ~25 tokens
whatever its fact's length, so that budget undercounts long facts (the engine still checks the
real length and raises ``ContextOverflowError`` rather than truncating).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.callbacks import CallbackManager
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from inferscale_integrations._common import (
    EngineConstructors,
    EngineRef,
    OnEngine,
    RecallMode,
    check_mode,
    checks_arguments,
    content_of,
    item_metadata,
    search,
    user_of,
)

if TYPE_CHECKING:
    from inferscale_engine import InferScaleEngine
    from inferscale_engine.memory import MemoryItem, MemoryStore


# Handles this process's retrievers handed out, per store: an InferScaleLLM given no user_id
# serves the handles of the one user they were retrieved for (RetrieverQueryEngine passes the
# LLM only the prompt text, never the retriever). Bounded: old entries are forgotten first.
_ISSUED: weakref.WeakKeyDictionary[MemoryStore, OrderedDict[str, str]] = weakref.WeakKeyDictionary()
_ISSUED_MAX = 100_000
_ISSUED_LOCK = threading.Lock()


def remember_issued(store: MemoryStore, handles: dict[str, str]) -> None:
    with _ISSUED_LOCK:
        issued = _ISSUED.setdefault(store, OrderedDict())
        for handle, user in handles.items():
            issued[handle] = user
            issued.move_to_end(handle)
        while len(issued) > _ISSUED_MAX:
            issued.popitem(last=False)


def issued_to(store: MemoryStore, handles: list[str]) -> set[str | None]:
    """The users the handles were retrieved for (None for a handle no retriever issued)."""
    with _ISSUED_LOCK:
        issued: Mapping[str, str] = _ISSUED.get(store) or {}
        return {issued.get(h) for h in handles}


def node_for(item: MemoryItem, *, user_id: str, mode: str) -> TextNode:
    metadata = item_metadata(item, user_id=user_id)
    keys = list(metadata)
    return TextNode(
        id_=item.id,
        text=content_of(item, mode),
        metadata=metadata,
        excluded_llm_metadata_keys=keys,
        excluded_embed_metadata_keys=keys,
    )


class InferScaleRetriever(OnEngine, EngineConstructors, BaseRetriever):
    """Top-``similarity_top_k`` memories of ``user_id`` for a query, as handle (or text) nodes.

    Example:
        ```python
        from llama_index.core.query_engine import RetrieverQueryEngine
        from inferscale_integrations.llamaindex import InferScaleLLM, InferScaleRetriever

        retriever = InferScaleRetriever(model="smollm2", user_id="alice", similarity_top_k=3)
        engine = RetrieverQueryEngine.from_args(retriever, llm=InferScaleLLM(model="smollm2", user_id="alice"))
        print(engine.query("What is my dog's name?"))
        ```
    """

    #: What other retrievers call ``similarity_top_k``, for the unknown-argument error.
    _ARGUMENT_ALIASES: ClassVar[dict[str, str]] = {
        "k": "similarity_top_k", "top_k": "similarity_top_k", "search_kwargs": "similarity_top_k",
    }

    @checks_arguments
    def __init__(
        self,
        *,
        user_id: str | None = None,
        engine: InferScaleEngine | None = None,
        model: str | None = None,
        similarity_top_k: int = 4,
        mode: RecallMode = "handles",
        min_score: float | None = None,
        engine_options: dict[str, Any] | None = None,
        callback_manager: CallbackManager | None = None,
        verbose: bool = False,
    ) -> None:
        super().__init__(callback_manager=callback_manager, verbose=verbose)
        self.user_id = user_of(type(self), user_id)
        self.similarity_top_k = similarity_top_k
        self.mode = check_mode(mode)
        self.min_score = min_score
        self._engine = EngineRef(engine, model, engine_options)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        hits = search(
            self.store, user_id=self.user_id, query=query_bundle.query_str, k=self.similarity_top_k, min_score=self.min_score
        )
        if self.mode == "handles":
            remember_issued(self.store, {h.handle: self.user_id for h in hits})
        return [NodeWithScore(node=node_for(h, user_id=self.user_id, mode=self.mode), score=h.score) for h in hits]

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return await asyncio.to_thread(self._retrieve, query_bundle)
