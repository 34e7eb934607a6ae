"""The live facts of a memory store, in memory: what every read is answered from.

SQLite is written through and read only at open, so the store keeps each live fact's row by
id, each user's facts in insertion order (the window a fact is encoded after), and each
user's vector index. One lock guards all of it, and the encoding state of the facts too
(:class:`~inferscale_engine.memory.kv.keeper.KVKeeper` takes the same lock), so a fact
changes atomically whether the API or the encoder changes it.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from inferscale_engine.errors import FactNotFoundError, ForgedHandleError
from inferscale_engine.memory.text.context import Context, ContextBuilder
from inferscale_engine.memory.text.query_graph import DeviceQuery
from inferscale_engine.memory.meta.db import FactRow
from inferscale_engine.memory.meta.index import IndexKind, UserIndex
from inferscale_engine.memory.validation import check_user


class FactTable:
    """Rows by id, ids per user (insertion order) and per-user vector indexes; hold ``lock``."""

    def __init__(self, *, index_kind: IndexKind, device: str) -> None:
        self.lock = threading.RLock()
        self.by_id: dict[str, FactRow] = {}
        self._by_seq: dict[int, str] = {}
        self._of_user: dict[str, dict[str, None]] = {}  # a dict keeps insertion order and deletes in O(1)
        self._indexes: dict[str, UserIndex] = {}
        self._index_kind: IndexKind = index_kind
        self._device = device

    def __len__(self) -> int:
        return len(self.by_id)

    @property
    def users(self) -> int:
        return sum(1 for v in self._of_user.values() if v)

    def add(self, facts: Sequence[FactRow], vecs: np.ndarray) -> None:
        """Committed facts, with their embeddings (``vecs[i]`` of ``facts[i]``), in insertion order."""
        by_user: dict[str, list[int]] = {}
        unordered: set[str] = set()
        for i, f in enumerate(facts):
            f.embedding = None  # the index holds it
            ids = self._of_user.setdefault(f.user_id, {})
            if ids and self.by_id[next(reversed(ids))].seq > f.seq:
                unordered.add(f.user_id)  # another replica's earlier fact, arriving late
            self.by_id[f.id] = f
            self._by_seq[f.seq] = f.id
            ids[f.id] = None
            by_user.setdefault(f.user_id, []).append(i)
        for user_id, at in by_user.items():
            self._index(user_id, vecs.shape[1]).add([facts[i].seq for i in at], vecs[at])
        for user_id in unordered:
            self._of_user[user_id] = dict.fromkeys(sorted(self._of_user[user_id], key=lambda i: self.by_id[i].seq))

    def replace(self, f: FactRow, vec: np.ndarray) -> None:
        """``f`` takes the place of the row with its id (same seq), re-embedded as ``vec``."""
        self.by_id[f.id] = f
        self._index(f.user_id, vec.shape[0]).add([f.seq], vec[None])

    def remove(self, f: FactRow) -> None:
        self.by_id.pop(f.id, None)
        self._by_seq.pop(f.seq, None)
        self._of_user.get(f.user_id, {}).pop(f.id, None)
        index = self._indexes.get(f.user_id)
        if index is not None:
            index.remove(f.seq)

    def lookup(self, fact_id: str, user_id: str | None) -> FactRow:
        """The row of ``fact_id`` (of ``user_id``, when given); :class:`FactNotFoundError` if none."""
        if not isinstance(fact_id, str):
            raise TypeError(f"fact id must be a string, got {type(fact_id).__name__}")
        if user_id is not None:
            user_id = check_user(user_id)
        fact = self.by_id.get(fact_id)
        if fact is None or (user_id is not None and fact.user_id != user_id):
            who = f" for user {user_id!r}" if user_id is not None else ""
            raise FactNotFoundError(f"no memory {fact_id!r}{who}")
        return fact

    def snapshot(self, fact_ids: Sequence[str], user_id: str) -> list[FactRow]:
        """Copies of the rows of ``fact_ids``, all of ``user_id`` (a handle's MAC vouched for that)."""
        out = []
        for fact_id in fact_ids:
            fact = self.by_id.get(fact_id)
            if fact is None:
                raise FactNotFoundError(f"memory {fact_id} does not exist (never did, or was deleted)")
            if fact.user_id != user_id:  # cannot happen with a valid MAC; checked anyway
                raise ForgedHandleError(f"memory {fact_id} does not belong to this user")
            out.append(fact.copy())
        return out

    def count_encoded(self, fingerprint: str | None) -> int:
        """Facts whose KV was made under ``fingerprint`` (the store's current one)."""
        return sum(1 for f in self.by_id.values() if fingerprint and f.fingerprint == fingerprint)

    def new_rows(self, user_id: str, texts: Sequence[str], token_ids: Sequence[tuple[int, ...] | None],
                 contexts: Sequence[Context | None], metas: Sequence[dict[str, Any]], vecs: np.ndarray, *,
                 kind: str, window: int, now: str) -> list[FactRow]:
        """Rows for new facts, under fresh ids (``seq`` is given by the database on insert)."""
        rows = []
        for text, ids, ctx, meta, vec in zip(texts, token_ids, contexts, metas, vecs):
            fact_id = secrets.token_hex(8)
            while fact_id in self.by_id:
                fact_id = secrets.token_hex(8)
            rows.append(FactRow(
                seq=0, id=fact_id, user_id=user_id, text=text, token_ids=ids,
                context_ids=None if ctx is None else ctx.ids, context_text=None if ctx is None else ctx.text,
                context_kind=kind, context_window=window, metadata=meta,
                created_at=now, updated_at=now, kv_version=1, fingerprint=None, encode_error=None, embedding=vec,
            ))
        return rows

    def of_user(self, user_id: str) -> list[FactRow]:
        """The live facts of ``user_id``, in insertion order."""
        return [self.by_id[i] for i in self._of_user.get(user_id, ())]

    def last_texts(self, user_id: str, count: int) -> list[str]:
        """Texts of the last ``count`` facts of ``user_id``, oldest first."""
        if count <= 0:
            return []
        out = []
        for fact_id in reversed(self._of_user.get(user_id, {})):
            out.append(self.by_id[fact_id].text)
            if len(out) == count:
                break
        return out[::-1]

    def texts_before(self, f: FactRow, count: int) -> list[str]:
        """Texts of the ``count`` facts of the same user before ``f`` (all of them if ``f`` is gone)."""
        if count <= 0:
            return []
        ids = list(self._of_user.get(f.user_id, {}))
        at = ids.index(f.id) if f.id in ids else len(ids)
        return [self.by_id[i].text for i in ids[max(0, at - count) : at]]

    def ids_by_user(self) -> dict[str, list[str]]:
        """Fact ids of every user the table has seen (also those with none left), in insertion order."""
        return {u: list(ids) for u, ids in self._of_user.items()}

    def index(self, user_id: str) -> UserIndex | None:
        return self._indexes.get(user_id)

    def has_facts(self, user_id: str) -> bool:
        return bool(self._of_user.get(user_id))

    def search(self, user_id: str, vec: np.ndarray | DeviceQuery, k: int) -> list[tuple[FactRow, float]]:
        index = self._indexes.get(user_id)
        if index is None:
            return []
        out = []
        for seq, score in index.search(vec, k):
            fact_id = self._by_seq.get(seq)
            if fact_id is not None:
                out.append((self.by_id[fact_id], score))
        return out

    def _index(self, user_id: str, dim: int) -> UserIndex:
        index = self._indexes.get(user_id)
        if index is None:
            index = self._indexes[user_id] = UserIndex(dim, kind=self._index_kind, device=self._device)
        return index


def retexted(old: FactRow, text: str, token_ids: tuple[int, ...] | None, contexts: ContextBuilder | None,
             now: str) -> FactRow:
    """``old`` with a new text, under the next KV version (its KV is encoded anew, after the same
    context, shortened where the new text needs the room)."""
    ctx = old.context_ids
    if token_ids is not None and ctx is not None and contexts is not None:
        ctx = contexts.trim(ctx, len(token_ids))
    return dataclasses.replace(
        old, text=text, token_ids=token_ids, context_ids=ctx, updated_at=now, kv_version=old.kv_version + 1,
        fingerprint=None, encode_error=None,
    )
