"""Where fact KV lives: a paged device slab, a host tier and a disk tier.

* **Device tier** – one slab preallocated on first use (``torch.empty``), shaped
  ``[num_pages, layers, 2, page_tokens, kv_heads, head_dim]``: a fact of ``n`` tokens takes
  ``ceil(n / page_tokens)`` pages from a free list, so nothing is allocated per fact. On a CPU
  engine the "device" is the CPU and the slab is an ordinary tensor.
* **Host tier** – per-fact CPU tensors in the slab's page layout (``[pages, layers, 2,
  page_tokens, heads, dim]``, pinned when CUDA is available). A host hit is promoted by DMA
  straight into the slab pages it gets, on a side stream: one ``cudaMemcpyBatchAsync`` for the
  whole batch, a range per run of pages the slab has consecutive. The promoted facts are then
  device-tier facts and are read like the others, in the same gather; that gather waits for the
  copies on the device (stream order), so the caller never blocks on PCIe.
* **Disk tier** – one safetensors file per fact version, written atomically (temp file in the
  same folder, fsync, ``os.replace``, fsync of the folder) and carrying the model fingerprint
  in its metadata. Disk is write-through and unbounded: every encoded fact has its file before
  it enters memory, so the memory tiers are pure caches.

Memory tiers are exclusive and LRU: a ``put`` or a promotion lands on the device; the device
evicts its least recently used fact to the host (never one the same ``get_many`` serves), the
host drops its least recently used fact (the disk still holds it). ``get_many`` returns its
facts as views of *one copy* gathered from the slab for all of them (two kernels whatever
``k``), so a span in flight never sees its pages reused. Bytes are never converted: KV read
back from any tier is ``torch.equal`` to what was put.
"""

from __future__ import annotations

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
from inferscale_engine.kv import FactKV
from inferscale_engine.memory.dma import ByteCopier, Sources

logger = logging.getLogger(__name__)

KVKey = tuple[str, int]  # (fact id, kv version)
Tier = Literal["device", "host", "disk"]

