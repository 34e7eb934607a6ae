"""MemoryStore with a real InferScaleEngine (tiny random Llama, CPU, fp32).

One engine and one MiniLM embedder are shared by the whole module; every test gets its own
store folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest
import torch
from probes import fact_row, logged, mint_handle

from inferscale_engine.errors import (
    ConnectorError,
    ContextOverflowError,
    EngineClosedError,
    FactNotFoundError,
    ForgedHandleError,
    InferScaleError,
    KVNotReadyError,
    MalformedHandleError,
    StaleKVError,
)
from inferscale_engine.handles import Handle, find_handles
from inferscale_engine.kv import FactKV
from inferscale_engine.memory import MemoryItem, MemoryStore
from inferscale_engine.memory.encoding import engine_generate
from inferscale_engine.memory.text.embedder import Embedder
from inferscale_engine.types import EncodeWindow, Span, as_fact_source

REPO = Path(__file__).resolve().parent.parent
ENGINE_OPTIONS = {"device": "cpu", "dtype": "float32", "max_model_len": 1024, "recompute": 0}


@pytest.fixture(scope="module")
def engine(tiny_llama, tmp_path_factory):
    from inferscale_engine import InferScaleEngine

    eng = InferScaleEngine(model=tiny_llama, store_path=tmp_path_factory.mktemp("engine-store"), **ENGINE_OPTIONS)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    emb = Embedder()
    emb.embed(["warm up"])
    return emb


@pytest.fixture
def make_store(engine, embedder, tmp_path):
    stores: list[MemoryStore] = []

    def make(path: Path | None = None, *, eng=None, **kwargs) -> MemoryStore:
        store = MemoryStore(eng or engine, path or tmp_path / "store", embedder=embedder, **kwargs)
        stores.append(store)
        return store

    yield make
    engine.fact_source = None
    for s in stores:
        s.close()


def handle_of(item: MemoryItem) -> Handle:
    (h,) = find_handles(item.handle)
    return h


def kv_files(store: MemoryStore) -> set[str]:
    return {p.name for p in (store.path / "kv").rglob("*") if p.is_file()}


class GatedEngine:
    """The real engine, with encode calls that can be held back or made to fail."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.hold = threading.Event()  # set: the next encode call blocks until `release` is set
        self.release = threading.Event()
        self.blocked = threading.Event()
        self.fail = 0
        self.calls: list[int] = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def encode(self, windows, **kwargs):
        self.calls.append(len(windows))
        if self.fail:
            self.fail -= 1
            raise RuntimeError("injected encode failure")
        if self.hold.is_set():
            self.hold.clear()
            self.blocked.set()
            assert self.release.wait(60)
        return self._engine.encode(windows, **kwargs)


# ------------------------------------------------------------------------------ basics


def test_add_messages_get_history_update_delete(make_store, engine):
    store = make_store()
    items = store.add(
        [{"role": "user", "content": "My dog is called Rex."},
         {"role": "assistant", "content": "Rex is a good name."},
         {"role": "user", "content": "Bob says hi.", "name": "Bob"}],
        user_id="alice", metadata={"session": 1},
    )
    assert [i.memory for i in items] == ["User: My dog is called Rex.", "Assistant: Rex is a good name.", "Bob: Bob says hi."]
    plain = store.add("Alice lives in Paris.", user_id="alice")[0]
    assert plain.memory == "Alice lives in Paris." and plain.metadata == {}
    for it in items + [plain]:
        assert len(it.id) == 16 and all(c in "0123456789abcdef" for c in it.id)
        assert it.user_id == "alice" and it.score is None
        assert it.handle == store.handle(it.id, user_id="alice")
    d = items[0].to_dict()
    assert set(d) == {"id", "memory", "user_id", "hash", "metadata", "created_at", "updated_at", "handle"}
    assert d["metadata"] == {"session": 1}
    assert "score" in store.search("dog", user_id="alice")[0].to_dict()

    store.wait_for_encoding(30)
    assert all(i.encoded for i in store.get_all(user_id="alice"))
    assert [i.id for i in store.get_all(user_id="alice")] == [i.id for i in items] + [plain.id]
    assert store.get(plain.id).memory == plain.memory

    span = store.resolve(handle_of(items[0]), "alice")
    assert isinstance(span, Span) and span.key == f"fact:{items[0].id}:1"
    assert list(span.token_ids) == engine.tokenize("User: My dog is called Rex.")
    assert span.text == "User: My dog is called Rex." and span.kv.num_tokens == len(span.token_ids)
    assert span.kv.position == 0  # the first fact of the user has no context

    # The 4th fact was encoded after the three before it (window 5), "\n"-joined.
    span4 = store.resolve(handle_of(plain), "alice")
    context = engine.tokenize("\n".join(i.memory for i in items) + "\n")
    assert span4.kv.position == len(context)
    ref = engine.encode([EncodeWindow.single(span4.token_ids, context)])[0][0]
    assert torch.allclose(ref.k, span4.kv.k, atol=1e-4) and torch.allclose(ref.v, span4.kv.v, atol=1e-4)

    old_file = store.tiers.path((items[0].id, 1))
    assert old_file.exists()
    updated = store.update(items[0].id, "User: My dog is called Max.", user_id="alice")
    assert updated.memory == "User: My dog is called Max." and updated.handle == items[0].handle
    assert updated.updated_at > updated.created_at
    span = store.resolve(handle_of(items[0]), "alice")  # waits for / performs the re-encode
    assert span.key == f"fact:{items[0].id}:2" and span.text == "User: My dog is called Max."
    assert not old_file.exists() and store.tiers.path((items[0].id, 2)).exists()
    assert store.search("dog name", user_id="alice", k=1)[0].memory == "User: My dog is called Max."

    store.delete(items[1].id)
    with pytest.raises(FactNotFoundError):
        store.get(items[1].id)
    with pytest.raises(FactNotFoundError):
        store.resolve(handle_of(items[1]), "alice")
    assert items[1].id not in {i.id for i in store.search("name", user_id="alice", k=10)}
    hist = store.history(items[0].id)
    assert [h["event"] for h in hist] == ["ADD", "UPDATE"]
    assert hist[1]["old_memory"] == "User: My dog is called Rex." and hist[1]["new_memory"] == "User: My dog is called Max."
    assert set(hist[0]) == {"id", "memory_id", "user_id", "event", "old_memory", "new_memory", "created_at"}
    hist = store.history(items[1].id)
    assert [(h["event"], h["old_memory"], h["new_memory"]) for h in hist] == [
        ("ADD", None, "Assistant: Rex is a good name."), ("DELETE", "Assistant: Rex is a good name.", None),
    ]
    assert store.history("0123456789abcdef") == []
    assert store.delete_all(user_id="alice") == 3
    assert store.get_all(user_id="alice") == [] and kv_files(store) == set()
    assert store.delete_all(user_id="alice") == 0


