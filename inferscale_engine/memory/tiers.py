"""Where fact KV lives: a paged device slab, a host tier and a disk tier.

* **Device tier** – one slab preallocated on first use (``torch.empty``), shaped
  ``[num_pages, layers, 2, page_tokens, kv_heads, head_dim]``: a fact of ``n`` tokens takes
  ``ceil(n / page_tokens)`` pages from a free list, so nothing is allocated per fact. On a CPU
  engine the "device" is the CPU and the slab is an ordinary tensor.
* **Host tier** – per-fact CPU tensors, layer-major (``[layers, 2, tokens, heads, dim]``,
  pinned when CUDA is available). Host hits are promoted together without stalling the caller:
  on a side stream, layer group by layer group (:data:`LAYER_GROUPS`), one batch of DMAs (a
  range per fact) per group into one device staging buffer; the KV handed out carries one CUDA
  event per group (``FactKV.ready``), and the injection writes each group once its own event has
  fired, so a forward pass can run its first layers while the later ones are still crossing PCIe.
  The slab caches the promoted facts from the same staging copy, on the same side stream.
* **Disk tier** – one safetensors file per fact version, written atomically (temp file in the
  same folder, fsync, ``os.replace``, fsync of the folder) and carrying the model fingerprint
  in its metadata. Disk is write-through and unbounded: every encoded fact has its file before
  it enters memory, so the memory tiers are pure caches.

Memory tiers are exclusive and LRU: a ``put`` or a promotion lands on the device; the device
evicts its least recently used fact to the host, the host drops its least recently used fact
(the disk still holds it). ``get_many`` returns device-tier facts as views of *one copy*
gathered from the slab for all of them (two kernels whatever ``k``), so a span in flight never
sees its pages reused. Bytes are never converted: KV read back from any tier is
``torch.equal`` to what was put.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import re
import threading
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from inferscale_engine.errors import StaleKVError
from inferscale_engine.kv import FactKV, LayerReady
from inferscale_engine.memory.dma import ByteCopier, Sources

logger = logging.getLogger(__name__)

KVKey = tuple[str, int]  # (fact id, kv version)
Tier = Literal["device", "host", "disk"]

FILE_FORMAT = "inferscale-kv/1"
#: Layer groups of a host-tier promotion: each has its own batch of copies and event. More
#: groups start the forward pass sooner but cost a batch (or, before CUDA 12.8, ``k`` copies) each.
LAYER_GROUPS = 4
_FILE_RE = re.compile(r"^([0-9a-f]{16})-(\d+)\.safetensors$")


class KVMissingError(LookupError):
    """No usable KV file for this fact version (never written, deleted, or unreadable)."""


@dataclass
class _DeviceEntry:
    pages: list[int]
    num_tokens: int
    position: int
    fingerprint: str


@dataclass
class _HostEntry:
    # Layer-major, [layers, 2, pages * page_tokens, heads, dim]: any run of layers is one
    # contiguous range, so a promotion moves a layer group of a fact in one copy.
    block: torch.Tensor
    num_tokens: int
    position: int
    fingerprint: str
    # The block's geometry, read once: a promotion of k facts would otherwise ask torch for it
    # several times per fact, on the request's path. The block is never replaced or resized.
    shape: tuple[int, ...] = field(init=False)
    numel: int = field(init=False)
    nbytes: int = field(init=False)
    address: int = field(init=False)

    def __post_init__(self) -> None:
        block = self.block
        self.shape, self.numel, self.nbytes, self.address = tuple(block.shape), block.numel(), block.nbytes, block.data_ptr()


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
    ) -> None:
        if page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")
        if device_bytes < 0 or host_bytes < 0:
            raise ValueError("tier capacities must be >= 0 bytes")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.device = torch.device(device)
        self.device_bytes = int(device_bytes)
        self.host_bytes = int(host_bytes)
        self.page_tokens = int(page_tokens)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._lock = threading.RLock()
        self._geometry: tuple[int, int, int, torch.dtype] | None = None  # layers, kv heads, head dim, dtype
        self._slab: torch.Tensor | None = None
        self._free: list[int] = []
        self._device: OrderedDict[KVKey, _DeviceEntry] = OrderedDict()
        self._host: OrderedDict[KVKey, _HostEntry] = OrderedDict()
        self._host_used = 0
        # CUDA: promotions copy and write the slab on a side stream; slab readers on the
        # caller's stream wait for the last such write, and host sources stay referenced until
        # their copies have run.
        self._side: torch.cuda.Stream | None = None
        self._copier: ByteCopier | None = None
        self._slab_written: torch.cuda.Event | None = None
        self._in_flight: list[tuple[torch.cuda.Event, list[torch.Tensor]]] = []
        self.counters = {
            "disk_writes": 0, "disk_reads": 0, "host_to_device": 0, "device_to_host": 0, "host_drops": 0,
        }

    # ------------------------------------------------------------------ public API

    def put(self, key: KVKey, kv: FactKV, fingerprint: str) -> None:
        """Store ``kv`` durably on disk, then cache it on the device."""
        self._check_geometry(kv)
        self._write_file(key, kv, fingerprint)
        with self._lock:
            self._drop_memory(key)
            self._insert(key, self._to_pages(kv.k, kv.v), kv.num_tokens, kv.position, fingerprint)

    def get(self, key: KVKey, fingerprint: str) -> FactKV:
        """KV of ``key`` (see :meth:`get_many`)."""
        return self.get_many([key], fingerprint)[0]

    def get_many(self, keys: list[KVKey], fingerprint: str) -> list[FactKV]:
        """KV of each key on the device, for injection: device-tier facts as views of one
        gathered copy, host-tier facts promoted (asynchronously on CUDA: their KV carries
        per-layer-group ``ready`` events), disk-tier facts read and cached on the device.

        Raises :class:`KVMissingError` when no tier has a key and :class:`StaleKVError` when
        its stored KV was made under another model fingerprint.
        """
        out: list[FactKV | None] = [None] * len(keys)
        with self._lock:
            if self._in_flight:  # pinned sources of earlier promotions, once copied
                self._in_flight = [(e, t) for e, t in self._in_flight if not e.query()]
            on_device: list[tuple[int, _DeviceEntry]] = []
            on_host: dict[KVKey, list[int]] = {}
            for i, key in enumerate(keys):
                entry = self._device.get(key)
                if entry is not None:
                    _check_fingerprint(key, entry.fingerprint, fingerprint, "device tier")
                    self._device.move_to_end(key)
                    on_device.append((i, entry))
                    continue
                host = self._host.get(key)
                if host is not None:
                    _check_fingerprint(key, host.fingerprint, fingerprint, "host tier")
                    on_host.setdefault(key, []).append(i)
            for (i, _), kv in zip(on_device, self._read_device([e for _, e in on_device])):
                out[i] = kv
            for key, kv in zip(on_host, self._promote(list(on_host))):
                for i in on_host[key]:
                    out[i] = kv
        for i, key in enumerate(keys):
            if out[i] is None:
                out[i] = self._get_from_disk(key, fingerprint)
        return out  # type: ignore[return-value]

    def where(self, key: KVKey) -> Tier | None:
        """The fastest tier holding ``key``."""
        with self._lock:
            if key in self._device:
                return "device"
            if key in self._host:
                return "host"
        return "disk" if self.path(key).exists() else None

    def evict(self, key: KVKey, to: Literal["host", "disk"] = "host") -> None:
        """Move ``key`` down to ``to`` (for tests and benchmarks; LRU does this on its own)."""
        with self._lock:
            if key in self._device and (to == "host" or to == "disk"):
                self._evict_device(key)
            if to == "disk" and key in self._host:
                self._host_used -= self._host.pop(key).nbytes

    def drop_memory(self) -> None:
        """Forget every cached copy (device and host); disk keeps everything."""
        with self._lock:
            for key in list(self._device):
                self._free.extend(self._device.pop(key).pages)
            self._host.clear()
            self._host_used = 0

    def delete(self, fact_id: str) -> None:
        """Free every version of ``fact_id`` in every tier, its disk files included."""
        with self._lock:
            for key in [k for k in self._device if k[0] == fact_id]:
                self._free.extend(self._device.pop(key).pages)
            for key in [k for k in self._host if k[0] == fact_id]:
                self._host_used -= self._host.pop(key).nbytes
            folder = self.root / fact_id[:2]
            if folder.is_dir():
                for p in folder.glob(f"{fact_id}-*.safetensors"):
                    _unlink(p)
                for p in folder.glob(f".{fact_id}-*.tmp"):
                    _unlink(p)

    def delete_key(self, key: KVKey) -> None:
        """Free one version of a fact in every tier."""
        with self._lock:
            self._drop_memory(key)
            _unlink(self.path(key))

    def path(self, key: KVKey) -> Path:
        fact_id, version = key
        return self.root / fact_id[:2] / f"{fact_id}-{int(version)}.safetensors"

    def read_metadata(self, key: KVKey) -> dict[str, str] | None:
        """The safetensors metadata of ``key``'s file, or ``None`` when absent or unreadable."""
        from safetensors import safe_open

        try:
            with safe_open(str(self.path(key)), framework="pt", device="cpu") as f:
                return dict(f.metadata() or {})
        except Exception:
            return None

    def sweep(self, live: Mapping[str, int]) -> tuple[set[KVKey], int]:
        """Remove temp files and KV files of no live fact version; return (files kept, removed)."""
        kept: set[KVKey] = set()
        removed = 0
        with self._lock:
            for folder in self.root.iterdir():
                if not folder.is_dir():
                    continue
                for p in folder.iterdir():
                    m = _FILE_RE.match(p.name)
                    if p.name.endswith(".tmp"):
                        _unlink(p)
                        removed += 1
                    elif m is not None:
                        key = (m.group(1), int(m.group(2)))
                        if live.get(key[0]) == key[1]:
                            kept.add(key)
                        else:
                            _unlink(p)
                            removed += 1
        return kept, removed

    def stats(self) -> dict[str, int]:
        with self._lock:
            total = 0 if self._slab is None else self._slab.shape[0]
            return {
                "device_facts": len(self._device),
                "device_pages_used": total - len(self._free),
                "device_pages_total": total,
                "device_bytes": 0 if self._slab is None else self._slab.nbytes,
                "host_facts": len(self._host),
                "host_bytes": self._host_used,
                **self.counters,
            }

    @property
    def page_bytes(self) -> int | None:
        if self._geometry is None:
            return None
        layers, heads, dim, dtype = self._geometry
        return layers * 2 * self.page_tokens * heads * dim * torch.empty((), dtype=dtype).element_size()

    # ------------------------------------------------------------------ memory tiers

    def _check_geometry(self, kv: FactKV) -> None:
        layers, n, heads, dim = kv.k.shape
        geometry = (layers, heads, dim, kv.k.dtype)
        if kv.v.shape != kv.k.shape or kv.v.dtype != kv.k.dtype:
            raise ValueError(f"K {tuple(kv.k.shape)}/{kv.k.dtype} and V {tuple(kv.v.shape)}/{kv.v.dtype} differ")
        with self._lock:
            if self._geometry is None:
                self._geometry = geometry
                num_pages = self.device_bytes // self.page_bytes  # type: ignore[operator]
                if num_pages > 0:
                    shape = (num_pages, layers, 2, self.page_tokens, heads, dim)
                    self._slab = torch.empty(shape, dtype=kv.k.dtype, device=self.device)
                    self._free = list(range(num_pages - 1, -1, -1))
                logger.info(
                    "KV device slab: %d pages of %d tokens (%.1f MiB) on %s",
                    num_pages, self.page_tokens, num_pages * self.page_bytes / 2**20, self.device,  # type: ignore[operator]
                )
            elif geometry != self._geometry:
                raise ValueError(f"KV geometry {geometry} does not match this store's {self._geometry}")

    def _get_from_disk(self, key: KVKey, fingerprint: str) -> FactKV:
        k, v, position = self._read_file(key, fingerprint)
        with self._lock:
            if key in self._device or key in self._host:  # another thread loaded it meanwhile
                return self.get_many([key], fingerprint)[0]
            if not self.path(key).exists():  # deleted while we read it: serve, but do not cache
                return FactKV(k.to(self.device), v.to(self.device), position)
            self._insert(key, self._to_pages(k, v), k.shape[1], position, fingerprint)
            entry = self._device.get(key)
            if entry is not None:
                return self._read_device([entry])[0]
        # Too large for the slab: served from the file (the host tier may keep a copy).
        return FactKV(k.to(self.device), v.to(self.device), position)

    def _promote(self, keys: list[KVKey]) -> list[FactKV]:
        """Move host-tier facts to the device (lock held) and return their KV without waiting
        for the copies: views of one staging copy, which the slab then caches."""
        if not keys:
            return []
        hosts = [self._host.pop(key) for key in keys]
        for h in hosts:
            self._host_used -= h.nbytes
        placed = self._place(keys, hosts)
        # Facts of one shape side by side in the staging buffer: each run of one page count goes
        # to the slab in one write, and each run of one shape is handed out in two view ops.
        order = sorted(range(len(hosts)), key=lambda i: _shape_of(hosts[i]))
        offsets = [0] * len(hosts)
        total = 0
        for i in order:
            offsets[i] = total
            total += hosts[i].numel
        cuda = self.device.type == "cuda"
        caller = torch.cuda.current_stream(self.device) if cuda else None
        side = self._side_stream() if cuda else None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            staging = torch.empty(total, dtype=hosts[0].block.dtype, device=self.device)
            ready: LayerReady = ()
            if side is not None:
                ready = self._upload(hosts, order, offsets, staging, side)
            else:
                for h, o in zip(hosts, offsets):
                    staging[o : o + h.numel].view(h.shape).copy_(h.block)
            if placed:
                if side is not None:  # after the caller's reads of pages this write may reuse
                    side.wait_stream(caller)  # type: ignore[arg-type]
                self._write_promoted(keys, hosts, placed, order, offsets, staging)
                if side is not None:
                    self._slab_written = torch.cuda.Event()
                    self._slab_written.record(side)
        if side is not None:
            staging.record_stream(caller)  # type: ignore[arg-type]
            done = torch.cuda.Event()
            done.record(side)
            self._in_flight.append((done, [h.block for h in hosts]))
        for key, h in zip(keys, hosts):
            if key in placed:
                self._device[key] = _DeviceEntry(placed[key], h.num_tokens, h.position, h.fingerprint)
        self.counters["host_to_device"] += len(placed)
        out: list[FactKV | None] = [None] * len(hosts)
        for run, ks, vs in _promoted_views(staging, hosts, order, offsets):
            facts = FactKV.cut_alike(ks, vs, [hosts[i].position for i in run], ready or None)
            for i, fact in zip(run, facts):
                out[i] = fact
        return out  # type: ignore[return-value]

    def _place(self, keys: list[KVKey], hosts: list[_HostEntry]) -> dict[KVKey, list[int]]:
        """Slab pages for each promoted fact, evicting older entries as needed (lock held); a
        fact the slab cannot take stays on the host."""
        placed: dict[KVKey, list[int]] = {}
        for key, h in zip(keys, hosts):
            m = h.shape[2] // self.page_tokens
            # Only entries from before this batch may be evicted: the batch's own pages are not
            # written yet.
            while len(self._free) < m and self._device:
                self._evict_device(next(iter(self._device)))
            if self._slab is None or len(self._free) < m:
                self._host[key] = h
                self._host_used += h.nbytes
                continue
            placed[key] = [self._free.pop() for _ in range(m)]
        return placed

    def _upload(
        self, hosts: list[_HostEntry], order: list[int], offsets: list[int], staging: torch.Tensor,
        side: torch.cuda.Stream,
    ) -> LayerReady:
        """Queue the copies on ``side``, layer group by layer group: one batch and one event per
        group."""
        if self._copier is None:
            self._copier = ByteCopier(side)
        layers = hosts[0].shape[0]
        srcs = Sources(
            [hosts[i].block for i in order],
            np.array([hosts[i].address for i in order], dtype=np.int64),
            np.array([hosts[i].nbytes for i in order], dtype=np.int64),
        )
        per_layer = srcs.nbytes // layers
        dst = np.array([offsets[i] for i in order], dtype=np.int64) * staging.element_size()
        groups = min(LAYER_GROUPS, layers)
        ready = []
        start = 0
        for stop in [round(layers * (g + 1) / groups) for g in range(groups)]:
            first = start * per_layer
            self._copier.copy(staging, dst + first, srcs, first, (stop - start) * per_layer)
            event = torch.cuda.Event()
            event.record(side)
            ready.append((stop, event))
            start = stop
        return tuple(ready)

    def _write_promoted(
        self, keys: list[KVKey], hosts: list[_HostEntry], placed: dict[KVKey, list[int]], order: list[int],
        offsets: list[int], staging: torch.Tensor,
    ) -> None:
        """Write the placed facts' pages from the staging copy to the slab: per run of one page
        count, one indexed write straight from the staging layout (no relayout copy first)."""
        assert self._slab is not None
        pt = self.page_tokens
        runs = [list(run) for _, run in itertools.groupby(order, key=lambda i: hosts[i].shape[2])]
        index = self._index([p for run in runs for i in run for p in placed.get(keys[i], ())])
        used = 0
        for run in runs:
            first = hosts[run[0]]
            layers, _, tokens, heads, dim = first.shape
            m = tokens // pt
            start = offsets[run[0]]
            pages = (staging[start : start + len(run) * first.numel]
                     .view(len(run), layers, 2, m, pt, heads, dim).permute(0, 3, 1, 2, 4, 5, 6))
            kept = [r for r, i in enumerate(run) if keys[i] in placed]
            if not kept:
                continue
            if len(kept) < len(run):  # the slab is full: some facts of this run stay on the host
                pages = pages.index_select(0, self._index(kept))
            self._slab.index_put_((index[used : used + len(kept) * m].view(len(kept), m),), pages)
            used += len(kept) * m

    def _read_device(self, entries: list[_DeviceEntry]) -> list[FactKV]:
        """Every entry's KV as views of one copy of their pages (lock held): one gather and one
        relayout for all, and later slab writes never change KV handed out."""
        if not entries:
            return []
        assert self._slab is not None
        self._after_slab_writes()
        index = self._index([p for e in entries for p in e.pages])
        # [2, layers, tokens, heads, dim], contiguous from offset 0 (a one-page gather could
        # otherwise come back as a strided view).
        block = self._pages_to_block(self._slab.index_select(0, index)).contiguous()
        # Each fact's rows, then its page padding, along the token axis: two splits hand out
        # every fact's K and V (k=200 facts a request; one op per tensor would cost ~1 ms).
        sizes = [n for e in entries for n in (e.num_tokens, len(e.pages) * self.page_tokens - e.num_tokens)]
        ks, vs = block[0].split(sizes, dim=1)[::2], block[1].split(sizes, dim=1)[::2]
        return FactKV.cut_alike(ks, vs, [e.position for e in entries])

    def _insert(self, key: KVKey, pages: torch.Tensor, n: int, position: int, fingerprint: str) -> None:
        """Cache a fact's pages on the device slab (lock held)."""
        need = pages.shape[0]
        if self._slab is None or need > self._slab.shape[0]:  # larger than the whole slab: the host serves it
            self._insert_host(key, self._pages_to_fact(pages), n, position, fingerprint)
            return
        while len(self._free) < need:
            self._evict_device(next(iter(self._device)))
        slots = [self._free.pop() for _ in range(need)]
        self._after_slab_writes()
        self._slab.index_copy_(0, self._index(slots), pages.to(self.device, non_blocking=pages.is_pinned()))
        self._device[key] = _DeviceEntry(slots, n, position, fingerprint)

    def _evict_device(self, key: KVKey) -> None:
        entry = self._device.pop(key)
        self._after_slab_writes()
        block = self._pages_to_fact(self._slab.index_select(0, self._index(entry.pages))).to("cpu")  # type: ignore[union-attr]
        self._free.extend(entry.pages)
        self.counters["device_to_host"] += 1
        self._insert_host(key, block, entry.num_tokens, entry.position, entry.fingerprint)

    def _insert_host(self, key: KVKey, block: torch.Tensor, n: int, position: int, fingerprint: str) -> None:
        # Own copy: the caller's tensor (or the slab pages it came from) may change later.
        block = block.to("cpu", copy=True).contiguous()
        if self.pin_memory:
            block = block.pin_memory()
        entry = _HostEntry(block, n, position, fingerprint)
        if entry.nbytes > self.host_bytes:
            self.counters["host_drops"] += 1
            return  # the disk has it
        while self._host_used + entry.nbytes > self.host_bytes:
            self._host_used -= self._host.popitem(last=False)[1].nbytes
            self.counters["host_drops"] += 1
        self._host[key] = entry
        self._host_used += entry.nbytes

    def _after_slab_writes(self) -> None:
        """Order the caller's stream after the last promotion's slab write (side stream)."""
        if self._slab_written is not None:
            torch.cuda.current_stream(self.device).wait_event(self._slab_written)

    def _side_stream(self) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def _drop_memory(self, key: KVKey) -> None:
        entry = self._device.pop(key, None)
        if entry is not None:
            self._free.extend(entry.pages)
        host = self._host.pop(key, None)
        if host is not None:
            self._host_used -= host.nbytes

    def _index(self, pages: list[int]) -> torch.Tensor:
        """Page numbers on the device without a host wait: a plain copy from pageable memory
        would first wait for everything queued on the stream (another request's forward pass,
        promotions in flight)."""
        index = torch.tensor(pages, dtype=torch.long)
        if self.device.type != "cuda":
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

    @staticmethod
    def _pages_to_fact(pages: torch.Tensor) -> torch.Tensor:
        """Page layout to the host tier's ``[layers, 2, m * page_tokens, heads, dim]``."""
        m, layers, _, pt, heads, dim = pages.shape
        return pages.permute(1, 2, 0, 3, 4, 5).reshape(layers, 2, m * pt, heads, dim)

    # ------------------------------------------------------------------ disk tier

    def _write_file(self, key: KVKey, kv: FactKV, fingerprint: str) -> None:
        from safetensors.torch import save

        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {"k": kv.k.detach().to("cpu").contiguous(), "v": kv.v.detach().to("cpu").contiguous()}
        metadata = {
            "format": FILE_FORMAT,
            "fingerprint": fingerprint,
            "fact_id": key[0],
            "kv_version": str(key[1]),
            "position": str(int(kv.position)),
            "num_tokens": str(kv.num_tokens),
        }
        data = save(tensors, metadata=metadata)
        tmp = path.parent / f".{path.stem}.{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        self.counters["disk_writes"] += 1

    def _read_file(self, key: KVKey, fingerprint: str) -> tuple[torch.Tensor, torch.Tensor, int]:
        from safetensors import safe_open

        path = self.path(key)
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = dict(f.metadata() or {})
                k, v = f.get_tensor("k"), f.get_tensor("v")
        except FileNotFoundError:
            raise KVMissingError(f"no KV file for fact {key[0]} v{key[1]}") from None
        except Exception as exc:
            logger.warning("unreadable KV file %s: %s", path, exc)
            raise KVMissingError(f"unreadable KV file for fact {key[0]} v{key[1]}: {exc}") from exc
        if meta.get("format") != FILE_FORMAT or meta.get("fact_id") != key[0] or meta.get("kv_version") != str(key[1]):
            raise KVMissingError(f"KV file {path.name} does not hold fact {key[0]} v{key[1]}")
        _check_fingerprint(key, meta.get("fingerprint"), fingerprint, f"file {path.name}")
        if k.shape != v.shape or k.shape[1] != int(meta.get("num_tokens", -1)):
            raise KVMissingError(f"KV file {path.name} is inconsistent")
        self.counters["disk_reads"] += 1
        return k, v, int(meta["position"])