FILE_FORMAT = "inferscale-kv/1"
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
    # The slab's page layout, [pages, layers, 2, page_tokens, heads, dim]: each page is one
    # contiguous range, copied by DMA straight into a slab page.
    block: torch.Tensor
    num_tokens: int
    position: int
    fingerprint: str
    # Read once: a promotion of k facts would otherwise ask torch for them per fact, on the
    # request's path. The block is never replaced or resized.
    pages: int = field(init=False)
    nbytes: int = field(init=False)
    address: int = field(init=False)

    def __post_init__(self) -> None:
        self.pages, self.nbytes, self.address = self.block.shape[0], self.block.nbytes, self.block.data_ptr()


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
        # CUDA: promotions copy into the slab on a side stream. Slab readers and writers on the
        # caller's stream wait for the last such copy; a copy waits for the caller's last slab
        # access (it may reuse the pages that one read), not for all the caller's queued work;
        # host sources stay referenced until their copies have run.
        self._side: torch.cuda.Stream | None = None
        self._copier: ByteCopier | None = None
        self._slab_written: torch.cuda.Event | None = None
        self._slab_used: torch.cuda.Event | None = None
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
        """KV of each key on the device, for injection, as views of one copy gathered from the
        slab: host-tier facts are promoted into the slab first (asynchronously on CUDA: the
        gather waits for their copies on the device, not on the host), disk-tier facts are read
        and cached on the device.

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
            if on_host:
                promoted, served = self._promote(list(on_host), keep={keys[i] for i, _ in on_device})
                for key, entry in promoted.items():
                    on_device.extend((i, entry) for i in on_host[key])
                for key, kv in served.items():
                    for i in on_host[key]:
                        out[i] = kv
            for (i, _), kv in zip(on_device, self._read_device([e for _, e in on_device])):
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

    def _promote(
        self, keys: list[KVKey], keep: set[KVKey]
    ) -> tuple[dict[KVKey, _DeviceEntry], dict[KVKey, FactKV]]:
        """Move host-tier facts into slab pages (lock held), evicting device facts not in
        ``keep`` as needed; return the new device entries, and the KV of facts the slab could
        not take, which stay on the host and are served from there."""
        placed: list[tuple[KVKey, _HostEntry, list[int]]] = []
        served: dict[KVKey, FactKV] = {}
        for key in keys:
            h = self._host.pop(key)
            self._host_used -= h.nbytes
            while len(self._free) < h.pages:
                victim = next((k for k in self._device if k not in keep), None)
                if victim is None:
                    break
                self._evict_device(victim)
            if self._slab is None or len(self._free) < h.pages:
                self._keep_on_host(key, h)
                pages = h.block.to(self.device, non_blocking=h.block.is_pinned(), copy=True)
                served[key] = self._hand_out(pages, [(h.num_tokens, h.pages, h.position)])[0]
                continue
            placed.append((key, h, [self._free.pop() for _ in range(h.pages)]))
        if placed:
            self._copy_to_slab(placed)
        promoted = {}
        for key, h, pages in placed:
            promoted[key] = self._device[key] = _DeviceEntry(pages, h.num_tokens, h.position, h.fingerprint)
        self.counters["host_to_device"] += len(placed)
        return promoted, served

    def _copy_to_slab(self, placed: list[tuple[KVKey, _HostEntry, list[int]]]) -> None:
        """Copy host blocks into their slab pages: on CUDA one batch of DMAs on the side stream,
        a range per run of pages that lie one after the other in both the block and the slab."""
        assert self._slab is not None
        if self.device.type != "cuda":
            pages = [p for _, _, ps in placed for p in ps]
            self._slab.index_copy_(0, self._index(pages), torch.cat([h.block for _, h, _ in placed]))
            return
        page_bytes = self._slab[0].nbytes
        counts = np.array([len(ps) for _, _, ps in placed], dtype=np.int64)
        fact = np.repeat(np.arange(len(placed)), counts)  # which fact each page belongs to
        first_page = np.repeat(np.cumsum(counts) - counts, counts)
        src = (np.arange(len(fact)) - first_page) * page_bytes  # byte offset in its host block
        dst = np.fromiter((p for _, _, ps in placed for p in ps), dtype=np.int64, count=len(fact)) * page_bytes
        run_start = np.ones(len(fact), dtype=bool)
        run_start[1:] = (fact[1:] != fact[:-1]) | (dst[1:] != dst[:-1] + page_bytes)
        starts = np.flatnonzero(run_start)
        sizes = np.diff(np.append(starts, len(fact))) * page_bytes
        blocks = [h.block for _, h, _ in placed]
        owner = fact[starts]
        srcs = Sources(
            [blocks[i] for i in owner.tolist()],
            np.array([h.address for _, h, _ in placed], dtype=np.int64)[owner],
            np.array([h.nbytes for _, h, _ in placed], dtype=np.int64)[owner],
        )
        side = self._side_stream()
        if self._copier is None:
            self._copier = ByteCopier(side)
        if self._slab_used is not None:  # the pages may have been read or written there last
            side.wait_event(self._slab_used)
        self._copier.copy(self._slab, dst[starts], srcs, src[starts], sizes)
        written = torch.cuda.Event()
        written.record(side)
        self._slab_written = written
        self._in_flight.append((written, blocks))

    def _read_device(self, entries: list[_DeviceEntry]) -> list[FactKV]:
        """Every entry's KV as views of one copy of their pages (lock held): one gather and one
        relayout for all, and later slab writes never change KV handed out."""
        if not entries:
            return []
        assert self._slab is not None
        self._after_slab_writes()
        pages = self._slab.index_select(0, self._index([p for e in entries for p in e.pages]))
        self._used_slab()
        return self._hand_out(pages, [(e.num_tokens, len(e.pages), e.position) for e in entries])

    def _hand_out(self, pages: torch.Tensor, facts: list[tuple[int, int, int]]) -> list[FactKV]:
        """FactKVs of facts laid out one after the other in ``pages`` (page layout), given as
        ``(tokens, pages, position)`` each."""
        # [2, layers, tokens, heads, dim], contiguous from offset 0 (a one-page gather could
        # otherwise come back as a strided view).
        block = self._pages_to_block(pages).contiguous()
        # Each fact's rows, then its page padding, along the token axis: two splits hand out
        # every fact's K and V (k=200 facts a request; one op per tensor would cost ~1 ms).
        pt = self.page_tokens
        sizes = [n for tokens, m, _ in facts for n in (tokens, m * pt - tokens)]
        ks, vs = block[0].split(sizes, dim=1)[::2], block[1].split(sizes, dim=1)[::2]
        return FactKV.cut_alike(ks, vs, [position for _, _, position in facts])

    def _insert(self, key: KVKey, pages: torch.Tensor, n: int, position: int, fingerprint: str) -> None:
        """Cache a fact's pages on the device slab (lock held)."""
        need = pages.shape[0]
        if self._slab is None or need > self._slab.shape[0]:  # larger than the whole slab: the host serves it
            self._insert_host(key, pages, n, position, fingerprint)
            return
        while len(self._free) < need:
            self._evict_device(next(iter(self._device)))
        slots = [self._free.pop() for _ in range(need)]
        self._after_slab_writes()
        self._slab.index_copy_(0, self._index(slots), pages.to(self.device, non_blocking=pages.is_pinned()))
        self._used_slab()
        self._device[key] = _DeviceEntry(slots, n, position, fingerprint)

    def _evict_device(self, key: KVKey) -> None:
        entry = self._device.pop(key)
        self._after_slab_writes()
        pages = self._slab.index_select(0, self._index(entry.pages)).to("cpu")  # type: ignore[union-attr]
        self._free.extend(entry.pages)
        self.counters["device_to_host"] += 1
        self._insert_host(key, pages, entry.num_tokens, entry.position, entry.fingerprint)

    def _insert_host(self, key: KVKey, pages: torch.Tensor, n: int, position: int, fingerprint: str) -> None:
        # Own copy: the caller's tensor (or the slab pages it came from) may change later.
        block = pages.to("cpu", copy=True).contiguous()
        if self.pin_memory:
            block = block.pin_memory()
        self._keep_on_host(key, _HostEntry(block, n, position, fingerprint))

    def _keep_on_host(self, key: KVKey, entry: _HostEntry) -> None:
        """Put ``entry`` in the host tier, dropping least recently used ones to make room."""
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

    def _used_slab(self) -> None:
        """Mark the caller's last slab access: promotions reusing pages wait for it."""
        if self.device.type == "cuda":
            used = torch.cuda.Event()
            used.record(torch.cuda.current_stream(self.device))
            self._slab_used = used

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
