"""Issue 23 (hardening): attacks that used to succeed, each replayed against a real engine.

One tiny-Llama engine for the module (one engine per process); tests that need a restart
build a fresh store on the same folder through the same engine.
"""

from __future__ import annotations

import statistics
import uuid

import pytest

from inferscale_engine.testing import cached_static_spans, encoder_replaced, has_unfinished_requests

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

PRIVATE = ("Alice's bank PIN is 4471. " + "She banks with the northern cooperative and keeps her records on paper. " * 12)


def uid(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def engine(tiny_llama, tmp_path_factory):
    from inferscale_engine import InferScaleEngine

    eng = InferScaleEngine(model=tiny_llama, store_path=tmp_path_factory.mktemp("hard-store"),
                           device="cpu", dtype="float32", max_model_len=1024, recompute=0)
    yield eng
    eng.close()


# ------------------------------------------------------------------------------ prefix-cache oracle


def test_plain_prompts_never_hit_another_users_prefix_cache(engine, monkeypatch):
    """B sending A's private system text (right guess) looks exactly like a wrong guess."""
    a = uid("alice")

    def ask(user: str, system: str):
        return engine.generate(f"{system}\nQuestion: what is the weather? Answer:", user_id=user, max_tokens=1)

    ask(a, PRIVATE)
    assert ask(a, PRIVATE).usage.cached_tokens > 0  # control: the cache works for its own user
    # Each guess from a user who never sent it: only another user's blocks could make it a hit.
    right = [ask(uid("bob"), PRIVATE) for _ in range(5)]
    wrong = [ask(uid("bob"), PRIVATE.replace("4471", f"90{i}{i}")) for i in range(5)]
    assert [x.usage.cached_tokens for x in right + wrong] == [0] * 10
    med_right = statistics.median(x.ttft_s for x in right)
    med_wrong = statistics.median(x.ttft_s for x in wrong)
    # Loose: a cache hit made right guesses 3-10x faster; noise on a shared CPU is far smaller.
    assert med_right > 0.5 * med_wrong, (med_right, med_wrong)
    # Negative control: with the cache shared (the old behaviour, now opt-in) the oracle is back.
    monkeypatch.setattr(engine.config, "shared_prefix_cache", True)
    ask(uid("alice"), PRIVATE)
    assert ask(uid("bob"), PRIVATE).usage.cached_tokens > 0


def test_head_cache_is_per_user(engine, monkeypatch):
    """B sending A's private head with B's own handle must encode it anew, not hit A's entry."""
    store = engine.memory
    a, b = uid("alice"), uid("bob")
    ha = store.add("Alice likes tea.", user_id=a)[0].handle
    hb = store.add("Bob likes coffee.", user_id=b)[0].handle
    store.wait_for_encoding(60)
    head = f"Private: Alice was born on 3 May 1990 [{uuid.uuid4().hex[:6]}]. Memory: "
    engine.generate(head + ha + "\nQ: drink? A:", user_id=a, max_tokens=1)
    before = cached_static_spans(engine)
    engine.generate(head + ha + "\nQ: drink? A:", user_id=a, max_tokens=1)
    assert cached_static_spans(engine) == before  # control: A's own head is reused
    engine.generate(head + hb + "\nQ: drink? A:", user_id=b, max_tokens=1)
    assert cached_static_spans(engine) == before + 1  # B's copy is B's own
    monkeypatch.setattr(engine.config, "shared_prefix_cache", True)  # negative control: shared again
    engine.generate(head + "x" + ha + "\nQ: drink? A:", user_id=a, max_tokens=1)
    engine.generate(head + "x" + hb + "\nQ: drink? A:", user_id=b, max_tokens=1)
    assert cached_static_spans(engine) == before + 2


# ------------------------------------------------------------------------------ integrity of stored KV


def _open_store(engine, path):
    from inferscale_engine.config import MemoryConfig
    from inferscale_engine.memory import MemoryStore

    return MemoryStore.for_engine(engine, MemoryConfig.for_engine(engine.config, path=path))


def _kv_file(store, item):
    f = store.table.by_id[item.id]
    return store.tiers.disk.path((item.id, f.kv_version))


def _rewrite(path, edit, keep_checksum: bool) -> None:
    """Load a KV file, ``edit`` its tensors, save it with its metadata (minus the checksum:
    a file written before checksums, so only the finiteness check stands between it and vLLM)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {name: f.get_tensor(name) for name in ("k", "v")}
    edit(tensors)
    if not keep_checksum:
        meta.pop("sha256", None)
    save_file(tensors, str(path), metadata=meta)


@pytest.fixture
def fact_store(engine, tmp_path):
    """A store on its own folder serving ``engine``'s handles; ``reopen()`` restarts it."""
    state = {"store": _open_store(engine, tmp_path / "store")}
    engine.fact_source = state["store"]

    def reopen():
        state["store"].close()
        state["store"] = engine.fact_source = _open_store(engine, tmp_path / "store")
        return state["store"]

    state["reopen"] = reopen
    yield state
    engine.fact_source = None
    state["store"].close()


def _chat(engine, user, text, n=8):
    return engine.generate(text, user_id=user, max_tokens=n)


def test_nan_in_a_kv_file_never_reaches_the_cache(engine, fact_store):
    """One NaN in one user's KV file, restart, inject it: nobody else's chat may break."""
    store = fact_store["store"]
    a, others = uid("alice"), [uid("bob"), uid("carol")]
    item = store.add("Alice's locker number is 318 on the second floor.", user_id=a)[0]
    store.wait_for_encoding(60)
    question = f"Memory: {item.handle}\nQ: locker? A:"
    clean = _chat(engine, a, question)
    shorts = ["Hi", "Q: 2+2? A:", "Hello there", "ok"]
    reference = {(u, s): _chat(engine, u, s) for u in others for s in shorts}
    path = _kv_file(store, item)
    store = fact_store["reopen"]()  # files are read from disk after a restart

    def poison(t):
        t["v"][0, 0, 0, 0] = float("nan")

    _rewrite(path, poison, keep_checksum=False)
    again = _chat(engine, a, question)
    assert again.text == clean.text  # re-encoded, not served
    assert store.tiers.stats()["disk_corrupt"] == 1
    for (u, s), ref in reference.items():
        got = _chat(engine, u, s)
        assert (got.text, got.finish_reason) == (ref.text, ref.finish_reason), (u, s)


def test_bit_rot_in_a_kv_file_is_detected_and_re_encoded(engine, fact_store):
    store = fact_store["store"]
    a = uid("alice")
    item = store.add("Alice's favourite colour is teal and her cat is Miso.", user_id=a)[0]
    store.wait_for_encoding(60)
    question = f"Memory: {item.handle}\nQ: colour? A:"
    clean = _chat(engine, a, question)
    path = _kv_file(store, item)
    store = fact_store["reopen"]()
    # One exponent bit of every 32nd value of V, in place: finite garbage only a checksum sees.
    raw = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(raw[:8], "little")
    import json

    start, stop = json.loads(raw[8:header])["v"]["data_offsets"]
    for i in range(header + start + 3, header + stop, 32 * 4):
        raw[i] ^= 0x20
    path.write_bytes(bytes(raw))
    assert _chat(engine, a, question).text == clean.text
    assert store.tiers.stats()["disk_corrupt"] == 1
    from inferscale_apps.server.metrics import Metrics

    metrics = Metrics()
    metrics.store_stats = store.tiers.stats
    assert b"inferscale_kv_corrupt_total 1.0" in metrics.render()
    # The re-encoded file is whole again: the next restart reads it without complaint.
    store = fact_store["reopen"]()
    assert _chat(engine, a, question).text == clean.text
    assert store.tiers.stats()["disk_corrupt"] == 0


# ------------------------------------------------------------------------------ HTTP: inputs, storage, disconnects


@pytest.fixture(scope="module")
def http(engine):
    import httpx

    from inferscale_apps.bench.load import serve_app
    from inferscale_apps.server import create_app

    app = create_app(engine, served_model_name="tiny")
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        client.app = app  # type: ignore[attr-defined]
        yield client


def test_the_server_serves_pending_memories_as_text(http, engine):
    assert engine.memory.serve_as_text_after == 0.5


def _listed(http, user):
    r = http.get("/v1/memories/", params={"user_id": user})
    assert r.status_code == 200, r.text
    return r.json()["results"]


def test_refused_metadata_leaves_nothing_behind(http):
    user = uid("deep")
    deep: dict = {}
    for _ in range(260):
        deep = {"a": deep}
    r = http.post("/v1/memories/", json={"messages": "Deep fact.", "user_id": user, "metadata": deep})
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
    big = {"blob": "x" * (100 << 10)}
    r = http.post("/v1/memories/", json={"messages": "Big fact.", "user_id": user, "metadata": big})
    assert r.status_code == 413
    r = http.post("/v1/memories/", json={"messages": "y" * (100 << 10), "user_id": user})
    assert r.status_code == 413
    assert _listed(http, user) == []  # nothing committed, and listing still answers
    ok = http.post("/v1/memories/", json={"messages": "Fine fact.", "user_id": user, "metadata": {"a": {"b": 1}}})
    assert ok.status_code == 200 and len(_listed(http, user)) == 1


def test_huge_bodies_are_refused_early(http):
    import time

    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"a" * (32 << 20) + b'"}]}'
    t0 = time.perf_counter()
    r = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert time.perf_counter() - t0 < 10

    def chunked():  # no Content-Length: refused once the limit is passed
        for _ in range(40):
            yield b"a" * (1 << 20)

    r = http.post("/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_full_or_read_only_disk_is_a_typed_error(http, engine, monkeypatch):
    # The database's own failures become these in the store (test_hardening_store.py).
    from inferscale_engine.errors import StorageFullError, StorageUnavailableError
    from inferscale_engine.memory.meta.db import SQLiteDB

    user = uid("disk")

    def full(*a, **k):
        raise StorageFullError("database or disk is full")

    monkeypatch.setattr(SQLiteDB, "insert_facts", full)
    r = http.post("/v1/memories/", json={"messages": "A fact.", "user_id": user})
    assert r.status_code == 507 and r.json()["error"]["code"] == "insufficient_storage"

    def read_only(*a, **k):
        raise StorageUnavailableError("attempt to write a readonly database")

    monkeypatch.setattr(SQLiteDB, "insert_facts", read_only)
    r = http.post("/v1/memories/", json={"messages": "A fact.", "user_id": user})
    assert r.status_code == 503 and r.json()["error"]["code"] == "storage_unavailable"
    monkeypatch.undo()
    assert _listed(http, user) == []


@pytest.mark.parametrize("code", ["ENOSPC", "EROFS"])  # a full disk; a store read-only since the start
def test_a_kv_write_that_fails_never_fails_the_handle(http, engine, monkeypatch, code):
    import errno
    import os

    from inferscale_engine.memory.kv.disk_tier import DiskTier

    def no_space(self, *a, **k):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(DiskTier, "put", no_space)
    user = uid("nospace")
    r = http.post("/v1/memories/", json={"messages": "Dana's train leaves at 7.", "user_id": user})
    assert r.status_code == 200
    handle = r.json()["results"][0]["handle"]
    engine.memory.wait_for_encoding(60)  # the background write failed
    for _ in range(2):
        chat = http.post("/v1/chat/completions", json={
            "model": "tiny", "user": user, "max_tokens": 4,
            "messages": [{"role": "user", "content": f"Memory: {handle}\nWhen does the train leave?"}]})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["injected_tokens"] > 0
    monkeypatch.undo()


def test_abandoned_non_streaming_requests_stop_generating(http, engine):
    import threading
    import time

    import httpx

    body = {"model": "tiny", "max_tokens": 900, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me a very long story about the sea."}]}
    t0 = time.perf_counter()
    full = http.post("/v1/chat/completions", json=body)
    alone = time.perf_counter() - t0
    assert full.status_code == 200
    if full.json()["usage"]["completion_tokens"] < 800 or alone < 4:
        pytest.skip(f"a full request ends too soon to tell ({alone:.1f}s) on this machine")

    def abandon() -> None:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(str(http.base_url) + "/v1/chat/completions", json=body, timeout=0.5)

    threads = [threading.Thread(target=abandon) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gone = time.perf_counter()
    while has_unfinished_requests(engine) and time.perf_counter() - gone < 30:
        time.sleep(0.05)
    stopped = time.perf_counter() - gone
    # Six together would have run at least as long as one alone; aborted, they stop within a poll or two.
    assert stopped < min(3.0, alone / 2), (stopped, alone)


# ------------------------------------------------------------------------------ chats vs ingestion


def test_chats_do_not_wait_behind_ingestion(engine, fact_store):
    """The encoder is stuck on a batch (a backed-up queue): a chat that uses a fact of that batch
    is served at once with the fact as text (counted in usage), not after resolve_timeout."""
    import threading
    import time

    store = fact_store["store"]
    release, entered = threading.Event(), threading.Event()

    class Stuck:
        def __init__(self, real):
            self.real = real

        def __getattr__(self, name):
            return getattr(self.real, name)

        def encode(self, windows, **kw):
            if threading.current_thread().name != threading.main_thread().name and not release.is_set():
                entered.set()
                release.wait(120)
            return self.real.encode(windows, **kw)

    store.serve_as_text_after = 0.5  # what the server sets (create_app); the library waits by default
    with encoder_replaced(store, Stuck):
        try:
            user = uid("chat")
            items = store.add("The gate code is 5512.", user_id=user) + store.add("Parking is on level 3.", user_id=user)
            for i in range(40):
                store.add(f"Ingested fact number {i}.", user_id=uid("ingest"))
            assert entered.wait(30)  # the encoder thread holds the first batch, the rest is queued
            latencies = []
            for _ in range(3):
                t0 = time.perf_counter()
                out = engine.generate(f"Memory: {items[0].handle} {items[1].handle}\nQ: gate code? A:",
                                      user_id=user, max_tokens=4)
                latencies.append(time.perf_counter() - t0)
                assert out.usage.memories_as_text >= 1
                as_text = out.text
            assert sorted(latencies)[-1] < 10, latencies  # p95 of 3 = the worst; waited 60 s before
        finally:
            release.set()
    store.wait_for_encoding(120)
    prompt = f"Memory: {items[0].handle} {items[1].handle}\nQ: gate code? A:"
    out = engine.generate(prompt, user_id=user, max_tokens=4)
    assert out.usage.memories_as_text == 0 and out.usage.injected_tokens > 0
    # As text, the facts were served as prompt injection serves them: the same answer.
    assert engine.generate(prompt, user_id=user, max_tokens=4, mode="prompt").text == as_text
