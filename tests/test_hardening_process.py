"""Issue 39 (hardening, second round): the processes.

* SIGTERM (``kill``, ``docker stop``, systemd) closes ``inferscale serve`` and ``inferscale chat``
  as Ctrl-C does: each runs in a fresh process on a tiny model, adds a memory, gets SIGTERM, and
  must end soon with the store closed: lock released by the close (its file emptied), the WAL
  checkpointed into ``memory.sqlite3``, the memory there on reopen.
* A store held by a process started with secrets on its command line (``--api-key s3cret``, a
  database password) is refused without quoting them: by the CLI, and in the 503 body of a
  server that could not open it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from inferscale_engine.memory import MemoryStore

REPO = Path(__file__).resolve().parent.parent
EXIT_TIMEOUT = 120  # seconds from SIGTERM to exit (~7 s alone; this 2-core box is shared with other test runs)


def start_cli(tmp_path: Path, name: str, *args: str) -> tuple[subprocess.Popen, Path]:
    """``inferscale ARGS`` in a new process; stderr goes to a log file (returned)."""
    log = tmp_path / f"{name}.log"
    env = {**os.environ, "INFERSCALE_HOME": str(tmp_path / "home"), "PYTHONFAULTHANDLER": "1"}
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "inferscale_apps.cli", *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=REPO)
    return proc, log


def readline(proc: subprocess.Popen, timeout: float) -> str:
    got: list[str] = []
    t = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    t.start()
    t.join(timeout)
    return got[0] if got else ""


def terminate(proc: subprocess.Popen, log: Path) -> None:
    """SIGTERM, then the process must be gone within EXIT_TIMEOUT, with 143 and no traceback."""
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(EXIT_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)  # faulthandler writes every thread's stack to the log
        time.sleep(3)
        proc.kill()
        raise AssertionError(f"still running {EXIT_TIMEOUT} s after SIGTERM:\n{log.read_text()[-8000:]}") from None
    assert rc == 143, (rc, log.read_text()[-3000:])
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def assert_closed_cleanly(store: Path, fact_id: str, text: str, tmp_path: Path) -> None:
    # The close emptied the lock file; a process that died holding the store leaves its pid there.
    assert (store / ".lock").read_bytes() == b""
    wal = store / "memory.sqlite3-wal"
    assert not wal.exists() or wal.stat().st_size == 0, wal.stat().st_size
    # The memory is in the database file itself, not only in a WAL waiting to be replayed.
    alone = tmp_path / "alone.sqlite3"
    shutil.copyfile(store / "memory.sqlite3", alone)
    with sqlite3.connect(alone) as db:
        assert db.execute("SELECT text FROM facts WHERE id=? AND NOT deleted", (fact_id,)).fetchall() == [(text,)]
    with MemoryStore(None, store) as reopened:
        assert reopened.get(fact_id).memory == text


@pytest.mark.slow
def test_sigterm_closes_chat(tiny_llama, tmp_path):
    store = tmp_path / "store"
    proc, log = start_cli(tmp_path, "chat", "chat", "--model", tiny_llama, "--store", str(store),
                          "--max-model-len", "512", "--user", "ann")
    try:
        proc.stdin.write("/remember My dog is called Rex.\n")
        proc.stdin.flush()
        line = readline(proc, 300)
        added = re.match(r"remembered ([0-9a-f]{16}): (.*)$", line.strip())
        assert added, (line, log.read_text()[-3000:])
        terminate(proc, log)  # waiting for the next line, stdin still open
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_closed_cleanly(store, added.group(1), added.group(2), tmp_path)


@pytest.mark.slow
def test_sigterm_closes_serve(tiny_llama, tmp_path):
    store = tmp_path / "store"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc, log = start_cli(tmp_path, "serve", "serve", "--model", tiny_llama, "--store", str(store), "--port", str(port),
                          "--max-model-len", "512", "--log-level", "warning", "--served-model-name", "tiny")
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "server did not come up:\n" + log.read_text()[-3000:]
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        r = httpx.post(base + "/v1/memories/", timeout=60, json={
            "messages": [{"role": "user", "content": "My cat is called Tom."}], "user_id": "ann", "infer": False})
        assert r.status_code == 200, r.text
        (item,) = r.json()["results"]
        terminate(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_closed_cleanly(store, item["id"], item["memory"], tmp_path)


SECRET = "s3cret"
#: A lock holder's command line as a user might type it (``python -c HOLDER`` followed by these).
HOLDER_ARGV = ["serve", "--api-key", SECRET, f"--api-key={SECRET}", "--hf-token", SECRET, "--db-password",
               SECRET, "--store", f"postgresql://bob:{SECRET}@db.example/memories", f"https://bob:{SECRET}@example.com",
               SECRET]
HOLDER = """
import fcntl, os, sys
from inferscale_engine.memory import MemoryStore

path = os.environ["HOLD_STORE"]
if os.environ["HOLDER_KIND"] == "current":
    store = MemoryStore(None, path)
else:  # an InferScale from before summaries: its lock file has the whole command line
    os.makedirs(path, exist_ok=True)
    fd = os.open(os.path.join(path, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, f"{os.getpid()}\\n{' '.join(sys.argv)}\\n".encode())
print("HOLDING", flush=True)
sys.stdin.read()
if os.environ["HOLDER_KIND"] == "current":
    store.close()
"""


@pytest.fixture(scope="module")
def engine(tiny_llama, tmp_path_factory):
    """A real engine whose store another process holds (the server then answers 503 for memories)."""
    from inferscale_engine import InferScaleEngine

    eng = InferScaleEngine(model=tiny_llama, store_path=tmp_path_factory.mktemp("held") / "store",
                           device="cpu", dtype="float32", max_model_len=512, recompute=0)
    yield eng
    eng.close()


@pytest.mark.parametrize("kind", ["current", "older InferScale"])
def test_a_lock_holders_secrets_are_never_quoted(engine, kind, capsys, tmp_path):
    from fastapi.testclient import TestClient

    from inferscale_apps.cli import main
    from inferscale_apps.server import create_app

    store = engine.config.store_path
    env = {**os.environ, "HOLD_STORE": str(store), "HOLDER_KIND": kind}
    log = tmp_path / "holder.log"
    with log.open("w") as err:
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, *HOLDER_ARGV], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=REPO)
    try:
        assert readline(holder, 120).strip() == "HOLDING", log.read_text()[-3000:]
        if kind == "current":
            assert SECRET not in (Path(store) / ".lock").read_text()

        assert main(["memory", "list", "--user", "ann", "--store", str(store)]) == 1
        refusal = " ".join(capsys.readouterr().err.split())
        assert f"already open by process {holder.pid} (-c serve)" in refusal, refusal
        assert SECRET not in refusal and "bob" not in refusal

        with TestClient(create_app(engine, served_model_name="tiny")) as client:
            r = client.get("/v1/memories/", params={"user_id": "ann"})
        assert r.status_code == 503, r.text
        assert f"already open by process {holder.pid}" in r.text, r.text
        assert SECRET not in r.text and "bob" not in r.text
    finally:
        holder.stdin.close()
        try:
            holder.wait(60)
        finally:
            holder.kill()  # no-op once it exited; else the next test would find the store held
