"""The single-query embedding path a GPU search replays as a CUDA graph, checked on the CPU:
same computation (padded, mean-pooled over real tokens), same vectors as sentence-transformers."""

from __future__ import annotations

import numpy as np
import pytest

from inferscale_engine.memory.embedder import Embedder
from inferscale_engine.memory.query_graph import BUCKETS, GraphedQueryEncoder


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder(device="cpu")


def test_padded_query_path_matches_sentence_transformers(embedder):
    model = embedder.model
    encoder = GraphedQueryEncoder(model[0].auto_model)
    texts = ["hi", "My dog is called Rex and he likes long walks.", "word " * 200]
    reference = embedder.embed(texts)  # batched: the ordinary sentence-transformers path
    for text, ref in zip(texts, reference):
        ids = model.tokenizer(text, truncation=True, max_length=model.max_seq_length)["input_ids"]
        got = encoder(ids).numpy()
        assert np.abs(got - ref).max() < 1e-5
        assert abs(float(np.linalg.norm(got)) - 1.0) < 1e-5
    assert len(ids) > BUCKETS[-3]  # the long text is padded to one of the larger buckets


def test_only_mean_pooled_transformers_on_cuda_take_the_graphed_path(embedder):
    model = embedder.model
    assert not embedder._graphable(model)  # CPU: ordinary batched path
    on_gpu = Embedder(model, device="cuda")
    assert on_gpu._graphable(model)
    assert not on_gpu._graphable(object())
