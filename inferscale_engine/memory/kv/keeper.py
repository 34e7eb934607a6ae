"""The KV of a store's facts: made in the background, in bulk, or on demand; kept in the
tiers; recorded in the database; served to ``resolve``.

Every fact version goes ``queued → running → done``; whoever moves it to ``running`` (the
encoder thread, an import, or a ``resolve`` that cannot wait) encodes it, and everyone else
waits for its event. KV is written to the tiers before the fact is marked encoded, and KV made
under another fingerprint is re-encoded under a new KV version, never served.

:class:`KVKeeper` shares the store's :class:`~inferscale_engine.memory.meta.facts.FactTable` and its
lock (a fact changes under that one lock whether the API or the encoder changes it); it owns
the encoding state and the encode queue.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal

from tqdm.auto import tqdm

from inferscale_engine.errors import EngineClosedError, FactNotFoundError, InferScaleError, KVNotReadyError, StaleKVError
from inferscale_engine.kv import FactKV
from inferscale_engine.memory.text.context import Chunk, ContextBuilder
from inferscale_engine.memory.meta.db import FactRow, MetaDB
from inferscale_engine.memory.kv.encode_queue import EncodeQueue, Job
from inferscale_engine.memory.encoding import Encoder
from inferscale_engine.memory.meta.facts import FactTable
from inferscale_engine.memory.kv.tiers import KVKey, KVMissingError, KVTiers
from inferscale_engine.types import ColdFact, EncodeWindow, Span, TextFact

logger = logging.getLogger(__name__)


def _span_key(fact_id: str, kv_version: int) -> str:
    """The span key of a fact version's KV, which never changes (new KV, new version)."""
    return f"fact:{fact_id}:{kv_version}"


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


class _ColdRead:
    """:class:`~inferscale_engine.types.ColdRead` of one fact version's KV file."""

    def __init__(self, keeper: KVKeeper, fact: FactRow, key: KVKey) -> None:
        self._keeper = keeper
        self._fact = fact
        self._key = key
        self._future: Future[FactKV] | None = None

    @functools.cached_property
    def nbytes(self) -> int:
        return self._keeper.tiers.file_bytes(self._key, len(self._fact.token_ids or ()))

    @functools.cached_property
    def cached(self) -> bool:
        return self._keeper.tiers.disk.cached(self._key)

    def start(self) -> None:
        if self._future is None:
            self._future = self._keeper.tiers.read_async([self._key], self._keeper.fingerprint)[0]

    def wait(self) -> Span | TextFact:
        self.start()
        return self._keeper._load_cold(self._future, self._fact)  # type: ignore[arg-type]

    def promote(self) -> None:
        if self._future is None:
            self._keeper.tiers.prefetch([self._key], self._keeper.fingerprint)


