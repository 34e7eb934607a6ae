"""``InferScaleRetriever``: a LangChain retriever over one user's InferScale memories.

Each ``Document``'s ``page_content`` is the fact's handle (``mode="handles"``): a prompt built
from the documents carries handles that an InferScale model injects as KV. Metadata never
holds the fact text (so a prompt that renders metadata does not paste it back): ``fact_id``,
``score``, ``user_id``, ``role``, ``turn_id``, ``session_id``, ``created_at``... With
``mode="text"`` ``page_content`` is the fact text, for LLMs that are not InferScale.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from langchain_core.callbacks import (
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import field_validator

from inferscale_integrations._common import (
    OnEngine,
    RecallMode,
    check_mode,
    check_user_id,
    content_of,
    item_metadata,
    search,
)
from inferscale_integrations.langchain._base import InferScaleModelBase


class InferScaleRetriever(OnEngine, InferScaleModelBase, BaseRetriever):
    """Top-``k`` memories of ``user_id`` for a query, as handle (or text) documents.

    Example:
        ```python
        retriever = InferScaleRetriever(model="smollm2", user_id="alice", k=3)
        docs = retriever.invoke("What is my dog's name?")
        docs[0].page_content        # '<<mem:3f9a0c1d2e4b5a69:9c1e8b7d6a5f4e3c>>'
        docs[0].metadata["score"]   # 0.71
        ```
    """

    #: What other retrievers call ``k`` and ``min_score`` (``VectorStoreRetriever``'s
    #: ``search_kwargs={"k": ...}``, LlamaIndex's ``similarity_top_k``), for the unknown-argument error.
    _ARGUMENT_ALIASES: ClassVar[dict[str, str]] = {
        "search_kwargs": "k", "top_k": "k", "similarity_top_k": "k", "score_threshold": "min_score",
    }

    model: str | None = None
    """Model alias or local folder whose shared engine's store keeps the facts."""
    k: int = 4
    mode: RecallMode = "handles"
    min_score: float | None = None

    @field_validator("mode")
    @classmethod
    def _mode(cls, value: str) -> str:
        return check_mode(value)

    def _get_relevant_documents(
        self,
        query: str,
        *,
        run_manager: CallbackManagerForRetrieverRun | None = None,
        k: int | None = None,
        user_id: str | None = None,
        mode: str | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        user = self.user_id if user_id is None else check_user_id(user_id)
        mode = check_mode(mode or self.mode)
        hits = search(self.store, user_id=user, query=query, k=self.k if k is None else k, min_score=self.min_score)
        return [
            Document(page_content=content_of(item, mode), metadata=item_metadata(item, user_id=user), id=item.id)
            for item in hits
        ]

    async def _aget_relevant_documents(
        self,
        query: str,
        *,
        run_manager: AsyncCallbackManagerForRetrieverRun | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        return await asyncio.to_thread(self._get_relevant_documents, query, **kwargs)