def test_bad_inputs(make_store):
    store = make_store()
    item = store.add("I like tea.", user_id="u")[0]
    for bad in ("", "   \n\t"):
        with pytest.raises(ValueError):
            store.add(bad, user_id="u")
    for bad in (123, None, b"bytes", 4.5):
        with pytest.raises(TypeError):
            store.add(bad, user_id="u")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        store.add([], user_id="u")
    with pytest.raises(TypeError):
        store.add([{"role": "user", "content": 5}], user_id="u")
    with pytest.raises(TypeError):
        store.add(["just a string in a list"], user_id="u")  # type: ignore[list-item]
    with pytest.raises(ValueError):
        store.add([{"role": "user", "content": "ok"}, {"role": "user", "content": "  "}], user_id="u")
    assert len(store.get_all(user_id="u")) == 1  # nothing of a rejected batch was stored
    for bad_user in ("", "   ", "x" * 129, "a\nb", None, 7):
        with pytest.raises(ValueError):
            store.add("fine", user_id=bad_user)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            store.search("fine", user_id=bad_user)  # type: ignore[arg-type]
    store.add("fine", user_id="x" * 128)
    for bad_k in (0, -1, 1001, 2.5, True, "5", None):
        with pytest.raises(ValueError):
            store.search("tea", user_id="u", k=bad_k)  # type: ignore[arg-type]
    assert len(store.search("tea", user_id="u", k=1000)) == 1
    with pytest.raises(ValueError):
        store.search("  ", user_id="u")
    with pytest.raises(TypeError):
        store.search(None, user_id="u")  # type: ignore[arg-type]
    with pytest.raises(ContextOverflowError):
        store.add("word " * 3000, user_id="u")
    with pytest.raises(ContextOverflowError):  # an explicit context that cannot fit is not truncated
        store.add("short", user_id="u", context=["word " * 3000])
    with pytest.raises(TypeError):
        store.add("ok", user_id="u", metadata=["not", "a", "dict"])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        store.add("ok", user_id="u", metadata={"x": object()})
    with pytest.raises(TypeError):
        store.add("ok", user_id="u", context="not a list")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        store.update(item.id, "   ")
    with pytest.raises(FactNotFoundError):
        store.get("ffffffffffffffff")
    with pytest.raises(FactNotFoundError):
        store.get(item.id, user_id="someone-else")
    with pytest.raises(FactNotFoundError):
        store.update("not-an-id", "x")
    with pytest.raises(FactNotFoundError):
        store.delete("ffffffffffffffff")
    with pytest.raises(MalformedHandleError):
        store.resolve("<<mem:xyz>>", "u")  # type: ignore[arg-type]
    with pytest.raises(ForgedHandleError):
        store.resolve(Handle(item.id, "0" * 16, 0, 0), "u")
    with pytest.raises(ValueError):
        store.import_conversation([("A", "")], user_id="u")
    with pytest.raises(TypeError):
        store.import_conversation(["no speaker"], user_id="u")  # type: ignore[list-item]
    with pytest.raises(ValueError):
        store.import_conversation([("A", "x")], user_id="u", metadata_per_turn=[{}, {}])
    with pytest.raises(ValueError):
        MemoryStore(None, store.path.parent / "other", window=-1)
    with pytest.raises(ValueError):
        MemoryStore(None, store.path.parent / "other", index="annoy")  # type: ignore[arg-type]
    with pytest.raises(Exception, match="already open"):
        MemoryStore(None, store.path)
    store.close()
    with pytest.raises(EngineClosedError):
        store.add("after close", user_id="u")
    with pytest.raises(EngineClosedError):
        store.resolve(handle_of(item), "u")
    store.close()  # idempotent


# ------------------------------------------------------------------------------ isolation


