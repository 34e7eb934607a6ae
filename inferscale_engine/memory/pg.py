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

Search runs over the embeddings each replica holds in its in-memory index: pgvector is not
packaged for this Debian release, and the per-user indexes already answer from memory.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from inferscale_engine.errors import FactNotFoundError, InferScaleError
from inferscale_engine.memory.db import Changes, FactRow, SQLMetaDB

#: Key of the advisory lock every stamping transaction holds (any constant; ours spells "ISCL").
_WRITE_LOCK = 0x4953434C
_STAMP = "nextval('fact_changes')"


def redact(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0].split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[1]}"))


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

    def __init__(self, url: str) -> None:
        try:
            import psycopg
        except ImportError:
            raise InferScaleError("a postgresql:// store needs psycopg: pip install 'psycopg[binary]'") from None
        self.location = redact(url)
        self._url = url
        self._psycopg = psycopg
        self.lock = threading.RLock()
        self._cursor = 0  # the last change stamp this process has seen
        self.conn = self._connect()
        try:
            with self._writing() as c:  # the lock: replicas starting together create the schema once
                c.execute(self._schema)
                self._check_schema(c)
        except BaseException:
            self.conn.close()
            raise

    def _connect(self) -> Any:
        try:
            return self._psycopg.connect(self._url, autocommit=True)
        except self._psycopg.Error as exc:
            raise InferScaleError(f"cannot connect to the memory store {self.location}: {exc}".strip()) from None

    @contextmanager
    def _session(self) -> Iterator[Any]:
        """The connection, under the lock: a new one if the server dropped it (a restart, a
        failover); a database error comes out as an InferScaleError that names the store."""
        with self.lock:
            if self.conn.broken:
                self.conn = self._connect()
            try:
                yield self.conn
            except self._psycopg.OperationalError as exc:
                raise InferScaleError(f"memory store {self.location}: {exc}".strip()) from exc

    @contextmanager
    def _reading(self) -> Iterator[Any]:
        with self._session() as conn, conn.cursor() as c:
            yield c

    @contextmanager
    def _transaction(self) -> Iterator[Any]:
        with self._session() as conn, conn.transaction(), conn.cursor() as c:
            yield c

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
