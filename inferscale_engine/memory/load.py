"""Opening a memory store: bring stored facts up to date with the models they are served with,
and the encoded flags up to date with the KV files on disk (after a crash, a new model...)."""

from __future__ import annotations

import logging

import numpy as np

from inferscale_engine.memory.text.context import ContextBuilder
from inferscale_engine.memory.meta.db import FactRow, MetaDB
from inferscale_engine.memory.text.embedder import Embedder
from inferscale_engine.memory.meta.facts import FactTable
from inferscale_engine.memory.kv.tiers import KVTiers

logger = logging.getLogger(__name__)


def load_facts(db: MetaDB, table: FactTable, embedder: Embedder, contexts: ContextBuilder | None, tiers: KVTiers,
               encoder_fingerprint: str | None, fingerprint: str | None) -> None:
    """A store's live facts into ``table``, refreshed and reconciled with the KV on disk."""
    rows = db.load_live_facts()
    refresh(rows, db, embedder, contexts, encoder_fingerprint)
    if rows:
        table.add(rows, np.stack([f.embedding for f in rows]))  # type: ignore[misc]
    reconcile_kv(rows, db, tiers, fingerprint)


def refresh(rows: list[FactRow], db: MetaDB, embedder: Embedder, contexts: ContextBuilder | None,
            tokenizer: str | None) -> None:
    """Re-embed facts another embedder embedded; re-tokenize facts another tokenizer (model
    fingerprint ``tokenizer``) tokenized; mark window contexts made with another prefix for
    rebuilding. ``contexts`` is ``None`` for a store without an encoder (no tokens)."""
    stale_embedder = db.get_meta("embedder") != embedder.name
    redo = [f for f in rows if stale_embedder or f.embedding is None]
    if redo:
        logger.info("embedding %d stored facts with %s", len(redo), embedder.name)
        vecs = embedder.embed([f.text for f in redo], progress=len(redo) > 1000)
        db.set_embeddings((f.id, v) for f, v in zip(redo, vecs))
        for f, v in zip(redo, vecs):
            f.embedding = v
    if redo or not rows:
        db.set_meta("embedder", embedder.name)
    if contexts is None or tokenizer is None:
        return
    # Token ids belong to the tokenizer that made them: another model re-tokenizes facts and
    # contexts (context ids are rebuilt from the stored context text when encoding).
    same = db.get_meta("tokenizer") == tokenizer
    retok = [f for f in rows if f.token_ids is None or not same]
    for f in retok:
        f.token_ids = contexts.tokenize(f.text)
        f.context_ids = None
        if len(f.token_ids) >= contexts.max_model_len:
            logger.warning("memory %s has %d tokens under this model, more than its context", f.id, len(f.token_ids))
    db.set_token_ids((f.id, f.token_ids) for f in retok)
    db.set_meta("tokenizer", tokenizer)
    if retok:
        logger.info("re-tokenized %d memories for model %s", len(retok), tokenizer)
    if (db.get_meta("context_prefix") or "") != contexts.prefix:
        for f in rows:  # window contexts start with the prefix: rebuild them when encoding
            if f.context_kind != "explicit":
                f.context_window = -1
    db.set_meta("context_prefix", contexts.prefix)


def reconcile_kv(rows: list[FactRow], db: MetaDB, tiers: KVTiers, fingerprint: str | None) -> None:
    """Drop temp files and orphans; a fact is encoded exactly when its KV file is on disk."""
    kept, removed = tiers.sweep({f.id: f.kv_version for f in rows})
    changes: list[tuple[str | None, str]] = []
    for f in rows:
        has_file = (f.id, f.kv_version) in kept
        if f.fingerprint is not None and not has_file:
            f.fingerprint = None
            changes.append((None, f.id))
        elif f.fingerprint is None and has_file and fingerprint is not None:
            meta = tiers.read_metadata((f.id, f.kv_version)) or {}
            if meta.get("fingerprint") == fingerprint and f.token_ids is not None \
                    and meta.get("num_tokens") == str(len(f.token_ids)):
                f.fingerprint = fingerprint  # encoded just before a crash: adopt the file
                changes.append((f.fingerprint, f.id))
    if changes:
        db.set_fingerprints(changes)
    if removed or changes:
        logger.info("memory store %s: removed %d stray KV files, reconciled %d facts", db.location, removed,
                    len(changes))
