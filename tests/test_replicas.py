"""Replicas sharing one store: two ``inferscale serve`` processes (SmolLM2) on one PostgreSQL.

A throwaway cluster (``initdb`` into a temp folder, ``pg_ctl start`` on a free loopback port)
is started here and stopped afterwards; CI installs PostgreSQL from Debian (``.ci/run``). What
is checked, through the public HTTP API and the store's public API:

* a fact added through replica A is answered on replica B from injected KV (B encodes it on a
  miss), the same answer A gives and the same as the fact pasted as text;
* an update or delete through A is never served stale by B: B checks each memory's version
  when it resolves the handles, and re-encodes (or refuses a deleted one);
* user isolation holds across replicas; the store folder's lock does not stop two replicas.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from test_server import start_server, stop_server

from inferscale_apps.bench.postgres import find_bindir, throwaway_cluster
from inferscale_engine.prompting import memory_system_message
from inferscale_engine.vllm_compat import cpu_emulates_bfloat16

psycopg = pytest.importorskip("psycopg", reason="psycopg is not installed (pip install 'psycopg[binary]')")
if find_bindir() is None:
    pytest.skip("PostgreSQL's binaries are not installed (apt-get install postgresql; .ci/run does)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def cluster():
    with throwaway_cluster() as c:
        yield c


@pytest.fixture
def url(cluster) -> str:
    return cluster.new_database()


# ---------------------------------------------------------------------- the store's API (no model)


def test_replica_stores_follow_each_other(url, tmp_path, monkeypatch):
    from inferscale_engine.memory import MemoryStore

    monkeypatch.setenv("INFERSCALE_HOME", str(tmp_path / "home"))
    a = MemoryStore(None, url)  # both take the default KV folder: the lock gives each its own slot
    b = MemoryStore(None, url)
    try:
        assert a.path != b.path and a.path.parent == b.path.parent
        [rex] = a.add("My dog is called Rex.", user_id="alice")
        [paris] = b.add("I live in Paris.", user_id="alice")
        assert [m.memory for m in b.get_all(user_id="alice")] == ["My dog is called Rex.", "I live in Paris."]
        assert [m.memory for m in a.get_all(user_id="alice")] == [m.memory for m in b.get_all(user_id="alice")]
        assert b.search("What is my dog called?", user_id="alice", k=1)[0].id == rex.id
        assert rex.handle == b.handle(rex.id, user_id="alice")  # one secret, in the database

        b.update(rex.id, "My dog is called Max.", user_id="alice")
        assert a.get(rex.id).memory == "My dog is called Max."
        a.update(rex.id, "My dog is called Bo.", user_id="alice")
        assert b.get(rex.id).memory == "My dog is called Bo."
        assert [e["event"] for e in b.history(rex.id)] == ["ADD", "UPDATE", "UPDATE"]

        a.delete(paris.id, user_id="alice")
        assert [m.id for m in b.get_all(user_id="alice")] == [rex.id]
        assert paris.id not in {m.id for m in b.search("Where do I live?", user_id="alice")}
        assert b.get_all(user_id="bob") == [] and b.search("dog", user_id="bob") == []
        assert b.user_ids() == ["alice"]
    finally:
        a.close()
        b.close()


def test_concurrent_updates_get_distinct_versions(url, tmp_path):
    """Two replicas updating one fact each write their own version: neither's KV can pass for the other's."""
    from inferscale_engine.memory import MemoryStore
    from inferscale_engine.memory.meta.pg import PostgresDB

    a = MemoryStore(None, url, kv_path=tmp_path / "a")
    b = MemoryStore(None, url, kv_path=tmp_path / "b")
    try:
        [fact] = a.add("My dog is called Rex.", user_id="alice")
        b.get_all(user_id="alice")
        a.update(fact.id, "My dog is called Max.", user_id="alice")
        b.update(fact.id, "My dog is called Bo.", user_id="alice")  # B had not seen A's update
        db = PostgresDB(url)
        try:
            assert db.live_versions([fact.id], "alice") == {fact.id: 3}
            assert db.live_versions([fact.id], "bob") == {}
        finally:
            db.close()
        assert a.get(fact.id).memory == b.get(fact.id).memory == "My dog is called Bo."
    finally:
        a.close()
        b.close()


def test_explicit_kv_folder_is_still_one_process(url, tmp_path):
    from inferscale_engine.errors import InferScaleError
    from inferscale_engine.memory import MemoryStore

    a = MemoryStore(None, url, kv_path=tmp_path / "kv")
    try:
        with pytest.raises(InferScaleError, match="already open"):
            MemoryStore(None, url, kv_path=tmp_path / "kv")
    finally:
        a.close()


@pytest.mark.parametrize("drop", ["restart", "terminate"])
def test_dropped_connection_is_reconnected_and_the_call_retried(cluster, tmp_path, drop):
    """A server restart, or every connection terminated server-side: the next calls (reads and
    writes) succeed on a new connection, without an error reaching the caller."""
    from inferscale_engine.memory import MemoryStore

    url = cluster.new_database()
    a = MemoryStore(None, url, kv_path=tmp_path / "a")
    b = MemoryStore(None, url, kv_path=tmp_path / "b")
    try:
        [fact] = a.add("My dog is called Rex.", user_id="alice")
        assert [m.id for m in b.get_all(user_id="alice")] == [fact.id]
        if drop == "restart":
            cluster.restart()
        else:
            assert cluster.terminate_clients(url) >= 2
        assert [m.id for m in a.get_all(user_id="alice")] == [fact.id]  # a read, on a dropped connection
        b.update(fact.id, "My dog is called Max.", user_id="alice")  # a write, on a dropped connection
        assert a.get(fact.id).memory == "My dog is called Max."
        assert [e["event"] for e in a.history(fact.id)] == ["ADD", "UPDATE"]  # written once, not twice
    finally:
        a.close()
        b.close()


def test_write_cut_off_during_its_commit_is_reported_not_repeated(url, tmp_path):
    """The connection drops while the COMMIT of an update runs (a deferred trigger ends its own
    session, once): the update may or may not be stored, so it is reported, not run again."""
    import psycopg

    from inferscale_engine.errors import DatabaseUnavailableError
    from inferscale_engine.memory import MemoryStore

    a = MemoryStore(None, url, kv_path=tmp_path / "a")
    try:
        [fact] = a.add("My dog is called Rex.", user_id="alice")
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("""
                CREATE SEQUENCE drops;
                CREATE FUNCTION drop_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN
                    IF nextval('drops') = 1 THEN  -- sequences are not rolled back: once only
                        PERFORM pg_terminate_backend(pg_backend_pid());
                        PERFORM pg_sleep(5);
                    END IF;
                    RETURN NULL;
                END $$;
                CREATE CONSTRAINT TRIGGER drop_at_commit AFTER INSERT ON history
                    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION drop_at_commit();
            """)
        with pytest.raises(DatabaseUnavailableError, match="while a write was committing: it may or may not"):
            a.update(fact.id, "My dog is called Max.", user_id="alice")
        assert [e["event"] for e in a.history(fact.id)] == ["ADD"]  # cut off before it committed, and not retried
        assert a.get(fact.id).memory == "My dog is called Rex."
        a.update(fact.id, "My dog is called Max.", user_id="alice")  # the caller's retry, on a new connection
        assert [e["event"] for e in a.history(fact.id)] == ["ADD", "UPDATE"]
    finally:
        a.close()


@pytest.mark.parametrize("sqlstate", ["serialization_failure", "deadlock_detected", "lock_not_available"])
def test_error_on_a_live_connection_is_retried_or_reported(url, tmp_path, sqlstate):
    """The server fails a write once (a trigger raises ``sqlstate``) on a connection that stays
    up: a transaction it rolled back (serialization failure, deadlock) is run again and
    succeeds; another operational error is an InferScaleError naming the store, not repeated."""
    import psycopg

    from inferscale_engine.errors import DatabaseUnavailableError, InferScaleError
    from inferscale_engine.memory import MemoryStore

    a = MemoryStore(None, url, kv_path=tmp_path / "a")
    try:
        [fact] = a.add("My dog is called Rex.", user_id="alice")
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"""
                CREATE SEQUENCE fails;
                CREATE FUNCTION fail_once() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN
                    IF nextval('fails') = 1 THEN  -- sequences are not rolled back: once only
                        RAISE EXCEPTION 'injected' USING ERRCODE = '{sqlstate}';
                    END IF;
                    RETURN NULL;
                END $$;
                CREATE TRIGGER fail_once AFTER INSERT ON history FOR EACH ROW EXECUTE FUNCTION fail_once();
            """)
        if sqlstate == "lock_not_available":
            with pytest.raises(InferScaleError, match=f"memory store {a.location}: injected") as info:
                a.update(fact.id, "My dog is called Max.", user_id="alice")
            assert not isinstance(info.value, DatabaseUnavailableError)
            assert [e["event"] for e in a.history(fact.id)] == ["ADD"]  # rolled back, not run again
            a.update(fact.id, "My dog is called Max.", user_id="alice")  # the caller's retry
        else:
            a.update(fact.id, "My dog is called Max.", user_id="alice")  # rolled back by the server, run again
        assert [e["event"] for e in a.history(fact.id)] == ["ADD", "UPDATE"]
        assert a.get(fact.id).memory == "My dog is called Max."
    finally:
        a.close()


def test_database_that_stays_down_is_a_clear_error_after_the_retries(tmp_path):
    import time

    from inferscale_engine.errors import DatabaseUnavailableError
    from inferscale_engine.memory.meta.pg import PostgresDB

    with throwaway_cluster() as own:  # stopped and started here: not the module's cluster
        url = own.new_database()
        db = PostgresDB(url, retry_seconds=2)
        try:
            assert db.count_facts() == 0
            own.stop()
            t0 = time.monotonic()
            with pytest.raises(DatabaseUnavailableError, match="is unreachable .retried for 2 s"):
                db.count_facts()
            assert 1.5 < time.monotonic() - t0 < 10
            own.start()
            assert db.count_facts() == 0  # and back once the database is
        finally:
            db.close()


def _eventually(call, error: type[Exception], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            return call()
        except error:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_replicas_of_another_model_are_refused_while_one_runs(url):
    """The claim a serving replica records (the backend's API; the servers' is tested below)."""
    from inferscale_engine.errors import ReplicaMismatchError
    from inferscale_engine.memory.meta.pg import PostgresDB

    first, same, other = PostgresDB(url), PostgresDB(url), PostgresDB(url)
    try:
        first.claim_serving("fp-smol-w5", "smollm2 (bfloat16, window 5)")
        same.claim_serving("fp-smol-w5", "smollm2 (bfloat16, window 5)")
        with pytest.raises(ReplicaMismatchError, match=r"running replicas of smollm2 .* this replica runs qwen"):
            other.claim_serving("fp-qwen-w5", "qwen (bfloat16, window 5)")
        first.close()
        with pytest.raises(ReplicaMismatchError):  # one replica of the store's model still runs
            other.claim_serving("fp-qwen-w5", "qwen (bfloat16, window 5)")
        same.close()
        # None runs: the store moves (once the server has ended the closed sessions, a moment later).
        _eventually(lambda: other.claim_serving("fp-qwen-w5", "qwen (bfloat16, window 5)"), ReplicaMismatchError)
        assert other.get_meta("kv_fingerprint") == "fp-qwen-w5"
        back = PostgresDB(url)
        try:
            with pytest.raises(ReplicaMismatchError, match="running replicas of qwen"):
                back.claim_serving("fp-smol-w5", "smollm2 (bfloat16, window 5)")
        finally:
            back.close()
    finally:
        for db in (first, same, other):
            db.close()


def test_bad_database_url_is_a_clear_error(cluster, tmp_path):
    from inferscale_engine.errors import InferScaleError
    from inferscale_engine.memory import MemoryStore

    bad = f"postgresql://postgres:hunter2@127.0.0.1:{cluster.port}/no_such_db"
    with pytest.raises(InferScaleError, match="cannot connect") as info:
        MemoryStore(None, bad, kv_path=tmp_path / "kv")
    assert "hunter2" not in str(info.value)


# ---------------------------------------------------------------------- two servers (SmolLM2)


@pytest.fixture(scope="module")
def replicas_url(cluster) -> str:
    return cluster.new_database()


@pytest.fixture(scope="module")
def replica_dirs(tmp_path_factory) -> list:
    """Each replica's folder (its INFERSCALE_HOME, hence its KV folder, is inside)."""
    return [tmp_path_factory.mktemp(f"replica-{name}") for name in ("a", "b")]


