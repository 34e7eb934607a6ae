"""Following the other replicas of a shared store: their writes, applied to this process's facts.

A store in PostgreSQL is written by several processes. Each keeps the live facts in memory (its
:class:`~inferscale_engine.memory.facts.FactTable`, what reads are answered from) and its own KV;
before a read it applies what the others changed (:meth:`MetaDB.changes`): new facts join the
table (this replica encodes them on a miss), a newer version replaces the row and retires the
KV of the old one, a delete removes the fact and its KV.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from inferscale_engine.memory.context import ContextBuilder
from inferscale_engine.memory.db import Changes, FactRow
from inferscale_engine.memory.embedder import Embedder
from inferscale_engine.memory.facts import FactTable
from inferscale_engine.memory.kv_keeper import KVKeeper
from inferscale_engine.memory.tiers import KVKey


def apply_changes(changes: Changes, table: FactTable, keeper: KVKeeper | None, embedder: Embedder,
                  contexts: ContextBuilder | None) -> tuple[list[KVKey], list[str]]:
    """Under the store lock: bring ``table`` up to ``changes``. Returns the KV to free once the
    lock is released: versions replaced, and facts deleted (every version)."""
    stale: list[KVKey] = []
    gone: list[str] = []
    for fact_id in changes.deleted:
        f = table.by_id.get(fact_id)
        if f is not None:
            table.remove(f)
            gone.append(fact_id)
            if keeper is not None:
                keeper.retire(fact_id)
    new: list[FactRow] = []
    for row in changes.live:
        if contexts is not None and row.token_ids is None:  # written by a replica without a model
            row.token_ids = contexts.tokenize(row.text)
        if row.embedding is None:
            row.embedding = embedder.embed([row.text])[0]
        local = table.by_id.get(row.id)
        if local is None:
            new.append(row)
        elif row.kv_version != local.kv_version:  # updated elsewhere: this replica's KV is stale
            table.replace(row, row.embedding)
            row.embedding = None
            stale.append((row.id, local.kv_version))
            if keeper is not None:
                keeper.retire(row.id)
        else:  # same text and KV (this replica's own write, or metadata): keep the KV state
            table.by_id[row.id] = dataclasses.replace(local, metadata=row.metadata, updated_at=row.updated_at)
    if new:
        table.add(new, np.stack([f.embedding for f in new]))  # type: ignore[misc]
    return stale, gone