def test_user_isolation(make_store, engine):
    store = make_store()
    a = store.add("My PIN is 1234.", user_id="alice")[0]
    b = store.add("My PIN is 9876.", user_id="bob")[0]
    store.wait_for_encoding(30)
    assert [i.id for i in store.search("PIN", user_id="alice", k=10)] == [a.id]
    assert [i.id for i in store.search("PIN", user_id="bob", k=10)] == [b.id]
    assert a.handle != mint_handle(store, "bob", a.id)
    with pytest.raises(ForgedHandleError):
        store.resolve(handle_of(a), "bob")  # B presenting A's handle
    with pytest.raises(FactNotFoundError):
        store.handle(a.id, user_id="bob")  # B cannot mint one either
    for call in (store.get, store.delete):
        with pytest.raises(FactNotFoundError):
            call(a.id, user_id="bob")
    with pytest.raises(FactNotFoundError):
        store.update(a.id, "hacked", user_id="bob")
    assert store.get(a.id).memory == "My PIN is 1234."
    assert store.delete_all(user_id="bob") == 1 and store.get_all(user_id="alice")[0].id == a.id
    # Through the engine: a prompt of B with A's handle is refused before anything runs.
    engine.fact_source = store
    with pytest.raises(ForgedHandleError):
        engine.generate(f"Memory: {a.handle}\nQ:", user_id="bob", max_tokens=2)
    assert engine.generate(f"Memory: {a.handle}\nQ:", user_id="alice", max_tokens=2).usage.injected_tokens > 0


# ------------------------------------------------------------------------------ injection


def test_injection_equals_prompt_when_context_matches(make_store, engine):
    store = make_store()
    store.add("My cat is called Luna.", user_id="u")  # some other history
    head = "You are a helpful assistant. Answer the question using the memory below.\nMemory:"
    fact = store.add("My dog is called Rex and he likes to run in the park.", user_id="u", context=[head])[0]
    engine.fact_source = store
    prompt = f"{head}\n{fact.handle}\nQuestion: What is my dog's name? Answer:"
    injected = engine.generate(prompt, user_id="u", max_tokens=16, first_logprobs=5)  # waits for the encode
    plain = engine.generate(prompt, user_id="u", max_tokens=16, first_logprobs=5, mode="prompt")
    assert injected.prompt_token_ids == plain.prompt_token_ids
    assert injected.usage.injected_tokens >= len(engine.tokenize(fact.memory))
    assert injected.token_ids == plain.token_ids
    common = set(injected.first_logprobs) & set(plain.first_logprobs)
    assert common and max(abs(injected.first_logprobs[t] - plain.first_logprobs[t]) for t in common) < 1e-3

    # Negative control: the same handle served with noise for V must change the output.
    class Noisy:  # a FactSource with only the one-handle resolve(): asked handle by handle
        def resolve(self, handle, user_id):
            span = store.resolve(handle, user_id)
            g = torch.Generator().manual_seed(0)
            noise = torch.randn(span.kv.v.shape, generator=g).to(span.kv.v.dtype) * 5
            return Span(span.key + ":noise", span.token_ids, FactKV(span.kv.k, noise, span.kv.position), span.text)

    engine.fact_source = Noisy()
    noisy = engine.generate(prompt, user_id="u", max_tokens=16, first_logprobs=5)
    diff = [abs(noisy.first_logprobs[t] - plain.first_logprobs[t]) for t in set(noisy.first_logprobs) & set(plain.first_logprobs)]
    assert noisy.token_ids != plain.token_ids or not diff or max(diff) > 1e-2

    # A source of the caller's own with KV of another model's shape is refused before staging
    # (the in-process exchange takes spans by reference, unchecked: the engine checks them).
    class OtherModel:
        def resolve(self, handle, user_id):
            span = store.resolve(handle, user_id)
            k, v = span.kv.k[:1], span.kv.v[:1]  # one layer
            return Span(span.key + ":one-layer", span.token_ids, FactKV(k, v, span.kv.position), span.text)

    engine.fact_source = OtherModel()
    with pytest.raises(ConnectorError, match="does not fit the served model"):
        engine.generate(prompt, user_id="u", max_tokens=4)

    # Through engine.memory (the engine's own store) with the default window context.
    engine.fact_source = None
    mem = engine.memory
    assert isinstance(mem, MemoryStore) and mem.window == engine.config.window
    it = mem.add("My dog is called Rex.", user_id="u2")[0]
    out = engine.generate(f"Memory: {it.handle}\nQuestion: dog? Answer:", user_id="u2", max_tokens=4)
    assert out.usage.injected_tokens > 0 and len(out.token_ids) == 4


def test_a_source_of_the_callers_own_is_completed_once_when_assigned(make_store, engine):
    """A source with less than FactSource (resolve_many alone) serves handles with FactSource's
    defaults: the engine asks it what it has once, where it is assigned, never per request; a
    source that cannot resolve anything is refused there. The store is a whole FactSource."""
    store = make_store()
    assert as_fact_source(store) is store
    fact = store.add("My dog is called Rex.", user_id="u")[0]
    asked: list[str] = []

    class Partial:
        def __getattr__(self, name):  # only for what it lacks: the flags, prefetch
            asked.append(name)
            raise AttributeError(name)

        def resolve_many(self, handles, user_id):  # takes no option: it announces none
            return [store.resolve(h, user_id) for h in handles]

    source = Partial()
    engine.fact_source = source
    assert engine.fact_source is source
    assert set(asked) == {"defers_cold", "skips_held", "checks_room", "prefetch"}
    asked.clear()
    prompt = f"Memory: {fact.handle}\nQuestion: dog? Answer:"
    for _ in range(2):
        segments = engine.resolve(prompt, user_id="u", max_tokens=4)
        assert [type(s) for s in segments] == [list, Span, list]
    assert engine.prefetch("u") == 0
    assert asked == []

    class Nothing:
        pass

    with pytest.raises(TypeError, match="resolve_many"):
        engine.fact_source = Nothing()
    assert engine.fact_source is source
    engine.fact_source = None


