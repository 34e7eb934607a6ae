"""Where fact KV lives: a paged device slab, a host tier and a disk tier, one class each behind
one small interface (:mod:`.backend`), coordinated by :class:`KVTiers`.

* **Device tier** (:class:`~.device_tier.DeviceTier`) – one slab preallocated on first use,
  shaped ``[num_pages, layers, 2, page_tokens, kv_heads, head_dim]``: a fact of ``n`` tokens takes
  ``ceil(n / page_tokens)`` pages from a free list, so nothing is allocated per fact. On a CPU
  engine the "device" is the CPU and the slab is an ordinary tensor.
* **Host tier** (:class:`~.host_tier.HostTier`) – pages in the slab's layout in CPU memory
  (pinned when CUDA is available), allocated ``HOST_CHUNK_BYTES`` at a time as the tier fills, up
  to ``host_bytes``, with their own free list. Facts move between the memory tiers as page copies
  queued on CUDA streams (:class:`~.pages.PageMover`), one ``cudaMemcpyBatchAsync`` per batch of
  facts (a range per run of consecutive pages): a promotion copies host pages straight into the
  slab pages it takes (side stream); an eviction gathers its slab pages into a device buffer
  (side stream) and copies that down on a stream of its own, so a promotion into the freed pages
  waits for a device-side copy, not for PCIe. Nothing waits on the host for either; the slab's
  readers and writers on the caller's stream wait for the side stream's last copy on the device,
  a copy waits for their last access, and a promotion waits for the eviction still writing its
  host pages.
* **Disk tier** (:class:`~.disk_tier.DiskTier`) – one safetensors file per fact version, written
  atomically and carrying the model fingerprint. Disk is write-through and unbounded: every
  encoded fact has its file before it enters memory, so the memory tiers are pure caches.

Each tier answers ``contains`` / ``put`` / ``get`` / ``remove`` / ``stats`` / ``close`` for itself
alone (:class:`~.backend.TierBackend`); all three are built from one
:class:`~.backend.TierConfig`. What is between tiers is :class:`KVTiers`'s: promotion, eviction
and their order, the budgets, the disk readers, and the one lock every tier is called under.

Memory tiers are LRU: a ``put`` or a promotion lands on the device; the device evicts its least
recently used fact to the host (never one the same ``get_many`` serves), the host drops its least
recently used fact (the disk still holds it). A fact promoted from the host keeps its host pages
while the host tier has room for them (a key's KV never changes): evicting it again, as a working
set larger than the slab does at every request, is then bookkeeping, not a copy. The host tier
takes those pages back, oldest promotion first, before it drops any fact of its own: kept pages
only use room the host would otherwise leave free. ``get_many`` returns its facts as rows of
*one copy* gathered from the slab for all of them (one kernel whatever ``k``), so a span in
flight never sees its pages reused. Bytes are never converted: KV read back from any tier is
``torch.equal`` to what was put.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Literal, Unpack

import torch

from inferscale_engine.errors import KVMissingError
from inferscale_engine.kv import FactKV
from inferscale_engine.memory.kv.backend import (
    KVKey,
    Tier,
    TierBackend,
    TierConfig,
    TierSettings,
    check_fingerprint,
)
from inferscale_engine.memory.kv.device_tier import DeviceTier
from inferscale_engine.memory.kv.disk_tier import DiskTier
from inferscale_engine.memory.kv.host_tier import HostTier
from inferscale_engine.memory.kv.pages import Entry, PageLayout, PageMover, take

__all__ = ["KVKey", "KVMissingError", "KVTiers", "Tier"]

logger = logging.getLogger(__name__)


class KVTiers:
    """Device / host / disk KV storage of one memory store. Thread-safe."""

    def __init__(self, root: str | os.PathLike, **settings: Unpack[TierSettings]) -> None:
        """Tiers over the disk folder ``root``, built from ``TierConfig.of(root, **settings)``."""
        self.config = config = TierConfig.of(root, **settings)
        self.device = config.device
        self.pin_memory = config.pin_memory
        self.device_bytes = config.device_bytes
        self.host_bytes = config.host_bytes
        self.page_tokens = config.page_tokens
        self.read_threads = config.read_threads
        self.layout = PageLayout(config.page_tokens)
        #: The copies between the memory tiers, and the CUDA streams they run on.
        self.mover = PageMover(config.device, self.layout)
        self.device_tier = DeviceTier(config, self.layout, self.mover)
        self.host_tier = HostTier(config, self.layout, self.mover)
        self.disk = DiskTier.of(config)
        #: Fastest first.
        self.backends: tuple[TierBackend, ...] = (self.device_tier, self.host_tier, self.disk)
        self.root = self.disk.root
        # Disk reads run on a pool: a request's cold facts are read in parallel (NVMe needs a
        # deep queue; the checksum and finiteness checks release the GIL), and reads for facts a
        # request recomputes instead, or prefetches, finish in the background.
        self._pool: ThreadPoolExecutor | None = None
        # Prefetches and promotions of facts a request prefilled: a few threads, so that their
        # Python work (GIL) barely slows the requests running meanwhile.
        self._background: ThreadPoolExecutor | None = None
        self._reading: dict[KVKey, Future[None]] = {}  # background reads into a memory tier
        self._missing: set[KVKey] = set()  # files a read found missing since their last put
        self._lock = threading.RLock()
        # Device facts that keep the host pages they were promoted from, oldest promotion first:
        # the host takes those back in this order, without a walk over the whole device tier.
        self._kept: OrderedDict[KVKey, list[int]] = OrderedDict()
        #: device_to_host counts every fact evicted to the host; device_to_host_kept those of them
        #: that took back the host pages they were promoted from (no copy).
        # host_to_device_copies: the copies (ranges of pages) promotions took, about one per run
        # of facts lying together on both sides: what a promotion's host time grows with.
        self.counters = {"host_to_device": 0, "host_to_device_copies": 0, "device_to_host": 0,
                         "device_to_host_kept": 0}

    # ------------------------------------------------------------------ public API

    def put(self, key: KVKey, kv: FactKV, fingerprint: str) -> None:
        """Store ``kv`` durably on disk, then cache it on the device."""
        self._check_geometry(kv)
        self.disk.put(key, kv, fingerprint)
        with self._lock:
            self._missing.discard(key)
            self._drop_memory(key)
            self._insert(key, self.layout.to_pages(kv.k, kv.v), kv.num_tokens, kv.position, fingerprint)

    def get(self, key: KVKey, fingerprint: str) -> FactKV:
        """KV of ``key`` (see :meth:`get_many`)."""
        return self.get_many([key], fingerprint)[0]

    def get_many(self, keys: list[KVKey], fingerprint: str) -> list[FactKV]:
        """KV of each key on the device, for injection, as rows of one copy gathered from the
        slab: host-tier facts are copied into the slab first (asynchronously on CUDA: the
        gather waits for those copies on the device, not on the host), disk-tier facts are read
        and cached on the device.

        Raises :class:`KVMissingError` when no tier has a key and :class:`StaleKVError` when
        its stored KV was made under another model fingerprint.
        """
        out: list[FactKV | None] = [None] * len(keys)
        with self._lock:
            device, host = self.device_tier.entries, self.host_tier.entries
            on_device: list[tuple[int, Entry]] = []
            on_host: dict[KVKey, list[int]] = {}
            for i, key in enumerate(keys):
                entry = device.get(key)
                if entry is not None:
                    check_fingerprint(key, entry.fingerprint, fingerprint, "device tier")
                    device.move_to_end(key)
                    on_device.append((i, entry))
                    continue
                held = host.get(key)
                if held is not None:
                    check_fingerprint(key, held.fingerprint, fingerprint, "host tier")
                    on_host.setdefault(key, []).append(i)
            if on_host:
                promoted, served = self._promote(list(on_host), keep={keys[i] for i, _ in on_device})
                for key, entry in promoted.items():
                    for i in on_host[key]:
                        on_device.append((i, entry))
                for key, kv in served.items():
                    for i in on_host[key]:
                        out[i] = kv
            for (i, _), kv in zip(on_device, self.device_tier.read([e for _, e in on_device])):
                out[i] = kv
        cold = [i for i in range(len(keys)) if out[i] is None]
        if len(cold) == 1:
            out[cold[0]] = self._get_from_disk(keys[cold[0]], fingerprint)
        elif cold:
            for i, future in zip(cold, self.read_async([keys[i] for i in cold], fingerprint)):
                out[i] = future.result()
        return out  # type: ignore[return-value]

    def read_async(self, keys: Sequence[KVKey], fingerprint: str) -> list[Future[FactKV]]:
        """Read disk-tier facts on the reader pool, in this order, each cached on the device
        when read: futures of their KV (as :meth:`get_many` returns it), which raise what
        :meth:`get_many` would. A request that does not wait for them still has them promoted."""
        pool = self._readers()
        futures = []
        with self._lock:
            for key in keys:
                reading = self._reading.get(key)  # a prefetch into the host tier: served from there
                if reading is not None:
                    futures.append(pool.submit(self._after, reading, key, fingerprint))
                else:
                    futures.append(pool.submit(self._get_from_disk, key, fingerprint))
        return futures

    def prefetch(self, keys: Sequence[KVKey], fingerprint: str) -> int:
        """Start reading the disk-tier facts among ``keys`` into the host tier in the background
        (a user's session is starting, a search just picked them); returns how many reads
        started. Facts already in memory or on their way there are left alone."""
        started = 0
        with self._lock:
            if self.host_bytes < self.layout.page_bytes:
                return 0
            device, host = self.device_tier.entries, self.host_tier.entries
            for key in keys:
                if key in device or key in host or key in self._reading:
                    continue
                future = self._background_readers().submit(self._read_to_host, key, fingerprint)
                self._reading[key] = future
                started += 1
        return started

    def where_many(self, keys: Sequence[KVKey], *, check_disk: bool = True) -> list[Tier | None]:
        """:meth:`where` of every key, memory tiers read under one lock. ``check_disk=False``
        asks the filesystem nothing (a request may name 200 files): a key in no memory tier is
        on disk unless a read found its file missing since it was last put. That is for keys
        whose files were written (an encoded fact: the disk tier is write-through); a file
        removed behind the store's back is found missing by the read that needed it."""
        with self._lock:
            device, host = self.device_tier.entries, self.host_tier.entries
            found: list[Tier | None] = [
                "device" if key in device else "host" if key in host else None for key in keys]
            if not check_disk:
                return [t if t is not None else None if key in self._missing else "disk"
                        for t, key in zip(found, keys)]
        return [t if t is not None else ("disk" if self.disk.contains(key) else None) for t, key in zip(found, keys)]

    def file_bytes(self, key: KVKey, num_tokens: int) -> int:
        """Bytes a read of ``key``'s file (``num_tokens`` tokens of KV) brings in: from the KV
        geometry once any fact was stored or read (no filesystem call), else the file's size."""
        # No lock: set once and never changed, and the cost model asks this on a request's
        # path, where a background read holding the lock would make it wait.
        nbytes = self.layout.fact_bytes(num_tokens)
        return self.disk.nbytes(key) if nbytes is None else nbytes

    def close(self) -> None:
        """Stop the reader pool; reads already running finish."""
        for pool in (self._pool, self._background):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self._pool = self._background = None
        for backend in self.backends:
            backend.close()

    def where(self, key: KVKey) -> Tier | None:
        """The fastest tier holding ``key``."""
        with self._lock:
            for backend in self.backends[:2]:  # the memory tiers; the disk asks the filesystem
                if backend.contains(key):
                    return backend.name
        return "disk" if self.disk.contains(key) else None

    def evict(self, key: KVKey, to: Literal["host", "disk"] = "host") -> None:
        """Move ``key`` down to ``to`` (for tests and benchmarks; LRU does this on its own)."""
        with self._lock:
            if to == "disk":
                self._drop_memory(key)
            elif self.device_tier.contains(key):
                self._evict([key])

    def drop_memory(self) -> None:
        """Forget every cached copy (device and host); disk keeps everything."""
        with self._lock:
            for key in list(self.device_tier.entries) + list(self.host_tier.entries):
                self._drop_memory(key)

    def delete(self, fact_id: str) -> None:
        """Free every version of ``fact_id`` in every tier, its disk files included."""
        with self._lock:
            held = (*self.device_tier.entries, *self.host_tier.entries, *self._missing)
            for key in [k for k in held if k[0] == fact_id]:
                self._drop_memory(key)
                self._missing.discard(key)
            self.disk.remove_fact(fact_id)

    def delete_key(self, key: KVKey) -> None:
        """Free one version of a fact in every tier."""
        with self._lock:
            self._drop_memory(key)
            self._missing.discard(key)
            self.disk.remove(key)

    def path(self, key: KVKey) -> Path:
        return self.disk.path(key)

    def read_metadata(self, key: KVKey) -> dict[str, str] | None:
        return self.disk.read_metadata(key)

    def sweep(self, live: Mapping[str, int]) -> tuple[set[KVKey], int]:
        """Remove temp files and KV files of no live fact version; return (files kept, removed)."""
        with self._lock:
            return self.disk.sweep(live)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                **self.device_tier.stats(),
                **self.host_tier.stats(),
                # Host pages device facts keep from their promotion (taken back for room).
                "host_backup_bytes": sum(len(pages) for pages in self._kept.values()) * self.layout.page_bytes,
                **self.disk.stats(),
                **self.counters,
            }

    @property
    def page_bytes(self) -> int | None:
        return self.layout.page_bytes or None

    # ------------------------------------------------------------------ disk reads

    def _readers(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.read_threads, thread_name_prefix="inferscale-disk")
            return self._pool

    def _background_readers(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._background is None:
                self._background = ThreadPoolExecutor(min(4, self.read_threads),
                                                      thread_name_prefix="inferscale-disk-background")
            return self._background

    def _after(self, reading: Future[None], key: KVKey, fingerprint: str) -> FactKV:
        """``key``'s KV once the prefetch reading it is done (from the tier it put it in)."""
        try:
            reading.result()
        except Exception:
            pass  # the read below says why, or reads the file itself
        return self.get_many([key], fingerprint)[0]

    def _read_to_host(self, key: KVKey, fingerprint: str) -> None:
        """Read a fact file into the host tier (a prefetch: the device slab keeps what requests use)."""
        read = None
        try:
            k, v, position = self.disk.get_blocking(key, fingerprint)
            self._check_geometry(FactKV(k, v, position))
            read = (self.layout.to_pages(k, v), k.shape[1], position)
        except Exception as exc:  # the request that needs it reads it again and repairs it
            logger.info("prefetch of fact %s v%d failed: %s", key[0], key[1], exc)
            if isinstance(exc, KVMissingError):
                self._found_missing(key)
        with self._lock:
            # The read stops counting as one in the step that puts its fact in the host tier: a
            # caller that sees it there and evicts it must find no read in flight, or its next
            # prefetch would skip the fact, which then never leaves the disk.
            self._reading.pop(key, None)
            if read is None or self.device_tier.contains(key) or self.host_tier.contains(key) \
                    or not self.disk.contains(key):
                return
            self._insert_host(key, *read, fingerprint)

    def _found_missing(self, key: KVKey) -> None:
        """A read found ``key``'s file missing or unusable: ``where_many(check_disk=False)``
        stops taking it to be on disk until it is put again."""
        with self._lock:
            self._missing.add(key)

    def _get_from_disk(self, key: KVKey, fingerprint: str) -> FactKV:
        try:
            k, v, position = self.disk.get_blocking(key, fingerprint)
        except KVMissingError:
            self._found_missing(key)
            raise
        self._check_geometry(FactKV(k, v, position))  # a store reopened reads before it writes
        if self.mover.cuda:  # from the pinned read buffer, a DMA; the page layout is made on the device
            k, v = k.to(self.device, non_blocking=True), v.to(self.device, non_blocking=True)
        pages = self.layout.to_pages(k, v)  # outside the lock: other readers insert meanwhile
        with self._lock:
            if self.device_tier.contains(key) or self.host_tier.contains(key):  # another thread loaded it meanwhile
                return self.get_many([key], fingerprint)[0]
            if not self.disk.contains(key):  # deleted while we read it: serve, but do not cache
                return FactKV(k.to(self.device), v.to(self.device), position)
            self._insert(key, pages, k.shape[1], position, fingerprint)
            entry = self.device_tier.entries.get(key)
            if entry is not None:
                return self.device_tier.read([entry])[0]
        # Too large for the slab: served from the file (the host tier may keep a copy).
        return FactKV(k.to(self.device), v.to(self.device), position)

    # ------------------------------------------------------------------ between the memory tiers

    def _check_geometry(self, kv: FactKV) -> None:
        with self._lock:
            if self.layout.fix(kv):
                self.device_tier.allocate()
                self.host_tier.allocate()
                logger.info(
                    "KV device slab: %d pages of %d tokens (%.1f MiB) on %s; host tier: up to %d pages",
                    self.device_tier.pages_total, self.page_tokens,
                    self.device_tier.pages_total * self.layout.page_bytes / 2**20, self.device,
                    self.host_tier.pages_total,
                )

    def _insert(self, key: KVKey, pages: torch.Tensor, n: int, position: int, fingerprint: str) -> None:
        """Cache a fact's pages on the device slab, making room there (lock held)."""
        need = pages.shape[0]
        if need > self.device_tier.pages_total:  # larger than the whole slab: the host serves it
            self._insert_host(key, pages, n, position, fingerprint)
            return
        self._make_room(need, keep=set())
        self.device_tier.insert(key, pages, n, position, fingerprint)

    def _insert_host(self, key: KVKey, pages: torch.Tensor, n: int, position: int, fingerprint: str) -> None:
        """Put a fact's pages in the host tier, written from the host (lock held); the disk has
        it when the host has no room."""
        self.host_tier.insert(key, pages, n, position, fingerprint, take_back=self._release_backup)

    def _drop_memory(self, key: KVKey) -> None:
        if self.device_tier.remove(key):
            self.host_tier.free += self._kept.pop(key, ())
        self.host_tier.remove(key)

    def _promote(self, keys: list[KVKey], keep: set[KVKey]) -> tuple[dict[KVKey, Entry], dict[KVKey, FactKV]]:
        """Move host-tier facts into slab pages (lock held), evicting device facts not in
        ``keep`` for room; return the new device entries, and the KV of facts the slab could
        not take, which stay on the host and are served from there."""
        device, host = self.device_tier, self.host_tier
        hosts = [host.entries.pop(key) for key in keys]
        self._make_room(sum(len(h.pages) for h in hosts), keep)
        promoted: dict[KVKey, Entry] = {}
        served: dict[KVKey, FactKV] = {}
        room = len(device.free)
        fits: list[tuple[KVKey, Entry]] = []
        for key, h in zip(keys, hosts):
            if len(h.pages) > room:
                host.entries[key] = h
                served[key] = host.read(h)
                continue
            room -= len(h.pages)
            fits.append((key, h))
        if not fits:
            return promoted, served
        # In host-page order, into slab pages taken in one piece: facts that lie one after the
        # other on the host (evicted or prefetched together) copy as one range, whatever order
        # the request names them in (a prefetch's parallel reads land in completion order).
        to_pages = sorted(take(device.free, len(device.free) - room))
        from_pages: list[int] = []
        slab_pages: dict[KVKey, list[int]] = {}
        for key, h in sorted(fits, key=lambda kh: kh[1].pages[0]):
            slab_pages[key] = to_pages[len(from_pages) : len(from_pages) + len(h.pages)]
            from_pages += h.pages
        self.mover.wait_written(hosts)
        assert device.pool is not None  # a fact fit in free slab pages: the slab exists
        # Queued before the bookkeeping: the sooner the DMA starts, the sooner its tail lands.
        self.counters["host_to_device_copies"] += self.mover.copy(device.pool, to_pages, host.pool, from_pages)
        for key, h in fits:  # in the request's order, which later evictions go by (_kept)
            # The entry moves to the device. Its host pages stay the fact's: an eviction back is
            # then bookkeeping. Taken back for room only after this copy is queued, so a copy
            # into them is queued after it.
            self._kept[key] = h.pages
            h.pages = slab_pages[key]
            promoted[key] = h
        device.entries.update(promoted)
        self.counters["host_to_device"] += len(promoted)
        return promoted, served

    def _make_room(self, need: int, keep: set[KVKey]) -> None:
        """Evict least recently used device facts not in ``keep`` until ``need`` slab pages are
        free, or no other fact is left (lock held)."""
        victims = self.device_tier.lru(need, keep)
        if victims:
            self._evict(victims)

    def _evict(self, keys: list[KVKey]) -> None:
        """Move device facts to the host tier (lock held): those promoted from there take back the
        host pages still holding them; the others are copied, one batch for all of them, queued
        on CUDA streams, so no one waits for it on the host. Their slab pages are free at once
        (later slab writes queue after the copies out of them)."""
        device, host = self.device_tier, self.host_tier
        entries = [device.entries.pop(key) for key in keys]
        # Taken first, so that room made for a later fact of this batch never takes them back.
        backups = [self._kept.pop(key, None) for key in keys]
        kept: list[tuple[KVKey, Entry]] = []
        copied: list[tuple[KVKey, Entry]] = []
        to_pages: list[int] = []
        from_pages: list[int] = []
        for key, e, backup in zip(keys, entries, backups):
            if backup is not None:
                kept.append((key, Entry(backup, e.num_tokens, e.position, e.fingerprint)))
                continue
            pages = host.take_pages(len(e.pages), self._release_backup)
            if pages is None:  # the disk has it
                continue
            to_pages += pages
            from_pages += e.pages
            copied.append((key, Entry(pages, e.num_tokens, e.position, e.fingerprint)))
        if copied:
            assert device.slab is not None and device.pool is not None  # the pages are evicted from the slab
            written = self.mover.copy_out(host.pool, to_pages, device.slab, device.pool, from_pages)
            copied = [(key, replace(e, written=written)) for key, e in copied]
        # Entered only now, so a later fact of this batch cannot drop them to make room.
        host.entries.update(kept + copied)
        self.counters["device_to_host"] += len(kept) + len(copied)
        self.counters["device_to_host_kept"] += len(kept)
        device.free += [p for e in entries for p in e.pages]

    def _release_backup(self) -> bool:
        """Give the host the pages the device fact promoted longest ago still keeps (lock
        held); False when none keeps any."""
        if not self._kept:
            return False
        _, pages = self._kept.popitem(last=False)
        self.host_tier.free += pages
        return True
