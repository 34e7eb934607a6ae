"""LlamaIndex ingestion: ``VectorStoreIndex.from_documents`` into ``InferScaleVectorStore``, then a
query engine built the usual way, on SmolLM2. Asserts chunking, injection and retrieval, not
a 135M model's wording."""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llama_index.core import Document, StorageContext, VectorStoreIndex
from llama_index.core.vector_stores.types import (
    ExactMatchFilter,
    MetadataFilters,
    VectorStoreQuery,
)

from inferscale_engine.handles import HANDLE_PATTERN
from inferscale_integrations import get_engine
from inferscale_integrations.llamaindex import (
    InferScaleEmbedding,
    InferScaleLLM,
    InferScaleVectorStore,
)

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probes import Recorder  # noqa: E402
from test_examples import load  # noqa: E402

HANDBOOK = load("llamaindex_ingest").HANDBOOK


def uid() -> str:
    return f"u-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def engine(smollm2_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    # One engine per module, closed at the end: vLLM keeps the first live engine's KV-connector
    # worker in a process global, so an engine left alive would break any engine built after it.
    eng = get_engine("smollm2", store_path=tmp_path_factory.mktemp("li-ingest"), recompute=0)
    yield eng
    eng.close()


def ingest(engine: Any, user: str, documents: list[Document], **kwargs: Any) -> tuple[InferScaleVectorStore, Any]:
    vector_store = InferScaleVectorStore(engine=engine, user_id=user, **kwargs)
    index = VectorStoreIndex.from_documents(
        documents,
        storage_context=StorageContext.from_defaults(vector_store=vector_store),
        embed_model=InferScaleEmbedding(engine=engine),
    )
    return vector_store, index


def test_documents_become_chunks_that_fit(engine: Any) -> None:
    user = uid()
    vector_store, _ = ingest(engine, user, [Document(text=HANDBOOK, metadata={"title": "handbook"})])
    facts = engine.memory.get_all(user_id=user)
    assert len(facts) >= 3  # a long document is split...
    assert all(len(engine.tokenize(f.memory)) <= vector_store.chunk_tokens for f in facts)  # ...to fit
    for sentence in ("The big wood-fired oven is called Bertha", "25 days of paid holiday", "Marta Silva"):
        assert any(sentence in f.memory for f in facts)  # nothing is lost between chunks
    assert {f.metadata["llamaindex_node"]["metadata"]["title"] for f in facts} == {"handbook"}


def test_query_engine_built_the_usual_way_injects_the_document(engine: Any) -> None:
    user = uid()
    _, index = ingest(engine, user, [Document(text=HANDBOOK)])
    engine.memory.wait_for_encoding()
    query_engine = index.as_query_engine(llm=InferScaleLLM(engine=engine, user_id=user, max_tokens=24))
    with Recorder(engine) as rec:
        response = query_engine.query("How many days of paid holiday do staff get?")
    # Retrieval: the chunk that answers came back, as a handle of this user's fact.
    texts = []
    for hit in response.source_nodes:
        assert HANDLE_PATTERN.fullmatch(hit.node.get_content())
        texts.append(engine.memory.resolve(hit.node.get_content(), user).text)
    assert any("25 days of paid holiday" in t for t in texts)
    # Injection: the chunks reached the model as KV, the bulk of the prompt.
    (result,) = rec.results
    assert result.usage.injected_tokens >= sum(len(engine.tokenize(t)) for t in texts)
    assert result.usage.injected_tokens > result.usage.prompt_tokens // 2
    print("answer:", str(response).strip())


def test_store_api_delete_filters_and_async(engine: Any) -> None:
    user = uid()
    docs = [Document(text="The red bicycle belongs to Ana.", doc_id="doc-a", metadata={"topic": "bikes"}),
            Document(text="The blue kayak belongs to Rui.", doc_id="doc-b", metadata={"topic": "boats"})]
    vector_store, index = ingest(engine, user, docs)
    query = VectorStoreQuery(query_str="who owns the bicycle?", similarity_top_k=1)
    (node,) = vector_store.query(query).nodes
    assert engine.memory.resolve(node.get_content(), user).text == "The red bicycle belongs to Ana."
    boats = MetadataFilters(filters=[ExactMatchFilter(key="topic", value="boats")])
    filtered = vector_store.query(VectorStoreQuery(query_str="who owns the bicycle?", similarity_top_k=2, filters=boats))
    assert [n.metadata["topic"] for n in filtered.nodes] == ["boats"]
    assert len(asyncio.run(vector_store.aquery(query)).nodes) == 1
    text_store = InferScaleVectorStore(engine=engine, user_id=user, mode="text")
    assert [n.get_content() for n in text_store.get_nodes()] == [d.text for d in docs]
    # Another user's store sees none of it.
    assert InferScaleVectorStore(engine=engine, user_id=uid()).query(query).nodes == []
    # LlamaIndex's own delete path: by document.
    index.delete_ref_doc("doc-a")
    assert [n.get_content() for n in text_store.get_nodes()] == ["The blue kayak belongs to Rui."]
    vector_store.delete_nodes(filters=boats)
    assert text_store.get_nodes() == [] and engine.memory.get_all(user_id=user) == []


def test_example_llamaindex_ingest(engine: Any) -> None:
    example = load("llamaindex_ingest")
    with Recorder(engine) as rec:
        answers = example.main(engine, example.QUESTIONS)
    assert len(answers) == len(example.QUESTIONS) and all(isinstance(a, str) for a in answers)
    assert rec.handles_seen >= len(example.QUESTIONS) and rec.injected > 0
    assert all(r.usage.injected_tokens > 0 for r in rec.results)
