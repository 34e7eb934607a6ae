"""``MemoryStore``: a Mem0-style, per-user memory whose facts carry precomputed KV.

What happens to a fact (module doing it in brackets)::

    add() ── validate [validation], tokenize (encoder), embed ──▶ SQLite commit [db]
          ──▶ searchable, handle ready (add returns here)
                                                        ▼
          bounded queue [encode_queue] ──▶ encoder thread: one batched encoder.encode() of
          whatever is queued, each fact after its context [context] ──▶ [keeper]
                                                        ▼
          KV tiers [tiers]: disk file (atomic, fingerprinted) ──▶ device slab (LRU ▶ host ▶ disk)

    resolve(handle, user) ── MAC, owner, existence ──▶ KV from the fastest tier (promoted),
          waiting for a queued/in-flight encode (bounded), or encoding on demand [keeper] ──▶ Span

Decisions (see ``docs/memory.md``):

* **Resolve waits for encoding.** A fact is searchable the moment ``add`` returns; its KV
  comes later. ``resolve`` of a fact still in the queue takes it out and encodes it right
  away; one that the encoder thread is already running is waited for up to
  ``resolve_timeout`` seconds, then :class:`~inferscale_engine.errors.KVNotReadyError`.
* **Context.** Each fact is encoded after ``context_prefix`` and the ``window`` facts of the
  same user before it (``"\\n"``-joined), or after an explicit ``context=``. The context token
  ids are stored, so re-encoding (missing file) reproduces the same KV; a store reopened with
  another ``window`` or ``context_prefix`` rebuilds window contexts.
* **Fingerprint** = engine fingerprint + window (+ prefix digest). KV made under another fingerprint is refused
  (:class:`~inferscale_engine.errors.StaleKVError` inside) and re-encoded, never served.
* **Durability.** ``add``/``update``/``delete`` commit to SQLite (WAL, ``synchronous=FULL``)
  before returning. KV files are written when encoded (write-through from the encoder thread,
  before the fact is marked encoded); a fact whose file is missing after a restart is
  re-encoded on demand.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence, Set
from datetime import datetime
from pathlib import Path
from typing import Any


from inferscale_engine.config import MemoryConfig, default_replica_path, is_database_url
from inferscale_engine.errors import (
    EngineClosedError,
    FactNotFoundError,
    InferScaleError,
    check_utf8,
)
from inferscale_engine.handles import Handle, HandleCodec
from inferscale_engine.memory.meta.backends import open_db
from inferscale_engine.memory.kv.bandwidth import TierSpeeds
from inferscale_engine.memory.kv.bandwidth import measure as measure_tiers
from inferscale_engine.memory.text.context import Chunk, Context, ContextBuilder
from inferscale_engine.memory.text.dates import resolve_relative_dates
from inferscale_engine.memory.meta.db import FactRow, utc_now
from inferscale_engine.memory.text.embedder import Embedder
from inferscale_engine.memory.encoding import (
    ChatGenerate,
    Encoder,
    ServingEngine,
    describe,
    device_of,
    engine_generate,
    kv_fingerprint,
)
from inferscale_engine.memory.text.extraction import infer_facts
from inferscale_engine.memory.meta.facts import FactTable, retexted
from inferscale_engine.memory.meta.folder import (
    DB_FILE,
    KV_DIR,
    LOCK_FILE,
    SECRET_FILE,
    acquire_lock,
    acquire_replica_folder,
    check_database,
    open_secret,
    record_url,
    release_lock,
)
from inferscale_engine.memory.meta.index import IndexKind
from inferscale_engine.memory.item import MemoryItem
from inferscale_engine.memory.kv.keeper import KVKeeper
from inferscale_engine.memory.load import load_facts
from inferscale_engine.memory.replica import Follower, apply_changes
from inferscale_engine.memory.kv.tiers import KVTiers
from inferscale_engine.types import Room, Span, TextFact
from inferscale_engine.memory.validation import (
    check_store_options,
    check_context,
    check_k,
    check_metadata,
    check_metadata_per_turn,
    check_sliding_group,
    check_text,
    check_user,
    texts_of,
    turn_texts,
)


logger = logging.getLogger(__name__)


class MemoryStore:
    """Per-user memory facts with KV for injection; also the engine's ``FactSource``.

    Args:
        encoder: the :class:`~inferscale_engine.memory.encoding.Encoder` (the serving engine)
            whose model encodes the facts; ``None`` gives a retrieval-only store (no tokens, no KV).
        path: folder of the store (``memory.sqlite3``, ``secret.key``, ``kv/``; created), or the
            ``postgresql://`` URL of a database that replicas share (see ``docs/scaling.md``).
        kv_path: with a database ``path``, this process's own KV folder (default: a free slot
            under :func:`~inferscale_engine.config.default_replica_path`).
        generate: the model that extracts facts for ``add(..., infer=True)``
            (:func:`~inferscale_engine.memory.encoding.engine_generate`); ``None``: no extraction.
        the others: the :class:`~inferscale_engine.config.MemoryConfig` fields of the same
            names, documented there (:meth:`from_config` builds a store from one).
    """

    def __init__(
        self,
        encoder: Encoder | None,
        path: str | os.PathLike,
        *,
        generate: ChatGenerate | None = None,
        device: str | None = None,
        window: int = 5,
        context_prefix: str = "",
        embedder: Any = None,
        index: IndexKind = "auto",
        device_kv_bytes: int = 512 << 20,
        host_kv_bytes: int = 2 << 30,
        page_tokens: int = 16,
        encode_queue: int = 1024,
        encode_batch: int = 32,
        encode_batch_tokens: int | None = None,
        resolve_timeout: float = 60.0,
        kv_path: str | os.PathLike | None = None,
        disk_read_threads: int = 16,
        disk_read_bps: float | None = None,
        follow_interval: float | None = None,
        resolve_dates: bool = False,
    ) -> None:
        check_store_options(window, index, encode_queue, encode_batch, encode_batch_tokens)
        self.device: str = device or device_of(encoder)
        if encode_batch_tokens is None:
            encode_batch_tokens = 4096 if self.device == "cuda" else 256
        self.encoder = encoder
        self.generate = generate
        #: Where the facts live: the store folder, or the database URL (without its password).
        self.location: str
        #: This process's folder: the store's own, or (shared store) this replica's KV folder.
        self.path: Path
        self.window = window
        self.resolve_dates = bool(resolve_dates)
        self.context_prefix = check_utf8(str(context_prefix), "context_prefix")
        self.index_kind: IndexKind = index
        self._keeper: KVKeeper | None = None  # with an encoder: the KV of the facts
        self.resolve_timeout = resolve_timeout
        self.fingerprint = kv_fingerprint(encoder, window, self.context_prefix)
        self.max_model_len: int | None = encoder.max_model_len if encoder is not None else None
        self.contexts: ContextBuilder | None = None if encoder is None else ContextBuilder(
            encoder.tokenize, encoder.max_model_len, window=window, prefix=self.context_prefix)

        self._closed = False  # the API refuses calls
        self._speeds: TierSpeeds | None = None
        self._speeds_lock = threading.Lock()
        #: The live facts in memory (read-only outside the store, like ``tiers``).
        self.table = FactTable(index_kind=index, device=self.device)
        self._lock = self.table.lock
        self._facts = self.table.by_id

        if is_database_url(path):
            # Replicas share the database; the lock guards only this process's KV folder.
            base = Path(kv_path).expanduser() if kv_path else default_replica_path(str(path))
            self.path, self._lock_fd = acquire_replica_folder(base, explicit=kv_path is not None)
        else:
            self.path = Path(path).expanduser()
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock_fd = acquire_lock(self.path / LOCK_FILE)
        try:
            if not is_database_url(path):
                check_database(self.path)  # never start over empty where a store's database was lost
            self._db = open_db(str(path) if is_database_url(path) else self.path / DB_FILE)
            self.location = self._db.location if self._db.shared else str(self.path)
            try:
                if self.fingerprint is not None:  # replicas of one store must make the same KV
                    self._db.claim_serving(self.fingerprint, describe(encoder, window, self.context_prefix))
                secret = self._db.handle_secret() if self._db.shared else open_secret(self.path / SECRET_FILE, self._db)
                self._codec = HandleCodec(secret)
            except BaseException:
                self._db.close()
                raise
            self.embedder = embedder if isinstance(embedder, Embedder) else Embedder(embedder, device=self.device)
            self.tiers = KVTiers(
                self.path / KV_DIR, device=self.device, device_bytes=device_kv_bytes,
                host_bytes=host_kv_bytes, page_tokens=page_tokens, read_threads=disk_read_threads,
                disk_read_bps=disk_read_bps,
            )
            load_facts(self._db, self.table, self.embedder, self.contexts, self.tiers,
                       None if encoder is None else encoder.fingerprint, self.fingerprint)
        except BaseException:
            release_lock(self._lock_fd)
            raise
        if encoder is not None:
            self._keeper = KVKeeper(
                encoder, self.contexts, self.fingerprint, self.table, db=self._db, tiers=self.tiers,  # type: ignore[arg-type]
                queue_size=encode_queue,
                batch=encode_batch, batch_tokens=encode_batch_tokens, resolve_timeout=self._resolve_timeout,
            )
        #: A shared store with an encoder: encode what other replicas write as it arrives.
        self._pre_encode = self._db.shared and self._keeper is not None and bool(follow_interval)
        self._follower = Follower(self._follow, float(follow_interval)) \
            if self._pre_encode and follow_interval else None

    @classmethod
    def from_config(cls, encoder: Encoder | None, config: MemoryConfig, *,
                    generate: ChatGenerate | None = None) -> "MemoryStore":
        """The store ``config`` describes (``config.extraction_max_tokens`` belongs to ``generate``)."""
        return cls(
            encoder, config.path, generate=generate, device=config.device, window=config.window,  # type: ignore[arg-type]
            context_prefix=config.context_prefix, embedder=config.embedder, index=config.index,
            device_kv_bytes=config.device_kv_bytes, host_kv_bytes=config.host_kv_bytes,
            page_tokens=config.page_tokens, encode_queue=config.encode_queue, encode_batch=config.encode_batch,
            encode_batch_tokens=config.encode_batch_tokens, resolve_timeout=config.resolve_timeout,
            kv_path=config.kv_path, disk_read_threads=config.disk_read_threads,
            disk_read_bps=config.disk_read_bps, follow_interval=config.follow_interval,
            resolve_dates=config.resolve_dates,
        )

    @classmethod
    def for_engine(cls, engine: ServingEngine, config: MemoryConfig | None = None) -> "MemoryStore":
        """A store whose facts ``engine`` encodes and extracts (``infer=True``), as
        ``engine.memory`` builds on first use; ``config`` defaults to
        :meth:`MemoryConfig.for_engine` of the engine's config."""
        config = config or MemoryConfig.for_engine(engine.config)
        generate = engine_generate(engine, max_tokens=config.extraction_max_tokens)
        return cls.from_config(engine, config, generate=generate)

    @property
    def resolve_timeout(self) -> float:
        """Seconds ``resolve`` waits for a fact that is being encoded; may be changed any time."""
        return self._resolve_timeout

    @resolve_timeout.setter
    def resolve_timeout(self, seconds: float) -> None:
        self._resolve_timeout = float(seconds)
        if self._keeper is not None:
            self._keeper.resolve_timeout = self._resolve_timeout

    @property
    def serve_as_text_after(self) -> float | None:
        """Seconds ``resolve`` waits for a fact that is being encoded before it returns the fact's
        token ids as a :class:`~inferscale_engine.types.TextFact` (prefilled, counted in
        ``usage.memories_as_text``) instead of its KV; ``None`` (default): wait up to
        ``resolve_timeout``. ``inferscale serve`` sets it, so chats never wait behind ingestion."""
        return self._keeper.serve_as_text_after if self._keeper is not None else None

    @serve_as_text_after.setter
    def serve_as_text_after(self, seconds: float | None) -> None:
        if self._keeper is not None:
            self._keeper.serve_as_text_after = None if seconds is None else float(seconds)

    def add(
        self,
        messages_or_text: str | Sequence[Mapping[str, Any]],
        *,
        user_id: str,
        metadata: dict[str, Any] | None = None,
        context: list[str] | None = None,
        infer: bool = False,
        progress: bool = False,
    ) -> list[MemoryItem]:
        """Store facts for ``user_id``; one per message (``"User: ..."``) or the text as-is.

        Returns once the facts are committed and searchable; their KV is encoded in the
        background (``item.encoded`` is ``False`` until then). ``context`` replaces the
        ``window`` previous facts as the text each fact is encoded after. ``infer=True`` asks
        the ``generate`` model to extract and reconcile facts Mem0-style instead.
        """
        self._check_open()
        user_id = check_user(user_id)
        texts = texts_of(messages_or_text)
        meta = check_metadata(metadata)
        ctx = check_context(context)
        if infer:
            if self.generate is None:
                raise InferScaleError("add(..., infer=True) needs a model to extract facts: build the store "
                                      "with generate=")
            return infer_facts(self, self.generate, texts, user_id=user_id, metadata=meta)
        return self._insert(texts, user_id, [meta] * len(texts), explicit=ctx, progress=progress)

    def add_texts(
        self,
        texts: Sequence[str],
        *,
        user_id: str,
        metadata: Sequence[dict[str, Any] | None] | None = None,
        context: list[str] | None = None,
    ) -> list[MemoryItem]:
        """Store each text as it is (no role prefix), each with its own metadata, in one
        transaction: a crash keeps all of them or none, as :meth:`add` does for its messages."""
        self._check_open()
        user_id = check_user(user_id)
        if isinstance(texts, str) or not texts:
            raise ValueError("add_texts() takes a non-empty list of texts")
        checked = [check_text(t) for t in texts]
        metas = [check_metadata(m) for m in (metadata if metadata is not None else [None] * len(checked))]
        if len(metas) != len(checked):
            raise ValueError(f"{len(checked)} texts but {len(metas)} metadata entries")
        return self._insert(checked, user_id, metas, explicit=check_context(context))

    def search(self, query: str, *, user_id: str, k: int = 5) -> list[MemoryItem]:
        """The ``k`` facts of ``user_id`` most similar to ``query``, best first (``.score`` = cosine)."""
        self._check_open()
        user_id = check_user(user_id)
        query = check_text(query, "query")
        k = check_k(k)
        self._follow()
        with self._lock:
            if not self.table.has_facts(user_id):
                return []
        vec = self.embedder.embed_query(query)
        with self._lock:
            found = self.table.search(user_id, vec, k)
            items = [self._item(f, score=score) for f, score in found]
        if self._keeper is not None:
            # Their handles are about to be resolved: KV only on disk starts moving up now.
            self._keeper.prefetch([f for f, _ in found])
        return items

    def prefetch(self, user_id: str, *, limit: int = 256) -> int:
        """Start moving the KV of ``user_id``'s ``limit`` most recent facts from disk to the host
        tier in the background, for a session that is about to start (its first request then
        injects from memory instead of reading cold files); returns how many reads started.
        :meth:`search` does the same for the facts it returns."""
        self._check_open()
        user_id = check_user(user_id)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit must be an integer >= 0, got {limit!r}")
        if self._keeper is None or not limit:
            return 0
        with self._lock:
            facts = self.table.of_user(user_id)[-limit:]
        return self._keeper.prefetch(facts[::-1])

    def tier_speeds(self, *, refresh: bool = False) -> TierSpeeds:
        """Measured disk and host-to-device speeds of this store's KV tiers (the engine's cost
        model weighs cold reads by them); measured on first call (a fraction of a second) or
        with ``refresh``."""
        self._check_open()
        with self._speeds_lock:
            if self._speeds is None or refresh:
                self._speeds = measure_tiers(self.tiers)
            return self._speeds

    def get(self, fact_id: str, *, user_id: str | None = None) -> MemoryItem:
        """One fact; :class:`FactNotFoundError` if it does not exist or belongs to another user."""
        self._check_open()
        self._follow()
        with self._lock:
            return self._item(self.table.lookup(fact_id, user_id))

    def get_all(self, *, user_id: str) -> list[MemoryItem]:
        """Every live fact of ``user_id``, in insertion order."""
        self._check_open()
        user_id = check_user(user_id)
        self._follow()
        with self._lock:
            return [self._item(f) for f in self.table.of_user(user_id)]

    def user_ids(self) -> list[str]:
        """Every user that has live facts (what an HTTP ``users`` listing needs)."""
        self._check_open()
        self._follow()
        with self._lock:
            return [u for u, ids in self.table.ids_by_user().items() if ids]

    def update_metadata(self, fact_id: str, metadata: dict[str, Any], *, user_id: str | None = None) -> MemoryItem:
        """Replace a fact's metadata; text, handle and KV stay as they are (Mem0 lets clients edit it alone)."""
        self._check_open()
        meta = check_metadata(metadata)
        now = utc_now()
        self._follow()
        with self._lock:
            self._check_open()
            old = self.table.lookup(fact_id, user_id)
            self._db.set_metadata(fact_id, meta, now)
            new = self.table.by_id[fact_id] = dataclasses.replace(old, metadata=meta, updated_at=now)
            return self._item(new)

    def update(self, fact_id: str, text: str, *, user_id: str | None = None) -> MemoryItem:
        """Replace a fact's text: re-tokenized, re-embedded, re-encoded under a new KV version.

        The handle stays the same; it resolves to the new text and KV from now on.
        """
        self._check_open()
        text = check_text(text)
        now = utc_now()
        text = self._dated([text], now)[0]
        self._follow()
        with self._lock:
            self.table.lookup(fact_id, user_id)
        token_ids = self.contexts.fact_tokens(text) if self.contexts is not None else None
        vec = self.embedder.embed([text])[0]
        with self._lock:
            self._check_open()
            old = self.table.lookup(fact_id, user_id)
            new = retexted(old, text, token_ids, self.contexts, now)
            version = self._db.update_text(old, new, vec)  # a shared store's may be further on
            if version != new.kv_version:
                new = dataclasses.replace(new, kv_version=version)
            self.table.replace(new, vec)
            if self._keeper is not None:
                self._keeper.retire(fact_id)
                self._keeper.expect(fact_id, version)
            item = self._item(new)
        self.tiers.delete_key((fact_id, old.kv_version))
        if self._keeper is not None:
            self._keeper.enqueue([(fact_id, version)])
        return item

    def delete(self, fact_id: str, *, user_id: str | None = None) -> None:
        """Delete a fact: gone from search and resolution, its KV freed in every tier."""
        self._check_open()
        self._follow()
        with self._lock:
            self._check_open()
            fact = self.table.lookup(fact_id, user_id)
            self._delete_facts([fact])
        self.tiers.delete(fact_id)

    def delete_all(self, *, user_id: str) -> int:
        """Delete every fact of ``user_id``; returns how many."""
        self._check_open()
        user_id = check_user(user_id)
        self._follow()
        with self._lock:
            self._check_open()
            facts = self.table.of_user(user_id)
            self._delete_facts(facts)
        for f in facts:
            self.tiers.delete(f.id)
        return len(facts)

    def history(self, fact_id: str) -> list[dict[str, Any]]:
        """Mem0-shaped events of a fact, oldest first (also after it was deleted)."""
        self._check_open()
        if not isinstance(fact_id, str):
            raise TypeError(f"fact id must be a string, got {type(fact_id).__name__}")
        return self._db.history(fact_id)

    def handle(self, fact_id: str, *, user_id: str) -> str:
        """The handle string of a fact of ``user_id``, to put in a prompt in place of its text."""
        self._check_open()
        user_id = check_user(user_id)
        self._follow()
        with self._lock:
            self.table.lookup(fact_id, user_id)
        return self._codec.make(user_id, fact_id)

    def resolve(self, handle: Handle | str, user_id: str) -> Span | TextFact:
        """The engine's ``FactSource``: the span a handle in a request of ``user_id`` stands for.

        Checks the MAC (:class:`ForgedHandleError`, also for another user's handle), existence
        (:class:`FactNotFoundError`) and KV fingerprint (stale KV is re-encoded, never served).
        Waits for a fact that is being encoded, at most ``resolve_timeout`` seconds
        (:class:`KVNotReadyError`).
        """
        return self.resolve_many([handle], user_id)[0]

    #: ``resolve_many(..., defer_cold=True)`` works (what the engine's cost model needs).
    defers_cold = True
    #: ``resolve_many(..., held=...)`` works (a multiprocess engine's exchange holds spans).
    skips_held = True
    #: ``resolve_many(..., room=...)`` refuses facts over the context before reading or encoding any.
    checks_room = True

    def resolve_many(self, handles: Sequence[Handle | str], user_id: str, *, defer_cold: bool = False,
                     held: Callable[[str], bool] | None = None, room: Room | None = None) -> list[Span | TextFact]:
        """:meth:`resolve` for every handle of one request, reading their KV in one batch.
        ``defer_cold``: facts whose KV is only in a disk file come back as
        :class:`~inferscale_engine.types.ColdFact`, nothing read yet (the engine's cost model
        reads them, or prefills them and has them promoted). ``held``: a predicate over span
        keys (``KVExchange.holds``); a fact whose key it holds comes back as a held
        :class:`~inferscale_engine.types.Span`, without KV, and none is read for it. ``room``:
        facts that do not fit it are refused before any KV is read or encoded."""
        self._check_open()
        user_id = check_user(user_id)
        fact_ids = [self._codec.verify(h, user_id) for h in handles]
        if self._db.shared:
            # Another replica may have added, updated or deleted them: one query for the current
            # versions; any this process does not hold (or holds older) is caught up first, so
            # KV of an older version is never served.
            current = self._db.live_versions(fact_ids, user_id)
            with self._lock:
                behind = any(current.get(i) != getattr(self._facts.get(i), "kv_version", None) for i in fact_ids)
            if behind:
                self._follow(encoding_here=set(fact_ids))
            for i in fact_ids:
                if i not in current:
                    raise FactNotFoundError(f"memory {i} does not exist (never did, or was deleted)")
        with self._lock:
            facts = self.table.snapshot(fact_ids, user_id)
        if room is not None:
            room.check(sum(len(f.token_ids or ()) for f in facts))
        if self._keeper is None:
            raise InferScaleError("this memory store has no engine (encoder), so it has no KV to serve")
        return self._keeper.spans(facts, defer_cold=defer_cold, held=held)

    def advertise(self, url: str) -> None:
        """Record in the store's lock file that ``url`` serves this store over HTTP: a command
        the lock refuses (``inferscale memory list``...) then uses that API instead."""
        self._check_open()
        record_url(self._lock_fd, url)

    def encoding_paused(self) -> contextlib.AbstractContextManager[None]:
        """A block in which no batch of facts is encoded (the one running finishes first,
        queued facts wait): the engine measures its own speed inside one, so that ingestion
        right after start-up does not make it look slower than it is."""
        if self._keeper is None:
            return contextlib.nullcontext()
        return self._keeper.encoding_paused()

    def wait_for_encoding(self, timeout: float | None = None) -> None:
        """Block until every queued fact has been encoded (or failed); ``TimeoutError`` after ``timeout``."""
        if self._keeper is not None:
            self._keeper.wait_idle(timeout)

    def close(self) -> None:
        """Stop the encoder (the batch in flight finishes) and close the database. Idempotent.

        Facts still queued stay unencoded and are encoded on demand after the store reopens;
        call :meth:`wait_for_encoding` first to flush them.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._follower is not None:
            self._follower.stop()
        dropped = self._keeper.stop() if self._keeper is not None else 0
        self.tiers.close()
        with self._lock:
            if self._keeper is not None:
                self._keeper.close()
            self._db.close()
        release_lock(self._lock_fd)
        if dropped:
            logger.info("memory store closed with %d facts still queued; they will be encoded on demand", dropped)

    def import_conversation(
        self,
        turns: Sequence[tuple[str, str]],
        *,
        user_id: str,
        metadata_per_turn: Sequence[dict[str, Any] | None] | None = None,
        sliding_group: int | None = None,
        progress: bool = True,
    ) -> list[MemoryItem]:
        """Bulk import of ``(speaker, text)`` turns as ``"speaker: text"`` facts (e.g. LoCoMo).

        One transaction, batched embedding, and batched encoding in this thread (returns
        with the KV encoded). ``sliding_group=g`` encodes ``g`` consecutive turns per prefill
        after the ``window`` turns before them (sliding-chunk encoding: every turn sees at
        least ``window`` turns of context, and far fewer prefill tokens are spent per fact);
        ``None`` encodes each turn after its own ``window`` predecessors.
        """
        self._check_open()
        user_id = check_user(user_id)
        texts = turn_texts(turns)
        if not texts:
            return []
        metas = check_metadata_per_turn(metadata_per_turn, len(texts))
        sliding_group = check_sliding_group(sliding_group)
        return self._insert(texts, user_id, metas, explicit=None, progress=progress, sliding_group=sliding_group,
                            background=False)

    def reencode(self, *, user_id: str | None = None) -> int:
        """Queue every fact (of ``user_id``, or all) whose KV is missing or stale for background
        encoding; returns how many. Useful after a model or window change, so that ``resolve``
        does not encode them one by one on demand."""
        self._check_open()
        if self._keeper is None:
            return 0
        if user_id is not None:
            user_id = check_user(user_id)
        with self._lock:
            ids = [f.id for f in self.table.of_user(user_id)] if user_id is not None else list(self._facts)
        return self._keeper.reencode(ids)

    @property
    def encoding_errors(self) -> dict[str, str]:
        """Facts whose last background encoding failed (fact id → error); they are re-encoded on demand."""
        return self._keeper.errors if self._keeper is not None else {}

    def stats(self) -> dict[str, Any]:
        with self._lock:
            facts = len(self.table)
            encoded = self.table.count_encoded(self.fingerprint)
            users = self.table.users
        return {"users": users, "facts": facts, "encoded": encoded,
                "queued": self._keeper.queued if self._keeper is not None else 0,
                "encode_errors": len(self.encoding_errors), **self.tiers.stats()}

    def __enter__(self) -> "MemoryStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MemoryStore(location={self.location!r}, window={self.window}, facts={len(self._facts)})"

    def _follow(self, encoding_here: Set[str] = frozenset()) -> None:
        """A shared store: take in what the other replicas wrote since this one last looked, and
        queue what arrived for encoding (``follow_interval``), except ``encoding_here``: facts
        the calling request resolves, and so encodes itself, at once."""
        if not self._db.shared:
            return
        with self._lock:
            self._check_open()
            stale, gone, arrived = apply_changes(self._db.changes(), self.table, self._keeper, self.embedder,
                                                 self.contexts)
        for key in stale:
            self.tiers.delete_key(key)
        for fact_id in gone:
            self.tiers.delete(fact_id)
        queue = [i for i in arrived if i not in encoding_here]
        if self._pre_encode and queue and self._keeper is not None:
            self._keeper.reencode(queue)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("this memory store was closed")

    def _item(self, f: FactRow, score: float | None = None) -> MemoryItem:
        return MemoryItem(
            id=f.id, memory=f.text, user_id=f.user_id, handle=self._codec.make(f.user_id, f.id), score=score,
            metadata=json.loads(json.dumps(f.metadata)), created_at=f.created_at, updated_at=f.updated_at,
            encoded=self.fingerprint is not None and f.fingerprint == self.fingerprint,
        )

    def _delete_facts(self, facts: list[FactRow]) -> None:
        """Under the store lock: mark deleted in SQLite (one transaction) and forget in memory."""
        if not facts:
            return
        self._db.delete_facts(facts, utc_now())
        for f in facts:
            self.table.remove(f)
            if self._keeper is not None:
                self._keeper.retire(f.id)

    def _dated(self, texts: list[str], now: str) -> list[str]:
        """``texts`` as stored at ``now`` (the facts' ``created_at`` / ``updated_at``): with
        ``resolve_dates``, relative dates resolved against its UTC day."""
        if not self.resolve_dates:
            return texts
        day = datetime.fromisoformat(now).date()
        return [resolve_relative_dates(t, day) for t in texts]

    def _insert(
        self,
        texts: list[str],
        user_id: str,
        metas: list[dict[str, Any]],
        *,
        explicit: list[str] | None,
        progress: bool = False,
        sliding_group: int | None = None,
        background: bool = True,
    ) -> list[MemoryItem]:
        for t in texts:  # speakers and imported turns too, not only checked contents
            check_utf8(t, "memory text")
        now = utc_now()
        texts = self._dated(texts, now)
        token_ids = [self.contexts.fact_tokens(t) for t in texts] if self.contexts is not None else None
        vecs = self.embedder.embed(texts, progress=progress)
        chunks: list[Chunk] = []
        self._follow()  # a shared store: the window before these facts includes other replicas' facts
        with self._lock:
            self._check_open()
            kind = "explicit" if explicit is not None else "window"
            contexts: Sequence[Context | None] = [None] * len(texts)  # retrieval only: no tokens, no context
            if self.contexts is not None and token_ids is not None:
                before = self.table.last_texts(user_id, self.window)
                if sliding_group is not None:
                    contexts, chunks = self.contexts.sliding(before, texts, token_ids, sliding_group)
                    kind = "sliding"
                else:
                    contexts = self.contexts.for_new(before, texts, token_ids, explicit)
            new = self.table.new_rows(user_id, texts, token_ids or [None] * len(texts), contexts, metas, vecs,
                                      kind=kind, window=self.window, now=now)
            self._db.insert_facts(new, now)
            self.table.add(new, vecs)  # committed: from here on the facts are visible
            keeper = self._keeper
            pendings = {f.id: keeper.expect(f.id, 1, queued=background) for f in new} if keeper is not None else {}
            items = [self._item(f) for f in new]
        if keeper is None:
            return items
        if background:
            keeper.enqueue([(f.id, 1) for f in new])
            return items

        keeper.encode_now(new, chunks, pendings, progress=progress)
        with self._lock:
            return [self._item(self._facts.get(f.id, f)) for f in new]
