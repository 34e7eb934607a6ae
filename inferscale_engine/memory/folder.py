"""The folder of a memory store: its files, its handle secret and the lock that keeps it to one process."""

from __future__ import annotations

import fcntl
import os
import secrets
import sys
from pathlib import Path

from inferscale_engine.errors import InferScaleError

SECRET_FILE = "secret.key"
DB_FILE = "memory.sqlite3"
KV_DIR = "kv"
LOCK_FILE = ".lock"


def load_secret(path: Path) -> bytes:
    """The store's handle secret: created once (0600, atomically), then read."""
    try:
        secret = path.read_bytes()
    except FileNotFoundError:
        secret = secrets.token_bytes(32)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secret)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # fails if another process created it first
        except FileExistsError:
            secret = path.read_bytes()
        finally:
            tmp.unlink()
    if len(secret) < 32:
        raise InferScaleError(f"handle secret {path} is damaged ({len(secret)} bytes)")
    return secret


def acquire_lock(path: Path) -> int:
    """Hold the store's lock; the file names the holder (pid, command line) for whoever is refused."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _lock_holder(fd)
        os.close(fd)
        if holder is None:
            raise InferScaleError(f"memory store {path.parent} is already open in this process; close it first") from None
        raise InferScaleError(
            f"memory store {path.parent} is already open {holder}. Stop that process, or, if it is "
            "`inferscale serve`, use its HTTP API instead: GET /v1/memories/?user_id=USER lists, "
            "POST /v1/memories/search/ searches (docs/server.md)"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n{' '.join(sys.argv)}\n".encode(errors="replace"), 0)
    return fd


def _lock_holder(fd: int) -> str | None:
    """Who holds the lock, for the refusal; None when it is this process."""
    try:
        pid, _, command = os.pread(fd, 4096, 0).decode(errors="replace").partition("\n")
    except OSError:
        return "by another process"
    if not pid.strip().isdigit():  # a lock file from before holders were recorded
        return "by another process"
    if int(pid) == os.getpid():
        return None
    command = command.strip()
    return f"by process {pid.strip()}" + (f" ({command})" if command else "")


def release_lock(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
