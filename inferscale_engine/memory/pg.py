"""PostgreSQL metadata of a memory store that several replicas (``inferscale serve`` processes)
share: users, facts, history, embeddings, the handle secret.

What is shared and what is not:

* Shared: each fact's text, tokens, context, metadata, embedding and **version** (bumped by
  every text update, atomically in SQL, so two updates never get the same version), and the
  secret handles are made with (a handle made by one replica verifies on every other).
* Per replica: the KV itself and whether this replica has it (``fingerprint``,
  ``encode_error``). KV is derived data; a replica encodes a fact on a miss, from the shared
  tokens and context, and keeps it in its own tiers.

Replicas follow each other's writes through a change counter: every write that changes what a
fact is (insert, text update, delete, metadata, a new KV version) stamps the row with the next
value of one sequence, inside a transaction that holds one advisory lock, so stamps commit in
order and :meth:`PostgresDB.changes` (rows stamped after the last one seen) misses none.

Every replica that encodes KV records the KV fingerprint (model, dtype, window, prefix) it
serves under, and holds a shared advisory lock on its connection while it runs: a replica with
another fingerprint is refused while any other runs (:meth:`PostgresDB.claim_serving`), since
its tokens and contexts would overwrite theirs in the shared rows.

A dropped connection (a server restart, a failover, ``pg_terminate_backend``) is re-opened and
the call run again, for up to ``retry_seconds``: every call is one transaction, and one that
failed before its COMMIT was sent was rolled back by the server, so running it again is safe.
One that failed during its COMMIT may have been written: that one is not repeated, the caller
gets a :class:`~inferscale_engine.errors.DatabaseUnavailableError` saying so.

Search runs over the embeddings each replica holds in its in-memory index: pgvector is not
packaged for this Debian release, and the per-user indexes already answer from memory.
"""

from __future__ import annotations

import functools
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Concatenate, ParamSpec, TypeVar
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from inferscale_engine.errors import (
    DatabaseUnavailableError,
    FactNotFoundError,
    InferScaleError,
    ReplicaMismatchError,
)
from inferscale_engine.memory.db import (
    SCHEMA_VERSION,
    Changes,
    FactRow,
    MetaDB,
    blob_to_ids,
    blob_to_vec,
    ids_to_blob,
    vec_to_blob,
)
from inferscale_engine.memory.item import text_hash

logger = logging.getLogger(__name__)

#: Key of the advisory lock every stamping transaction holds (any constant; ours spells "ISCL").
_WRITE_LOCK = 0x4953434C
#: Key of the advisory lock each serving replica holds shared for as long as it is connected.
_SERVING_LOCK = _WRITE_LOCK + 1
#: Seconds a call keeps re-opening a dropped connection before it fails (a restart takes a few).
RETRY_SECONDS = 30.0

_SCHEMA = """
CREATE SEQUENCE IF NOT EXISTS fact_changes;
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS users (
    user_id    TEXT PRIMARY KEY,
    created_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS facts (
    seq            BIGSERIAL PRIMARY KEY,              -- insertion order
    id             TEXT NOT NULL UNIQUE,               -- 16 lowercase hex
    user_id        TEXT NOT NULL REFERENCES users(user_id),
    text           TEXT NOT NULL,
    hash           TEXT NOT NULL,
    token_ids      BYTEA,                              -- int32 LE
    context_ids    BYTEA,                              -- int32 LE
    context_text   TEXT,
    context_kind   TEXT NOT NULL DEFAULT 'window',
    context_window INTEGER NOT NULL DEFAULT 0,
    metadata       TEXT NOT NULL DEFAULT '{}',
    created_at     TEXT NOT NULL,
    updated_at     TEXT NOT NULL,
    deleted        BOOLEAN NOT NULL DEFAULT FALSE,
    version        INTEGER NOT NULL DEFAULT 1,         -- the KV version: a replica's KV of another is stale
    change_seq     BIGINT NOT NULL,                    -- from fact_changes, at the row's last change
    embedding      BYTEA                               -- float32, L2-normalised
);
CREATE INDEX IF NOT EXISTS facts_by_user ON facts(user_id, deleted, seq);
CREATE INDEX IF NOT EXISTS facts_by_change ON facts(change_seq);
CREATE TABLE IF NOT EXISTS history (
    seq        BIGSERIAL PRIMARY KEY,
    id         TEXT NOT NULL UNIQUE,
    memory_id  TEXT NOT NULL,
    user_id    TEXT NOT NULL,
    event      TEXT NOT NULL CHECK (event IN ('ADD', 'UPDATE', 'DELETE')),
    old_memory TEXT,
    new_memory TEXT,
    created_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS history_by_memory ON history(memory_id, seq);
"""

