"""The folder of a memory store: its files, its handle secret and the lock that keeps it to one process
(for a store in PostgreSQL: the folder of one replica's KV)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import os
import re
import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from inferscale_engine.errors import InferScaleError, SecretError, StoreDamagedError

SECRET_FILE = "secret.key"
DB_FILE = "memory.sqlite3"
KV_DIR = "kv"
LOCK_FILE = ".lock"
#: What SQLite keeps beside the database while it is open (or after a crash).
DB_COMPANIONS = ("-wal", "-shm", "-journal")
_SQLITE_HEADER = b"SQLite format 3\x00"

if TYPE_CHECKING:
    from inferscale_engine.memory.meta.db import MetaDB

#: Key, in the database's meta table, of a digest of the secret the store's handles were made with.
SECRET_CHECK = "secret_check"


def secret_check(secret: bytes) -> str:
    """Identifies a secret without revealing it (a MAC of a constant under it)."""
    return hmac.new(secret, b"inferscale secret check", hashlib.sha256).hexdigest()[:32]


def rotate_command(folder: Path) -> str:
    return f"inferscale memory rotate-secret --store {folder}"


def open_secret(path: Path, db: MetaDB) -> bytes:
    """The store's handle secret, checked against the one its handles were made with.

    A store with facts whose secret is gone or replaced would call every handle it gave out
    "forged" (403) while looking healthy: it refuses to open instead, naming the file and the
    command that issues a new secret on purpose.
    """
    has_facts = db.count_facts() > 0
    # Without facts there is no handle to keep valid: a new or emptied store takes what it finds.
    recorded = db.get_meta(SECRET_CHECK) if has_facts else None
    if not path.exists() and has_facts:
        raise SecretError(
            f"the handle secret {path} is missing, but this store has memories whose handles were made with it; "
            f"restore the file from a backup, or issue a new secret (every handle given out so far stops "
            f"working) with: {rotate_command(path.parent)}"
        )
    secret = load_secret(path)
    check = secret_check(secret)
    if recorded is not None and not hmac.compare_digest(recorded, check):
        raise SecretError(
            f"the handle secret {path} is not the one this store's handles were made with (replaced or "
            f"damaged); restore the original file, or issue a new secret (every handle given out so far stops "
            f"working) with: {rotate_command(path.parent)}"
        )
    if recorded is None and db.get_meta(SECRET_CHECK) != check:  # a store from before the check: trust what it has
        db.set_meta(SECRET_CHECK, check)
    return secret


def check_database(folder: Path) -> None:
    """Refuse a store folder whose database is gone, empty or not SQLite while the rest of a store
    is there (:class:`StoreDamagedError`); a new folder, or one with an intact database, passes.

    SQLite would create an empty database in its place, and the open would then remove every KV
    file as belonging to no memory: everybody's memories, lost without a word. Call it holding
    the store's lock, before the database is opened.
    """
    db = folder / DB_FILE
    try:
        size = db.stat().st_size
    except FileNotFoundError:
        size = None
    if size:
        with db.open("rb") as f:
            if f.read(len(_SQLITE_HEADER)) != _SQLITE_HEADER:
                raise StoreDamagedError(folder, f"{DB_FILE} is not a SQLite database", DB_FILE)
        return
    marks = _store_marks(folder)
    if marks:
        problem = f"{DB_FILE} is missing" if size is None else f"{DB_FILE} is empty (0 bytes)"
        raise StoreDamagedError(folder, f"{problem}, yet the folder holds the rest of a store ({', '.join(marks)})",
                                DB_FILE)


def _store_marks(folder: Path) -> list[str]:
    """The files of an existing store in ``folder``, but for its database."""
    marks = [name for name in (SECRET_FILE, *(DB_FILE + c for c in DB_COMPANIONS)) if (folder / name).exists()]
    kv_files = sum(1 for _ in (folder / KV_DIR).rglob("*.safetensors"))
    if kv_files:
        marks.append(f"{kv_files} KV file{'s' if kv_files > 1 else ''}")
    return marks


def rotate_secret(folder: Path) -> int:
    """Give the store in ``folder`` a new handle secret; returns how many live memories get new
    handles (the old ones stop working). The store must not be open elsewhere."""
    from inferscale_engine.memory.meta.db import SQLiteDB

    lock = acquire_lock(folder / LOCK_FILE)
    try:
        check_database(folder)
        db = SQLiteDB(folder / DB_FILE)
        try:
            secret = secrets.token_bytes(32)
            path = folder / SECRET_FILE
            tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, secret)
                os.fsync(fd)
            finally:
                os.close(fd)
            # The check goes first: a crash between the two leaves a store that refuses to open
            # (and says to rotate again), never one that silently serves under a mismatched secret.
            db.set_meta(SECRET_CHECK, secret_check(secret))
            os.replace(tmp, path)
            return db.count_facts()
        finally:
            db.close()
    finally:
        release_lock(lock)


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


@dataclass(frozen=True)
class LockHolder:
    """Who holds a store's lock, as its lock file says: the process (its :func:`process_summary`),
    and the URL of the HTTP API it serves the store on (``inferscale serve`` records it), if any."""

    pid: int | None
    command: str = ""
    url: str | None = None

    def describe(self) -> str:
        if self.pid is None:
            return "by another process"
        return f"by process {self.pid}" + (f" ({self.command})" if self.command else "")


#: A command word (``serve``, ``memory``, ``rotate-secret``): letters and dashes, no digits, short.
_COMMAND_WORD = re.compile(r"[a-z]+(?:-[a-z]+)*")


def process_summary(argv: Sequence[str]) -> str:
    """What a lock file tells of the process holding it: the program and up to two command words
    after it (``inferscale serve``, ``inferscale memory add``), never an option or argument.

    The summary is quoted to whoever the lock refuses, HTTP clients of a server that could not
    open its store included, and the rest of a command line may hold an API key, a database
    password or a memory's text."""
    if not argv:
        return ""
    words = [Path(argv[0]).name]
    for arg in argv[1:3]:
        if len(arg) > 16 or not _COMMAND_WORD.fullmatch(arg):
            break
        words.append(arg)
    return " ".join(words)