def test_an_in_process_engine_reads_every_memory_it_serves(make_store, engine, monkeypatch):
    """In-process, spans go to vLLM by reference, so the exchange holds none for later requests
    (held spans are a multiprocess engine's, see test_held_spans): each request reads its
    memories' KV from the tiers again, and resolve() hands every span over with its KV."""
    store = make_store()
    fact = store.add("My dog is called Rex.", user_id="u")[0]
    engine.fact_source = store
    prompt = f"Memory: {fact.handle}\nQuestion: dog? Answer:"
    reads: list[int] = []
    get_many = store.tiers.get_many

    def counted(keys, fingerprint):
        reads.append(len(keys))
        return get_many(keys, fingerprint)

    monkeypatch.setattr(store.tiers, "get_many", counted)
    first = engine.generate(prompt, user_id="u", max_tokens=4)  # waits for the encode
    reads.clear()
    second = engine.generate(prompt, user_id="u", max_tokens=4)
    assert reads == [1] and second.token_ids == first.token_ids and second.usage.injected_tokens > 0
    spans = [s for s in engine.resolve(prompt, user_id="u") if isinstance(s, Span)]
    assert len(spans) == 1 and spans[0].kv is not None and not engine.exchange.holds(spans[0].key)


# ------------------------------------------------------------------------------ background encoding


def test_resolve_waits_for_background_encoding(make_store, engine):
    gated = GatedEngine(engine)
    store = make_store(eng=gated)
    gated.hold.set()
    a = store.add("I have two children, Tom and Emma.", user_id="u")[0]
    assert gated.blocked.wait(30)  # the encoder thread is inside engine.encode for `a`
    assert not store.get(a.id).encoded
    assert store.search("children", user_id="u")[0].id == a.id  # searchable before it is encoded

    got: list = []
    t = threading.Thread(target=lambda: got.append(store.resolve(handle_of(a), "u")))
    t.start()
    time.sleep(0.5)
    assert not got and t.is_alive()  # resolve is waiting for the running encode
    # A fact still in the queue is taken out and encoded by resolve itself, right away.
    b = store.add("The meeting is on Monday at ten.", user_id="u")[0]
    span_b = store.resolve(handle_of(b), "u")
    assert span_b.text == b.memory and store.get(b.id).encoded
    # With a short timeout the waiting resolve gives up with a clear error.
    store.resolve_timeout = 0.3
    with pytest.raises(KVNotReadyError, match="still being encoded"):
        store.resolve(handle_of(a), "u")
    store.resolve_timeout = 60
    gated.release.set()
    t.join(30)
    assert got and got[0].text == a.memory and got[0].kv.num_tokens == len(got[0].token_ids)
    store.wait_for_encoding(30)
    assert store.get(a.id).encoded


class ShortKVEngine(GatedEngine):
    """The real engine, whose encoder returns each fact's KV one token short."""

    def encode(self, windows, **kwargs):
        return [[FactKV(kv.k[:, :-1], kv.v[:, :-1], kv.position) for kv in kvs]
                for kvs in super().encode(windows, **kwargs)]


def test_kv_of_the_wrong_token_count_is_refused_when_encoded_not_stored(make_store, engine):
    # A request's spans skip the token-count check (Span.stored): it is made here, where the KV
    # enters the store, and nothing of the KV is stored (no file a later request would serve).
    store = make_store(eng=ShortKVEngine(engine))
    a = store.add("I am allergic to peanuts.", user_id="u")[0]
    store.wait_for_encoding(30)
    assert not store.get(a.id).encoded and kv_files(store) == set()
    assert "KV of" in store.encoding_errors[a.id] and "tokens for memory" in store.encoding_errors[a.id]
    with pytest.raises(InferScaleError, match="tokens for memory"):  # the on-demand encode is refused too
        store.resolve_many([handle_of(a)], "u")
    assert kv_files(store) == set()


def test_a_served_span_is_the_span_the_checked_constructor_makes(make_store):
    # Span.stored skips only the check: every field (a new one included) is as Span() sets it.
    store = make_store()
    a = store.add("Alice lives in Paris.", user_id="u")[0]
    store.wait_for_encoding(30)
    (span,) = store.resolve_many([handle_of(a)], "u")
    checked = Span(span.key, span.token_ids, span.kv, span.text)
    assert type(span) is Span and vars(span) == vars(checked) and span == checked
    assert isinstance(span.token_ids, tuple) and span.kv.num_tokens == len(span.token_ids)
    with pytest.raises(FrozenInstanceError):
        span.key = "other"  # type: ignore[misc]


def test_a_requests_snapshot_of_a_fact_is_its_own_copy(make_store):
    # A request reads copies of its facts' rows outside the store's lock (FactRow.copy): equal
    # to the live row, and nothing set on either reaches the other.
    store = make_store()
    a = store.add("Alice lives in Paris.", user_id="u")[0]
    store.wait_for_encoding(30)
    live = fact_row(store, a.id)
    snap = live.copy()
    assert type(snap) is type(live) and snap is not live and vars(snap) == vars(live) and snap == live
    snap.fingerprint, snap.kv_version = None, live.kv_version + 1
    assert live.fingerprint is not None and live.kv_version == 1 and store.get(a.id).encoded
    assert store.resolve_many([handle_of(a)], "u")[0].key == f"fact:{a.id}:1"


