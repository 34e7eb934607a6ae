"""Following the other replicas of a shared store: their writes, applied to this process's facts.

A store in PostgreSQL is written by several processes. Each keeps the live facts in memory (its
:class:`~inferscale_engine.memory.meta.facts.FactTable`, what reads are answered from) and its own KV;
before a read it applies what the others changed (:meth:`MetaDB.changes`): new facts join the
table (this replica encodes them on a miss), a newer version replaces the row and retires the
KV of the old one, a delete removes the fact and its KV. A :class:`Follower` looks every second
or so while the replica is idle, so that it can encode what arrived before anyone asks for it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable

import numpy as np

from inferscale_engine.errors import EngineClosedError
from inferscale_engine.memory.text.context import ContextBuilder
from inferscale_engine.memory.meta.db import Changes, FactRow
from inferscale_engine.memory.text.embedder import Embedder
from inferscale_engine.memory.meta.facts import FactTable
from inferscale_engine.memory.kv.keeper import KVKeeper
from inferscale_engine.memory.kv.tiers import KVKey

logger = logging.getLogger(__name__)


def apply_changes(changes: Changes, table: FactTable, keeper: KVKeeper | None, embedder: Embedder,
                  contexts: ContextBuilder | None) -> tuple[list[KVKey], list[str], list[str]]:
    """Under the store lock: bring ``table`` up to ``changes``. Returns the KV to free once the
    lock is released (versions replaced, and facts deleted: every version), and the facts that
    arrived (new, or at a new version), which this replica has no KV of."""
    stale: list[KVKey] = []
    gone: list[str] = []
    arrived: list[str] = []
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
            arrived.append(row.id)
        elif row.kv_version != local.kv_version:  # updated elsewhere: this replica's KV is stale
            arrived.append(row.id)
            table.replace(row, row.embedding)
            row.embedding = None
            stale.append((row.id, local.kv_version))
            if keeper is not None:
                keeper.retire(row.id)
        else:  # same text and KV (this replica's own write, or metadata): keep the KV state
            table.by_id[row.id] = dataclasses.replace(local, metadata=row.metadata, updated_at=row.updated_at)
    if new:
        table.add(new, np.stack([f.embedding for f in new]))  # type: ignore[misc]
    return stale, gone, arrived


class Follower:
    """Calls ``follow`` every ``interval`` seconds in a daemon thread until :meth:`stop`: a
    replica takes in the others' writes (and encodes what arrived) while no request asks it to."""

    def __init__(self, follow: Callable[[], None], interval: float) -> None:
        self._follow = follow
        self._interval = interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inferscale-follower", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)  # bounded: a look may be retrying a database that is down

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                self._follow()
            except EngineClosedError:
                return
            except Exception as exc:  # noqa: BLE001  (the database down past its retries: look again later)
                logger.warning("following the other replicas: %s: %s", type(exc).__name__, exc)
