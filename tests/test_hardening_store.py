"""Issue 23 (hardening) without a model: the handle secret, refused inputs, storage errors."""

from __future__ import annotations

import pytest

from inferscale_engine.errors import ForgedHandleError, SecretError
from inferscale_engine.memory import MemoryStore


@pytest.fixture(scope="module")
def embedder():
    from inferscale_engine.memory.embedder import Embedder

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

    secret.unlink()
    assert main(["memory", "rotate-secret", "--store", str(path)]) == 0
    with MemoryStore(None, path, embedder=embedder) as store:
        new = store.get(item.id).handle
        assert new != item.handle
        with pytest.raises(ForgedHandleError):
            store._codec.verify(item.handle, "alice")
        assert store._codec.verify(new, "alice") == item.id


def test_a_new_store_still_creates_its_secret(tmp_path, embedder):
    with MemoryStore(None, tmp_path / "fresh", embedder=embedder) as store:
        store.add("hello", user_id="u")
    assert (tmp_path / "fresh" / "secret.key").stat().st_size == 32
