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
So is one the server rolled back itself (SQLSTATE class 40: a serialization failure, a deadlock).
One that failed during its COMMIT may have been written: that one is not repeated, the caller
gets a :class:`~inferscale_engine.errors.DatabaseUnavailableError` saying so. Every public
method, those :class:`~inferscale_engine.memory.meta.db.SQLMetaDB` writes for both backends too, is
run this way (:func:`_retrying`).

Search runs over the embeddings each replica holds in its in-memory index: pgvector is not
packaged for this Debian release, and the per-user indexes already answer from memory.
"""

from __future__ import annotations

import functools
import inspect
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
from inferscale_engine.memory.meta.db import Changes, FactRow, SQLMetaDB

logger = logging.getLogger(__name__)

#: Key of the advisory lock every stamping transaction holds (any constant; ours spells "ISCL").
_WRITE_LOCK = 0x4953434C
#: Key of the advisory lock each serving replica holds shared for as long as it is connected.
_SERVING_LOCK = _WRITE_LOCK + 1
#: Seconds a call keeps re-opening a dropped connection before it fails (a restart takes a few).
RETRY_SECONDS = 30.0
_STAMP = "nextval('fact_changes')"


def redact(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0].split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[1]}"))


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


_DB = TypeVar("_DB", bound="type[PostgresDB]")


def _retrying(cls: _DB) -> _DB:
    """``cls`` with :func:`_retried` around every public method, its own and those it inherits
    from :class:`SQLMetaDB` alike (not ``close``: closing needs no connection)."""
    for name, method in inspect.getmembers(cls, inspect.isfunction):
        if not name.startswith("_") and name != "close":
            setattr(cls, name, _retried(method))
    return cls


@_retrying
class PostgresDB(SQLMetaDB):
    """A memory store's metadata in a PostgreSQL database shared by replicas (``postgresql://`` URL)."""

    shared = True
    # The dialect, and what sharing adds: a change stamp on every row, no KV state (see above).
    PARAM = "%s"
    SERIAL = "BIGSERIAL PRIMARY KEY"
    BYTES = "BYTEA"
    FLAG = "BOOLEAN NOT NULL DEFAULT FALSE"
    VERSION = "version"
    OWN_COLUMNS = "change_seq     BIGINT NOT NULL,                    -- from fact_changes, at the row's last change"
    OWN_SCHEMA = """CREATE SEQUENCE IF NOT EXISTS fact_changes;
CREATE INDEX IF NOT EXISTS facts_by_change ON facts(change_seq);
"""
    KV_STATE = "NULL, NULL"
    STAMP = f", change_seq={_STAMP}"

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
            self._create_schema()
        except BaseException:
            self.conn.close()
            raise

    @_retried
    def _create_schema(self) -> None:
        """The schema, created if missing; checked to be the version this InferScale reads."""
        with self._writing() as c:  # the lock: replicas starting together create the schema once
            c.execute(self._schema)
            self._check_schema(c)

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
            self._hold_serving(conn)
            recorded = self._meta(conn, "kv_fingerprint")
            if recorded is not None and recorded != self._serving:  # moved to another model while cut off
                raise ReplicaMismatchError(
                    f"memory store {self.location} was moved to KV fingerprint {recorded} while this replica "
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
                # SQLSTATE class 40, a transaction the server rolled back (serialization failure,
                # deadlock), wrote nothing: run again, as one cut off by a dropped connection is.
                # psycopg 3 has no common base class for them (psycopg2's TransactionRollbackError).
                if self.conn.broken or (exc.sqlstate or "").startswith("40"):
                    raise _ConnectionLost(exc, self._committing) from exc
                raise InferScaleError(f"memory store {self.location}: {exc}".strip()) from exc

    @contextmanager
    def _reading(self) -> Iterator[Any]:
        with self._session() as conn, conn.cursor() as c:
            yield c

    @contextmanager
    def _transaction(self) -> Iterator[Any]:
        with self._session() as conn, conn.transaction():
            with conn.cursor() as c:
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

    def handle_secret(self) -> bytes:
        with self._transaction() as c:
            secret = bytes.fromhex(self._meta_once(c, "handle_secret", secrets.token_hex(32)))
        if len(secret) < 32:
            raise InferScaleError(f"the handle secret in {self.location} is damaged ({len(secret)} bytes)")
        return secret

    def claim_serving(self, fingerprint: str, model: str) -> None:
        """Record that this process serves the store's KV under ``fingerprint`` (``model`` says
        it in words), and hold that claim while connected. A store recorded under another
        fingerprint moves to this one only when no other replica is running: else
        :class:`~inferscale_engine.errors.ReplicaMismatchError`."""
        with self._writing() as c:  # one claim at a time: two replicas of two models cannot both win
            recorded = self._meta(c, "kv_fingerprint")
            if recorded is not None and recorded != fingerprint:
                alone = c.execute("SELECT pg_try_advisory_lock(%s)", (_SERVING_LOCK,)).fetchone()[0]
                their_model = self._meta(c, "kv_model") or "another model"
                if not alone:
                    raise ReplicaMismatchError(
                        f"memory store {self.location} is served by running replicas of {their_model} "
                        f"(KV fingerprint {recorded}); this replica runs {model} (KV fingerprint {fingerprint}). "
                        f"Start it with the same model, dtype, window and context prefix as they do, or give it "
                        f"a database of its own; to move the store to {model}, stop every replica of it first")
                c.execute("SELECT pg_advisory_unlock(%s)", (_SERVING_LOCK,))
                logger.warning("memory store %s moves from %s to %s (no other replica is running): tokens and "
                               "contexts are rebuilt for it, and KV encoded on use", self.location, their_model, model)
            self._put_meta(c, "kv_fingerprint", fingerprint)
            self._put_meta(c, "kv_model", model)
            self._hold_serving(c)
        self._serving = fingerprint

    @staticmethod
    def _hold_serving(c: Any) -> None:
        """The serving claim's shared lock, held by the session until it ends (not by the transaction)."""
        c.execute("SELECT pg_advisory_lock_shared(%s)", (_SERVING_LOCK,))

    # ------------------------------------------------------------------ facts

    def load_live_facts(self) -> list[FactRow]:
        # One snapshot for the rows and the stamp they are current to.
        with self._transaction() as c:
            c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            self._cursor = int(c.execute("SELECT COALESCE(MAX(change_seq), 0) FROM facts").fetchone()[0])
            return self._live_facts(c)

    def changes(self) -> Changes:
        with self._reading() as c:
            rows = c.execute(
                f"SELECT {self._fact_columns}, deleted, change_seq FROM facts WHERE change_seq > %s ORDER BY change_seq",
                (self._cursor,),
            ).fetchall()
            if rows:
                self._cursor = int(rows[-1][-1])
        live = sorted((self._row(r) for r in rows if not r[-2]), key=lambda f: f.seq)
        return Changes(live=live, deleted=[r[1] for r in rows if r[-2]])

    def live_versions(self, fact_ids: Sequence[str], user_id: str) -> dict[str, int]:
        with self._reading() as c:
            rows = c.execute(
                "SELECT id, version FROM facts WHERE id = ANY(%s) AND user_id=%s AND NOT deleted",
                (list(fact_ids), user_id),
            ).fetchall()
        return {r[0]: int(r[1]) for r in rows}

    def _insert_fact(self, c: Any, f: FactRow) -> int:
        return int(c.execute(
            self._sql(f"INSERT INTO facts({self._INSERTED}, version, change_seq) VALUES ({self._params(14)}, {_STAMP}) "
                      "RETURNING seq"),
            self._fact_values(f),
        ).fetchone()[0])

    def _write_text(self, c: Any, new: FactRow, embedding: np.ndarray) -> int:
        """Writes the stored version plus one (another replica may have updated the fact meanwhile)."""
        row = c.execute(
            self._sql(f"UPDATE facts SET {self._TEXT_SET}, version=version+1{self.STAMP} WHERE id=? AND NOT deleted "
                      "RETURNING version"),
            (*self._text_values(new, embedding), new.id),
        ).fetchone()
        if row is None:
            raise FactNotFoundError(f"memory {new.id} was deleted (by another replica)")
        return int(row[0])

    def new_kv_versions(self, facts: Iterable[tuple[int, str]]) -> None:
        with self._writing() as c:
            c.executemany(f"UPDATE facts SET version=GREATEST(version, %s){self.STAMP} WHERE id=%s", list(facts))

    # Whether this replica holds a fact's KV is its own business (see the module docstring).

    def set_fingerprints(self, facts: Iterable[tuple[str | None, str]]) -> None:
        return None

    def mark_encoded(self, fingerprint: str, keys: Iterable[tuple[str, int]]) -> None:
        return None

    def mark_unencoded(self, fact_id: str, version: int) -> None:
        return None

    def set_encode_errors(self, errors: Iterable[tuple[str, str]]) -> None:
        return None