def _promoted_views(
    staging: torch.Tensor, hosts: list[_HostEntry], order: list[int], offsets: list[int]
) -> list[tuple[list[int], tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """Facts of the staging copy and their K and V views, per run of facts of one shape (host
    block and token count) in ``order``: each fact is its host block's ``[layers, 2, tokens,
    heads, dim]`` at its offset, so a run is one ``[facts, layers, 2, tokens, heads, dim]``
    tensor, unbound — two view ops per run instead of two per fact."""
    out = []
    for _, group in itertools.groupby(order, key=lambda i: _shape_of(hosts[i])):
        run = list(group)
        first = hosts[run[0]]
        start = offsets[run[0]]
        views = staging[start : start + len(run) * first.numel].view(len(run), *first.shape)
        rows = views[:, :, :, : first.num_tokens]
        out.append((run, rows[:, :, 0].unbind(0), rows[:, :, 1].unbind(0)))
    return out


def _shape_of(h: _HostEntry) -> tuple[int, int]:
    """Padded and real token counts: facts equal in both are laid out and viewed alike."""
    return h.shape[2], h.num_tokens


def _check_fingerprint(key: KVKey, found: str | None, expected: str, where: str) -> None:
    if found != expected:
        raise StaleKVError(
            f"KV of fact {key[0]} v{key[1]} in {where} was encoded under model fingerprint {found!r}, "
            f"this store serves {expected!r}; refusing it"
        )


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
