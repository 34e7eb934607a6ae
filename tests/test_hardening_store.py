"""Issue 23 (hardening) without a model: the handle secret, refused inputs, storage errors."""

from __future__ import annotations

import pytest

from inferscale_engine.errors import ForgedHandleError, InferScaleError, SecretError
from inferscale_engine.memory import MemoryStore
from inferscale_engine.testing import verify_handle


@pytest.fixture(scope="module")
def embedder():
    from inferscale_engine.memory.text.embedder import Embedder

    return Embedder(None, device="cpu")


def test_lost_or_changed_secret_refuses_to_open_and_rotation_reissues_handles(tmp_path, embedder):
    from inferscale_apps.cli import main

    path = tmp_path / "store"
    with MemoryStore(None, path, embedder=embedder) as store:
        item = store.add("Alice's bank PIN is 4471.", user_id="alice")[0]
    secret = path / "secret.key"
    original = secret.read_bytes()

    secret.unlink()  # lost: used to be re-created silently, every old handle then 403
    with pytest.raises(SecretError) as err:
        MemoryStore(None, path, embedder=embedder)
    assert str(secret) in str(err.value) and f"inferscale memory rotate-secret --store {path}" in str(err.value)
    assert not secret.exists()  # refusing wrote nothing

    secret.write_bytes(b"x" * 32)  # replaced
    with pytest.raises(SecretError, match="not the one"):
        MemoryStore(None, path, embedder=embedder)

    secret.write_bytes(original)  # restored from a backup: opens, old handles work
    with MemoryStore(None, path, embedder=embedder) as store:
        assert store.get(item.id).handle == item.handle
        assert verify_handle(store, item.handle, "alice") == item.id  # remembered by this store

    secret.unlink()
    assert main(["memory", "rotate-secret", "--store", str(path)]) == 0
    with MemoryStore(None, path, embedder=embedder) as store:
        new = store.get(item.id).handle
        assert new != item.handle
        with pytest.raises(ForgedHandleError):
            verify_handle(store, item.handle, "alice")
        assert verify_handle(store, new, "alice") == item.id


def test_a_new_store_still_creates_its_secret(tmp_path, embedder):
    with MemoryStore(None, tmp_path / "fresh", embedder=embedder) as store:
        store.add("hello", user_id="u")
    assert (tmp_path / "fresh" / "secret.key").stat().st_size == 32


def _store_with_kv(path, embedder):
    """A store with one memory, and a KV file for it (a retrieval-only store writes none)."""
    with MemoryStore(None, path, embedder=embedder) as store:
        item = store.add("Bob's locker code is 5512.", user_id="bob")[0]
    kv = path / "kv" / item.id[:2] / f"{item.id}-1.safetensors"
    kv.parent.mkdir(parents=True)
    kv.write_bytes(b"kv of a live memory")
    return item, kv


@pytest.mark.parametrize("damage", ["deleted", "emptied", "overwritten", "truncated", "deleted, -wal left"])
def test_a_store_whose_database_is_lost_refuses_to_open_and_keeps_its_files(tmp_path, embedder, damage):
    from inferscale_engine.errors import StoreDamagedError
    from inferscale_engine.memory.meta.folder import lock_holder

    path = tmp_path / "store"
    item, kv = _store_with_kv(path, embedder)
    db = path / "memory.sqlite3"
    if damage == "deleted":
        db.unlink()
    elif damage == "emptied":
        db.write_bytes(b"")
    elif damage == "overwritten":
        db.write_bytes(b"not a database, " * 64)
    elif damage == "truncated":  # header intact, pages gone
        with MemoryStore(None, path, embedder=embedder) as store:
            store.add_texts([f"filler memory {i} " * 40 for i in range(60)], user_id="bob")
        with db.open("r+b") as f:
            f.truncate(8192)
    else:
        (path / "memory.sqlite3-wal").write_bytes(db.read_bytes())
        db.unlink()
        (path / "secret.key").unlink()
        kv.unlink()  # the -wal alone marks the store
    before = sorted(p.relative_to(path) for p in path.rglob("*") if p.name != ".lock")

    with pytest.raises(StoreDamagedError) as err:
        MemoryStore(None, path, embedder=embedder)
    message = str(err.value)
    assert str(path) in message and "memory.sqlite3" in message
    assert "Restore memory.sqlite3 from a backup" in message and f"delete the folder {path}" in message
    # Nothing swept, nothing created: the KV files and the secret are still there for a restore.
    assert sorted(p.relative_to(path) for p in path.rglob("*") if p.name != ".lock") == before
    if damage != "deleted, -wal left":
        assert kv.read_bytes() == b"kv of a live memory"
    assert lock_holder(path) is None  # refused, not left holding the lock
    with pytest.raises(StoreDamagedError):  # and a second open gets the same answer
        MemoryStore(None, path, embedder=embedder)


