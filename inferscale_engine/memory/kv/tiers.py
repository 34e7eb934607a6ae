"""Where fact KV lives: a paged device slab, a host tier and a disk tier.

* **Device tier** – one slab preallocated on first use (``torch.empty``), shaped
  ``[num_pages, layers, 2, page_tokens, kv_heads, head_dim]``: a fact of ``n`` tokens takes
  ``ceil(n / page_tokens)`` pages from a free list, so nothing is allocated per fact. On a CPU
  engine the "device" is the CPU and the slab is an ordinary tensor.
* **Host tier** – pages in the slab's layout in CPU memory (pinned when CUDA is available),
  allocated :data:`HOST_CHUNK_BYTES` at a time as the tier fills, up to ``host_bytes``, with
  their own free list. Facts move between the tiers as page copies queued on CUDA streams,
  one ``cudaMemcpyBatchAsync`` per batch of facts (a range per run of consecutive pages): a
  promotion copies host pages straight into the slab pages it takes (side stream); an eviction
  gathers its slab pages into a device buffer (side stream) and copies that down on a stream
  of its own, so a promotion into the freed pages waits for a device-side copy, not for PCIe.
  Nothing waits on the host for either; the slab's readers and writers on the caller's stream
  wait for the side stream's last copy on the device, a copy waits for their last access
  (:meth:`KVTiers._copy`), and a promotion waits for the eviction still writing its host pages.
* **Disk tier** (:class:`~inferscale_engine.memory.kv.disk_tier.DiskTier`) – one safetensors file
  per fact version, written atomically and carrying the model fingerprint. Disk is
  write-through and unbounded: every encoded fact has its file before it enters memory, so the
  memory tiers are pure caches.

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

Every tier answers the same small interface (LMCache's storage backends have its shape):

* ``contains(key)`` – whether the tier holds ``key`` (memory tiers: an entry; disk: a file);
* ``put(key, kv, fingerprint)`` – store ``kv`` there if the tier has room for it, saying whether it
  did (the memory tiers never make room on their own: moving a fact down is the coordinator's);
* ``get(key, fingerprint)`` – the KV, ``torch.equal`` to what was put, from that tier alone (no
  promotion); :class:`KVMissingError` when the tier lacks ``key``, :class:`StaleKVError` when it
  was made under another fingerprint;
* ``remove(key)`` – free what the tier holds of ``key``, saying whether it held any;
* ``close()`` and ``stats()``.

What is not per tier stays with the coordinator: promotion and eviction between tiers, their
order (LRU, kept host pages), the budgets, the disk readers and the lock.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np
import torch

from inferscale_engine.kv import FactKV
from inferscale_engine.memory.kv.disk_tier import DiskTier, KVKey, KVMissingError, check_fingerprint
from inferscale_engine.memory.kv.dma import ByteCopier, Sources

__all__ = ["KVKey", "KVMissingError", "KVTiers", "Tier"]

logger = logging.getLogger(__name__)

Tier = Literal["device", "host", "disk"]

#: Host-tier pages are pinned this many bytes at a time, as the tier fills.
HOST_CHUNK_BYTES = 64 << 20


@dataclass
class _Entry:
    """A fact cached in a memory tier: the pages it holds in that tier's slab."""

    pages: list[int]
    num_tokens: int
    position: int
    fingerprint: str
    #: CUDA, host tier: the eviction copy writing these pages, until it is known to be done.
    written: _Written | None = None
    #: Device tier: host pages still holding this fact's bytes (it was promoted from there).
    backup: list[int] | None = None


@dataclass(frozen=True)
class _Written:
    """An eviction's copy to the host: its event, and its place in the order evictions are
    queued on their one stream (a later one ends after every earlier one)."""

    seq: int
    event: torch.cuda.Event


