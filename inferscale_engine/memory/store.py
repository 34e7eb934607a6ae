"""``MemoryStore``: a Mem0-style, per-user memory whose facts carry precomputed KV.

What happens to a fact::

    add() ── validate, tokenize (engine), embed ──▶ SQLite commit ──▶ searchable, handle ready
                                                        │  (add returns here)
                                                        ▼
          bounded queue ──▶ encoder thread: one batched engine.encode() of whatever is queued
                                                        ▼
          KV tiers: disk file (atomic, fingerprinted) ──▶ device slab (LRU ▶ host ▶ disk)

    resolve(handle, user) ── MAC, owner, existence ──▶ KV from the fastest tier (promoted),
          waiting for a queued/in-flight encode (bounded), or encoding on demand ──▶ Span

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

import dataclasses
import hashlib
import fcntl
import json
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from tqdm.auto import tqdm

from inferscale_engine.encoder import EncodeWindow
from inferscale_engine.errors import (
    ContextOverflowError,
    EngineClosedError,
    FactNotFoundError,
    ForgedHandleError,
    InferScaleError,
    KVNotReadyError,
    StaleKVError,
    check_utf8,
)
from inferscale_engine.handles import Handle, HandleCodec
from inferscale_engine.kv import FactKV
from inferscale_engine.memory.db import FactRow, MetaDB, ids_to_blob, vec_to_blob
from inferscale_engine.memory.embedder import Embedder
from inferscale_engine.memory.extraction import extract_actions
from inferscale_engine.memory.index import IndexKind, UserIndex
from inferscale_engine.memory.item import MemoryItem, text_hash
from inferscale_engine.memory.tiers import KVKey, KVMissingError, KVTiers

if TYPE_CHECKING:
    from inferscale_engine.engine import InferScaleEngine, Span

logger = logging.getLogger(__name__)

MAX_USER_ID = 128
MAX_K = 1000
SECRET_FILE = "secret.key"
DB_FILE = "memory.sqlite3"
KV_DIR = "kv"
LOCK_FILE = ".lock"


@dataclass(frozen=True)
class _Task:
    """What one fact is encoded from (a snapshot taken under the store lock)."""

    fact_id: str
    version: int
    token_ids: tuple[int, ...]
    context_ids: tuple[int, ...]

    @property
    def key(self) -> KVKey:
        return (self.fact_id, self.version)


class _Pending:
    """Encoding state of one fact version: queued → running → done (event set)."""

    __slots__ = ("version", "state", "event", "error")

    def __init__(self, version: int, state: Literal["queued", "running"]) -> None:
        self.version = version
        self.state: str = state
        self.event = threading.Event()
        self.error: BaseException | None = None


class MemoryStore:
    """Per-user memory facts with KV for injection; also the engine's ``FactSource``.

    Args:
        engine: the :class:`~inferscale_engine.engine.InferScaleEngine` whose model encodes
            and serves the facts; ``None`` gives a retrieval-only store (no tokens, no KV).
        path: folder of the store (``memory.sqlite3``, ``secret.key``, ``kv/``); created.
        window: facts of the same user a new fact is encoded after (0 = independent).
        context_prefix: text every window context starts with — the opening of the prompts the
            facts will be served in (chat template, system text), so a fact is encoded after the
            same first tokens (attention sink, instructions) it is later served after.
        embedder: ``None`` (all-MiniLM-L6-v2), a sentence-transformers path/name, or a model.
        index: ``"exact"`` (torch matmul + topk), ``"faiss"``, or ``"auto"`` (faiss past 20k
            facts of one user).
        device_kv_bytes / host_kv_bytes: capacity of the device slab and the host tier.
        page_tokens: tokens per device page.
        encode_queue: bound of the background encode queue (``add`` waits when it is full).
        encode_batch / encode_batch_tokens: most facts / prefill tokens per background
            ``engine.encode`` call. vLLM serves requests first come first served, so a chat
            request arriving while the encoder works waits behind at most one such batch.
            Default: 256 tokens on CPU (where batching buys nothing and chat latency stays
            within ~20% of idle), 4096 on CUDA.
        resolve_timeout: seconds ``resolve`` waits for a fact that is being encoded.
    """

    def __init__(
        self,
        engine: InferScaleEngine | None,
        path: str | os.PathLike,
        *,
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
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"window must be an integer >= 0, got {window!r}")
        if index not in ("auto", "exact", "faiss"):
            raise ValueError(f"index must be 'auto', 'exact' or 'faiss', got {index!r}")
        config = getattr(engine, "config", None)
        self.device: str = str(getattr(config, "device", None) or "cpu")
        if encode_batch_tokens is None:
            encode_batch_tokens = 4096 if self.device == "cuda" else 256
        if encode_queue < 1 or encode_batch < 1 or encode_batch_tokens < 1:
            raise ValueError("encode_queue, encode_batch and encode_batch_tokens must be >= 1")
        self.engine = engine
        self.path = Path(path).expanduser()
        self.window = window
        self.context_prefix = check_utf8(str(context_prefix), "context_prefix")
        self.index_kind: IndexKind = index
        self.encode_batch = encode_batch
        self.encode_batch_tokens = encode_batch_tokens
        self.resolve_timeout = float(resolve_timeout)
        self.extraction_max_tokens = 512
        self.fingerprint: str | None = f"{engine.fingerprint}-w{window}" if engine is not None else None
        if self.fingerprint is not None and self.context_prefix:
            self.fingerprint += "-p" + hashlib.sha256(self.context_prefix.encode()).hexdigest()[:12]
        self.max_model_len: int | None = engine.max_model_len if engine is not None else None

        self._lock = threading.RLock()
        self._idle = threading.Condition()
        self._inflight = 0
        self._closed = False  # the API refuses calls
        self._stopping = False  # the encoder thread stops after its batch
        self._db_open = True
        self._facts: dict[str, FactRow] = {}
        self._by_seq: dict[int, str] = {}
        self._user_facts: dict[str, dict[str, None]] = {}  # insertion-ordered fact ids per user
        self._indexes: dict[str, UserIndex] = {}
        self._pending: dict[str, _Pending] = {}
        self._encode_errors: dict[str, str] = {}
        self._queue: queue.Queue[tuple[str, int]] = queue.Queue(maxsize=encode_queue)
        self._worker: threading.Thread | None = None

        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _acquire_lock(self.path / LOCK_FILE)
        try:
            self._codec = HandleCodec(_load_secret(self.path / SECRET_FILE))
            self.embedder = embedder if isinstance(embedder, Embedder) else Embedder(embedder, device=self.device)
            self._db = MetaDB(self.path / DB_FILE)
            self.tiers = KVTiers(
                self.path / KV_DIR, device=self.device, device_bytes=device_kv_bytes,
                host_bytes=host_kv_bytes, page_tokens=page_tokens,
            )
            self._load()
        except BaseException:
            _release_lock(self._lock_fd)
            raise
        if engine is not None:
            self._worker = threading.Thread(target=self._work, name="inferscale-memory-encoder", daemon=True)
            self._worker.start()

    # ================================================================== public API

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
        the engine's model to extract and reconcile facts Mem0-style instead.
        """
        self._check_open()
        user_id = _check_user(user_id)
        texts = _texts_of(messages_or_text)
        meta = _check_metadata(metadata)
        ctx = _check_context(context)
        if infer:
            return self._add_inferred(texts, user_id, meta)
        return self._insert(texts, user_id, [meta] * len(texts), explicit=ctx, progress=progress)

    def search(self, query: str, *, user_id: str, k: int = 5) -> list[MemoryItem]:
        """The ``k`` facts of ``user_id`` most similar to ``query``, best first (``.score`` = cosine)."""
        self._check_open()
        user_id = _check_user(user_id)
        query = _check_text(query, "query")
        k = _check_k(k)
        with self._lock:
            if not self._user_facts.get(user_id):
                return []
        vec = self.embedder.embed([query])[0]
        with self._lock:
            index = self._indexes.get(user_id)
            if index is None:
                return []
            hits = index.search(vec, k)
            out = []
            for seq, score in hits:
                fact_id = self._by_seq.get(seq)
                if fact_id is not None:
                    out.append(self._item(self._facts[fact_id], score=score))
            return out

    def get(self, fact_id: str, *, user_id: str | None = None) -> MemoryItem:
        """One fact; :class:`FactNotFoundError` if it does not exist or belongs to another user."""
        self._check_open()
        with self._lock:
            return self._item(self._lookup(fact_id, user_id))

    def get_all(self, *, user_id: str) -> list[MemoryItem]:
        """Every live fact of ``user_id``, in insertion order."""
        self._check_open()
        user_id = _check_user(user_id)
        with self._lock:
            return [self._item(self._facts[i]) for i in self._user_facts.get(user_id, ())]

    def user_ids(self) -> list[str]:
        """Every user that has live facts (what an HTTP ``users`` listing needs)."""
        self._check_open()
        with self._lock:
            return [u for u, facts in self._user_facts.items() if facts]

    def update_metadata(self, fact_id: str, metadata: dict[str, Any], *, user_id: str | None = None) -> MemoryItem:
        """Replace a fact's metadata; text, handle and KV stay as they are (Mem0 lets clients edit it alone)."""
        self._check_open()
        meta = _check_metadata(metadata)
        now = _now()
        with self._lock:
            self._check_open()
            old = self._lookup(fact_id, user_id)
            with self._db.transaction() as c:
                c.execute("UPDATE facts SET metadata=?, updated_at=? WHERE id=?", (json.dumps(meta), now, fact_id))
            new = self._facts[fact_id] = dataclasses.replace(old, metadata=meta, updated_at=now)
            return self._item(new)

    def update(self, fact_id: str, text: str, *, user_id: str | None = None) -> MemoryItem:
        """Replace a fact's text: re-tokenized, re-embedded, re-encoded under a new KV version.

        The handle stays the same; it resolves to the new text and KV from now on.
        """
        self._check_open()
        text = _check_text(text)
        with self._lock:
            self._lookup(fact_id, user_id)
        token_ids = self._tokenize_fact(text)
        vec = self.embedder.embed([text])[0]
        now = _now()
        with self._lock:
            self._check_open()
            old = self._lookup(fact_id, user_id)
            version = old.kv_version + 1
            ctx = old.context_ids
            if token_ids is not None and ctx is not None and len(ctx) + len(token_ids) >= self.max_model_len:  # type: ignore[operator]
                ctx = ctx[len(ctx) + len(token_ids) - self.max_model_len + 1 :]  # type: ignore[operator]
            new = dataclasses.replace(
                old, text=text, token_ids=token_ids, context_ids=ctx, updated_at=now, kv_version=version,
                fingerprint=None, encode_error=None,
            )
            with self._db.transaction() as c:
                c.execute(
                    "UPDATE facts SET text=?, hash=?, token_ids=?, context_ids=?, updated_at=?, kv_version=?, "
                    "fingerprint=NULL, encode_error=NULL, embedding=? WHERE id=?",
                    (text, text_hash(text), ids_to_blob(token_ids), ids_to_blob(ctx), now, version,
                     vec_to_blob(vec), fact_id),
                )
                MetaDB.add_history(c, _new_hex(), fact_id, old.user_id, "UPDATE", old.text, text, now)
            self._facts[fact_id] = new
            self._index_for(old.user_id, vec.shape[0]).add([old.seq], vec[None])
            self._encode_errors.pop(fact_id, None)
            self._retire_pending(fact_id)
            if self.engine is not None:
                self._pending[fact_id] = _Pending(version, "queued")
            item = self._item(new)
        self.tiers.delete_key((fact_id, old.kv_version))
        if self.engine is not None:
            self._enqueue([(fact_id, version)])
        return item

    def delete(self, fact_id: str, *, user_id: str | None = None) -> None:
        """Delete a fact: gone from search and resolution, its KV freed in every tier."""
        self._check_open()
        with self._lock:
            self._check_open()
            fact = self._lookup(fact_id, user_id)
            self._delete_facts([fact])
        self.tiers.delete(fact_id)

    def delete_all(self, *, user_id: str) -> int:
        """Delete every fact of ``user_id``; returns how many."""
        self._check_open()
        user_id = _check_user(user_id)
        with self._lock:
            self._check_open()
            facts = [self._facts[i] for i in self._user_facts.get(user_id, ())]
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
        user_id = _check_user(user_id)
        with self._lock:
            self._lookup(fact_id, user_id)
        return self._codec.make(user_id, fact_id)

    def resolve(self, handle: Handle | str, user_id: str) -> "Span":
        """The engine's ``FactSource``: the span a handle in a request of ``user_id`` stands for.

        Checks the MAC (:class:`ForgedHandleError`, also for another user's handle), existence
        (:class:`FactNotFoundError`) and KV fingerprint (stale KV is re-encoded, never served).
        Waits for a fact that is being encoded, at most ``resolve_timeout`` seconds
        (:class:`KVNotReadyError`).
        """
        return self.resolve_many([handle], user_id)[0]

    def resolve_many(self, handles: Sequence[Handle | str], user_id: str) -> list["Span"]:
        """:meth:`resolve` for every handle of one request, reading their KV in one batch."""
        from inferscale_engine.engine import Span

        self._check_open()
        user_id = _check_user(user_id)
        fact_ids = [self._codec.verify(h, user_id) for h in handles]
        with self._lock:
            facts = []
            for fact_id in fact_ids:
                fact = self._facts.get(fact_id)
                if fact is None:
                    raise FactNotFoundError(f"memory {fact_id} does not exist (never did, or was deleted)")
                if fact.user_id != user_id:  # cannot happen with a valid MAC; checked anyway
                    raise ForgedHandleError(f"memory {fact_id} does not belong to this user")
                facts.append(dataclasses.replace(fact))
        if self.engine is None:
            raise InferScaleError("this memory store has no engine, so it has no KV to serve")
        kvs: list[FactKV | None] = [None] * len(facts)
        ready = [i for i, f in enumerate(facts) if f.fingerprint == self.fingerprint]
        try:
            got = self.tiers.get_many([(facts[i].id, facts[i].kv_version) for i in ready], self.fingerprint)  # type: ignore[arg-type]
            for i, kv in zip(ready, got):
                kvs[i] = kv
        except (KVMissingError, StaleKVError):
            pass  # the fact-by-fact path below repairs (re-encodes) what is missing or stale
        spans = []
        for fact, kv in zip(facts, kvs):
            if kv is None:  # not encoded yet, or its KV needs repair
                kv, fact = self._kv(fact.id)
            assert fact.token_ids is not None
            spans.append(Span(key=f"fact:{fact.id}:{fact.kv_version}", token_ids=tuple(fact.token_ids), kv=kv, text=fact.text))
        return spans

    def wait_for_encoding(self, timeout: float | None = None) -> None:
        """Block until every queued fact has been encoded (or failed); ``TimeoutError`` after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._inflight > 0:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"{self._inflight} memory facts still waiting to be encoded")
                self._idle.wait(remaining)

    def close(self) -> None:
        """Stop the encoder (the batch in flight finishes) and close the database. Idempotent.

        Facts still queued stay unencoded and are encoded on demand after the store reopens;
        call :meth:`wait_for_encoding` first to flush them.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stopping = True
        if self._worker is not None:
            self._worker.join(timeout=300)
        dropped = 0
        while True:
            try:
                self._queue.get_nowait()
                dropped += 1
            except queue.Empty:
                break
        with self._idle:
            self._inflight = 0
            self._idle.notify_all()
        with self._lock:
            for p in self._pending.values():
                p.event.set()
            self._pending.clear()
            self._db_open = False
            self._db.close()
        _release_lock(self._lock_fd)
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
        user_id = _check_user(user_id)
        if isinstance(turns, (str, bytes)) or not isinstance(turns, Sequence):
            raise TypeError("turns must be a list of (speaker, text) pairs")
        texts = []
        for i, turn in enumerate(turns):
            if not isinstance(turn, (tuple, list)) or len(turn) != 2:
                raise TypeError(f"turn {i} must be a (speaker, text) pair")
            speaker, text = turn
            if not isinstance(speaker, str) or not isinstance(text, str):
                raise TypeError(f"turn {i}: speaker and text must be strings")
            if not text.strip():
                raise ValueError(f"turn {i} has empty text")
            texts.append(f"{speaker.strip()}: {text}" if speaker.strip() else text)
        if not texts:
            return []
        if metadata_per_turn is None:
            metas: list[dict[str, Any]] = [{} for _ in texts]
        else:
            if len(metadata_per_turn) != len(texts):
                raise ValueError(f"metadata_per_turn has {len(metadata_per_turn)} entries for {len(texts)} turns")
            metas = [_check_metadata(m) for m in metadata_per_turn]
        if sliding_group is not None and (isinstance(sliding_group, bool) or not isinstance(sliding_group, int)
                                          or sliding_group < 1):
            raise ValueError(f"sliding_group must be None or an integer >= 1, got {sliding_group!r}")
        return self._insert(texts, user_id, metas, explicit=None, progress=progress, sliding_group=sliding_group,
                            background=False)

    # ------------------------------------------------------------------ extras

    def reencode(self, *, user_id: str | None = None) -> int:
        """Queue every fact (of ``user_id``, or all) whose KV is missing or stale for background
        encoding; returns how many. Useful after a model or window change, so that ``resolve``
        does not encode them one by one on demand."""
        self._check_open()
        if self.engine is None:
            return 0
        if user_id is not None:
            user_id = _check_user(user_id)
        jobs: list[tuple[str, int]] = []
        stale: list[KVKey] = []
        with self._lock:
            ids = list(self._user_facts.get(user_id, ())) if user_id is not None else list(self._facts)
            rows = []
            for fact_id in ids:
                f = self._facts[fact_id]
                if f.fingerprint == self.fingerprint or fact_id in self._pending:
                    continue
                if f.fingerprint is not None:  # stale KV: new version, as in resolve()
                    stale.append((fact_id, f.kv_version))
                    f = self._facts[fact_id] = dataclasses.replace(f, kv_version=f.kv_version + 1, fingerprint=None)
                    rows.append((f.kv_version, fact_id))
                self._pending[fact_id] = _Pending(f.kv_version, "queued")
                jobs.append((fact_id, f.kv_version))
            if rows:
                with self._db.transaction() as c:
                    c.executemany("UPDATE facts SET kv_version=?, fingerprint=NULL WHERE id=?", rows)
        for key in stale:
            self.tiers.delete_key(key)
        self._enqueue(jobs)
        return len(jobs)

    @property
    def encoding_errors(self) -> dict[str, str]:
        """Facts whose last background encoding failed (fact id → error); they are re-encoded on demand."""
        with self._lock:
            return dict(self._encode_errors)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            facts = len(self._facts)
            encoded = sum(1 for f in self._facts.values() if f.fingerprint == self.fingerprint and f.fingerprint)
            users = sum(1 for v in self._user_facts.values() if v)
        with self._idle:
            inflight = self._inflight
        return {"users": users, "facts": facts, "encoded": encoded, "queued": inflight,
                "encode_errors": len(self._encode_errors), **self.tiers.stats()}

    def __enter__(self) -> "MemoryStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MemoryStore(path={str(self.path)!r}, window={self.window}, facts={len(self._facts)})"

    # ================================================================== internals: state

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("this memory store was closed")

    def _lookup(self, fact_id: str, user_id: str | None) -> FactRow:
        if not isinstance(fact_id, str):
            raise TypeError(f"fact id must be a string, got {type(fact_id).__name__}")
        if user_id is not None:
            user_id = _check_user(user_id)
        fact = self._facts.get(fact_id)
        if fact is None or (user_id is not None and fact.user_id != user_id):
            who = f" for user {user_id!r}" if user_id is not None else ""
            raise FactNotFoundError(f"no memory {fact_id!r}{who}")
        return fact

    def _item(self, f: FactRow, score: float | None = None) -> MemoryItem:
        return MemoryItem(
            id=f.id, memory=f.text, user_id=f.user_id, handle=self._codec.make(f.user_id, f.id), score=score,
            metadata=json.loads(json.dumps(f.metadata)), created_at=f.created_at, updated_at=f.updated_at,
            encoded=self.fingerprint is not None and f.fingerprint == self.fingerprint,
        )

    def _index_for(self, user_id: str, dim: int) -> UserIndex:
        index = self._indexes.get(user_id)
        if index is None:
            index = self._indexes[user_id] = UserIndex(dim, kind=self.index_kind, device=self.device)
        return index

    def _load(self) -> None:
        rows = self._db.load_live_facts()
        stale_embedder = self._db.get_meta("embedder") != self.embedder.name
        redo = [f for f in rows if stale_embedder or f.embedding is None]
        if redo:
            logger.info("embedding %d stored facts with %s", len(redo), self.embedder.name)
            vecs = self.embedder.embed([f.text for f in redo], progress=len(redo) > 1000)
            with self._db.transaction() as c:
                c.executemany("UPDATE facts SET embedding=? WHERE id=?",
                              [(vec_to_blob(v), f.id) for f, v in zip(redo, vecs)])
            for f, v in zip(redo, vecs):
                f.embedding = v
        if redo or not rows:
            with self._db.transaction() as c:
                MetaDB.set_meta(c, "embedder", self.embedder.name)
        if self.engine is not None:
            # Token ids belong to the tokenizer that made them: another model re-tokenizes facts
            # and contexts (context ids are rebuilt from the stored context text when encoding).
            same = self._db.get_meta("tokenizer") == self.engine.fingerprint
            retok = [f for f in rows if f.token_ids is None or not same]
            for f in retok:
                f.token_ids = tuple(int(t) for t in self.engine.tokenize(f.text))
                f.context_ids = None
                if len(f.token_ids) >= self.max_model_len:  # type: ignore[operator]
                    logger.warning("memory %s has %d tokens under this model, more than its context", f.id,
                                   len(f.token_ids))
            with self._db.transaction() as c:
                c.executemany("UPDATE facts SET token_ids=?, context_ids=NULL WHERE id=?",
                              [(ids_to_blob(f.token_ids), f.id) for f in retok])
                MetaDB.set_meta(c, "tokenizer", self.engine.fingerprint)
            if retok:
                logger.info("re-tokenized %d memories for model %s", len(retok), self.engine.fingerprint)
            if (self._db.get_meta("context_prefix") or "") != self.context_prefix:
                for f in rows:  # window contexts start with the prefix: rebuild them when encoding
                    if f.context_kind != "explicit":
                        f.context_window = -1
            with self._db.transaction() as c:
                MetaDB.set_meta(c, "context_prefix", self.context_prefix)
        by_user: dict[str, list[FactRow]] = {}
        for f in rows:
            self._facts[f.id] = f
            self._by_seq[f.seq] = f.id
            self._user_facts.setdefault(f.user_id, {})[f.id] = None
            by_user.setdefault(f.user_id, []).append(f)
        for user_id, facts in by_user.items():
            vecs = np.stack([f.embedding for f in facts])  # type: ignore[misc]
            self._index_for(user_id, vecs.shape[1]).add([f.seq for f in facts], vecs)
        for f in rows:
            f.embedding = None  # the index holds it now

        # KV files: drop temp files and orphans; reconcile the encoded flags with what is on disk.
        kept, removed = self.tiers.sweep({f.id: f.kv_version for f in rows})
        changes: list[tuple[str | None, str]] = []
        for f in rows:
            has_file = (f.id, f.kv_version) in kept
            if f.fingerprint is not None and not has_file:
                f.fingerprint = None
                changes.append((None, f.id))
            elif f.fingerprint is None and has_file and self.fingerprint is not None:
                meta = self.tiers.read_metadata((f.id, f.kv_version)) or {}
                if meta.get("fingerprint") == self.fingerprint and f.token_ids is not None \
                        and meta.get("num_tokens") == str(len(f.token_ids)):
                    f.fingerprint = self.fingerprint  # encoded just before a crash: adopt the file
                    changes.append((f.fingerprint, f.id))
        if changes:
            with self._db.transaction() as c:
                c.executemany("UPDATE facts SET fingerprint=? WHERE id=?", changes)
        if removed or changes:
            logger.info("memory store %s: removed %d stray KV files, reconciled %d facts", self.path, removed, len(changes))

    def _delete_facts(self, facts: list[FactRow]) -> None:
        """Under the store lock: mark deleted in SQLite (one transaction) and forget in memory."""
        if not facts:
            return
        now = _now()
        with self._db.transaction() as c:
            for f in facts:
                c.execute(
                    "UPDATE facts SET deleted=1, embedding=NULL, token_ids=NULL, context_ids=NULL, context_text=NULL, fingerprint=NULL, "
                    "updated_at=? WHERE id=?", (now, f.id),
                )
                MetaDB.add_history(c, _new_hex(), f.id, f.user_id, "DELETE", f.text, None, now)
        for f in facts:
            self._facts.pop(f.id, None)
            self._by_seq.pop(f.seq, None)
            self._user_facts.get(f.user_id, {}).pop(f.id, None)
            index = self._indexes.get(f.user_id)
            if index is not None:
                index.remove(f.seq)
            self._encode_errors.pop(f.id, None)
            self._retire_pending(f.id)

    def _retire_pending(self, fact_id: str) -> None:
        p = self._pending.pop(fact_id, None)
        if p is not None:
            p.state = "done"
            p.event.set()  # waiters re-read the fact (new version, or gone)

    # ================================================================== internals: adding

    def _tokenize_fact(self, text: str) -> tuple[int, ...] | None:
        if self.engine is None:
            return None
        ids = tuple(int(t) for t in self.engine.tokenize(text))
        if not ids:
            raise ValueError("memory text produces no tokens")
        if len(ids) >= self.max_model_len:  # type: ignore[operator]
            raise ContextOverflowError(
                f"memory of {len(ids)} tokens does not fit the model's context of {self.max_model_len} tokens"
            )
        return ids

    def _previous_texts(self, user_id: str, count: int) -> list[str]:
        if count <= 0:
            return []
        out = []
        for fact_id in reversed(self._user_facts.get(user_id, {})):
            out.append(self._facts[fact_id].text)
            if len(out) == count:
                break
        return out[::-1]

    def _fit_context(self, prev: list[str], n: int, *, strict: bool, prefix: str = "") -> tuple[tuple[int, ...], str]:
        """Ids and text of ``prefix + "\\n".join(prev) + "\\n"``, dropping the oldest texts until it fits."""
        assert self.engine is not None and self.max_model_len is not None
        while True:
            text = prefix + ("\n".join(prev) + "\n" if prev else "")
            ctx = tuple(int(t) for t in self.engine.tokenize(text)) if text else ()
            if len(ctx) + n < self.max_model_len:
                return ctx, text
            if strict or not prev:  # nothing left to drop: the prefix alone is too long
                raise ContextOverflowError(
                    f"context of {len(ctx)} tokens plus a memory of {n} does not fit the model's context "
                    f"of {self.max_model_len} tokens"
                )
            prev = prev[1:]

    def _contexts(self, user_id: str, texts: list[str], token_ids: list[tuple[int, ...] | None],
                  explicit: list[str] | None) -> list[tuple[tuple[int, ...] | None, str | None]]:
        if self.engine is None:
            return [(None, None)] * len(texts)
        w = self.window
        out: list[tuple[tuple[int, ...] | None, str | None]] = []
        prior: list[str] = []
        base = list(explicit) if explicit is not None else self._previous_texts(user_id, w)
        for text, ids in zip(texts, token_ids):
            assert ids is not None
            if explicit is not None:
                prev = base + (prior[-w:] if w else [])
            else:
                prev = (base + prior)[-w:] if w else []
            out.append(self._fit_context(prev, len(ids), strict=explicit is not None,
                                         prefix="" if explicit is not None else self.context_prefix))
            prior.append(text)
        return out

    def _sliding_plan(self, user_id: str, texts: list[str], token_ids: list[tuple[int, ...]], group: int
                      ) -> tuple[list[tuple[tuple[int, ...], str]], list[tuple[tuple[int, ...], list[tuple[int, int, int]]]]]:
        """Sliding-chunk windows (like :func:`~inferscale_engine.encoder.sliding_windows`, with
        ``"\\n"`` between turns): per fact its context ids, and per window its ids and
        ``(fact index, start, length)`` ranges."""
        assert self.engine is not None and self.max_model_len is not None
        w = self.window
        prior = self._previous_texts(user_id, w)
        all_texts = prior + texts
        newline = tuple(int(t) for t in self.engine.tokenize("\n"))
        contexts: list[tuple[tuple[int, ...], str]] = [((), "")] * len(texts)
        windows = []
        i = 0
        while i < len(texts):
            at = len(prior) + i
            prev = all_texts[max(0, at - w) : at] if w else []
            prefix, text = self._fit_context(prev, len(token_ids[i]), strict=False, prefix=self.context_prefix)
            ids = list(prefix)
            ranges: list[tuple[int, int, int]] = []
            j = i
            while j < len(texts) and j - i < group:
                sep = newline if ranges else ()
                if ranges and len(ids) + len(sep) + len(token_ids[j]) >= self.max_model_len:
                    break
                ids.extend(sep)
                if sep:
                    text += texts[j - 1] + "\n"
                contexts[j] = (tuple(ids), text)
                ranges.append((j, len(ids), len(token_ids[j])))
                ids.extend(token_ids[j])
                j += 1
            windows.append((tuple(ids), ranges))
            i = j
        return contexts, windows

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
        token_ids = [self._tokenize_fact(t) for t in texts]
        vecs = self.embedder.embed(texts, progress=progress)
        now = _now()
        windows: list[tuple[tuple[int, ...], list[tuple[int, int, int]]]] = []
        with self._lock:
            self._check_open()
            if sliding_group is not None and self.engine is not None:
                contexts, windows = self._sliding_plan(user_id, texts, token_ids, sliding_group)  # type: ignore[arg-type]
                kind = "sliding"
            else:
                contexts = self._contexts(user_id, texts, token_ids, explicit)
                kind = "explicit" if explicit is not None else "window"
            new: list[FactRow] = []
            with self._db.transaction() as c:
                MetaDB.ensure_user(c, user_id, now)
                for text, ids, (ctx, ctx_text), meta, vec in zip(texts, token_ids, contexts, metas, vecs):
                    fact_id = _new_hex()
                    while fact_id in self._facts:
                        fact_id = _new_hex()
                    f = FactRow(
                        seq=0, id=fact_id, user_id=user_id, text=text, token_ids=ids, context_ids=ctx,
                        context_text=ctx_text, context_kind=kind, context_window=self.window, metadata=meta, created_at=now,
                        updated_at=now, kv_version=1, fingerprint=None, encode_error=None, embedding=vec,
                    )
                    f.seq = MetaDB.insert_fact(c, f, text_hash(text))
                    f.embedding = None
                    MetaDB.add_history(c, _new_hex(), fact_id, user_id, "ADD", None, text, now)
                    new.append(f)
            # Committed: from here on the facts are visible.
            for f in new:
                self._facts[f.id] = f
                self._by_seq[f.seq] = f.id
                self._user_facts.setdefault(user_id, {})[f.id] = None
            self._index_for(user_id, vecs.shape[1]).add([f.seq for f in new], vecs)
            pendings = {}
            if self.engine is not None:
                for f in new:
                    pendings[f.id] = self._pending[f.id] = _Pending(1, "queued" if background else "running")
            items = [self._item(f) for f in new]
        if self.engine is None:
            return items
        if background:
            self._enqueue([(f.id, 1) for f in new])
            return items

        # Bulk import: encode here, in batches, with a progress bar.
        if not windows:
            windows = [(tuple(f.context_ids) + tuple(f.token_ids), [(i, len(f.context_ids), len(f.token_ids))])  # type: ignore[arg-type]
                       for i, f in enumerate(new)]
        # Chunks obey the same limits as the encoder thread, so chat requests interleave.
        chunks: list[list[tuple[tuple[int, ...], list[tuple[int, int, int]]]]] = [[]]
        tokens = 0
        for w in windows:
            if chunks[-1] and (len(chunks[-1]) >= self.encode_batch or tokens + len(w[0]) > self.encode_batch_tokens):
                chunks.append([])
                tokens = 0
            chunks[-1].append(w)
            tokens += len(w[0])
        bar = tqdm(total=len(new), desc="encoding memories", unit="fact", disable=not progress)
        try:
            for chunk in chunks:
                jobs = []
                for ids, ranges in chunk:
                    tasks = [(_Task(new[i].id, 1, tuple(new[i].token_ids), ids[:s]), pendings[new[i].id])  # type: ignore[arg-type]
                             for i, s, _ in ranges]
                    jobs.append((EncodeWindow(ids, tuple((s, n) for _, s, n in ranges)), tasks))
                self._encode_jobs(jobs)
                bar.update(sum(len(r) for _, r in chunk))
        finally:
            bar.close()
            for f in new:  # interrupted: whatever is left is encoded on demand
                p = pendings[f.id]
                if p.state != "done":
                    self._finish(f.id, p, None)
        with self._lock:
            return [self._item(self._facts.get(f.id, f)) for f in new]

    def _add_inferred(self, texts: list[str], user_id: str, meta: dict[str, Any]) -> list[MemoryItem]:
        if self.engine is None:
            raise InferScaleError("add(..., infer=True) needs an engine to run the extraction model")

        def generate(messages: list[dict[str, str]]) -> str:
            return self._generate(messages, user_id)

        def similar(fact: str) -> list[tuple[str, str]]:
            return [(it.id, it.memory) for it in self.search(fact, user_id=user_id, k=5)]

        out: list[MemoryItem] = []
        for action in extract_actions(generate, texts, similar):
            try:
                if action.event == "ADD":
                    out.extend(self._insert([action.text], user_id, [meta], explicit=None))  # type: ignore[list-item]
                elif action.event == "UPDATE":
                    out.append(self.update(action.fact_id, action.text, user_id=user_id))  # type: ignore[arg-type]
                elif action.event == "DELETE":
                    self.delete(action.fact_id, user_id=user_id)  # type: ignore[arg-type]
            except (FactNotFoundError, ValueError, TypeError) as exc:
                logger.warning("memory extraction: skipping %s: %s", action, exc)
        return out

    def _generate(self, messages: list[dict[str, str]], user_id: str) -> str:
        assert self.engine is not None
        # Conversation text must not be taken for handles by the engine.
        clean = [{"role": m["role"], "content": m["content"].replace("<<mem:", "<< mem:")} for m in messages]
        if getattr(self.engine.tokenizer, "chat_template", None):
            prompt: Any = clean
        else:
            prompt = "\n\n".join(m["content"] for m in clean) + "\n\nReply:\n"
        result = self.engine.generate(prompt, user_id=user_id, max_tokens=self.extraction_max_tokens,
                                      temperature=0.0, mode="prompt")
        return result.text

    # ================================================================== internals: encoding

    def _enqueue(self, jobs: list[tuple[str, int]]) -> None:
        with self._idle:
            self._inflight += len(jobs)
        for n, job in enumerate(jobs):
            while True:
                if self._stopping:
                    with self._idle:
                        self._inflight -= len(jobs) - n
                        self._idle.notify_all()
                    return
                try:
                    self._queue.put(job, timeout=0.1)  # waits while the queue is full (backpressure)
                    break
                except queue.Full:
                    continue

    def _work(self) -> None:
        """Encoder thread: batch what is queued (up to the batch limits) into one engine.encode call."""
        carry: tuple[str, int] | None = None
        while not self._stopping:
            if carry is not None:
                first, carry = carry, None
            else:
                try:
                    first = self._queue.get(timeout=0.1)
                except queue.Empty:
                    continue
            batch = [first]
            tokens = self._job_tokens(first)
            while len(batch) < self.encode_batch and tokens < self.encode_batch_tokens:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                n = self._job_tokens(job)
                if tokens + n > self.encode_batch_tokens:
                    carry = job  # first of the next batch
                    break
                batch.append(job)
                tokens += n
            try:
                jobs = []
                with self._lock:
                    for fact_id, version in batch:
                        p, f = self._pending.get(fact_id), self._facts.get(fact_id)
                        if p is None or f is None or p.version != version or f.kv_version != version or p.state != "queued":
                            continue  # deleted, updated, or taken by a resolve meanwhile
                        p.state = "running"
                        task = self._task(f)
                        jobs.append((EncodeWindow.single(task.token_ids, task.context_ids), [(task, p)]))
                if jobs:
                    self._encode_jobs(jobs)
            except Exception:  # never let the encoder thread die
                logger.exception("memory encoder thread: unexpected error")
            finally:
                with self._idle:
                    self._inflight = max(0, self._inflight - len(batch))
                    self._idle.notify_all()
        if carry is not None:
            with self._idle:
                self._inflight = max(0, self._inflight - 1)
                self._idle.notify_all()

    def _job_tokens(self, job: tuple[str, int]) -> int:
        with self._lock:
            f = self._facts.get(job[0])
            if f is None or f.token_ids is None:
                return 0
            return len(f.token_ids) + len(f.context_ids or ())

    def _task(self, f: FactRow) -> _Task:
        """Under the store lock: the inputs to encode ``f`` with now (window contexts follow the window)."""
        assert f.token_ids is not None and self.max_model_len is not None
        window_changed = f.context_kind != "explicit" and f.context_window != self.window
        if window_changed or (f.context_ids is None and f.context_text is None):
            # The window or prefix changed (both are in the fingerprint): rebuild from the predecessors.
            prev: list[str] = []
            if self.window:
                ids = list(self._user_facts.get(f.user_id, {}))
                at = ids.index(f.id) if f.id in ids else len(ids)
                prev = [self._facts[i].text for i in ids[max(0, at - self.window) : at]]
            f.context_ids, f.context_text = self._fit_context(prev, len(f.token_ids), strict=False, prefix=self.context_prefix)
            f.context_kind, f.context_window = "window", self.window
        elif f.context_ids is None:
            # Re-tokenized for another model: the same context text, with its tokenizer.
            ctx = tuple(int(t) for t in self.engine.tokenize(f.context_text)) if f.context_text else ()  # type: ignore[union-attr]
            f.context_ids = ctx[max(0, len(ctx) + len(f.token_ids) - self.max_model_len + 1) :]
        else:
            return _Task(f.id, f.kv_version, tuple(f.token_ids), tuple(f.context_ids))
        try:
            if not self._db_open:
                raise EngineClosedError("memory store closed")
            with self._db.transaction() as c:
                c.execute(
                    "UPDATE facts SET context_ids=?, context_text=?, context_kind=?, context_window=? WHERE id=?",
                    (ids_to_blob(f.context_ids), f.context_text, f.context_kind, f.context_window, f.id),
                )
        except Exception:
            logger.exception("could not record the new context of memory %s", f.id)
        return _Task(f.id, f.kv_version, tuple(f.token_ids), tuple(f.context_ids))

    def _encode_jobs(self, jobs: list[tuple[EncodeWindow, list[tuple[_Task, _Pending]]]]) -> BaseException | None:
        """Encode windows in one engine call and store every captured span; returns the first error."""
        assert self.engine is not None and self.fingerprint is not None
        try:
            results = self.engine.encode([w for w, _ in jobs])
        except Exception as exc:
            self._fail([tp for _, tps in jobs for tp in tps], exc)
            return exc
        stored: list[tuple[_Task, _Pending]] = []
        error: BaseException | None = None
        for (_, tps), kvs in zip(jobs, results):
            for (task, p), kv in zip(tps, kvs):
                with self._lock:
                    f = self._facts.get(task.fact_id)
                    current = f is not None and f.kv_version == task.version
                if not current:
                    self._finish(task.fact_id, p, None)
                    continue
                try:
                    self.tiers.put(task.key, kv, self.fingerprint)
                except Exception as exc:
                    self._fail([(task, p)], exc)
                    error = error or exc
                else:
                    stored.append((task, p))
        self._commit_encoded(stored)
        return error

    def _commit_encoded(self, stored: list[tuple[_Task, _Pending]]) -> None:
        orphans: list[KVKey] = []
        with self._lock:
            rows = []
            for task, _ in stored:
                f = self._facts.get(task.fact_id)
                if f is None or f.kv_version != task.version:  # deleted / updated while encoding
                    orphans.append(task.key)
                    continue
                f.fingerprint, f.encode_error = self.fingerprint, None
                self._encode_errors.pop(f.id, None)
                rows.append((self.fingerprint, f.id, f.kv_version))
            if rows and self._db_open:
                with self._db.transaction() as c:
                    c.executemany("UPDATE facts SET fingerprint=?, encode_error=NULL WHERE id=? AND kv_version=?", rows)
            for task, p in stored:
                self._finish(task.fact_id, p, None)
        for key in orphans:
            self.tiers.delete_key(key)

    def _fail(self, tasks: list[tuple[_Task, _Pending]], exc: BaseException) -> None:
        msg = f"{type(exc).__name__}: {exc}"
        logger.error("encoding %d memory fact(s) failed (%s); they stay unencoded and are encoded on demand",
                     len(tasks), msg)
        with self._lock:
            rows = []
            for task, p in tasks:
                f = self._facts.get(task.fact_id)
                if f is not None and f.kv_version == task.version:
                    f.encode_error = msg
                    self._encode_errors[f.id] = msg
                    rows.append((msg, f.id))
                self._finish(task.fact_id, p, exc)
            if rows and self._db_open:
                try:
                    with self._db.transaction() as c:
                        c.executemany("UPDATE facts SET encode_error=? WHERE id=?", rows)
                except Exception:
                    logger.exception("could not record the encoding error")

    def _finish(self, fact_id: str, p: _Pending, error: BaseException | None) -> None:
        with self._lock:
            p.error = error
            p.state = "done"
            if self._pending.get(fact_id) is p:
                del self._pending[fact_id]
        p.event.set()

    def _mark_unencoded(self, key: KVKey) -> None:
        with self._lock:
            if not self._db_open:
                return
            f = self._facts.get(key[0])
            if f is not None and f.kv_version == key[1] and f.fingerprint is not None:
                f.fingerprint = None
                with self._db.transaction() as c:
                    c.execute("UPDATE facts SET fingerprint=NULL WHERE id=? AND kv_version=?", (key[0], key[1]))

    def _new_kv_version(self, key: KVKey) -> None:
        with self._lock:
            f = self._facts.get(key[0])
            if f is None or f.kv_version != key[1] or not self._db_open:
                return
            version = f.kv_version + 1
            with self._db.transaction() as c:
                c.execute("UPDATE facts SET kv_version=?, fingerprint=NULL WHERE id=? AND kv_version=?",
                          (version, key[0], key[1]))
            self._facts[key[0]] = dataclasses.replace(f, kv_version=version, fingerprint=None)
            self._retire_pending(key[0])
        self.tiers.delete_key(key)

    def _kv(self, fact_id: str) -> tuple[FactKV, FactRow]:
        """KV of the current version of ``fact_id`` (and that version's record)."""
        deadline = time.monotonic() + self.resolve_timeout
        for _ in range(8):
            self._check_open()
            with self._lock:
                f = self._facts.get(fact_id)
                if f is None:
                    raise FactNotFoundError(f"memory {fact_id} does not exist (it was deleted)")
                snap = dataclasses.replace(f)
            if snap.fingerprint is not None:
                try:
                    if snap.fingerprint != self.fingerprint:
                        raise StaleKVError(f"memory {fact_id} was encoded under fingerprint {snap.fingerprint!r}, "
                                           f"this store serves {self.fingerprint!r}")
                    return self.tiers.get((fact_id, snap.kv_version), self.fingerprint), snap  # type: ignore[arg-type]
                except StaleKVError as exc:
                    # Other KV content under the same span key could be reused from vLLM's prefix
                    # cache: re-encode under a new KV version (new key, new file).
                    logger.warning("%s; re-encoding it with the current engine", exc)
                    self._new_kv_version((fact_id, snap.kv_version))
                except KVMissingError as exc:  # same fingerprint and context: same KV, same version
                    logger.warning("%s; re-encoding it", exc)
                    self._mark_unencoded((fact_id, snap.kv_version))
            with self._lock:
                f = self._facts.get(fact_id)
                if f is None:
                    raise FactNotFoundError(f"memory {fact_id} does not exist (it was deleted)")
                if f.kv_version != snap.kv_version or f.fingerprint == self.fingerprint:
                    continue  # changed meanwhile: look again
                p = self._pending.get(fact_id)
                mine = p is None or p.version != f.kv_version or p.state == "done" or p.state == "queued"
                if mine:
                    if p is None or p.version != f.kv_version or p.state == "done":
                        p = self._pending[fact_id] = _Pending(f.kv_version, "running")
                    p.state = "running"
                    task = self._task(f)
            if mine:  # encode it now, in this thread
                err = self._encode_jobs([(EncodeWindow.single(task.token_ids, task.context_ids), [(task, p)])])
                if err is not None:
                    raise InferScaleError(f"could not encode memory {fact_id}: {err}") from err
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not p.event.wait(remaining):  # type: ignore[union-attr]
                raise KVNotReadyError(
                    f"memory {fact_id} is still being encoded after {self.resolve_timeout:g}s "
                    "(raise MemoryStore.resolve_timeout, or wait_for_encoding() before serving)"
                )
        raise InferScaleError(f"memory {fact_id} kept changing while it was being resolved; try again")