def test_a_restored_database_opens_with_its_memories_and_kv(tmp_path, embedder):
    path = tmp_path / "store"
    item, kv = _store_with_kv(path, embedder)
    db = path / "memory.sqlite3"
    backup = db.read_bytes()
    db.unlink()
    with pytest.raises(InferScaleError):
        MemoryStore(None, path, embedder=embedder)
    db.write_bytes(backup)
    with MemoryStore(None, path, embedder=embedder) as store:
        assert store.get(item.id).memory == item.memory
    assert kv.exists()  # a live memory's file is kept


@pytest.mark.parametrize("leftover", [None, ".lock", "empty kv folder", "empty database"])
def test_a_new_folder_still_starts_a_store(tmp_path, embedder, leftover):
    path = tmp_path / "fresh"
    path.mkdir()
    if leftover == ".lock":  # an open that failed before the database was made
        (path / ".lock").write_text("")
    elif leftover == "empty kv folder":
        (path / "kv").mkdir()
    elif leftover == "empty database":  # SQLite made the file, a crash came before its first write
        (path / "memory.sqlite3").write_bytes(b"")
    with MemoryStore(None, path, embedder=embedder) as store:
        store.add("hello", user_id="u")
    with MemoryStore(None, path, embedder=embedder) as store:
        assert len(store.get_all(user_id="u")) == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", [
    ["memory", "list", "--user", "bob"],
    ["memory", "rotate-secret"],
    ["memory", "add", "--user", "bob", "I like tea.", "--model", "/no/such/model"],
    ["chat", "--model", "/no/such/model"],
    ["serve", "--model", "/no/such/model"],
])
def test_the_cli_names_a_lost_database_in_one_message(tmp_path, embedder, capsys, command):
    """Before any model loads (the model given does not even exist): one error, exit 1, no traceback."""
    from inferscale_apps.cli import main

    path = tmp_path / "store"
    _store_with_kv(path, embedder)
    (path / "memory.sqlite3").unlink()
    assert main([*command, "--store", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("inferscale: error: ") and err.count("error:") == 1, err
    assert "Traceback" not in err
    assert "memory.sqlite3 is missing" in " ".join(err.split()) and "Restore memory.sqlite3" in " ".join(err.split())
    assert not (path / "memory.sqlite3").exists()


def test_a_full_or_read_only_database_is_a_typed_storage_error(tmp_path):
    """SQLite's own full-disk and read-only failures reach callers as StorageFullError and
    StorageUnavailableError (the server's 507 and 503), and leave no transaction open."""
    from inferscale_engine.errors import StorageFullError, StorageUnavailableError
    from inferscale_engine.memory.meta.db import SQLiteDB

    db = SQLiteDB(tmp_path / "memory.sqlite3")
    try:
        db.set_meta("small", "fits")
        pages = db.conn.execute("PRAGMA page_count").fetchone()[0]
        most = db.conn.execute("PRAGMA max_page_count").fetchone()[0]
        db.conn.execute(f"PRAGMA max_page_count={pages}")  # the disk is full: no page more
        with pytest.raises(StorageFullError, match="full"):
            db.set_meta("big", "x" * 100_000)
        db.conn.execute(f"PRAGMA max_page_count={most}")
        db.set_meta("after", "the failed write left no transaction behind")
        assert db.get_meta("big") is None and db.get_meta("after") is not None

        db.conn.execute("PRAGMA query_only=ON")  # as a read-only file or folder refuses writes
        with pytest.raises(StorageUnavailableError, match="readonly"):
            db.set_meta("small", "changed")
        db.conn.execute("PRAGMA query_only=OFF")
        assert db.get_meta("small") == "fits"
    finally:
        db.close()