@pytest.fixture(scope="module")
def replicas(replicas_url, replica_dirs, smollm2_path):
    url = replicas_url
    procs = []
    try:
        bases = []
        # A encodes what B writes as it arrives (follow_interval); B, the default, encodes a fact
        # of A's on its first ask: the tests below exercise each way.
        for folder, follow in zip(replica_dirs, (["--engine-option", "follow_interval=1"], [])):
            proc, base, log = start_server("smollm2", folder, "--store", url, "--recompute", "0", *follow)
            procs.append((proc, log))
            bases.append(base)
        yield [httpx.Client(base_url=b, timeout=300) for b in bases]
    finally:
        for proc, log in procs:
            stop_server(proc)
            assert "Traceback" not in log.read_text(), log.read_text()[-4000:]


def _add(http: httpx.Client, text: str, user: str) -> dict:
    r = http.post("/v1/memories/", json={"messages": text, "user_id": user})
    assert r.status_code == 200, r.text
    return r.json()["results"][0]


def _ask(http: httpx.Client, user: str, memory: str, question: str) -> httpx.Response:
    return http.post("/v1/chat/completions", json={
        "model": "smollm2", "user": user, "temperature": 0, "max_tokens": 16,
        "messages": [{"role": "system", "content": memory_system_message([memory])},
                     {"role": "user", "content": question}],
    })


