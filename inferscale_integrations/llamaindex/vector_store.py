"""``InferScaleVectorStore``: LlamaIndex ingestion into InferScale memory, queried with injected KV.

The usual LlamaIndex path works unchanged but for the store and the models::

    vector_store = InferScaleVectorStore(model="smollm2", user_id="alice")
    index = VectorStoreIndex.from_documents(
        documents,
        storage_context=StorageContext.from_defaults(vector_store=vector_store),
        embed_model=InferScaleEmbedding(model="smollm2"),
    )
    index.as_query_engine(llm=InferScaleLLM(model="smollm2", user_id="alice")).query("...")

Decisions (see docs/llamaindex.md, "Ingesting documents"):

* **Nodes are facts.** ``add`` stores each node's text as memory facts of ``user_id``, in one
  transaction per call, encoded in the background like any fact. The node's id, its document's
  id (``ref_doc_id``) and its metadata go in the fact's metadata.
* **Chunks fit the model.** A node longer than ``chunk_tokens`` model tokens (default 256) is
  split by LlamaIndex's ``SentenceSplitter`` (``chunk_overlap`` tokens shared) into several
  facts, whatever node parser ran before (LlamaIndex's default is 1024 tokens of another
  tokenizer). The store's embedder (all-MiniLM-L6-v2) reads at most 256 word pieces, so a
  longer chunk's tail could never be found; and each fact is encoded after the ``window``
  facts before it, which keeps a chunk's encode at most 6 × 256 tokens of prefill.
* **The store embeds.** ``stores_text = True`` and ``is_embedding_query = False``: the memory
  store embeds facts and queries with its own model (all-MiniLM-L6-v2 by default), and
  ``query`` searches with the query text. LlamaIndex still embeds nodes at ingestion with the
  index's ``embed_model`` (its default needs OpenAI): :class:`InferScaleEmbedding` is the
  store's model, so nothing leaves the machine; those vectors are not used.
* **Query results are handles.** Each node returned has the fact's handle as its text
  (``mode="handles"``; ``mode="text"``: the chunk's text, for LLMs that are not InferScale), so
  the response synthesizer puts handles in the prompt and ``InferScaleLLM`` injects the KV.
  Node metadata is kept from the LLM's view, as :class:`InferScaleRetriever` does.
* Only facts added through a vector store are nodes: the user's chat memories are not returned.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from llama_index.core.bridge.pydantic import Field
from llama_index.core.schema import BaseNode, MetadataMode, NodeRelationship, RelatedNodeInfo, TextNode
from llama_index.core.vector_stores.types import (
    BasePydanticVectorStore,
    MetadataFilters,
    VectorStoreQuery,
    VectorStoreQueryResult,
)
from llama_index.core.vector_stores.utils import build_metadata_filter_fn

from inferscale_engine.errors import InferScaleError
from inferscale_engine.types import DEFAULT_USER
from inferscale_integrations._common import SOURCE_KEY, OnEngine, RecallMode, check_mode, content_of
from inferscale_integrations.llamaindex._base import InferScaleComponent
from inferscale_integrations.llamaindex.retrievers import remember_issued

if TYPE_CHECKING:
    from inferscale_engine.memory import MemoryItem

SOURCE = "llamaindex-vector-store"
#: Metadata key of a fact that is (a chunk of) a node: ``{"node_id", "ref_doc_id", "chunk", "metadata"}``.
NODE_KEY = "llamaindex_node"
_MAX_K = 1000  # the memory store's largest search


def _json_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """A node's metadata as JSON (what the store keeps): values JSON cannot hold become strings."""
    return json.loads(json.dumps(metadata, default=str))