# ====================================================================== helpers


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def _new_hex() -> str:
    return secrets.token_hex(8)


def _check_user(user_id: Any) -> str:
    if (
        not isinstance(user_id, str) or not user_id.strip() or len(user_id) > MAX_USER_ID
        or not user_id.isprintable()
    ):
        raise ValueError(f"user_id must be a non-empty string of at most {MAX_USER_ID} printable characters, "
                         f"got {user_id!r:.80}")
    return user_id


def _check_k(k: Any) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise ValueError(f"k must be an integer from 1 to {MAX_K}, got {k!r}")
    return k


def _check_text(text: Any, what: str = "memory text") -> str:
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"{what} is empty")
    return check_utf8(text, what)


def _texts_of(messages_or_text: Any) -> list[str]:
    if isinstance(messages_or_text, str):
        return [_check_text(messages_or_text)]
    if isinstance(messages_or_text, Mapping):
        messages_or_text = [messages_or_text]
    if not isinstance(messages_or_text, (list, tuple)):
        raise TypeError(f"add() takes a string or a list of message dicts, got {type(messages_or_text).__name__}")
    if not messages_or_text:
        raise ValueError("no messages to add")
    texts = []
    for i, m in enumerate(messages_or_text):
        if not isinstance(m, Mapping):
            raise TypeError(f"message {i} must be a dict with 'role' and 'content', got {type(m).__name__}")
        role, content, name = m.get("role"), m.get("content"), m.get("name")
        if not isinstance(role, str) or not isinstance(content, str):
            raise TypeError(f"message {i} needs string 'role' and 'content'")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"message {i}: 'name' must be a string")
        if not role.strip():
            raise ValueError(f"message {i} has an empty role")
        _check_text(content, f"message {i} content")
        speaker = name.strip() if name and name.strip() else role.strip().capitalize()
        texts.append(f"{speaker}: {content}")
    return texts


def _check_metadata(metadata: Any) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a dict, got {type(metadata).__name__}")
    try:
        return json.loads(json.dumps(dict(metadata)))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"metadata must be JSON-serialisable: {exc}") from None


def _check_context(context: Any) -> list[str] | None:
    if context is None:
        return None
    if isinstance(context, str) or not isinstance(context, (list, tuple)) \
            or not all(isinstance(c, str) for c in context):
        raise TypeError("context must be a list of strings")
    return [check_utf8(c, "context") for c in context]


def _load_secret(path: Path) -> bytes:
    """The store's handle secret: created once (0600, atomically), then read."""
    try:
        secret = path.read_bytes()
    except FileNotFoundError:
        secret = secrets.token_bytes(32)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secret)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # fails if another process created it first
        except FileExistsError:
            secret = path.read_bytes()
        finally:
            tmp.unlink()
    if len(secret) < 32:
        raise InferScaleError(f"handle secret {path} is damaged ({len(secret)} bytes)")
    return secret


def _acquire_lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise InferScaleError(
            f"memory store {path.parent} is already open (in this or another process); close it first"
        ) from None
    return fd


def _release_lock(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