def _answer(r: httpx.Response) -> tuple[str, dict]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], r.json()["usage"]


@pytest.mark.slow
def test_added_on_a_answered_from_injected_kv_on_b(replicas):
    a, b = replicas
    fact = _add(a, "My dog is called Rex.", "erin")
    # Answers are compared with the same replica's answer to the fact pasted as text (exact-context
    # encoding makes them equal), never with a 135M model's words, which differ across CPUs.
    text, usage = _answer(_ask(b, "erin", fact["handle"], "What is my dog's name?"))  # B encodes on a miss
    assert usage["injected_tokens"] > 0 and usage["memories_as_text"] == 0
    on_a, usage_a = _answer(_ask(a, "erin", fact["handle"], "What is my dog's name?"))
    assert on_a == text and usage_a["injected_tokens"] == usage["injected_tokens"]
    pasted, usage_p = _answer(_ask(b, "erin", fact["memory"], "What is my dog's name?"))
    assert pasted == text and usage_p["injected_tokens"] == 0


@pytest.mark.slow
def test_update_and_delete_on_a_never_served_stale_by_b(replicas):
    a, b = replicas
    fact = _add(a, "My dog is called Rex.", "fay")
    question = "What is my dog's name?"
    old, _ = _answer(_ask(b, "fay", "My dog is called Rex.", question))
    new, _ = _answer(_ask(b, "fay", "My dog is called Max.", question))
    assert old != new  # else this test could not tell a stale answer from a fresh one
    text, usage = _answer(_ask(b, "fay", fact["handle"], question))
    assert text == old and usage["injected_tokens"] > 0  # B now holds KV of the first version

    r = a.put(f"/v1/memories/{fact['id']}/", json={"text": "My dog is called Max.", "user_id": "fay"})
    assert r.status_code == 200, r.text
    text, usage = _answer(_ask(b, "fay", fact["handle"], question))
    assert text == new
    assert usage["injected_tokens"] > 0 and usage["memories_as_text"] == 0  # the new version, re-encoded on B
    assert b.get(f"/v1/memories/{fact['id']}/", params={"user_id": "fay"}).json()["memory"] == "My dog is called Max."

    r = a.delete(f"/v1/memories/{fact['id']}/", params={"user_id": "fay"})
    assert r.status_code == 200, r.text
    r = _ask(b, "fay", fact["handle"], question)
    assert r.status_code == 404, r.text
    assert b.post("/v1/memories/search/", json={"query": "dog", "user_id": "fay"}).json()["results"] == []