class InferScaleEmbedding(OnEngine, InferScaleComponent, BaseEmbedding):
    """The memory store's embedding model as a LlamaIndex ``BaseEmbedding`` (no OpenAI needed).

    Pass it as ``embed_model=`` (or set ``Settings.embed_model``) when an index is built on
    :class:`InferScaleVectorStore`.
    """

    model_name: str = Field(default="smollm2", description="Model alias/folder of the shared engine.")

    _WARN_NO_USER = False  # embeddings belong to no user
    __init__ = InferScaleComponent.__init__  # so that type checkers know engine=, model=

    @classmethod
    def class_name(cls) -> str:
        return "InferScaleEmbedding"

    def _embed(self, texts: list[str]) -> list[Embedding]:
        return self.store.embedder.embed(texts).tolist()

    def _get_query_embedding(self, query: str) -> Embedding:
        return self._embed([query])[0]

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return (await asyncio.to_thread(self._embed, [query]))[0]

    def _get_text_embedding(self, text: str) -> Embedding:
        return self._embed([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return self._embed(texts)


class InferScaleVectorStore(OnEngine, InferScaleComponent, BasePydanticVectorStore):
    """A LlamaIndex vector store whose nodes are memory facts of one user, queried as handles.

    Example:
        ```python
        from llama_index.core import Document, StorageContext, VectorStoreIndex
        from inferscale_integrations.llamaindex import InferScaleEmbedding, InferScaleLLM, InferScaleVectorStore

        vector_store = InferScaleVectorStore(model="smollm2", user_id="alice")
        index = VectorStoreIndex.from_documents(
            [Document(text=open("handbook.txt").read())],
            storage_context=StorageContext.from_defaults(vector_store=vector_store),
            embed_model=InferScaleEmbedding(model="smollm2"),
        )
        engine = index.as_query_engine(llm=InferScaleLLM(model="smollm2", user_id="alice"))
        print(engine.query("How many vacation days do I get?"))
        ```
    """

    stores_text: bool = True
    is_embedding_query: bool = False
    flat_metadata: bool = False

    user_id: str = Field(default=DEFAULT_USER, description="Owner of the facts; handles resolve only for this user.")
    model_name: str | None = Field(default=None, description="Model alias/folder of the shared engine.")
    mode: RecallMode = Field(default="handles", description="Query results as handles or as text.")
    chunk_tokens: int = Field(default=256, gt=0, description="Longest fact, in model tokens; longer nodes are split.")
    chunk_overlap: int = Field(default=32, ge=0, description="Tokens shared by consecutive chunks of a split node.")

    __init__ = InferScaleComponent.__init__  # so that type checkers know engine=, model=

    def _check_fields(self) -> None:
        check_mode(self.mode)
        if self.chunk_overlap >= self.chunk_tokens:
            raise ValueError(f"chunk_overlap ({self.chunk_overlap}) must be smaller than chunk_tokens ({self.chunk_tokens})")

    @classmethod
    def class_name(cls) -> str:
        return "InferScaleVectorStore"

    @property
    def client(self) -> Any:
        """The InferScale memory store (as other vector stores hand out their database client)."""
        return self.store

    @property
    def embed_model(self) -> InferScaleEmbedding:
        """An :class:`InferScaleEmbedding` on this store's engine, for ``embed_model=``."""
        return InferScaleEmbedding(engine=self.get_engine())

    # ------------------------------------------------------------------ writes

    def _chunks(self, text: str) -> list[str]:
        """``text`` in pieces of at most ``chunk_tokens`` model tokens (one piece when it fits)."""
        encoder = self.store.encoder
        if encoder is not None and len(encoder.tokenize(text)) <= self.chunk_tokens:
            return [text]
        from llama_index.core.node_parser import SentenceSplitter

        # Counted in the model's tokens; a retrieval-only store (no model) counts LlamaIndex's.
        splitter = SentenceSplitter(chunk_size=self.chunk_tokens, chunk_overlap=self.chunk_overlap,
                                    tokenizer=encoder.tokenize if encoder is not None else None)
        return [c for c in splitter.split_text(text) if c.strip()]

    def add(self, nodes: Sequence[BaseNode], **add_kwargs: Any) -> list[str]:
        """Store each node's text as facts of ``user_id`` (split to ``chunk_tokens``); returns the node ids."""
        texts: list[str] = []
        metas: list[dict[str, Any]] = []
        for node in nodes:
            text = node.get_content(metadata_mode=MetadataMode.NONE)
            for i, chunk in enumerate(self._chunks(text) if text.strip() else []):
                texts.append(chunk)
                metas.append({SOURCE_KEY: SOURCE, NODE_KEY: {
                    "node_id": node.node_id, "ref_doc_id": node.ref_doc_id, "chunk": i,
                    "metadata": _json_metadata(dict(node.metadata)),
                }})
        if texts:
            self.store.add_texts(texts, user_id=self.user_id, metadata=metas)
        return [node.node_id for node in nodes]

    async def async_add(self, nodes: Sequence[BaseNode], **kwargs: Any) -> list[str]:
        return await asyncio.to_thread(self.add, nodes, **kwargs)

    def _facts(self, node_ids: list[str] | None = None, filters: MetadataFilters | None = None,
               doc_ids: list[str] | None = None) -> list[MemoryItem]:
        """The user's node facts, restricted to ``node_ids`` (ids of the nodes added, or of the
        chunks returned) / ``doc_ids`` and ``filters``."""
        facts = {i.id: i for i in self.store.get_all(user_id=self.user_id) if NODE_KEY in (i.metadata or {})}
        keep = build_metadata_filter_fn(lambda fact_id: facts[fact_id].metadata[NODE_KEY]["metadata"], filters)
        wanted_nodes = set(node_ids) if node_ids is not None else None
        wanted_docs = set(doc_ids) if doc_ids is not None else None
        out = []
        for fact_id, item in facts.items():
            node = item.metadata[NODE_KEY]
            if wanted_nodes is not None and node["node_id"] not in wanted_nodes and fact_id not in wanted_nodes:
                continue
            if wanted_docs is not None and node["ref_doc_id"] not in wanted_docs:
                continue
            if keep(fact_id):
                out.append(item)
        return out

    def _delete(self, facts: list[MemoryItem]) -> None:
        for item in facts:
            self.store.delete(item.id, user_id=self.user_id)

    def delete(self, ref_doc_id: str, **delete_kwargs: Any) -> None:
        """Delete the facts of every node of document ``ref_doc_id``."""
        self._delete(self._facts(doc_ids=[ref_doc_id]))

    def delete_nodes(self, node_ids: list[str] | None = None, filters: MetadataFilters | None = None,
                     **delete_kwargs: Any) -> None:
        """Delete the facts of the nodes ``node_ids`` (all nodes for None) that pass ``filters``."""
        self._delete(self._facts(node_ids=node_ids, filters=filters))

    def clear(self) -> None:
        """Delete every node fact of ``user_id`` (the user's other memories stay)."""
        self._delete(self._facts())

    # ------------------------------------------------------------------ reads

    def _node(self, item: MemoryItem, score: float | None = None) -> TextNode:
        node = item.metadata[NODE_KEY]
        metadata = {**node["metadata"], "fact_id": item.id, "user_id": self.user_id, "chunk": node["chunk"]}
        if score is not None:
            metadata["score"] = score
        relationships = {}
        if node.get("ref_doc_id"):
            relationships[NodeRelationship.SOURCE] = RelatedNodeInfo(node_id=node["ref_doc_id"])
        keys = list(metadata)
        return TextNode(
            id_=item.id,  # a fact is a chunk: a node split at ingestion answers as several
            text=content_of(item, self.mode),
            metadata=metadata,
            relationships=relationships,
            excluded_llm_metadata_keys=keys,
            excluded_embed_metadata_keys=keys,
        )

    def get_nodes(self, node_ids: list[str] | None = None, filters: MetadataFilters | None = None) -> list[BaseNode]:
        """The stored chunks of ``node_ids`` (all for None) passing ``filters``, in insertion order."""
        return [self._node(item) for item in self._facts(node_ids=node_ids, filters=filters)]

    def query(self, query: VectorStoreQuery, **kwargs: Any) -> VectorStoreQueryResult:
        """The ``similarity_top_k`` chunks most similar to ``query.query_str`` (semantic search by
        the memory store), within ``node_ids`` / ``doc_ids`` / ``filters``; node text = handle."""
        if not query.query_str or not query.query_str.strip():
            raise InferScaleError("InferScaleVectorStore searches by query text (the memory store embeds it); "
                                  "this query has only an embedding")
        top_k = max(int(query.similarity_top_k or 1), 1)
        # An index over a store that keeps text passes node_ids=[]: no restriction.
        node_ids, doc_ids = query.node_ids or None, query.doc_ids or None
        restricted = node_ids is not None or doc_ids is not None or query.filters is not None
        allowed = {i.id for i in self._facts(node_ids, query.filters, doc_ids)} if restricted else None
        hits: list[MemoryItem] = []
        k = min(_MAX_K, 2 * top_k)
        while True:
            found = self.store.search(query.query_str, user_id=self.user_id, k=k)
            hits = [h for h in found if NODE_KEY in (h.metadata or {}) and (allowed is None or h.id in allowed)]
            if len(hits) >= top_k or len(found) < k or k == _MAX_K:
                break
            k = min(_MAX_K, 4 * k)
        hits = hits[:top_k]
        if self.mode == "handles":
            remember_issued(self.store, {h.handle: self.user_id for h in hits})
        nodes = [self._node(h, h.score) for h in hits]
        return VectorStoreQueryResult(nodes=nodes, similarities=[float(h.score or 0.0) for h in hits],
                                      ids=[n.node_id for n in nodes])

    async def aquery(self, query: VectorStoreQuery, **kwargs: Any) -> VectorStoreQueryResult:
        return await asyncio.to_thread(self.query, query, **kwargs)