def test_background_encoding_failure_is_surfaced_and_recovered(make_store, engine, caplog):
    gated = GatedEngine(engine)
    store = make_store(eng=gated)
    gated.fail = 1
    a = store.add("I am allergic to peanuts.", user_id="u")[0]
    store.wait_for_encoding(30)
    assert not store.get(a.id).encoded
    assert "injected encode failure" in store.encoding_errors[a.id]
    assert "encoding 1 memory fact(s) failed" in caplog.text
    span = store.resolve(handle_of(a), "u")  # re-encoded on demand
    assert span.kv.num_tokens == len(span.token_ids)
    assert store.get(a.id).encoded and store.encoding_errors == {}
    # An on-demand encode that fails too is reported to the caller.
    b = store.add("I drive a red car.", user_id="u")[0]
    store.wait_for_encoding(30)
    gated.fail = 1
    fact_row(store, b.id).fingerprint = None  # pretend its KV is gone
    with pytest.raises(Exception, match="injected encode failure"):
        store.resolve(handle_of(b), "u")


def test_encoder_batches_the_queue(make_store, engine, tmp_path):
    gated = GatedEngine(engine)
    store = make_store(eng=gated, encode_batch_tokens=100_000)
    gated.hold.set()
    store.add("first", user_id="u")
    assert gated.blocked.wait(30)
    store.add([{"role": "user", "content": f"message number {i}"} for i in range(10)], user_id="u")
    gated.release.set()
    store.wait_for_encoding(30)
    assert gated.calls[0] == 1 and gated.calls[1] == 10  # everything queued went in one engine call
    assert all(i.encoded for i in store.get_all(user_id="u"))

    # A token budget splits the queue into smaller calls (chat requests wait behind less).
    gated = GatedEngine(engine)
    store = make_store(tmp_path / "budget", eng=gated, encode_batch_tokens=60, window=0)
    gated.hold.set()
    store.add("first", user_id="u")
    assert gated.blocked.wait(30)
    msgs = store.add([{"role": "user", "content": f"message number {i}"} for i in range(10)], user_id="u")
    per_fact = len(engine.tokenize(msgs[0].memory))
    gated.release.set()
    store.wait_for_encoding(30)
    assert max(gated.calls[1:]) == 60 // per_fact and sum(gated.calls[1:]) == 10
    assert all(i.encoded for i in store.get_all(user_id="u"))


def test_concurrent_adds_searches_and_deletes(make_store):
    store = make_store(window=2)
    errors: list[BaseException] = []
    per_thread: dict[int, list[str]] = {}

    def writer(n: int) -> None:
        try:
            ids = []
            for i in range(8):
                ids += [it.id for it in store.add(f"Thread {n} remembers fact number {i}.", user_id=f"user{n % 2}")]
                store.search(f"fact {i}", user_id=f"user{n % 2}", k=3)
                if i % 4 == 3:
                    store.delete(ids.pop(0), user_id=f"user{n % 2}")
            per_thread[n] = ids
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    store.wait_for_encoding(60)
    for user in ("user0", "user1"):
        items = store.get_all(user_id=user)
        assert len(items) == 12 and all(i.encoded for i in items)
        order = [i.id for i in items]
        for n, ids in per_thread.items():
            if n % 2 == int(user[-1]):
                mine = [i for i in order if i in ids]
                assert mine == ids  # each thread's facts in its own order
        for it in items:
            span = store.resolve(handle_of(it), user)
            assert span.text == it.memory
    assert len(kv_files(store)) == 24


# ------------------------------------------------------------------------------ tiers through the store


def test_tier_eviction_promotion_and_delete_through_store(make_store, engine):
    page = 4 * 2 * 16 * 2 * 64 * 4  # layers * (K,V) * page tokens * kv heads * head dim * fp32
    store = make_store(device_kv_bytes=2 * page, host_kv_bytes=64 * 4096, page_tokens=16)  # host: 64 tokens
    items = [store.add(f"Fact {i}: my friend number {i} lives in town {i}.", user_id="u")[0] for i in range(7)]
    store.wait_for_encoding(60)
    keys = [(i.id, 1) for i in items]
    where = [store.tiers.where(k) for k in keys]
    assert set(where) == {"device", "host", "disk"}, where
    assert where[-1] == "device" and where[0] == "disk"
    from safetensors.torch import load_file

    for it, k in zip(items, keys):
        span = store.resolve(handle_of(it), "u")  # promotes to the device
        assert store.tiers.where(k) == "device"
        on_disk = load_file(str(store.tiers.path(k)))
        assert torch.equal(span.kv.k, on_disk["k"]) and torch.equal(span.kv.v, on_disk["v"])
    where = [store.tiers.where(k) for k in keys]
    assert set(where) == {"device", "host", "disk"} and where[-2] == "host"
    store.resolve(handle_of(items[-2]), "u")  # host -> device
    assert store.tiers.where(keys[-2]) == "device" and store.tiers.where(keys[-1]) == "host"
    s = store.tiers.stats()
    assert s["device_pages_used"] <= 2 and s["disk_reads"] >= 1 and s["host_to_device"] >= 1
    for it, k in zip(items, keys):
        store.delete(it.id)
        assert store.tiers.where(k) is None and not store.tiers.path(k).exists()
    s = store.tiers.stats()
    assert s["device_pages_used"] == 0 and s["host_facts"] == 0 and s["host_bytes"] == 0
    assert kv_files(store) == set()