@pytest.mark.slow
def test_user_isolation_across_replicas(replicas):
    a, b = replicas
    secret = _add(a, "My bank PIN is 4321.", "gus")
    r = _ask(b, "hal", secret["handle"], "What is my PIN?")  # gus's handle in hal's request, on the other replica
    assert r.status_code == 403, r.text
    hits = b.post("/v1/memories/search/", json={"query": "bank PIN", "user_id": "hal"}).json()["results"]
    assert all(h["user_id"] == "hal" for h in hits) and secret["id"] not in {h["id"] for h in hits}
    assert b.get(f"/v1/memories/{secret['id']}/", params={"user_id": "hal"}).status_code == 404
    assert b.get(f"/v1/memories/{secret['id']}/", params={"user_id": "gus"}).json()["memory"] == secret["memory"]


@pytest.mark.slow
def test_replica_of_another_model_refuses_to_start(replicas, replicas_url, tiny_llama, tmp_path):
    """SmolLM2 replicas serve the store: one of another model exits at start-up with one error,
    naming both models and what to do, and no traceback; the running replicas serve on."""
    a, _ = replicas
    with pytest.raises(RuntimeError, match="server exited with 1") as info:
        start_server(tiny_llama, tmp_path, "--store", replicas_url, "--max-model-len", "1024", "--recompute", "0")
    log = str(info.value)
    assert "Traceback" not in log, log
    error = " ".join(log[log.index("inferscale: error:"):].split())
    # The replicas run dtype auto: SmolLM2's bfloat16, float32 on a CPU that would emulate it.
    dtype = "float32" if cpu_emulates_bfloat16() else "bfloat16"
    assert f"served by running replicas of smollm2 ({dtype}, window 5)" in error, error
    assert f"this replica runs {tiny_llama} (" in error, error
    assert "stop every replica of it first" in error, error
    assert a.get("/health").status_code == 200


