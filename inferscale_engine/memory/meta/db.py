"""The metadata of a memory store (users, facts, history, embeddings) behind one small
interface, :class:`MetaDB`, with one class per backend: :class:`SQLiteDB` here (embedded, the
default) and :class:`~inferscale_engine.memory.meta.pg.PostgresDB` (shared by replicas).
:func:`~inferscale_engine.memory.meta.backends.open_db` picks one from the store's location.

All SQL lives behind methods named for what they record, written once in
:class:`SQLMetaDB` (what the backends share) and, where a backend differs, in its class; each
method is one transaction, so what it writes together commits together.

SQLite: one connection shared by the store's threads, serialised by a lock: the store keeps
every live fact in memory, so the database is written through and only read at open. Every
write happens in an explicit transaction that is committed (``synchronous=FULL``) before the
store's call returns.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from inferscale_engine.errors import SchemaVersionError, StorageFullError, StorageUnavailableError, StoreDamagedError
from inferscale_engine.memory.item import text_hash

SCHEMA_VERSION = 1

#: The tables of both backends; :meth:`SQLMetaDB._schema` fills in the backend's types and own columns.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS users (
    user_id    TEXT PRIMARY KEY,
    created_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS facts (
    seq            {serial},                         -- insertion order
    id             TEXT NOT NULL UNIQUE,             -- 16 lowercase hex
    user_id        TEXT NOT NULL REFERENCES users(user_id),
    text           TEXT NOT NULL,
    hash           TEXT NOT NULL,
    token_ids      {bytes},                          -- int32 LE; what the engine splices in
    context_ids    {bytes},                          -- int32 LE; what the fact is encoded after
    context_text   TEXT,                             -- the text those ids came from (re-tokenizing)
    context_kind   TEXT NOT NULL DEFAULT 'window',   -- window | explicit | sliding
    context_window INTEGER NOT NULL DEFAULT 0,       -- store window the context was built with
    metadata       TEXT NOT NULL DEFAULT '{{}}',
    created_at     TEXT NOT NULL,
    updated_at     TEXT NOT NULL,
    deleted        {flag},
    {version}      INTEGER NOT NULL DEFAULT 1,       -- of the KV: KV of another version is stale
    {own_columns}
    embedding      {bytes}                           -- float32, L2-normalised
);
CREATE INDEX IF NOT EXISTS facts_by_user ON facts(user_id, deleted, seq);
CREATE TABLE IF NOT EXISTS history (
    seq        {serial},
    id         TEXT NOT NULL UNIQUE,
    memory_id  TEXT NOT NULL,
    user_id    TEXT NOT NULL,
    event      TEXT NOT NULL CHECK (event IN ('ADD', 'UPDATE', 'DELETE')),
    old_memory TEXT,
    new_memory TEXT,
    created_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS history_by_memory ON history(memory_id, seq);
{own_schema}"""