_COLUMNS = ("seq, id, user_id, text, token_ids, context_ids, context_kind, context_window, metadata, created_at, "
            "updated_at, version, embedding, context_text")
_STAMP = "nextval('fact_changes')"


def redact(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0].split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[1]}"))


def _row(r: Sequence[Any]) -> FactRow:
    return FactRow(
        seq=r[0], id=r[1], user_id=r[2], text=r[3], token_ids=blob_to_ids(r[4]), context_ids=blob_to_ids(r[5]),
        context_kind=r[6], context_window=r[7], metadata=json.loads(r[8]), created_at=r[9], updated_at=r[10],
        kv_version=r[11], fingerprint=None, encode_error=None, embedding=blob_to_vec(r[12]), context_text=r[13],
    )


class _ConnectionLost(InferScaleError):
    """The connection dropped inside a call; ``committing``: while its COMMIT was in flight.
    Caught by :func:`_retried` around every public method; an InferScaleError should one escape."""

    def __init__(self, cause: BaseException, committing: bool) -> None:
        super().__init__(str(cause).strip())
        self.committing = committing


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _retried(method: Callable[Concatenate[PostgresDB, _P], _R]) -> Callable[Concatenate[PostgresDB, _P], _R]:
    """``method`` run again on a new connection while the database is unreachable, for up to
    ``retry_seconds`` (see the module docstring for why that is safe)."""

    @functools.wraps(method)
    def run(self: PostgresDB, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        deadline = time.monotonic() + self.retry_seconds
        delay = 0.05
        while True:
            try:
                return method(self, *args, **kwargs)
            except _ConnectionLost as lost:
                if lost.committing:
                    raise DatabaseUnavailableError(
                        f"memory store {self.location} dropped the connection while a write was committing: it may "
                        f"or may not have been stored; read it back before repeating it ({lost})") from None
                if time.monotonic() + delay > deadline:
                    raise DatabaseUnavailableError(
                        f"memory store {self.location} is unreachable (retried for {self.retry_seconds:g} s; "
                        f"nothing of this call was written): {lost}") from None
                logger.info("memory store %s: connection lost (%s); retrying", self.location, lost)
                time.sleep(delay)
                delay = min(2 * delay, 1.0)

    return run


class PostgresDB(MetaDB):
    """A memory store's metadata in a PostgreSQL database shared by replicas (``postgresql://`` URL)."""

    shared = True

    def __init__(self, url: str, *, retry_seconds: float = RETRY_SECONDS) -> None:
        try:
            import psycopg
        except ImportError:
            raise InferScaleError("a postgresql:// store needs psycopg: pip install 'psycopg[binary]'") from None
        self.location = redact(url)
        self._url = url
        self._psycopg = psycopg
        self.lock = threading.RLock()
        self._cursor = 0  # the last change stamp this process has seen
        self.retry_seconds = float(retry_seconds)
        self._serving: str | None = None  # the KV fingerprint claimed (claim_serving)
        self._committing = False  # the current transaction's COMMIT is in flight
        self.conn = self._connect()
        try:
            version = self._create_schema()
            if int(version) != SCHEMA_VERSION:
                raise InferScaleError(f"memory store {self.location} has schema version {version}, "
                                      f"this InferScale reads {SCHEMA_VERSION}")
        except BaseException:
            self.conn.close()
            raise

    @_retried
    def _create_schema(self) -> str:
        """The schema, created if missing; the schema version it is at."""
        with self._writing() as c:  # the lock: replicas starting together create the schema once
            c.execute(_SCHEMA)
            c.execute("INSERT INTO meta(key, value) VALUES ('schema_version', %s) ON CONFLICT (key) DO NOTHING",
                      (str(SCHEMA_VERSION),))
            return str(c.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0])

    def _connect(self) -> Any:
        try:
            return self._psycopg.connect(self._url, autocommit=True)
        except self._psycopg.Error as exc:
            raise InferScaleError(f"cannot connect to the memory store {self.location}: {exc}".strip()) from None

    def _reconnect(self) -> Any:
        """A new connection in place of a dropped one, holding what the old one held."""
        try:
            conn = self._psycopg.connect(self._url, autocommit=True)
        except self._psycopg.OperationalError as exc:
            raise _ConnectionLost(exc, committing=False) from exc
        self.conn = conn
        if self._serving is not None:
            conn.execute("SELECT pg_advisory_lock_shared(%s)", (_SERVING_LOCK,))
            row = conn.execute("SELECT value FROM meta WHERE key='kv_fingerprint'").fetchone()
            if row is not None and row[0] != self._serving:  # moved to another model while this one was cut off
                raise ReplicaMismatchError(
                    f"memory store {self.location} was moved to KV fingerprint {row[0]} while this replica "
                    f"({self._serving}) was disconnected from it: restart this replica with the store's model")
        return conn

    @contextmanager
    def _session(self) -> Iterator[Any]:
        """The connection, under the lock: a new one if the server dropped it (a restart, a
        failover). A dropped connection comes out as :class:`_ConnectionLost` (for
        :func:`_retried`), another database error as an InferScaleError that names the store."""
        with self.lock:
            self._committing = False
            try:
                yield self._reconnect() if self.conn.broken else self.conn
            except self._psycopg.OperationalError as exc:
                if self.conn.broken or isinstance(exc, self._psycopg.errors.TransactionRollbackError):
                    raise _ConnectionLost(exc, self._committing) from exc
                raise InferScaleError(f"memory store {self.location}: {exc}".strip()) from exc

    @contextmanager
    def _transaction(self) -> Iterator[Any]:
        with self._session() as c:
            with c.transaction():
                yield c
                self._committing = True  # the block is done: what fails from here on is the COMMIT

    @contextmanager
    def _writing(self) -> Iterator[Any]:
        """A transaction that stamps changes: stamps are taken and committed in order."""
        with self._transaction() as c:
            c.execute("SELECT pg_advisory_xact_lock(%s)", (_WRITE_LOCK,))
            yield c

    def close(self) -> None:
        with self.lock:
            self.conn.close()

    # ------------------------------------------------------------------ meta

    @_retried
    def get_meta(self, key: str) -> str | None:
        with self._session() as c:
            row = c.execute("SELECT value FROM meta WHERE key=%s", (key,)).fetchone()
        return None if row is None else row[0]

    @_retried
    def set_meta(self, key: str, value: str) -> None:
        with self._transaction() as c:
            c.execute("INSERT INTO meta(key, value) VALUES (%s, %s) ON CONFLICT (key) DO UPDATE SET value=excluded.value",
                      (key, value))

    @_retried
    def handle_secret(self) -> bytes:
        with self._transaction() as c:
            c.execute("INSERT INTO meta(key, value) VALUES ('handle_secret', %s) ON CONFLICT (key) DO NOTHING",
                      (secrets.token_hex(32),))
            value = c.execute("SELECT value FROM meta WHERE key='handle_secret'").fetchone()[0]
        secret = bytes.fromhex(value)
        if len(secret) < 32:
            raise InferScaleError(f"the handle secret in {self.location} is damaged ({len(secret)} bytes)")
        return secret

    @_retried
    def claim_serving(self, fingerprint: str, model: str) -> None:
        """Record that this process serves the store's KV under ``fingerprint`` (``model`` says
        it in words), and hold that claim while connected. A store recorded under another
        fingerprint moves to this one only when no other replica is running: else
        :class:`~inferscale_engine.errors.ReplicaMismatchError`."""
        with self._writing() as c:  # one claim at a time: two replicas of two models cannot both win
            row = c.execute("SELECT value FROM meta WHERE key='kv_fingerprint'").fetchone()
            if row is not None and row[0] != fingerprint:
                alone = c.execute("SELECT pg_try_advisory_lock(%s)", (_SERVING_LOCK,)).fetchone()[0]
                theirs = c.execute("SELECT value FROM meta WHERE key='kv_model'").fetchone()
                their_model = theirs[0] if theirs else "another model"
                if not alone:
                    raise ReplicaMismatchError(
                        f"memory store {self.location} is served by running replicas of {their_model} "
                        f"(KV fingerprint {row[0]}); this replica runs {model} (KV fingerprint {fingerprint}). "
                        f"Start it with the same model, dtype, window and context prefix as they do, or give it "
                        f"a database of its own; to move the store to {model}, stop every replica of it first")
                c.execute("SELECT pg_advisory_unlock(%s)", (_SERVING_LOCK,))
                logger.warning("memory store %s moves from %s to %s (no other replica is running): tokens and "
                               "contexts are rebuilt for it, and KV encoded on use", self.location, their_model, model)
            for key, value in (("kv_fingerprint", fingerprint), ("kv_model", model)):
                c.execute("INSERT INTO meta(key, value) VALUES (%s, %s) "
                          "ON CONFLICT (key) DO UPDATE SET value=excluded.value", (key, value))
            c.execute("SELECT pg_advisory_lock_shared(%s)", (_SERVING_LOCK,))
        self._serving = fingerprint

    # ------------------------------------------------------------------ facts

    @_retried
    def count_facts(self) -> int:
        with self._session() as c:
            return int(c.execute("SELECT COUNT(*) FROM facts WHERE NOT deleted").fetchone()[0])

    @_retried
    def load_live_facts(self) -> list[FactRow]:
        # One snapshot for the rows and the stamp they are current to.
        with self._transaction() as c:
            c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            self._cursor = int(c.execute("SELECT COALESCE(MAX(change_seq), 0) FROM facts").fetchone()[0])
            rows = c.execute(f"SELECT {_COLUMNS} FROM facts WHERE NOT deleted ORDER BY seq").fetchall()
        return [_row(r) for r in rows]

    @_retried
    def changes(self) -> Changes:
        with self._session() as c:
            rows = c.execute(
                f"SELECT {_COLUMNS}, deleted, change_seq FROM facts WHERE change_seq > %s ORDER BY change_seq",
                (self._cursor,),
            ).fetchall()
            if rows:
                self._cursor = int(rows[-1][-1])
        live = sorted((_row(r) for r in rows if not r[-2]), key=lambda f: f.seq)
        return Changes(live=live, deleted=[r[1] for r in rows if r[-2]])

    @_retried
    def live_versions(self, fact_ids: Sequence[str], user_id: str) -> dict[str, int]:
        with self._session() as c:
            rows = c.execute(
                "SELECT id, version FROM facts WHERE id = ANY(%s) AND user_id=%s AND NOT deleted",
                (list(fact_ids), user_id),
            ).fetchall()
        return {r[0]: int(r[1]) for r in rows}

    @_retried
    def insert_facts(self, facts: Sequence[FactRow], now: str) -> None:
        if not facts:
            return
        with self._writing() as c:
            c.execute("INSERT INTO users(user_id, created_at) VALUES (%s, %s) ON CONFLICT (user_id) DO NOTHING",
                      (facts[0].user_id, now))
            for f in facts:
                f.seq = int(c.execute(
                    "INSERT INTO facts(id, user_id, text, hash, token_ids, context_ids, context_kind, context_window, "
                    "metadata, created_at, updated_at, version, embedding, context_text, change_seq) "
                    f"VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,{_STAMP}) RETURNING seq",
                    (
                        f.id, f.user_id, f.text, text_hash(f.text), ids_to_blob(f.token_ids), ids_to_blob(f.context_ids),
                        f.context_kind, f.context_window, json.dumps(f.metadata), f.created_at, f.updated_at,
                        f.kv_version, vec_to_blob(f.embedding), f.context_text,
                    ),
                ).fetchone()[0])
                _add_history(c, f.id, f.user_id, "ADD", None, f.text, now)

    @_retried
    def update_text(self, old: FactRow, new: FactRow, embedding: np.ndarray) -> int:
        """As :meth:`SQLiteDB.update_text`, except that the version is the stored one plus one
        (another replica may have updated the fact meanwhile): returns it."""
        with self._writing() as c:
            row = c.execute(
                "UPDATE facts SET text=%s, hash=%s, token_ids=%s, context_ids=%s, updated_at=%s, version=version+1, "
                f"embedding=%s, change_seq={_STAMP} WHERE id=%s AND NOT deleted RETURNING version",
                (new.text, text_hash(new.text), ids_to_blob(new.token_ids), ids_to_blob(new.context_ids),
                 new.updated_at, vec_to_blob(embedding), new.id),
            ).fetchone()
            if row is None:
                raise FactNotFoundError(f"memory {new.id} was deleted (by another replica)")
            _add_history(c, new.id, old.user_id, "UPDATE", old.text, new.text, new.updated_at)
        return int(row[0])

    @_retried
    def delete_facts(self, facts: Sequence[FactRow], now: str) -> None:
        with self._writing() as c:
            for f in facts:
                gone = c.execute(
                    "UPDATE facts SET deleted=TRUE, embedding=NULL, token_ids=NULL, context_ids=NULL, "
                    f"context_text=NULL, updated_at=%s, change_seq={_STAMP} WHERE id=%s AND NOT deleted", (now, f.id),
                ).rowcount
                if gone:  # another replica may have deleted it first: one DELETE event
                    _add_history(c, f.id, f.user_id, "DELETE", f.text, None, now)

    @_retried
    def set_embeddings(self, facts: Iterable[tuple[str, np.ndarray]]) -> None:
        with self._transaction() as c, c.cursor() as cur:
            cur.executemany("UPDATE facts SET embedding=%s WHERE id=%s", [(vec_to_blob(v), i) for i, v in facts])

    @_retried
    def set_token_ids(self, facts: Iterable[tuple[str, Sequence[int] | None]]) -> None:
        with self._transaction() as c, c.cursor() as cur:
            cur.executemany("UPDATE facts SET token_ids=%s, context_ids=NULL WHERE id=%s",
                            [(ids_to_blob(t), i) for i, t in facts])

    @_retried
    def set_context(self, f: FactRow) -> None:
        with self._transaction() as c:
            c.execute(
                "UPDATE facts SET context_ids=%s, context_text=%s, context_kind=%s, context_window=%s WHERE id=%s",
                (ids_to_blob(f.context_ids), f.context_text, f.context_kind, f.context_window, f.id),
            )

    # Whether this replica holds a fact's KV is its own business (see the module docstring).

    def set_fingerprints(self, facts: Iterable[tuple[str | None, str]]) -> None:
        return None

    def mark_encoded(self, fingerprint: str, keys: Iterable[tuple[str, int]]) -> None:
        return None

    def mark_unencoded(self, fact_id: str, version: int) -> None:
        return None

    def set_encode_errors(self, errors: Iterable[tuple[str, str]]) -> None:
        return None

    @_retried
    def new_kv_versions(self, facts: Iterable[tuple[int, str]]) -> None:
        with self._writing() as c, c.cursor() as cur:
            cur.executemany(f"UPDATE facts SET version=GREATEST(version, %s), change_seq={_STAMP} WHERE id=%s",
                            list(facts))

    @_retried
    def new_kv_version(self, fact_id: str, old: int, new: int) -> None:
        with self._writing() as c:
            c.execute(f"UPDATE facts SET version=%s, change_seq={_STAMP} WHERE id=%s AND version=%s",
                      (new, fact_id, old))

    @_retried
    def set_metadata(self, fact_id: str, metadata: dict[str, Any], now: str) -> None:
        with self._writing() as c:
            c.execute(f"UPDATE facts SET metadata=%s, updated_at=%s, change_seq={_STAMP} WHERE id=%s",
                      (json.dumps(metadata), now, fact_id))

    @_retried
    def history(self, memory_id: str) -> list[dict[str, Any]]:
        with self._session() as c:
            rows = c.execute(
                "SELECT id, memory_id, user_id, event, old_memory, new_memory, created_at FROM history "
                "WHERE memory_id=%s ORDER BY seq",
                (memory_id,),
            ).fetchall()
        keys = ("id", "memory_id", "user_id", "event", "old_memory", "new_memory", "created_at")
        return [dict(zip(keys, r)) for r in rows]


def _add_history(c: Any, memory_id: str, user_id: str, event: str, old: str | None, new: str | None, now: str) -> None:
    c.execute(
        "INSERT INTO history(id, memory_id, user_id, event, old_memory, new_memory, created_at) "
        "VALUES (%s,%s,%s,%s,%s,%s,%s)",
        (secrets.token_hex(8), memory_id, user_id, event, old, new, now),
    )
