"""The single-query embedding path a GPU search replays as a CUDA graph, checked on the CPU:
same computation (padded, mean-pooled over real tokens), same vectors as sentence-transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inferscale_engine.memory.text.embedder import Embedder
from inferscale_engine.memory.text.query_graph import BUCKETS, GraphedQueryEncoder
from inferscale_engine.testing import query_embedding_eager, takes_graphed_path


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder(device="cpu")


@pytest.mark.minilm
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


@pytest.mark.minilm
def test_only_mean_pooled_transformers_on_cuda_take_the_graphed_path(embedder):
    model = embedder.model
    assert not takes_graphed_path(embedder, model)  # CPU: ordinary batched path
    on_gpu = Embedder(model, device="cuda")
    assert takes_graphed_path(on_gpu, model)
    assert not takes_graphed_path(on_gpu, object())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the half-precision query graph runs on CUDA only")
def test_half_precision_query_graph_finds_what_fp32_finds():
    """On CUDA a query embeds in fp16 (half the replay time) on a copy of the encoder: the vector
    and the ranking it gives over stored fp32 vectors are fp32's."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
    model = BertModel(cfg).cuda().eval()
    half, full = GraphedQueryEncoder(model), GraphedQueryEncoder(model, dtype=None)
    assert half.model is not model and next(half.model.parameters()).dtype == torch.float16
    assert full.model is model  # the facts' batched path keeps the model as it is
    stored = torch.nn.functional.normalize(torch.randn(10_000, 384), dim=-1)
    for n in (5, 24, 60):
        ids = torch.randint(1000, 30000, (n,)).tolist()
        a, b = half(ids), full(ids)
        assert float(a @ b) > 0.9999
        assert set(torch.topk(stored @ a, 10).indices.tolist()) == set(torch.topk(stored @ b, 10).indices.tolist())


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
])
def test_each_query_embeds_as_it_would_alone_whatever_came_before(device):
    """A query shorter than the one before it in the same bucket: the earlier one's tokens and
    mask past its length are gone (on CUDA the bucket's input buffer is reused)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    model = BertModel(cfg).to(device).eval()
    encoder = GraphedQueryEncoder(model, dtype=None)
    queries = [torch.randint(1000, 30000, (n,)).tolist() for n in (30, 5, 17, 16, 3, 300)]
    for ids in queries:
        got = encoder(ids)
        assert got.device.type == "cpu" and got.shape == (32,)
        assert torch.allclose(got, query_embedding_eager(model, ids).cpu(), atol=1e-5)


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
])
def test_queries_left_on_the_device_find_what_their_host_vectors_find(device):
    """The store's search path: each vector stays on the device and the index's stream waits for
    it. Queries embedded back to back, before any is searched (on CUDA each replays the bucket's
    graph over the last one's input and output buffers), each rank as their host vectors do."""
    from transformers import BertConfig, BertModel

    from inferscale_engine.memory.meta.index import ExactIndex, FaissIndex

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    model = BertModel(cfg).to(device).eval()
    encoder = GraphedQueryEncoder(model, dtype=None)
    index = ExactIndex(32, device=device)
    stored = torch.nn.functional.normalize(torch.randn(500, 32), dim=-1).numpy()
    index.add(list(range(1000, 1500)), stored)
    queries = [torch.randint(1000, 30000, (n,)).tolist() for n in (30, 5, 17, 16, 3)]
    on_device = [encoder.on_device(ids) for ids in queries]
    for ids, query in zip(queries, on_device):
        assert query.vec.device.type == device and (query.ready is not None) == (device == "cuda")
        host = encoder(ids).numpy()
        assert np.abs(query.numpy() - host).max() < 1e-6
        assert index.search(query, 20) == index.search(host, 20)
    if device == "cpu":
        pytest.importorskip("faiss")
        flat = FaissIndex(32)
        flat.add(list(range(1000, 1500)), stored)
        assert [s for s, _ in flat.search(on_device[0], 20)] == [s for s, _ in index.search(on_device[0], 20)]