class KVKeeper:
    """Makes, keeps and serves the KV of the facts in ``table`` (under its lock)."""

    def __init__(
        self,
        encoder: Encoder,
        contexts: ContextBuilder,
        fingerprint: str,
        table: FactTable,
        *,
        db: MetaDB,
        tiers: KVTiers,
        queue_size: int,
        batch: int,
        batch_tokens: int,
        resolve_timeout: float,
    ) -> None:
        self.encoder = encoder
        self.contexts = contexts
        self.window = contexts.window
        self.fingerprint = fingerprint
        self.tiers = tiers
        self.encode_batch = batch
        self.encode_batch_tokens = batch_tokens
        self.resolve_timeout = resolve_timeout
        self._table = table
        self._lock = table.lock
        self._facts = table.by_id
        self._db = db
        self._db_open = True
        self._closed = False
        #: Seconds ``resolve`` waits for a fact another thread is encoding before it serves the
        #: fact as text; ``None`` (the library's default): wait up to ``resolve_timeout``, then
        #: KVNotReadyError. The server sets it: under a backed-up encode queue, its chats waited
        #: behind ingestion past 90 s.
        self.serve_as_text_after: float | None = None
        self._pending: dict[str, _Pending] = {}
        self._encode_errors: dict[str, str] = {}
        self._queue = EncodeQueue(self._encode_batch, self._job_tokens, maxsize=queue_size, batch=batch,
                                  batch_tokens=batch_tokens)
        self._queue.start()

    # ------------------------------------------------------------------ the store's calls

    def expect(self, fact_id: str, version: int, *, queued: bool = True) -> _Pending:
        """Under the store lock: ``version`` of ``fact_id`` is to be encoded (by the queue, or
        by the caller: ``queued=False``)."""
        p = self._pending[fact_id] = _Pending(version, "queued" if queued else "running")
        return p

    def enqueue(self, jobs: list[Job]) -> None:
        self._queue.put(jobs)

    def retire(self, fact_id: str) -> None:
        """Under the store lock: ``fact_id`` is gone or has a new version; waiters on its old one wake."""
        self._encode_errors.pop(fact_id, None)
        p = self._pending.pop(fact_id, None)
        if p is not None:
            p.state = "done"
            p.event.set()  # waiters re-read the fact (new version, or gone)

    @property
    def errors(self) -> dict[str, str]:
        with self._lock:
            return dict(self._encode_errors)

    @property
    def queued(self) -> int:
        return self._queue.inflight

    def wait_idle(self, timeout: float | None) -> None:
        self._queue.wait_idle(timeout)

    def encoding_paused(self) -> contextlib.AbstractContextManager[None]:
        """No batch is encoded inside the block (see :meth:`EncodeQueue.paused`)."""
        return self._queue.paused()

    def stop(self) -> int:
        """Refuse new work and let the batch in flight finish; returns how many jobs were dropped."""
        self._closed = True
        return self._queue.stop()

    def close(self) -> None:
        """Under the store lock, before the database closes: wake every waiter, write nothing more."""
        for p in self._pending.values():
            p.event.set()
        self._pending.clear()
        self._db_open = False

    def reencode(self, fact_ids: list[str]) -> int:
        """Queue the facts whose KV is missing or stale (a new KV version for stale KV, as
        :meth:`kv` makes); returns how many."""
        jobs: list[tuple[str, int]] = []
        stale: list[KVKey] = []
        with self._lock:
            rows = []
            for fact_id in fact_ids:
                f = self._facts.get(fact_id)
                if f is None or f.fingerprint == self.fingerprint or fact_id in self._pending:
                    continue
                if f.fingerprint is not None:  # stale KV: new version, as in resolve()
                    stale.append((fact_id, f.kv_version))
                    f = self._facts[fact_id] = dataclasses.replace(f, kv_version=f.kv_version + 1, fingerprint=None)
                    rows.append((f.kv_version, fact_id))
                self.expect(fact_id, f.kv_version)
                jobs.append((fact_id, f.kv_version))
            if rows:
                self._db.new_kv_versions(rows)
        for key in stale:
            self.tiers.delete_key(key)
        self._queue.put(jobs)
        return len(jobs)

    def spans(self, facts: list[FactRow], *, defer_cold: bool = False,
              held: Callable[[str], bool] | None = None) -> list[Span | TextFact]:
        """What the engine injects for each fact: its tokens and their KV (see :meth:`kvs`). A fact
        another thread is still encoding comes back as :class:`TextFact` (its tokens, prefilled):
        a chat never waits behind ingestion for it. ``defer_cold``: a fact whose KV is only in a
        disk file comes back as a :class:`ColdFact`, nothing read yet, for the engine's cost
        model to read (at once where the page cache holds the file) or to prefill instead. ``held``: a
        predicate over span keys; an encoded fact whose key it holds comes back as a held
        :class:`Span` (no KV read from any tier; ``reread`` reads it)."""
        kept: dict[int, Span | TextFact] = {}
        if held is not None:
            for i, f in enumerate(facts):
                key = _span_key(f.id, f.kv_version)
                # Only KV of the current fingerprint: other KV is re-encoded, under a new key.
                if f.fingerprint == self.fingerprint and held(key):
                    kept[i] = Span(key, tuple(f.token_ids or ()), None, f.text,
                                   reread=functools.partial(self._reread, f))
        if defer_cold:
            todo = [i for i in range(len(facts)) if i not in kept]
            kept.update((todo[j], c) for j, c in self._cold([facts[i] for i in todo]).items())
        rest = [f for i, f in enumerate(facts) if i not in kept]
        # Span.stored: each KV's token count was checked against its fact's tokens when encoded
        # (_encode_jobs), and a fact's token ids change only with a new KV version (a new key).
        served = iter([Span.stored(_span_key(f.id, f.kv_version), tuple(f.token_ids or ()), kv, f.text)
                       if kv is not None else TextFact(f.token_ids or ()) for kv, f in self.kvs(rest)])
        return [kept[i] if i in kept else next(served) for i in range(len(facts))]

    def _reread(self, f: FactRow) -> Span | TextFact:
        """A held span of ``f`` (the snapshot it was resolved from) with its KV after all."""
        return self.spans([f])[0]

    def prefetch(self, facts: list[FactRow]) -> int:
        """Start reading the disk-only KV of ``facts`` into the host tier; how many reads started."""
        keys = [(f.id, f.kv_version) for f in facts if f.fingerprint == self.fingerprint]
        return self.tiers.prefetch(keys, self.fingerprint) if keys else 0

    def _cold(self, facts: list[FactRow]) -> dict[int, ColdFact]:
        """The facts (by position) whose KV is only in a disk file, as :class:`ColdFact`
        (nothing read yet: the engine's cost model starts what it needs). No filesystem call:
        an encoded fact has its file (write-through) unless a read found it missing, its size
        follows from its KV, and the page cache is probed (``read.cached``) only for the facts
        the cost model weighs reading."""
        ready = [i for i, f in enumerate(facts) if f.fingerprint == self.fingerprint]
        keys: list[KVKey] = [(facts[i].id, facts[i].kv_version) for i in ready]
        return {i: ColdFact(facts[i].token_ids or (), _ColdRead(self, facts[i], key))
                for i, key, tier in zip(ready, keys, self.tiers.where_many(keys, check_disk=False))
                if tier == "disk"}

    def _load_cold(self, future: Future[FactKV], f: FactRow) -> Span | TextFact:
        """A cold fact's span once its read is done; a file that turned out unusable goes the
        fact-by-fact way (:meth:`kv`: re-encoded, or served as text)."""
        try:
            kv: FactKV | None = future.result()
        except (KVMissingError, StaleKVError):
            kv, f = self.kv(f.id)
        if kv is None:
            return TextFact(f.token_ids or ())
        return Span(key=_span_key(f.id, f.kv_version), token_ids=tuple(f.token_ids or ()), kv=kv, text=f.text)

    def kvs(self, facts: list[FactRow]) -> list[tuple[FactKV | None, FactRow]]:
        """KV of each fact (snapshots of live rows), read in one batch from the tiers; what is
        not encoded yet, or whose KV needs repair, goes through :meth:`kv` one by one (``None``:
        serve it as text, see :meth:`kv`)."""
        kvs: list[FactKV | None] = [None] * len(facts)
        ready = [i for i, f in enumerate(facts) if f.fingerprint == self.fingerprint]
        keys: list[KVKey] = [(facts[i].id, facts[i].kv_version) for i in ready]
        try:
            got = self.tiers.get_many(keys, self.fingerprint) if keys else []
            for i, kv in zip(ready, got):
                kvs[i] = kv
        except (KVMissingError, StaleKVError):
            pass  # the fact-by-fact path repairs (re-encodes) what is missing or stale
        return [(kv, f) if kv is not None else self.kv(f.id) for f, kv in zip(facts, kvs)]

    def encode_now(self, new: list[FactRow], chunks: list[Chunk], pendings: dict[str, _Pending], *,
                   progress: bool) -> None:
        """Bulk import: encode new facts in this thread, in batches, with a progress bar; ``chunks``
        as :meth:`ContextBuilder.sliding` planned them, or none for one prefill per fact."""
        if not chunks:
            chunks = Chunk.per_fact([f.context_ids for f in new], [f.token_ids for f in new])  # type: ignore[misc]
        # Batches obey the same limits as the encoder thread, so chat requests interleave.
        batches: list[list[Chunk]] = [[]]
        tokens = 0
        for chunk in chunks:
            n = len(chunk.window.token_ids)
            if batches[-1] and (len(batches[-1]) >= self.encode_batch or tokens + n > self.encode_batch_tokens):
                batches.append([])
                tokens = 0
            batches[-1].append(chunk)
            tokens += n
        bar = tqdm(total=len(new), desc="encoding memories", unit="fact", disable=not progress)
        try:
            for batch in batches:
                jobs = []
                for chunk in batch:
                    ids = chunk.window.token_ids
                    tasks = [(_Task(new[i].id, 1, tuple(new[i].token_ids), ids[:s]), pendings[new[i].id])  # type: ignore[arg-type]
                             for i, (s, _) in zip(chunk.facts, chunk.window.ranges)]
                    jobs.append((chunk.window, tasks))
                self._encode_jobs(jobs)
                bar.update(sum(len(c.facts) for c in batch))
        finally:
            bar.close()
            for f in new:  # interrupted: whatever is left is encoded on demand
                p = pendings[f.id]
                if p.state != "done":
                    self._finish(f.id, p, None)

    # ------------------------------------------------------------------ encoding

    def _encode_batch(self, batch: list[Job]) -> None:
        """The encoder thread's work: encode the jobs no one changed or took meanwhile."""
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

    def _job_tokens(self, job: Job) -> int:
        with self._lock:
            f = self._facts.get(job[0])
            if f is None or f.token_ids is None:
                return 0
            return len(f.token_ids) + len(f.context_ids or ())

    def _task(self, f: FactRow) -> _Task:
        """Under the store lock: the inputs to encode ``f`` with now (window contexts follow the window)."""
        assert f.token_ids is not None and self.contexts is not None
        window_changed = f.context_kind != "explicit" and f.context_window != self.window
        if window_changed or (f.context_ids is None and f.context_text is None):
            # The window or prefix changed (both are in the fingerprint): rebuild from the predecessors.
            ctx = self.contexts.window_context(self._table.texts_before(f, self.window), len(f.token_ids))
            f.context_ids, f.context_text = ctx.ids, ctx.text
            f.context_kind, f.context_window = "window", self.window
        elif f.context_ids is None:
            # Re-tokenized for another model: the same context text, with its tokenizer.
            f.context_ids = self.contexts.retokenized(f.context_text, len(f.token_ids))
        else:
            return _Task(f.id, f.kv_version, tuple(f.token_ids), tuple(f.context_ids))
        try:
            if not self._db_open:
                raise EngineClosedError("memory store closed")
            self._db.set_context(f)
        except Exception:
            logger.exception("could not record the new context of memory %s", f.id)
        return _Task(f.id, f.kv_version, tuple(f.token_ids), tuple(f.context_ids))

    def _encode_jobs(self, jobs: list[tuple[EncodeWindow, list[tuple[_Task, _Pending]]]],
                     unstored: dict[KVKey, FactKV] | None = None) -> BaseException | None:
        """Encode windows in one encoder call and store every captured span; returns the first error.

        KV that was encoded but could not be written (a full or read-only disk) goes into
        ``unstored``, when given, so the caller can still serve it."""
        assert self.encoder is not None and self.fingerprint is not None
        try:
            # Keyed as they will be served: a multiprocess engine keeps each one staged for its
            # first request (a memory is often asked about right after it is added).
            results = self.encoder.encode([w for w, _ in jobs], keys=[[_span_key(t.fact_id, t.version) for t, _ in tps]
                                                                      for _, tps in jobs])
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
                if kv.num_tokens != len(task.token_ids):
                    # Checked here, once, rather than on every request that serves it (Span.stored).
                    wrong = ValueError(f"the encoder returned KV of {kv.num_tokens} tokens for memory "
                                       f"{task.fact_id} of {len(task.token_ids)} tokens")
                    self._fail([(task, p)], wrong)
                    error = error or wrong
                    continue
                try:
                    self.tiers.put(task.key, kv, self.fingerprint)
                except Exception as exc:
                    self._fail([(task, p)], exc)
                    error = error or exc
                    if unstored is not None and isinstance(exc, OSError):
                        unstored[task.key] = kv
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
                rows.append((f.id, f.kv_version))
            if rows and self._db_open:
                self._db.mark_encoded(self.fingerprint, rows)
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
                    self._db.set_encode_errors(rows)
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
                self._db.mark_unencoded(*key)

    def _new_kv_version(self, key: KVKey) -> None:
        with self._lock:
            f = self._facts.get(key[0])
            if f is None or f.kv_version != key[1] or not self._db_open:
                return
            version = f.kv_version + 1
            self._db.new_kv_version(key[0], key[1], version)
            self._facts[key[0]] = dataclasses.replace(f, kv_version=version, fingerprint=None)
            self.retire(key[0])
        self.tiers.delete_key(key)

    def kv(self, fact_id: str) -> tuple[FactKV | None, FactRow]:
        """KV of the current version of ``fact_id`` (and that version's record); ``None`` when
        another thread is still encoding it after ``serve_as_text_after`` seconds."""
        deadline = time.monotonic() + self.resolve_timeout
        for _ in range(8):
            if self._closed:
                raise EngineClosedError("this memory store was closed")
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
                    return self.tiers.get((fact_id, snap.kv_version), self.fingerprint), snap
                except StaleKVError as exc:
                    # Other KV content under the same span key could be reused from vLLM's prefix
                    # cache: re-encode under a new KV version (new key, new file).
                    logger.warning("%s; re-encoding it with the current encoder", exc)
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
                # Not mine: another thread is encoding this version; wait for its p.event below.
                mine = p is None or p.version != f.kv_version or p.state == "done" or p.state == "queued"
                if p is None or p.version != f.kv_version or p.state == "done":
                    p = self._pending[fact_id] = _Pending(f.kv_version, "running")
                if mine:
                    p.state = "running"
                    task = self._task(f)
            if mine:  # encode it now, in this thread
                unstored: dict[KVKey, FactKV] = {}
                err = self._encode_jobs([(EncodeWindow.single(task.token_ids, task.context_ids), [(task, p)])],
                                        unstored)
                if task.key in unstored:
                    # The add was acknowledged: a disk that cannot take its KV (full, read-only)
                    # must not make the handle fail. Served from this encode; the next request
                    # encodes again until a write succeeds.
                    logger.warning("serving memory %s without storing its KV: %s", fact_id, err)
                    return unstored[task.key], snap
                if err is not None:
                    raise InferScaleError(f"could not encode memory {fact_id}: {err}") from err
                continue
            remaining = deadline - time.monotonic()
            patience = remaining if self.serve_as_text_after is None else min(remaining, self.serve_as_text_after)
            if patience > 0 and p.event.wait(patience):
                continue
            if self.serve_as_text_after is not None:
                return None, snap
            raise KVNotReadyError(
                f"memory {fact_id} is still being encoded after {self.resolve_timeout:g}s "
                "(raise MemoryStore.resolve_timeout, or wait_for_encoding() before serving)"
            )
        raise InferScaleError(f"memory {fact_id} kept changing while it was being resolved; try again")