class KVTiers:
    """Device / host / disk KV storage of one memory store. Thread-safe."""

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        device: str | torch.device = "cpu",
        device_bytes: int = 512 << 20,
        host_bytes: int = 2 << 30,
        page_tokens: int = 16,
        pin_memory: bool | None = None,
        read_threads: int = 16,
        disk_read_bps: float | None = None,
    ) -> None:
        if page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")
        if device_bytes < 0 or host_bytes < 0:
            raise ValueError("tier capacities must be >= 0 bytes")
        if read_threads < 1:
            raise ValueError(f"read_threads must be >= 1, got {read_threads}")
        if disk_read_bps is not None and not disk_read_bps > 0:
            raise ValueError(f"disk_read_bps must be > 0 bytes a second or None, got {disk_read_bps!r}")
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.disk = DiskTier(root, pin_memory=self.pin_memory and self._cuda, read_bps=disk_read_bps)
        self.root = self.disk.root
        self.device_bytes = int(device_bytes)
        self.host_bytes = int(host_bytes)
        self.page_tokens = int(page_tokens)
        self.read_threads = int(read_threads)
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
        self._geometry: tuple[int, int, int, torch.dtype] | None = None  # layers, kv heads, head dim, dtype
        self._page_bytes = 0
        self._slab: torch.Tensor | None = None
        self._slab_pool: Sources | None = None  # the slab, as a copy pool
        # Free page lists are taken from the end, a slice at a time (_take), and pages go back
        # in the order they were held: pages taken together lie one after the other as often as
        # they can, and a batch copies one range per run of them rather than one per page.
        self._free: list[int] = []
        self._device: OrderedDict[KVKey, _Entry] = OrderedDict()
        # Host pages live in chunks allocated as the tier fills (pinning is slow and locks
        # memory): page p is page p % chunk_pages of chunk p // chunk_pages.
        self._host_chunks: list[torch.Tensor] = []
        self._host_chunk_pages = 0
        self._host_pages_total = 0  # capacity
        self._host_free: list[int] = []
        self._host_pool_cache: Sources | None = None
        self._host: OrderedDict[KVKey, _Entry] = OrderedDict()
        # Device facts that keep their host pages (_Entry.backup), oldest promotion first: the
        # host takes those back in this order, without a walk over the whole device tier.
        self._kept: OrderedDict[KVKey, None] = OrderedDict()
        # CUDA: every copy between the tiers runs on a side stream. The caller's slab accesses
        # wait for the side stream's last copy, and a copy waits for the caller's last slab
        # access (it may reuse the pages that one read) rather than for all its queued work.
        self._side: torch.cuda.Stream | None = None
        # Evictions copy to the host on a stream of their own, from a device-side copy of the
        # pages, so promotions into those slab pages need not wait for PCIe (see _evict).
        self._out: torch.cuda.Stream | None = None
        self._copiers: dict[torch.cuda.Stream, ByteCopier] = {}
        self._evictions = 0  # evictions queued on the eviction stream so far (_Written.seq)
        self._side_done: torch.cuda.Event | None = None
        self._caller_done: torch.cuda.Event | None = None
        #: device_to_host counts every fact evicted to the host; device_to_host_kept those of them
        #: that took back the host pages they were promoted from (no copy).
        # host_to_device_copies: the copies (ranges of pages) promotions took, about one per run
        # of facts lying together on both sides: what a promotion's host time grows with.
        self.counters = {"host_to_device": 0, "host_to_device_copies": 0, "device_to_host": 0,
                         "device_to_host_kept": 0, "host_drops": 0}

    # ------------------------------------------------------------------ public API

    def put(self, key: KVKey, kv: FactKV, fingerprint: str) -> None:
        """Store ``kv`` durably on disk, then cache it on the device."""
        self._check_geometry(kv)
        self.disk.put(key, kv, fingerprint)
        with self._lock:
            self._missing.discard(key)
            self._drop_memory(key)
            self._insert(key, self._to_pages(kv.k, kv.v), kv.num_tokens, kv.position, fingerprint)

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
            on_device: list[tuple[int, _Entry]] = []
            on_host: dict[KVKey, list[int]] = {}
            for i, key in enumerate(keys):
                entry = self._device.get(key)
                if entry is not None:
                    check_fingerprint(key, entry.fingerprint, fingerprint, "device tier")
                    self._device.move_to_end(key)
                    on_device.append((i, entry))
                    continue
                host = self._host.get(key)
                if host is not None:
                    check_fingerprint(key, host.fingerprint, fingerprint, "host tier")
                    on_host.setdefault(key, []).append(i)
            if on_host:
                promoted, served = self._promote(list(on_host), keep={keys[i] for i, _ in on_device})
                for key, entry in promoted.items():
                    for i in on_host[key]:
                        on_device.append((i, entry))
                for key, kv in served.items():
                    for i in on_host[key]:
                        out[i] = kv
            for (i, _), kv in zip(on_device, self._read_device([e for _, e in on_device])):
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
            if self.host_bytes < self._page_bytes:
                return 0
            for key in keys:
                if key in self._device or key in self._host or key in self._reading:
                    continue
                future = self._background_readers().submit(self._read_to_host, key, fingerprint)
                self._reading[key] = future
                future.add_done_callback(lambda _, key=key: self._done_reading(key))  # type: ignore[misc]
                started += 1
        return started

    def where_many(self, keys: Sequence[KVKey], *, check_disk: bool = True) -> list[Tier | None]:
        """:meth:`where` of every key, memory tiers read under one lock. ``check_disk=False``
        asks the filesystem nothing (a request may name 200 files): a key in no memory tier is
        on disk unless a read found its file missing since it was last put. That is for keys
        whose files were written (an encoded fact: the disk tier is write-through); a file
        removed behind the store's back is found missing by the read that needed it."""
        with self._lock:
            found: list[Tier | None] = [
                "device" if key in self._device else "host" if key in self._host else None for key in keys]
            if not check_disk:
                return [t if t is not None else None if key in self._missing else "disk"
                        for t, key in zip(found, keys)]
        return [t if t is not None else ("disk" if self.disk.contains(key) else None) for t, key in zip(found, keys)]

    def file_bytes(self, key: KVKey, num_tokens: int) -> int:
        """Bytes a read of ``key``'s file (``num_tokens`` tokens of KV) brings in: from the KV
        geometry once any fact was stored or read (no filesystem call), else the file's size."""
        # No lock: set once and never changed, and the cost model asks this on a request's
        # path, where a background read holding the lock would make it wait.
        geometry = self._geometry
        if geometry is None:
            return self.disk.nbytes(key)
        layers, heads, dim, dtype = geometry
        return 2 * layers * num_tokens * heads * dim * dtype.itemsize

    def close(self) -> None:
        """Stop the reader pool; reads already running finish."""
        for pool in (self._pool, self._background):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self._pool = self._background = None

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

    def _done_reading(self, key: KVKey) -> None:
        with self._lock:
            self._reading.pop(key, None)

    def _read_to_host(self, key: KVKey, fingerprint: str) -> None:
        """Read a fact file into the host tier (a prefetch: the device slab keeps what requests use)."""
        try:
            k, v, position = self.disk.get_blocking(key, fingerprint)
        except Exception as exc:  # the request that needs it reads it again and repairs it
            logger.info("prefetch of fact %s v%d failed: %s", key[0], key[1], exc)
            if isinstance(exc, KVMissingError):
                self._found_missing(key)
            return
        self._check_geometry(FactKV(k, v, position))
        pages = self._to_pages(k, v)
        with self._lock:
            if key in self._device or key in self._host or not self.disk.contains(key):
                return
            self._insert_host(key, pages, k.shape[1], position, fingerprint)

    def where(self, key: KVKey) -> Tier | None:
        """The fastest tier holding ``key``."""
        with self._lock:
            if key in self._device:
                return "device"
            if key in self._host:
                return "host"
        return "disk" if self.disk.contains(key) else None

    def evict(self, key: KVKey, to: Literal["host", "disk"] = "host") -> None:
        """Move ``key`` down to ``to`` (for tests and benchmarks; LRU does this on its own)."""
        with self._lock:
            if to == "disk":
                self._drop_memory(key)
            elif key in self._device:
                self._evict([key])

    def drop_memory(self) -> None:
        """Forget every cached copy (device and host); disk keeps everything."""
        with self._lock:
            for key in list(self._device) + list(self._host):
                self._drop_memory(key)

    def delete(self, fact_id: str) -> None:
        """Free every version of ``fact_id`` in every tier, its disk files included."""
        with self._lock:
            for key in [k for k in (*self._device, *self._host, *self._missing) if k[0] == fact_id]:
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
            total = 0 if self._slab is None else self._slab.shape[0]
            host_pages = sum(len(e.pages) for e in self._host.values())
            return {
                "device_facts": len(self._device),
                "device_pages_used": total - len(self._free),
                "device_pages_total": total,
                "device_bytes": 0 if self._slab is None else self._slab.nbytes,
                "host_facts": len(self._host),
                "host_bytes": host_pages * self._page_bytes,
                # Host pages device facts keep from their promotion (taken back for room).
                "host_backup_bytes": sum(len(e.backup or ()) for e in self._device.values()) * self._page_bytes,
                "host_bytes_allocated": sum(c.nbytes for c in self._host_chunks),
                "disk_writes": self.disk.writes,
                "disk_reads": self.disk.reads,
                "disk_corrupt": self.disk.corrupt,
                **self.counters,
            }

    @property
    def page_bytes(self) -> int | None:
        return self._page_bytes or None

    # ------------------------------------------------------------------ memory tiers

    def _check_geometry(self, kv: FactKV) -> None:
        layers, n, heads, dim = kv.k.shape
        geometry = (layers, heads, dim, kv.k.dtype)
        if kv.v.shape != kv.k.shape or kv.v.dtype != kv.k.dtype:
            raise ValueError(f"K {tuple(kv.k.shape)}/{kv.k.dtype} and V {tuple(kv.v.shape)}/{kv.v.dtype} differ")
        with self._lock:
            if self._geometry is None:
                self._geometry = geometry
                self._page_bytes = pb = layers * 2 * self.page_tokens * heads * dim * kv.k.element_size()
                num_pages = self.device_bytes // pb
                if num_pages > 0:
                    self._slab = torch.empty((num_pages, *self._page_shape()), dtype=kv.k.dtype, device=self.device)
                    self._slab_pool = Sources.of([self._slab])
                    self._free = list(range(num_pages))
                self._host_pages_total = self.host_bytes // pb
                self._host_chunk_pages = max(1, min(HOST_CHUNK_BYTES // pb, self._host_pages_total))
                logger.info(
                    "KV device slab: %d pages of %d tokens (%.1f MiB) on %s; host tier: up to %d pages",
                    num_pages, self.page_tokens, num_pages * pb / 2**20, self.device, self._host_pages_total,
                )
            elif geometry != self._geometry:
                raise ValueError(f"KV geometry {geometry} does not match this store's {self._geometry}")

    def _page_shape(self) -> tuple[int, ...]:
        layers, heads, dim, _ = self._geometry  # type: ignore[misc]
        return (layers, 2, self.page_tokens, heads, dim)

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
        if self._cuda:  # from the pinned read buffer, a DMA; the page layout is made on the device
            k, v = k.to(self.device, non_blocking=True), v.to(self.device, non_blocking=True)
        pages = self._to_pages(k, v)  # outside the lock: other readers insert meanwhile
        with self._lock:
            if key in self._device or key in self._host:  # another thread loaded it meanwhile
                return self.get_many([key], fingerprint)[0]
            if not self.disk.contains(key):  # deleted while we read it: serve, but do not cache
                return FactKV(k.to(self.device), v.to(self.device), position)
            self._insert(key, pages, k.shape[1], position, fingerprint)
            entry = self._device.get(key)
            if entry is not None:
                return self._read_device([entry])[0]
        # Too large for the slab: served from the file (the host tier may keep a copy).
        return FactKV(k.to(self.device), v.to(self.device), position)

    def _promote(self, keys: list[KVKey], keep: set[KVKey]) -> tuple[dict[KVKey, _Entry], dict[KVKey, FactKV]]:
        """Move host-tier facts into slab pages (lock held), evicting device facts not in
        ``keep`` for room; return the new device entries, and the KV of facts the slab could
        not take, which stay on the host and are served from there."""
        hosts = [self._host.pop(key) for key in keys]
        self._make_room(sum(len(h.pages) for h in hosts), keep)
        promoted: dict[KVKey, _Entry] = {}
        served: dict[KVKey, FactKV] = {}
        room = len(self._free)
        fits: list[tuple[KVKey, _Entry]] = []
        for key, h in zip(keys, hosts):
            if len(h.pages) > room:
                self._host[key] = h
                served[key] = self._read_host(h)
                continue
            room -= len(h.pages)
            fits.append((key, h))
        if not fits:
            return promoted, served
        # In host-page order, into slab pages taken in one piece: facts that lie one after the
        # other on the host (evicted or prefetched together) copy as one range, whatever order
        # the request names them in (a prefetch's parallel reads land in completion order).
        to_pages = sorted(_take(self._free, len(self._free) - room))
        from_pages: list[int] = []
        slab_pages: dict[KVKey, list[int]] = {}
        for key, h in sorted(fits, key=lambda kh: kh[1].pages[0]):
            slab_pages[key] = to_pages[len(from_pages) : len(from_pages) + len(h.pages)]
            from_pages += h.pages
        self._wait_written(hosts)
        assert self._slab_pool is not None  # a fact fit in free slab pages: the slab exists
        # Queued before the bookkeeping: the sooner the DMA starts, the sooner its tail lands.
        self.counters["host_to_device_copies"] += self._copy(self._slab_pool, to_pages, self._host_pool(), from_pages)
        for key, h in fits:  # in the request's order, which later evictions go by (_kept)
            # The entry moves to the device. Its host pages stay the fact's: an eviction back is
            # then bookkeeping. Taken back for room only after this copy is queued, so a copy
            # into them is queued after it.
            h.pages, h.backup = slab_pages[key], h.pages
            promoted[key] = h
        self._device.update(promoted)
        self._kept.update(dict.fromkeys(promoted))
        self.counters["host_to_device"] += len(promoted)
        return promoted, served

    def _make_room(self, need: int, keep: set[KVKey]) -> None:
        """Evict least recently used device facts not in ``keep`` until ``need`` slab pages are
        free, or no other fact is left (lock held)."""
        free = len(self._free)
        if free >= need:
            return
        victims = []
        for key, entry in self._device.items():
            if key not in keep:
                victims.append(key)
                free += len(entry.pages)
                if free >= need:
                    break
        if victims:
            self._evict(victims)

    def _evict(self, keys: list[KVKey]) -> None:
        """Move device facts to the host tier (lock held): those promoted from there take back the
        host pages still holding them; the others are copied, one batch for all of them, queued
        on CUDA streams, so no one waits for it on the host. Their slab pages are free at once
        (later slab writes queue after the copies out of them)."""
        entries = [self._device.pop(key) for key in keys]
        kept: list[tuple[KVKey, _Entry]] = []
        copied: list[tuple[KVKey, _Entry]] = []
        to_pages: list[int] = []
        from_pages: list[int] = []
        for key, e in zip(keys, entries):
            if e.backup is not None:
                self._kept.pop(key, None)
                kept.append((key, _Entry(e.backup, e.num_tokens, e.position, e.fingerprint)))
                continue
            pages = self._take_host_pages(len(e.pages))
            if pages is None:  # the disk has it
                self.counters["host_drops"] += 1
                continue
            to_pages += pages
            from_pages += e.pages
            copied.append((key, _Entry(pages, e.num_tokens, e.position, e.fingerprint)))
        if copied:
            written = self._copy_out(to_pages, from_pages)
            copied = [(key, replace(e, written=written)) for key, e in copied]
        # Entered only now, so a later fact of this batch cannot drop them to make room.
        self._host.update(kept + copied)
        self.counters["device_to_host"] += len(kept) + len(copied)
        self.counters["device_to_host_kept"] += len(kept)
        self._free += [p for e in entries for p in e.pages]

    def _take_host_pages(self, m: int) -> list[int] | None:
        """``m`` free host pages (lock held): allocating a chunk, taking back pages device facts
        keep, or dropping least recently used host facts (the disk keeps them), in this order;
        ``None`` when the whole tier is smaller."""
        if m > self._host_pages_total:
            return None
        while len(self._host_free) < m:
            # Kept pages go first: a copy of a fact the device holds is worth less than a fact
            # only the disk would hold otherwise.
            if self._grow_host() or self._release_backup():
                continue
            if not self._host:
                return None  # the facts holding the room are in flight in this very batch
            _, old = self._host.popitem(last=False)
            self._host_free += old.pages
            self.counters["host_drops"] += 1
        return _take(self._host_free, m)

    def _release_backup(self) -> bool:
        """Free the host pages the device fact promoted longest ago still keeps (lock held);
        False when none keeps any."""
        while self._kept:
            key, _ = self._kept.popitem(last=False)
            entry = self._device.get(key)  # not there: leaving the device in this very batch
            if entry is not None and entry.backup is not None:
                self._host_free += entry.backup
                entry.backup = None
                return True
        return False

    def _grow_host(self) -> bool:
        """Allocate the next host chunk, if the tier's capacity has room for one."""
        first = len(self._host_chunks) * self._host_chunk_pages
        n = min(self._host_chunk_pages, self._host_pages_total - first)
        if n <= 0:
            return False
        dtype = self._geometry[3]  # type: ignore[index]
        self._host_chunks.append(torch.empty((n, *self._page_shape()), dtype=dtype, pin_memory=self.pin_memory))
        self._host_pool_cache = None
        self._host_free += range(first, first + n)
        return True

    def _host_pool(self) -> Sources:
        if self._host_pool_cache is None:
            self._host_pool_cache = Sources.of(self._host_chunks)
        return self._host_pool_cache

    def _copy(self, dst: Sources, dst_pages: list[int], src: Sources, src_pages: list[int]) -> int:
        """Copy pages between pools (the slab, the host chunks, a buffer), page ``src_pages[i]``
        of ``src`` to page ``dst_pages[i]`` of ``dst``, a range per run of pages that lie one
        after the other on both sides; returns how many ranges. A pool's page ``p`` is page
        ``p % n`` of its tensor ``p // n``, ``n`` the pages of its first tensor (the host
        tier's chunks; other pools are one tensor). On CUDA: one batch of DMAs on the side stream."""
        if not self._cuda:
            return _copy_on_host(dst, dst_pages, src, src_pages)
        with self._side_work() as side:
            return self._dma(side, dst, dst_pages, src, src_pages)

    @contextlib.contextmanager
    def _side_work(self) -> Iterator[torch.cuda.Stream]:
        """The side stream, after the caller's last access to the pages (they may have been read
        or written there last); the caller's next access waits for what the block queued."""
        side = self._side_stream()
        if self._caller_done is not None:
            side.wait_event(self._caller_done)
        yield side
        done = torch.cuda.Event()
        done.record(side)
        self._side_done = done

    def _copy_out(self, host_pages: list[int], slab_pages: list[int]) -> _Written | None:
        """Copy slab pages to host pages; on CUDA, the copy writing the host pages.

        A promotion that needs the room waits for nothing slower than a device-side copy: the
        side stream gathers the pages into a buffer (device memory bandwidth), after which the
        slab pages can take new facts; the buffer goes to the host on the eviction stream, over
        PCIe, while the side stream copies the promoted facts the other way. Readers of those
        host pages wait for the returned event (:meth:`_wait_written`)."""
        if not self._cuda:
            assert self._slab_pool is not None  # the pages are evicted from the slab
            _copy_on_host(self._host_pool(), host_pages, self._slab_pool, slab_pages)
            return None
        assert self._slab is not None
        with self._side_work() as side, torch.cuda.stream(side):
            staged = self._slab.index_select(0, self._index(slab_pages))
        gathered = self._side_done
        assert gathered is not None
        # Behind everything queued on the side stream so far: the gather, and any promotion
        # still reading host pages this copy may now overwrite.
        out = self._out_stream()
        out.wait_event(gathered)
        staged.record_stream(out)  # its memory is not reused before the copy out of it ends
        self._dma(out, self._host_pool(), host_pages, Sources.of([staged]), list(range(len(slab_pages))))
        written = torch.cuda.Event()
        written.record(out)
        self._evictions += 1
        return _Written(self._evictions, written)

    def _wait_written(self, entries: list[_Entry]) -> None:
        """Order the side stream after the evictions still writing these host entries' pages:
        after the latest of them, which ends after the others (one stream), so a batch of facts
        evicted one by one costs one event query, not one each."""
        latest = max((e.written for e in entries if e.written is not None), key=lambda w: w.seq, default=None)
        if latest is not None and not latest.event.query():
            self._side_stream().wait_event(latest.event)
        for e in entries:
            e.written = None

    def _dma(self, stream: torch.cuda.Stream, dst: Sources, dst_pages: list[int], src: Sources,
             src_pages: list[int]) -> int:
        """Queue the page copies on ``stream``: one batch, a range per run of pages that lie one
        after the other on both sides; returns how many ranges."""
        r = _page_ranges(dst, dst_pages, src, src_pages)
        pb = self._page_bytes
        copier = self._copiers.get(stream)
        if copier is None:
            copier = self._copiers[stream] = ByteCopier(stream)
        copier.copy(_ranges(dst, r.dst_which), r.dst_index * pb, _ranges(src, r.src_which), r.src_index * pb,
                    r.lengths * pb)
        return len(r.lengths)

    def _read_host(self, entry: _Entry) -> FactKV:
        """A host-tier fact's KV on the device, without caching it there (lock held)."""
        m = len(entry.pages)
        buffer = torch.empty((m, *self._page_shape()), dtype=self._geometry[3], device=self.device)  # type: ignore[index]
        self._wait_written([entry])
        self._copy(Sources.of([buffer]), list(range(m)), self._host_pool(), entry.pages)
        self._after_side()
        # contiguous(): a one-page buffer's block is a strided view of it.
        block = self._pages_to_block(buffer).contiguous()
        return self._hand_out(block, [(entry.num_tokens, m, entry.position)])[0]

    def _read_device(self, entries: list[_Entry]) -> list[FactKV]:
        """Every entry's KV as rows of one copy of their pages (lock held): one kernel for all,
        and later slab writes never change KV handed out."""
        if not entries:
            return []
        # Gathered in slab order, where a promotion's facts lie one after the other whatever
        # order the request names them in (they were copied in host-page order): one slice.
        order = sorted(range(len(entries)), key=lambda i: entries[i].pages[0])
        block = self._gather([p for i in order for p in entries[i].pages])
        kvs = self._hand_out(block, [(entries[i].num_tokens, len(entries[i].pages), entries[i].position) for i in order])
        out: list[FactKV] = [None] * len(entries)  # type: ignore[list-item]
        for i, kv in zip(order, kvs):
            out[i] = kv
        return out

    def _gather(self, pages: list[int]) -> torch.Tensor:
        """Slab pages copied into one new ``[2, layers, tokens, heads, dim]`` block (lock held),
        gathered and laid out by one kernel. Pages one after the other, as a promotion leaves
        them, are sliced: no page index goes to the device."""
        assert self._slab is not None
        self._after_side()
        slab = self._slab.permute(2, 1, 0, 3, 4, 5)  # [2, layers, pages, page_tokens, heads, dim]
        first, m = pages[0], len(pages)
        if _one_interval(pages):
            block = slab[:, :, first : first + m].clone(memory_format=torch.contiguous_format)
        else:
            block = slab.index_select(2, self._index(pages))
        _, layers, _, pt, heads, dim = block.shape
        return block.view(2, layers, m * pt, heads, dim)

    def _hand_out(self, block: torch.Tensor, facts: list[tuple[int, int, int]]) -> list[FactKV]:
        """FactKVs of facts laid out one after the other in ``block`` (``[2, layers, tokens,
        heads, dim]``, contiguous, just copied from the slab or the host tier), given as
        ``(tokens, pages, position)`` each."""
        rows, start = [], 0
        for tokens, pages, position in facts:  # each fact's rows, then its page padding
            rows.append((start, tokens, position))
            start += pages * self.page_tokens
        # One event for all: readers on other streams (vLLM's worker) wait for this copy on the
        # device, and copies reusing the pages it read wait for it too.
        return FactKV.rows_of(block, rows, self._mark_caller())

    def _insert(self, key: KVKey, pages: torch.Tensor, n: int, position: int, fingerprint: str) -> None:
        """Cache a fact's pages on the device slab (lock held)."""
        need = pages.shape[0]
        if self._slab is None or need > self._slab.shape[0]:  # larger than the whole slab: the host serves it
            self._insert_host(key, pages, n, position, fingerprint)
            return
        self._make_room(need, keep=set())
        slots = _take(self._free, need)
        self._after_side()
        self._slab.index_copy_(0, self._index(slots), pages.to(self.device, non_blocking=pages.is_pinned()))
        self._mark_caller()
        self._device[key] = _Entry(slots, n, position, fingerprint)

    def _insert_host(self, key: KVKey, pages: torch.Tensor, n: int, position: int, fingerprint: str) -> None:
        """Put a fact's pages in the host tier, written from the host (lock held)."""
        slots = self._take_host_pages(pages.shape[0])
        if slots is None:
            self.counters["host_drops"] += 1
            return  # the disk has it
        for stream in (self._side, self._out):  # copies still queued may read or write these pages
            if stream is not None:
                stream.synchronize()
        _copy_on_host(self._host_pool(), slots, Sources.of([pages.to("cpu")]), list(range(len(slots))))
        self._host[key] = _Entry(slots, n, position, fingerprint)

    def _after_side(self) -> None:
        """Order the caller's stream after the side stream's last copy."""
        if self._side_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._side_done)

    def _mark_caller(self) -> torch.cuda.Event | None:
        """Mark the caller's last slab access, for copies reusing its pages to wait for; the
        event, on CUDA."""
        if not self._cuda:
            return None
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        self._caller_done = done
        return done

    def _side_stream(self) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def _out_stream(self) -> torch.cuda.Stream:
        if self._out is None:
            self._out = torch.cuda.Stream(self.device)
        return self._out

    def _drop_memory(self, key: KVKey) -> None:
        entry = self._device.pop(key, None)
        if entry is not None:
            self._free += entry.pages
            self._host_free += entry.backup or ()
            self._kept.pop(key, None)
        host = self._host.pop(key, None)
        if host is not None:
            self._host_free += host.pages

    def _index(self, pages: list[int]) -> torch.Tensor:
        """Page numbers on the device without a host wait: a plain copy from pageable memory
        would first wait for everything queued on the stream (another request's forward pass,
        copies in flight)."""
        index = torch.tensor(pages, dtype=torch.long)
        if not self._cuda:
            return index
        return index.pin_memory().to(self.device, non_blocking=True)

    def _to_pages(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``[layers, n, heads, dim]`` K and V as ``[pages, layers, 2, page_tokens, heads, dim]``."""
        layers, n, heads, dim = k.shape
        pt = self.page_tokens
        m = max(1, math.ceil(n / pt))
        out = torch.zeros((layers, 2, m * pt, heads, dim), dtype=k.dtype, device=k.device)
        out[:, 0, :n] = k
        out[:, 1, :n] = v
        return out.view(layers, 2, m, pt, heads, dim).permute(2, 0, 1, 3, 4, 5).contiguous()

    @staticmethod
    def _pages_to_block(pages: torch.Tensor) -> torch.Tensor:
        m, layers, _, pt, heads, dim = pages.shape
        return pages.permute(2, 1, 0, 3, 4, 5).reshape(2, layers, m * pt, heads, dim)


def _take(free: list[int], m: int) -> list[int]:
    """The last ``m`` pages of a free list, in its order, taken off it."""
    assert m <= len(free), "not enough free pages"
    pages = free[len(free) - m :]
    del free[len(free) - m :]
    return pages


def page_runs(
    dst_which: np.ndarray, dst_index: np.ndarray, src_which: np.ndarray, src_index: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Copies of pages ``i`` (tensor ``src_which[i]``, page ``src_index[i]`` to tensor
    ``dst_which[i]``, page ``dst_index[i]``) merged into runs that lie one after the other in
    one tensor on both sides: each run's first copy and its length in pages."""
    new_run = np.ones(len(dst_index), dtype=bool)
    new_run[1:] = ((dst_which[1:] != dst_which[:-1]) | (src_which[1:] != src_which[:-1])
                   | (dst_index[1:] != dst_index[:-1] + 1) | (src_index[1:] != src_index[:-1] + 1))
    starts = np.flatnonzero(new_run)
    return starts, np.diff(np.append(starts, len(new_run)))


def _split_pages(pool: Sources, pages: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Each page's tensor in ``pool`` and its index there (see :meth:`KVTiers._copy`)."""
    return np.divmod(np.array(pages, dtype=np.int64), _tensor_pages(pool))


class _PageRanges(NamedTuple):
    """Page copies merged into ranges: per range, each side's tensor and first page, and its length."""

    dst_which: np.ndarray
    dst_index: np.ndarray
    src_which: np.ndarray
    src_index: np.ndarray
    lengths: np.ndarray


def _page_ranges(dst: Sources, dst_pages: list[int], src: Sources, src_pages: list[int]) -> _PageRanges:
    """The ranges :meth:`KVTiers._copy` copies, on the device or on the host alike."""
    few = _interval_ranges(dst, dst_pages, src, src_pages)
    if few is not None:  # as a promotion of facts that lie together usually is: no numpy pass
        return _PageRanges(*(np.array(column, dtype=np.int64) for column in zip(*few)))
    dst_which, dst_index = _split_pages(dst, dst_pages)
    src_which, src_index = _split_pages(src, src_pages)
    starts, lengths = page_runs(dst_which, dst_index, src_which, src_index)
    return _PageRanges(dst_which[starts], dst_index[starts], src_which[starts], src_index[starts], lengths)


def _interval_ranges(
    dst: Sources, dst_pages: list[int], src: Sources, src_pages: list[int]
) -> list[tuple[int, int, int, int, int]] | None:
    """When both sides' pages are each one interval (a promotion of facts lying together): the
    ranges as ``(dst tensor, dst page, src tensor, src page, pages)``, cut where either side
    passes into its pool's next tensor (the host tier's chunks); else ``None``."""
    n = len(dst_pages)
    if not n or not (_one_interval(dst_pages) and _one_interval(src_pages)):
        return None
    d0, s0 = dst_pages[0], src_pages[0]
    dst_per, src_per = _tensor_pages(dst), _tensor_pages(src)
    out = []
    done = 0
    while done < n:
        (dw, d), (sw, s) = _locate(dst, d0 + done), _locate(src, s0 + done)
        m = min(n - done, dst_per - d, src_per - s)
        out.append((dw, d, sw, s, m))
        done += m
    return out


def _one_interval(pages: list[int]) -> bool:
    """Whether ``pages`` (not empty) are consecutive and increasing, as a promotion leaves them."""
    return pages == list(range(pages[0], pages[0] + len(pages)))


def _tensor_pages(pool: Sources) -> int:
    """Pages in each tensor of ``pool`` but maybe its last (unbounded for a one-tensor pool)."""
    return pool.tensors[0].shape[0] if len(pool.tensors) > 1 else 1 << 62


def _locate(pool: Sources, page: int) -> tuple[int, int]:
    """Page ``page`` of ``pool`` as (its tensor, its index there); see :meth:`KVTiers._copy`."""
    return divmod(page, _tensor_pages(pool))


def _copy_on_host(dst: Sources, dst_pages: list[int], src: Sources, src_pages: list[int]) -> int:
    """:meth:`KVTiers._copy` done by the host, a range per run of pages (CPU pools only)."""
    r = _page_ranges(dst, dst_pages, src, src_pages)
    for dw, d, sw, s, n in zip(r.dst_which.tolist(), r.dst_index.tolist(), r.src_which.tolist(),
                               r.src_index.tolist(), r.lengths.tolist()):
        dst.tensors[dw][d : d + n].copy_(src.tensors[sw][s : s + n])
    return len(r.lengths)


def _ranges(pool: Sources, which: np.ndarray) -> Sources:
    """``pool``'s tensor of each range, as :class:`ByteCopier` takes them."""
    return Sources([pool.tensors[i] for i in which.tolist()], pool.address[which], pool.nbytes[which])