def test_fingerprint_mismatch_is_refused_and_reencoded(make_store, engine, tmp_path):
    path = tmp_path / "fp-store"
    store = make_store(path, window=5)
    items = [store.add(f"Turn {i}: we talked about topic {i}.", user_id="u")[0] for i in range(4)]
    store.wait_for_encoding(30)
    original = {i.id: store.resolve(handle_of(i), "u").kv for i in items}
    fp5 = store.fingerprint
    store.close()

    store = make_store(path, window=2)  # another window: another fingerprint
    assert store.fingerprint != fp5 and store.fingerprint.startswith(engine.fingerprint)
    assert not any(i.encoded for i in store.get_all(user_id="u"))
    key = (items[3].id, 1)
    with pytest.raises(StaleKVError):
        store.tiers.get(key, store.fingerprint)  # the file says w5: refused
    span = store.resolve(handle_of(items[3]), "u")  # re-encoded with the current engine and window
    context = engine.tokenize("\n".join(i.memory for i in items[1:3]) + "\n")
    assert span.kv.position == len(context)
    # New KV content gets a new KV version: a new span key (vLLM prefix-cache salt) and file.
    assert span.key == f"fact:{items[3].id}:2"
    assert not store.tiers.path(key).exists()
    assert store.tiers.read_metadata((items[3].id, 2))["fingerprint"] == store.fingerprint
    assert store.get(items[3].id).encoded
    store.close()

    store = make_store(path, window=5)  # back: the w2 KV is stale now, w5 contexts are rebuilt
    span = store.resolve(handle_of(items[3]), "u")
    assert span.key == f"fact:{items[3].id}:3"
    assert torch.allclose(span.kv.k, original[items[3].id].k, atol=1e-4)
    assert span.kv.position == original[items[3].id].position

    # reencode() queues the stale rest in the background instead of encoding them one by one.
    store.close()
    store = make_store(path, window=3)
    assert store.reencode(user_id="u") == 4
    assert store.reencode(user_id="u") == 0  # already queued
    store.wait_for_encoding(60)
    assert all(i.encoded for i in store.get_all(user_id="u"))
    assert store.resolve(handle_of(items[3]), "u").key == f"fact:{items[3].id}:4"
    store.close()
    store = make_store(path, window=5)
    original = {i.id: store.resolve(handle_of(i), "u").kv for i in items}

    # A foreign file swapped in under a live fact is refused, never served.
    from safetensors.torch import save_file

    key0 = (items[0].id, int(store.resolve(handle_of(items[0]), "u").key.rsplit(":", 1)[1]))
    noise = {"k": torch.randn_like(original[items[0].id].k), "v": torch.randn_like(original[items[0].id].v)}
    meta = dict(store.tiers.read_metadata(key0), fingerprint="some-other-model")
    save_file(noise, str(store.tiers.path(key0)), metadata=meta)
    store.tiers.drop_memory()
    span = store.resolve(handle_of(items[0]), "u")
    version = int(span.key.rsplit(":", 1)[1])
    assert version == key0[1] + 1 and not store.tiers.path(key0).exists()
    assert not torch.equal(span.kv.k, noise["k"])
    assert torch.allclose(span.kv.k, original[items[0].id].k, atol=1e-4)
    assert store.tiers.read_metadata((items[0].id, version))["fingerprint"] == store.fingerprint


def test_context_prefix_starts_every_window_and_is_part_of_the_fingerprint(make_store, engine, tmp_path):
    path = tmp_path / "prefix-store"
    head = "<|im_start|>system\nMemories:\n"
    store = make_store(path, window=2, context_prefix=head)
    items = [store.add(f"Turn {i}: we talked about topic {i}.", user_id="u")[0] for i in range(3)]
    span = store.resolve(handle_of(items[2]), "u")
    context = engine.tokenize(head + "\n".join(i.memory for i in items[:2]) + "\n")
    assert span.kv.position == len(context)
    with_head = store.fingerprint
    store.close()

    # Without the prefix: another fingerprint, and window contexts rebuilt without the head.
    store = make_store(path, window=2)
    assert store.fingerprint != with_head and store.fingerprint.startswith(engine.fingerprint)
    span = store.resolve(handle_of(items[2]), "u")
    assert span.kv.position == len(engine.tokenize("\n".join(i.memory for i in items[:2]) + "\n"))
    store.close()

    store = make_store(path, window=2, context_prefix=head)  # back: same fingerprint and KV as at first
    assert store.fingerprint == with_head
    assert store.resolve(handle_of(items[2]), "u").kv.position == len(context)
    # An explicit context is laid out by the caller: the prefix is not added to it.
    explicit = store.add("Explicit one.", user_id="u", context=["Before."])[0]
    assert store.resolve(handle_of(explicit), "u").kv.position == len(engine.tokenize("Before.\n"))
    store.close()

    # A prefix that leaves no room for a memory is refused when the memory is added.
    store = make_store(tmp_path / "huge-prefix", window=2, context_prefix="word " * engine.max_model_len)
    with pytest.raises(ContextOverflowError):
        store.add("Too late.", user_id="u")