def utc_now() -> str:
    """The timestamp format of every ``created_at`` / ``updated_at`` the store writes."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def ids_to_blob(ids: Sequence[int] | None) -> bytes | None:
    return None if ids is None else np.asarray(ids, dtype="<i4").tobytes()


def blob_to_ids(blob: bytes | None) -> tuple[int, ...] | None:
    return None if blob is None else tuple(int(x) for x in np.frombuffer(blob, dtype="<i4"))


def vec_to_blob(vec: np.ndarray | None) -> bytes | None:
    return None if vec is None else np.asarray(vec, dtype="<f4").tobytes()


def blob_to_vec(blob: bytes | None) -> np.ndarray | None:
    return None if blob is None else np.frombuffer(blob, dtype="<f4").copy()


@dataclass
class FactRow:
    seq: int
    id: str
    user_id: str
    text: str
    token_ids: tuple[int, ...] | None
    context_ids: tuple[int, ...] | None
    context_text: str | None
    context_kind: str
    context_window: int
    metadata: dict[str, Any]
    created_at: str
    updated_at: str
    kv_version: int
    fingerprint: str | None
    encode_error: str | None
    embedding: np.ndarray | None

    def copy(self) -> FactRow:
        """A shallow copy (a snapshot a request reads outside the store's lock), at a seventh of
        ``copy.copy``'s cost: a request copies each of its memories' rows. The dict is copied
        whole rather than filled key by key: half the time (~0.25 µs a row)."""
        row = object.__new__(FactRow)
        row.__dict__ = self.__dict__.copy()
        return row


@dataclass
class Changes:
    """What other writers did to a shared store since it was last asked (see :meth:`MetaDB.changes`):
    the current rows of facts added or changed, and the ids of facts deleted."""

    live: list[FactRow]
    deleted: list[str]


class MetaDB(ABC):
    """The backend interface: what a :class:`~inferscale_engine.memory.MemoryStore` records.

    ``shared`` backends are written by several processes (replicas): the store follows their
    writes through :meth:`changes` and checks versions with :meth:`live_versions` before it
    serves KV. The KV state of a fact (``fingerprint``, ``encode_error``) belongs to the
    process that holds the KV: a shared backend keeps none of it.
    """

    shared: ClassVar[bool] = False
    #: Where the metadata lives, for messages (a file, or a database URL without its password).
    location: str

    @abstractmethod
    def close(self) -> None:
        ...

    def claim_serving(self, fingerprint: str, model: str) -> None:
        """A shared backend: record that this process serves KV made under ``fingerprint``
        (``model`` names it), refusing one that differs from running replicas'. One process
        owns an embedded store: nothing to claim."""
        return None

    @abstractmethod
    def get_meta(self, key: str) -> str | None:
        ...

    @abstractmethod
    def set_meta(self, key: str, value: str) -> None:
        ...

    @abstractmethod
    def count_facts(self) -> int:
        ...

    @abstractmethod
    def load_live_facts(self) -> list[FactRow]:
        ...

    @abstractmethod
    def insert_facts(self, facts: Sequence[FactRow], now: str) -> None:
        ...

    @abstractmethod
    def update_text(self, old: FactRow, new: FactRow, embedding: np.ndarray) -> int:
        ...

    @abstractmethod
    def delete_facts(self, facts: Sequence[FactRow], now: str) -> None:
        ...

    @abstractmethod
    def set_embeddings(self, facts: Iterable[tuple[str, np.ndarray]]) -> None:
        ...

    @abstractmethod
    def set_token_ids(self, facts: Iterable[tuple[str, Sequence[int] | None]]) -> None:
        ...

    @abstractmethod
    def set_context(self, f: FactRow) -> None:
        ...

    @abstractmethod
    def set_fingerprints(self, facts: Iterable[tuple[str | None, str]]) -> None:
        ...

    @abstractmethod
    def mark_encoded(self, fingerprint: str, keys: Iterable[tuple[str, int]]) -> None:
        ...

    @abstractmethod
    def mark_unencoded(self, fact_id: str, version: int) -> None:
        ...

    @abstractmethod
    def set_encode_errors(self, errors: Iterable[tuple[str, str]]) -> None:
        ...

    @abstractmethod
    def new_kv_versions(self, facts: Iterable[tuple[int, str]]) -> None:
        ...

    @abstractmethod
    def new_kv_version(self, fact_id: str, old: int, new: int) -> None:
        ...

    @abstractmethod
    def set_metadata(self, fact_id: str, metadata: dict[str, Any], now: str) -> None:
        ...

    @abstractmethod
    def history(self, memory_id: str) -> list[dict[str, Any]]:
        ...

    # Shared backends only.

    def changes(self) -> Changes:
        """Facts added, changed or deleted since the last call (or :meth:`load_live_facts`)."""
        raise NotImplementedError

    def live_versions(self, fact_ids: Sequence[str], user_id: str) -> dict[str, int]:
        """The current version of each of ``fact_ids`` that is live and belongs to ``user_id``."""
        raise NotImplementedError

    def handle_secret(self) -> bytes:
        """The secret every replica makes and checks handles with (created once)."""
        raise NotImplementedError


class SQLMetaDB(MetaDB):
    """The SQL both backends run, written once, behind :class:`MetaDB`'s named methods.

    Statements are written with ``?`` parameters; a backend says how it connects and holds
    transactions (each yields something with DB-API ``execute`` / ``executemany``), and names
    the few places its dialect or its sharing differs in the class attributes below.
    """

    # What a backend's dialect, and whether it is shared, make differ:
    #: The parameter marker of the backend's driver (statements here are written with ``?``).
    PARAM: ClassVar[str]
    #: Column types: a key numbered on insert, bytes, the deleted flag (false by default).
    SERIAL: ClassVar[str]
    BYTES: ClassVar[str]
    FLAG: ClassVar[str]
    #: The column holding a fact's KV version.
    VERSION: ClassVar[str]
    #: The backend's own columns of a fact, and the rest of its schema.
    OWN_COLUMNS: ClassVar[str]
    OWN_SCHEMA: ClassVar[str] = ""
    #: The KV state a fact row is read with: its columns, or NULLs where the rows keep none.
    KV_STATE: ClassVar[str]
    #: SET clause that drops the KV state of a fact whose KV no longer stands ("": none kept).
    FORGET_KV: ClassVar[str] = ""
    #: SET clause that stamps a row for :meth:`MetaDB.changes` ("": nobody follows changes).
    STAMP: ClassVar[str] = ""

    @abstractmethod
    def _reading(self) -> AbstractContextManager[Any]:
        """A connection or cursor to read with."""

    @abstractmethod
    def _transaction(self) -> AbstractContextManager[Any]:
        """A transaction, committed on leaving (rolled back on an exception)."""

    def _writing(self) -> AbstractContextManager[Any]:
        """A transaction of writes that :attr:`STAMP` rows: a shared backend commits them in stamp order."""
        return self._transaction()

    def _sql(self, statement: str) -> str:
        return statement if self.PARAM == "?" else statement.replace("?", self.PARAM)

    @property
    def _schema(self) -> str:
        return _SCHEMA.format(serial=self.SERIAL, bytes=self.BYTES, flag=self.FLAG, version=self.VERSION,
                              own_columns=self.OWN_COLUMNS, own_schema=self.OWN_SCHEMA)

    @staticmethod
    def _params(n: int) -> str:
        return ",".join("?" * n)

    @property
    def _fact_columns(self) -> str:
        """What :meth:`_row` reads, in its order."""
        return (f"seq, id, user_id, text, token_ids, context_ids, context_kind, context_window, metadata, created_at, "
                f"updated_at, {self.VERSION}, {self.KV_STATE}, embedding, context_text")

    @staticmethod
    def _row(r: Sequence[Any]) -> FactRow:
        """A row of :attr:`_fact_columns` (columns after those are the caller's)."""
        return FactRow(
            seq=r[0], id=r[1], user_id=r[2], text=r[3], token_ids=blob_to_ids(r[4]), context_ids=blob_to_ids(r[5]),
            context_kind=r[6], context_window=r[7], metadata=json.loads(r[8]), created_at=r[9], updated_at=r[10],
            kv_version=r[11], fingerprint=r[12], encode_error=r[13], embedding=blob_to_vec(r[14]), context_text=r[15],
        )

    # ------------------------------------------------------------------ meta

    def get_meta(self, key: str) -> str | None:
        with self._reading() as c:
            return self._meta(c, key)

    def set_meta(self, key: str, value: str) -> None:
        with self._transaction() as c:
            self._put_meta(c, key, value)

    def _meta(self, c: Any, key: str) -> str | None:
        """The value of ``key`` as ``c`` (a transaction, or a connection to read with) sees it."""
        row = c.execute(self._sql("SELECT value FROM meta WHERE key=?"), (key,)).fetchone()
        return None if row is None else str(row[0])

    def _put_meta(self, c: Any, key: str, value: str) -> None:
        c.execute(self._sql("INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value=excluded.value"),
                  (key, value))

    def _meta_once(self, c: Any, key: str, value: str) -> str:
        """The value of ``key``, set to ``value`` if it has none (whoever comes first sets it)."""
        c.execute(self._sql("INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT (key) DO NOTHING"), (key, value))
        return str(self._meta(c, key))

    def _check_schema(self, c: Any) -> None:
        version = self._meta_once(c, "schema_version", str(SCHEMA_VERSION))
        if int(version) != SCHEMA_VERSION:
            raise SchemaVersionError(f"memory store {self.location} has schema version {version}, "
                                     f"this InferScale reads {SCHEMA_VERSION}")

    # ------------------------------------------------------------------ facts

    def count_facts(self) -> int:
        """Live facts (each has a handle made with the store's secret)."""
        with self._reading() as c:
            return int(c.execute("SELECT COUNT(*) FROM facts WHERE NOT deleted").fetchone()[0])

    def load_live_facts(self) -> list[FactRow]:
        with self._reading() as c:
            return self._live_facts(c)

    def _live_facts(self, c: Any) -> list[FactRow]:
        rows = c.execute(f"SELECT {self._fact_columns} FROM facts WHERE NOT deleted ORDER BY seq").fetchall()
        return [self._row(r) for r in rows]

    def insert_facts(self, facts: Sequence[FactRow], now: str) -> None:
        """New facts of one user, with their ADD events; sets each row's ``seq``."""
        if not facts:
            return
        with self._writing() as c:
            c.execute(self._sql("INSERT INTO users(user_id, created_at) VALUES (?, ?) ON CONFLICT (user_id) DO NOTHING"),
                      (facts[0].user_id, now))
            for f in facts:
                f.seq = self._insert_fact(c, f)
                self._add_history(c, f.id, f.user_id, "ADD", None, f.text, now)

    #: The columns of a new fact that :meth:`_fact_values` gives, but for its version.
    _INSERTED = ("id, user_id, text, hash, token_ids, context_ids, context_kind, context_window, metadata, created_at, "
                 "updated_at, embedding, context_text")

    @staticmethod
    def _fact_values(f: FactRow) -> tuple[Any, ...]:
        return (f.id, f.user_id, f.text, text_hash(f.text), ids_to_blob(f.token_ids), ids_to_blob(f.context_ids),
                f.context_kind, f.context_window, json.dumps(f.metadata), f.created_at, f.updated_at,
                vec_to_blob(f.embedding), f.context_text, f.kv_version)

    @abstractmethod
    def _insert_fact(self, c: Any, f: FactRow) -> int:
        """Insert ``f`` (:attr:`_INSERTED`, its version and the backend's own columns); returns its ``seq``."""

    #: What a text update sets, before the version (the parameters of :meth:`_text_values`).
    _TEXT_SET = "text=?, hash=?, token_ids=?, context_ids=?, updated_at=?, embedding=?"

    @staticmethod
    def _text_values(new: FactRow, embedding: np.ndarray) -> tuple[Any, ...]:
        return (new.text, text_hash(new.text), ids_to_blob(new.token_ids), ids_to_blob(new.context_ids),
                new.updated_at, vec_to_blob(embedding))

    def update_text(self, old: FactRow, new: FactRow, embedding: np.ndarray) -> int:
        """``old`` became ``new`` (text, tokens, context, KV version): not encoded, UPDATE event.
        Returns the version written (see :meth:`_write_text`)."""
        with self._writing() as c:
            version = self._write_text(c, new, embedding)
            self._add_history(c, new.id, old.user_id, "UPDATE", old.text, new.text, new.updated_at)
        return version

    @abstractmethod
    def _write_text(self, c: Any, new: FactRow, embedding: np.ndarray) -> int:
        """The UPDATE of :meth:`update_text` (:attr:`_TEXT_SET` and the version); returns the version."""

    def delete_facts(self, facts: Sequence[FactRow], now: str) -> None:
        """Mark deleted (what the fact was made of goes; its row and history stay), DELETE events."""
        with self._writing() as c:
            for f in facts:
                gone = c.execute(self._sql(
                    "UPDATE facts SET deleted=TRUE, embedding=NULL, token_ids=NULL, context_ids=NULL, context_text=NULL"
                    f"{self.FORGET_KV}, updated_at=?{self.STAMP} WHERE id=? AND NOT deleted"), (now, f.id),
                ).rowcount
                if gone:  # another replica may have deleted it first: one DELETE event
                    self._add_history(c, f.id, f.user_id, "DELETE", f.text, None, now)

    def set_embeddings(self, facts: Iterable[tuple[str, np.ndarray]]) -> None:
        with self._transaction() as c:
            c.executemany(self._sql("UPDATE facts SET embedding=? WHERE id=?"), [(vec_to_blob(v), i) for i, v in facts])

    def set_token_ids(self, facts: Iterable[tuple[str, Sequence[int] | None]]) -> None:
        """New token ids; the context ids of the old tokenizer go too (rebuilt from their text)."""
        with self._transaction() as c:
            c.executemany(self._sql("UPDATE facts SET token_ids=?, context_ids=NULL WHERE id=?"),
                          [(ids_to_blob(t), i) for i, t in facts])

    def set_context(self, f: FactRow) -> None:
        with self._transaction() as c:
            c.execute(
                self._sql("UPDATE facts SET context_ids=?, context_text=?, context_kind=?, context_window=? WHERE id=?"),
                (ids_to_blob(f.context_ids), f.context_text, f.context_kind, f.context_window, f.id),
            )

    def new_kv_version(self, fact_id: str, old: int, new: int) -> None:
        """:meth:`new_kv_versions` for one fact, unless it moved past ``old`` meanwhile."""
        v = self.VERSION
        with self._writing() as c:
            c.execute(self._sql(f"UPDATE facts SET {v}=?{self.FORGET_KV}{self.STAMP} WHERE id=? AND {v}=?"),
                      (new, fact_id, old))

    def set_metadata(self, fact_id: str, metadata: dict[str, Any], now: str) -> None:
        with self._writing() as c:
            c.execute(self._sql(f"UPDATE facts SET metadata=?, updated_at=?{self.STAMP} WHERE id=?"),
                      (json.dumps(metadata), now, fact_id))

    def history(self, memory_id: str) -> list[dict[str, Any]]:
        with self._reading() as c:
            rows = c.execute(
                self._sql(f"SELECT {_HISTORY_COLUMNS} FROM history WHERE memory_id=? ORDER BY seq"), (memory_id,),
            ).fetchall()
        return [dict(zip(_HISTORY_KEYS, r)) for r in rows]

    def _add_history(self, c: Any, memory_id: str, user_id: str, event: str, old: str | None, new: str | None,
                     now: str) -> None:
        c.execute(
            self._sql(f"INSERT INTO history({_HISTORY_COLUMNS}) VALUES (?,?,?,?,?,?,?)"),
            (secrets.token_hex(8), memory_id, user_id, event, old, new, now),
        )


_HISTORY_KEYS = ("id", "memory_id", "user_id", "event", "old_memory", "new_memory", "created_at")
_HISTORY_COLUMNS = ", ".join(_HISTORY_KEYS)


class SQLiteDB(SQLMetaDB):
    """The embedded backend: one SQLite file in the store's folder."""

    PARAM = "?"
    SERIAL = "INTEGER PRIMARY KEY AUTOINCREMENT"
    BYTES = "BLOB"
    FLAG = "INTEGER NOT NULL DEFAULT 0"
    VERSION = "kv_version"
    OWN_COLUMNS = """fingerprint    TEXT,                             -- of the KV on disk; NULL = not encoded
    encode_error   TEXT,"""
    KV_STATE = "fingerprint, encode_error"
    FORGET_KV = ", fingerprint=NULL"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.location = str(path)
        self.lock = threading.RLock()
        self.conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=30)
        try:
            with self._damage_named():
                self.conn.execute("PRAGMA journal_mode=WAL")
                self.conn.execute("PRAGMA synchronous=FULL")
                self.conn.execute("PRAGMA foreign_keys=ON")
                with self.lock:
                    self.conn.executescript(self._schema)  # idempotent (IF NOT EXISTS); runs in its own transaction
            with self._transaction() as c:
                self._check_schema(c)
        except BaseException:
            self.conn.close()
            raise

    @contextmanager
    def _damage_named(self) -> Iterator[None]:
        """SQLite's failures of the file as typed errors, not a bare ``DatabaseError``: a file
        that is not a database, or a damaged one (truncated, overwritten), a
        :class:`StoreDamagedError` that says how to recover; a full disk a
        :class:`StorageFullError`; a read-only, unopenable or failing one a
        :class:`StorageUnavailableError`."""
        try:
            yield
        except sqlite3.DatabaseError as exc:
            code = (exc.sqlite_errorcode or 0) & 0xFF  # the primary code of an extended one
            if code in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
                raise StoreDamagedError(self.path.parent, f"{self.path.name} is damaged ({exc})", self.path.name) from exc
            if code == sqlite3.SQLITE_FULL:
                raise StorageFullError(str(exc)) from exc
            if code in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CANTOPEN):
                raise StorageUnavailableError(str(exc)) from exc
            raise

    @contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        with self.lock, self._damage_named():
            yield self.conn

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self.lock, self._damage_named():
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self.conn
                self.conn.execute("COMMIT")
            except BaseException:
                # SQLite rolls some failures back itself (a full disk): a ROLLBACK then would
                # fail too, and its error would hide the one that matters.
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
                raise

    def close(self) -> None:
        with self.lock:
            try:
                self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error:
                pass
            self.conn.close()

    def _insert_fact(self, c: sqlite3.Connection, f: FactRow) -> int:
        cur = c.execute(f"INSERT INTO facts({self._INSERTED}, kv_version, fingerprint) VALUES ({self._params(15)})",
                        (*self._fact_values(f), f.fingerprint))
        return int(cur.lastrowid)  # type: ignore[arg-type]

    def _write_text(self, c: sqlite3.Connection, new: FactRow, embedding: np.ndarray) -> int:
        """Writes ``new.kv_version``: this process is the store's one writer."""
        c.execute(f"UPDATE facts SET {self._TEXT_SET}, kv_version=?, fingerprint=NULL, encode_error=NULL WHERE id=?",
                  (*self._text_values(new, embedding), new.kv_version, new.id))
        return new.kv_version

    def new_kv_versions(self, facts: Iterable[tuple[int, str]]) -> None:
        """``(new version, fact id)``: their KV is to be made again, under a new key."""
        with self._transaction() as c:
            c.executemany("UPDATE facts SET kv_version=?, fingerprint=NULL WHERE id=?", list(facts))

    # The KV state of each fact (a shared store keeps none: see MetaDB).

    def set_fingerprints(self, facts: Iterable[tuple[str | None, str]]) -> None:
        """``(fingerprint, fact id)``: what the KV file of each fact was made under (None: no KV)."""
        with self._transaction() as c:
            c.executemany("UPDATE facts SET fingerprint=? WHERE id=?", list(facts))

    def mark_encoded(self, fingerprint: str, keys: Iterable[tuple[str, int]]) -> None:
        """The KV of these ``(fact id, kv version)`` is on disk; versions updated since are left alone."""
        with self._transaction() as c:
            c.executemany("UPDATE facts SET fingerprint=?, encode_error=NULL WHERE id=? AND kv_version=?",
                          [(fingerprint, i, v) for i, v in keys])

    def mark_unencoded(self, fact_id: str, version: int) -> None:
        with self._transaction() as c:
            c.execute("UPDATE facts SET fingerprint=NULL WHERE id=? AND kv_version=?", (fact_id, version))

    def set_encode_errors(self, errors: Iterable[tuple[str, str]]) -> None:
        """``(error, fact id)`` of facts whose encoding failed."""
        with self._transaction() as c:
            c.executemany("UPDATE facts SET encode_error=? WHERE id=?", list(errors))