@pytest.mark.slow
def test_database_restart_while_replicas_serve(replicas, replicas_url, cluster):
    """The database restarts, then drops every connection, under traffic on both replicas: no
    request fails (each re-opens its connection and retries), and B still answers from KV."""
    a, b = replicas
    fact = _add(a, "I was born in Lyon.", "ida")
    question = "Where was I born?"
    before, usage = _answer(_ask(b, "ida", fact["handle"], question))
    assert usage["injected_tokens"] > 0
    failures: list[str] = []
    calls = [0]
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            for r in (_ask(b, "ida", fact["handle"], question),
                      a.post("/v1/memories/search/", json={"query": "born", "user_id": "ida"}),
                      b.get(f"/v1/memories/{fact['id']}/", params={"user_id": "ida"})):
                calls[0] += 1
                if r.status_code != 200:
                    failures.append(f"{r.request.url}: {r.status_code} {r.text[:300]}")

    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        time.sleep(1)
        cluster.restart()
        time.sleep(2)
        assert cluster.terminate_clients(replicas_url) >= 2
        time.sleep(2)
    finally:
        stop.set()
        thread.join()
    assert not failures, failures
    assert calls[0] >= 6
    late = _add(a, "I work in Geneva.", "ida")  # a write after both drops, on A; read on B
    assert b.get(f"/v1/memories/{late['id']}/", params={"user_id": "ida"}).json()["memory"] == "I work in Geneva."
    after, usage = _answer(_ask(b, "ida", fact["handle"], question))
    assert after == before and usage["injected_tokens"] > 0


@pytest.mark.slow
def test_fact_added_on_b_is_encoded_on_a_before_it_is_asked(replicas, replica_dirs):
    """A follows the change feed while idle (``follow_interval=1``) and encodes a fact added
    through B before anyone asks A about it: its KV file appears in A's own folder."""
    a, b = replicas
    fact = _add(b, "My sister is called Ada.", "kim")
    deadline = time.monotonic() + 120
    while not list(replica_dirs[0].glob(f"**/{fact['id']}-*.safetensors")):
        assert time.monotonic() < deadline, "A did not encode a fact added through B until asked"
        time.sleep(0.5)
    text, usage = _answer(_ask(a, "kim", fact["handle"], "What is my sister's name?"))
    assert usage["injected_tokens"] > 0 and usage["memories_as_text"] == 0
    on_b, _ = _answer(_ask(b, "kim", fact["handle"], "What is my sister's name?"))
    assert on_b == text