def test_facts_are_retokenized_for_another_model(make_store, engine, embedder, tmp_path):
    path = tmp_path / "retok"
    with MemoryStore(None, path, embedder=embedder) as plain:  # no engine: no token ids yet
        bare = plain.add("I like green tea.", user_id="u")[0]
    store = make_store(path)
    span = store.resolve(handle_of(bare), "u")
    assert list(span.token_ids) == engine.tokenize("I like green tea.")
    head = "Memory of the user:"
    fact = store.add("My dog is called Rex.", user_id="u", context=[head])[0]
    store.wait_for_encoding(30)
    before = store.resolve(handle_of(fact), "u")
    store.close()
    # Pretend the facts were tokenized by another model: ids and contexts are rebuilt from text.
    import sqlite3

    with sqlite3.connect(path / "memory.sqlite3") as db:
        db.execute("UPDATE meta SET value='another-model' WHERE key='tokenizer'")
        db.execute("UPDATE facts SET token_ids=NULL")
    store.tiers.path((fact.id, 1)).unlink()
    store = make_store(path)
    after = store.resolve(handle_of(fact), "u")
    assert after.token_ids == before.token_ids
    assert after.kv.position == len(engine.tokenize(head + "\n")) == before.kv.position
    assert torch.allclose(after.kv.k, before.kv.k, atol=1e-4)


# ------------------------------------------------------------------------------ persistence

_CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from inferscale_engine import InferScaleEngine
    from inferscale_engine.handles import find_handles
    from inferscale_engine.memory import MemoryStore
    from inferscale_engine.memory.text.embedder import Embedder

    if __name__ == "__main__":
        model, path, out = sys.argv[1:4]
        calls = []
        class Counting(Embedder):
            def embed(self, texts, *, progress=False):
                calls.append(list(texts))
                return super().embed(texts, progress=progress)
        engine = InferScaleEngine(model=model, device="cpu", dtype="float32", max_model_len=1024, recompute=0)
        store = MemoryStore(engine, path, embedder=Counting())
        opened_calls = len(calls)
        result = {"embed_calls_on_open": opened_calls, "items": {}, "history": {}, "kv": {}, "search": {}}
        for user in ("alice", "bob"):
            items = store.get_all(user_id=user)
            result["items"][user] = [i.to_dict() | {"encoded": i.encoded} for i in items]
            result["search"][user] = [i.id for i in store.search("dog", user_id=user, k=3)]
            for i in items:
                span = store.resolve(find_handles(i.handle)[0], user)
                result["kv"][i.id] = (span.key, list(span.token_ids), span.kv.k, span.kv.v, span.kv.position)
        for fid in json.loads(sys.argv[4]):
            result["history"][fid] = store.history(fid)
        result["stats"] = store.stats()
        store.close()
        engine.close()
        torch.save(result, out)
    """
)


def test_persistence_across_process_restart(make_store, engine, tiny_llama, tmp_path):
    path = tmp_path / "persist"
    store = make_store(path)
    a = store.add([{"role": "user", "content": "My dog is called Rex."},
                   {"role": "assistant", "content": "What a nice dog."}], user_id="alice", metadata={"s": 1})
    a += store.add("Alice lives in Paris.", user_id="alice")
    b = store.add("Bob's dog is called Bruno.", user_id="bob")
    store.update(a[1].id, "Assistant: What a nice dog name.")
    gone = store.add("temporary", user_id="alice")[0]
    store.wait_for_encoding(30)
    store.delete(gone.id)
    expected_items = {u: [i.to_dict() | {"encoded": i.encoded} for i in store.get_all(user_id=u)] for u in ("alice", "bob")}
    expected_kv = {}
    for u, items in (("alice", store.get_all(user_id="alice")), ("bob", b)):
        for i in items:
            span = store.resolve(handle_of(i), u)
            expected_kv[i.id] = (span.key, list(span.token_ids), span.kv.k, span.kv.v, span.kv.position)
    expected_search = {u: [i.id for i in store.search("dog", user_id=u, k=3)] for u in ("alice", "bob")}
    fact_ids = [i.id for i in a + b] + [gone.id]
    expected_history = {fid: store.history(fid) for fid in fact_ids}
    # Damage to repair on open: a lost KV file, a stray temp file, an orphan file.
    lost = (a[2].id, 1)
    lost_kv = expected_kv.pop(a[2].id)
    expected_items["alice"][2]["encoded"] = False  # its file is gone: encoded again on demand
    store.close()
    store.tiers.path(lost).unlink()
    (store.tiers.path(lost).parent / f".{lost[0]}-1.0123.tmp").write_bytes(b"half written")
    orphan = store.tiers.path(("abababababababab", 1))
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(store.tiers.path((a[0].id, 1)).read_bytes())
    scratch = path / "kv" / ".calibration-0badc0de" / "00"  # a disk measurement a crash cut short
    scratch.mkdir(parents=True)
    (scratch / "0000000000000000-1.safetensors").write_bytes(b"\0" * 4096)
    assert (path / "memory.sqlite3").exists() and (path / "secret.key").stat().st_mode & 0o777 == 0o600

    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    out = tmp_path / "child.pt"
    proc = subprocess.run(
        [sys.executable, str(script), tiny_llama, str(path), str(out), json.dumps(fact_ids)],
        cwd=REPO, env=os.environ.copy(), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out, weights_only=False)

    assert got["embed_calls_on_open"] == 0  # embeddings were persisted
    assert got["items"] == expected_items
    assert got["history"] == expected_history
    assert got["search"] == expected_search
    assert got["stats"]["disk_reads"] >= len(expected_kv)  # KV came back lazily from disk
    for fid, (key, ids, k, v, pos) in expected_kv.items():
        gkey, gids, gk, gv, gpos = got["kv"][fid]
        assert (gkey, gids, gpos) == (key, ids, pos)
        assert torch.equal(gk, k) and torch.equal(gv, v), fid  # bit-identical KV after restart
    # The fact whose file was lost was re-encoded on demand with its stored context.
    gkey, gids, gk, gv, gpos = got["kv"][a[2].id]
    assert (gkey, gids, gpos) == lost_kv[:2] + (lost_kv[4],)
    assert torch.allclose(gk, lost_kv[2], atol=1e-4) and torch.allclose(gv, lost_kv[3], atol=1e-4)
    # No temp, orphan or scratch files survived the reopen.
    live = {f"{fid}-{key.rsplit(':', 1)[1]}.safetensors" for fid, (key, *_r) in got["kv"].items()}
    assert {p.name for p in (path / "kv").rglob("*") if p.is_file()} == live


def test_facts_committed_but_not_encoded_are_encoded_on_demand_after_reopen(make_store, engine, tmp_path):
    gated = GatedEngine(engine)
    path = tmp_path / "crashy"
    store = make_store(path, eng=gated)
    gated.hold.set()
    first = store.add("Encoded never: first.", user_id="u")[0]
    assert gated.blocked.wait(30)
    rest = store.add([{"role": "user", "content": f"queued {i}"} for i in range(3)], user_id="u")
    threading.Timer(0.5, gated.release.set).start()
    store.close()  # the batch in flight finishes; queued facts are dropped from the queue
    store = make_store(path)
    items = store.get_all(user_id="u")
    assert [i.id for i in items] == [first.id] + [r.id for r in rest]
    for it in items:
        assert store.resolve(handle_of(it), "u").text == it.memory
    assert all(i.encoded for i in store.get_all(user_id="u"))


# ------------------------------------------------------------------------------ bulk import


@pytest.mark.parametrize("group", [None, 4])
def test_import_conversation(make_store, engine, group):
    store = make_store(window=2)
    store.add("An earlier memory.", user_id="u")
    turns = [("Caroline" if i % 2 == 0 else "Melanie", f"This is turn number {i} of our chat.") for i in range(10)]
    turns.append(("", "[8 May 2023] a dated line with no speaker"))
    metas = [{"dia_id": f"D1:{i}"} for i in range(len(turns))]
    items = store.import_conversation(turns, user_id="u", metadata_per_turn=metas, sliding_group=group, progress=False)
    assert [i.memory for i in items][:2] == ["Caroline: This is turn number 0 of our chat.",
                                             "Melanie: This is turn number 1 of our chat."]
    assert items[-1].memory == "[8 May 2023] a dated line with no speaker"
    assert [i.metadata for i in items] == metas
    assert all(i.encoded for i in items)  # import returns with the KV encoded
    assert [i.id for i in store.get_all(user_id="u")][1:] == [i.id for i in items]
    for it in items[:6]:
        span = store.resolve(handle_of(it), "u")
        fact = fact_row(store, it.id)
        assert span.kv.position == len(fact.context_ids)
        # The stored context reproduces the KV (what an on-demand re-encode would do).
        ref = engine.encode([EncodeWindow.single(span.token_ids, fact.context_ids)])[0][0]
        assert torch.allclose(ref.k, span.kv.k, atol=1e-4) and torch.allclose(ref.v, span.kv.v, atol=1e-4)
    f5 = fact_row(store, items[5].id)
    if group is None:  # two previous turns, "\n"-joined
        assert f5.context_ids == tuple(engine.tokenize(items[3].memory + "\n" + items[4].memory + "\n"))
    else:  # turn 5 is the 2nd of the group [4..7]: the window before the group, then turn 4
        assert f5.context_kind == "sliding"
        assert len(f5.context_ids) > len(engine.tokenize(items[4].memory))


# ------------------------------------------------------------------------------ infer=True


def test_infer_with_garbage_model_output_stores_nothing(make_store, engine):
    store = make_store(generate=engine_generate(engine, max_tokens=24))
    before = store.add("I like tea.", user_id="u")
    with logged("inferscale_engine.memory.text.extraction") as messages:
        assert store.add("User: I moved to Rome last week.", user_id="u", infer=True) == []
    assert [i.id for i in store.get_all(user_id="u")] == [before[0].id]
    assert any("not the JSON asked for" in m for m in messages)


def test_infer_applies_add_update_delete(make_store):
    replies = iter([
        '```json\n{"facts": ["Lives in Rome", "Dislikes coffee", "Has a cat named Luna"]}\n```',
        '{"memory": [{"id": "X", "text": "Lives in Rome", "event": "UPDATE"},'
        ' {"id": "Y", "event": "DELETE"}, {"id": "new", "text": "Has a cat named Luna", "event": "ADD"}]}',
    ])
    seen = []

    def fake_generate(messages, user_id):
        seen.append(messages)
        text = next(replies)
        if len(seen) == 2:  # map the short ids the store showed the model
            listing = messages[-1]["content"]
            short = {line.split('"')[1]: line.split(": ", 1)[1] for line in listing.splitlines() if line.startswith("- id")}
            by_text = {v: k for k, v in short.items()}
            text = text.replace('"X"', f'"{by_text["Lives in Paris"]}"').replace('"Y"', f'"{by_text["Likes coffee"]}"')
        return text

    store = make_store(generate=fake_generate)
    paris = store.add("Lives in Paris", user_id="u")[0]
    coffee = store.add("Likes coffee", user_id="u")[0]
    out = store.add([{"role": "user", "content": "I moved to Rome, got a cat called Luna, and quit coffee."}],
                    user_id="u", infer=True)
    assert sorted(i.memory for i in out) == ["Has a cat named Luna", "Lives in Rome"]
    assert store.get(paris.id).memory == "Lives in Rome"
    with pytest.raises(FactNotFoundError):
        store.get(coffee.id)
    assert sorted(i.memory for i in store.get_all(user_id="u")) == ["Has a cat named Luna", "Lives in Rome"]