def acquire_lock(path: Path) -> int:
    """Hold the store's lock; the file names the holder (pid, :func:`process_summary`) for whoever is refused."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        if holder.pid == os.getpid():
            raise InferScaleError(f"memory store {path.parent} is already open in this process; close it first") from None
        raise InferScaleError(locked_message(path.parent, holder)) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n{process_summary(sys.argv)}\n".encode(errors="replace"), 0)
    return fd


def locked_message(folder: Path, holder: LockHolder) -> str:
    """The refusal for a store held by ``holder``: who it is, and how to reach the store anyway."""
    where = f"--server {holder.url}" if holder.url else "--server URL"
    return (f"memory store {folder} is already open {holder.describe()}. Stop that process, or, if it is "
            f"`inferscale serve`, use its HTTP API instead: `inferscale memory ... {where}` "
            "(or INFERSCALE_SERVER), or GET /v1/memories/?user_id=USER and POST /v1/memories/search/ (docs/server.md)")


def record_url(fd: int, url: str) -> None:
    """Note in the held lock file the URL of the HTTP API that serves this store, so a command
    refused by the lock can use that API instead (``inferscale memory ... `` does)."""
    from inferscale_engine.memory.meta.pg import redact

    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n{process_summary(sys.argv)}\n{redact(url)}\n".encode(errors="replace"), 0)


def lock_holder(folder: Path) -> LockHolder | None:
    """Who holds the lock of the store in ``folder`` now (None: nobody; the store can be opened)."""
    try:
        fd = os.open(Path(folder).expanduser() / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_holder(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read_holder(fd: int) -> LockHolder:
    try:
        lines = os.pread(fd, 4096, 0).decode(errors="replace").split("\n")
    except OSError:
        return LockHolder(None)
    if not lines[0].strip().isdigit():  # a lock file from before holders were recorded
        return LockHolder(None)
    url = lines[2].strip() if len(lines) > 2 and lines[2].strip() else None
    # A holder from before summaries recorded its whole command line: summarised here too.
    command = process_summary(lines[1].split()) if len(lines) > 1 else ""
    return LockHolder(int(lines[0]), command, url)


def acquire_replica_folder(base: Path, explicit: bool) -> tuple[Path, int]:
    """The local KV folder of one replica of a shared store, and its held lock.

    The database is shared, the KV folder is not: each replica needs its own. An ``explicit``
    folder is taken or refused; under the default one, replicas on one machine take the first
    free numbered slot (``base/0``, ``base/1``...), so starting two needs no extra flag."""
    if explicit:
        base.mkdir(parents=True, exist_ok=True)
        return base, acquire_lock(base / LOCK_FILE)
    for slot in range(256):
        folder = base / str(slot)
        folder.mkdir(parents=True, exist_ok=True)
        try:
            return folder, acquire_lock(folder / LOCK_FILE)
        except InferScaleError:
            continue
    raise InferScaleError(f"every KV folder under {base} is taken by a running replica; give one with kv_path=")


def release_lock(fd: int) -> None:
    """Let the store go. The lock file is emptied first: one that still names a holder after it
    exited was left by a process that never closed the store (killed, or crashed)."""
    try:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
