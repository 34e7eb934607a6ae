"""SQLite metadata of a memory store: users, facts, history, embeddings (WAL mode).

One connection shared by the store's threads, serialised by a lock: the store keeps every
live fact in memory, so the database is written through and only read at open. Every write
happens in an explicit transaction that is committed (``synchronous=FULL``) before the
store's call returns.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SCHEMA_VERSION = 1

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
    seq            INTEGER PRIMARY KEY AUTOINCREMENT,  -- insertion order
    id             TEXT NOT NULL UNIQUE,               -- 16 lowercase hex
    user_id        TEXT NOT NULL REFERENCES users(user_id),
    text           TEXT NOT NULL,
    hash           TEXT NOT NULL,
    token_ids      BLOB,                               -- int32 LE; what the engine splices in
    context_ids    BLOB,                               -- int32 LE; what the fact is encoded after
    context_text   TEXT,                               -- the text those ids came from (re-tokenizing)
    context_kind   TEXT NOT NULL DEFAULT 'window',     -- window | explicit | sliding
    context_window INTEGER NOT NULL DEFAULT 0,         -- store window the context was built with
    metadata       TEXT NOT NULL DEFAULT '{}',
    created_at     TEXT NOT NULL,
    updated_at     TEXT NOT NULL,
    deleted        INTEGER NOT NULL DEFAULT 0,
    kv_version     INTEGER NOT NULL DEFAULT 1,
    fingerprint    TEXT,                               -- of the KV on disk; NULL = not encoded
    encode_error   TEXT,
    embedding      BLOB                                -- float32, L2-normalised
);
CREATE INDEX IF NOT EXISTS facts_by_user ON facts(user_id, deleted, seq);
CREATE TABLE IF NOT EXISTS history (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
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


class MetaDB:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.RLock()
        self.conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=30)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.execute("PRAGMA foreign_keys=ON")
        with self.lock:
            self.conn.executescript(_SCHEMA)  # idempotent (IF NOT EXISTS); runs in its own transaction
        with self.transaction() as c:
            row = c.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                c.execute("INSERT INTO meta(key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) != SCHEMA_VERSION:
                raise RuntimeError(f"memory store {path} has schema version {row[0]}, this InferScale reads {SCHEMA_VERSION}")

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self.lock:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self.conn
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            self.conn.execute("COMMIT")

    def close(self) -> None:
        with self.lock:
            try:
                self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error:
                pass
            self.conn.close()

    # ------------------------------------------------------------------ meta

    def get_meta(self, key: str) -> str | None:
        with self.lock:
            row = self.conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else row[0]

    @staticmethod
    def set_meta(c: sqlite3.Connection, key: str, value: str) -> None:
        c.execute("INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value", (key, value))

    # ------------------------------------------------------------------ facts

    def load_live_facts(self) -> list[FactRow]:
        with self.lock:
            rows = self.conn.execute(
                "SELECT seq, id, user_id, text, token_ids, context_ids, context_kind, context_window, metadata, "
                "created_at, updated_at, kv_version, fingerprint, encode_error, embedding, context_text "
                "FROM facts WHERE deleted=0 ORDER BY seq"
            ).fetchall()
        return [
            FactRow(
                seq=r[0], id=r[1], user_id=r[2], text=r[3], token_ids=blob_to_ids(r[4]), context_ids=blob_to_ids(r[5]),
                context_kind=r[6], context_window=r[7], metadata=json.loads(r[8]), created_at=r[9], updated_at=r[10],
                kv_version=r[11], fingerprint=r[12], encode_error=r[13], embedding=blob_to_vec(r[14]),
                context_text=r[15],
            )
            for r in rows
        ]

    @staticmethod
    def ensure_user(c: sqlite3.Connection, user_id: str, now: str) -> None:
        c.execute("INSERT OR IGNORE INTO users(user_id, created_at) VALUES (?, ?)", (user_id, now))

    @staticmethod
    def insert_fact(c: sqlite3.Connection, f: FactRow, text_hash: str) -> int:
        cur = c.execute(
            "INSERT INTO facts(id, user_id, text, hash, token_ids, context_ids, context_kind, context_window, metadata, "
            "created_at, updated_at, kv_version, fingerprint, embedding, context_text) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                f.id, f.user_id, f.text, text_hash, ids_to_blob(f.token_ids), ids_to_blob(f.context_ids), f.context_kind,
                f.context_window, json.dumps(f.metadata), f.created_at, f.updated_at, f.kv_version, f.fingerprint,
                vec_to_blob(f.embedding), f.context_text,
            ),
        )
        return int(cur.lastrowid)

    @staticmethod
    def add_history(
        c: sqlite3.Connection, hid: str, memory_id: str, user_id: str, event: str,
        old: str | None, new: str | None, now: str,
    ) -> None:
        c.execute(
            "INSERT INTO history(id, memory_id, user_id, event, old_memory, new_memory, created_at) VALUES (?,?,?,?,?,?,?)",
            (hid, memory_id, user_id, event, old, new, now),
        )

    def history(self, memory_id: str) -> list[dict[str, Any]]:
        with self.lock:
            rows = self.conn.execute(
                "SELECT id, memory_id, user_id, event, old_memory, new_memory, created_at FROM history "
                "WHERE memory_id=? ORDER BY seq",
                (memory_id,),
            ).fetchall()
        keys = ("id", "memory_id", "user_id", "event", "old_memory", "new_memory", "created_at")
        return [dict(zip(keys, r)) for r in rows]
