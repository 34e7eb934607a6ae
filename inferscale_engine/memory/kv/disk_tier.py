"""The disk tier of a memory store's KV: one safetensors file per fact version.

Files are written atomically (temp file in the same folder, fsync, ``os.replace``, fsync of
the folder) and carry the model fingerprint in their metadata, so KV made by another model is
refused, never served. Each file also carries a SHA-256 of its tensor bytes: content that
rotted on disk (or was edited) fails it, is counted in ``corrupt`` and re-encoded, like a
truncated file, never served. Non-finite values are refused both ways: one NaN injected into
vLLM's paged cache outlives its request (see :func:`inferscale_engine.kv.check_finite`).
Disk is write-through and unbounded: every encoded fact has its file
before it enters memory, so the memory tiers above it are pure caches. :class:`DiskTier` is a
:class:`~inferscale_engine.memory.kv.backend.TierBackend`, with files' own operations besides
(``get_blocking``, ``cached``, ``sweep``, ``read_metadata``).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import json
import logging
import math
import mmap
import os
import platform
import re
import shutil
import struct
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch

from inferscale_engine.errors import KVMissingError, NonFiniteKVError
from inferscale_engine.kv import FactKV, check_finite
from inferscale_engine.memory.kv.backend import KVKey, Tier, TierBackend, TierConfig, check_fingerprint

__all__ = ["CALIBRATION_PREFIX", "DiskTier", "KVKey", "check_fingerprint"]

logger = logging.getLogger(__name__)

FILE_FORMAT = "inferscale-kv/1"
_FILE_RE = re.compile(r"^([0-9a-f]{16})-(\d+)\.safetensors$")
#: Scratch folders of the start-up disk measurement (memory.bandwidth), in the KV folder so that
#: it measures this disk; one a crash left behind is removed by :meth:`DiskTier.sweep`.
CALIBRATION_PREFIX = ".calibration-"


class DiskTier(TierBackend):
    """KV files under ``root`` (``root/<2 hex>/<fact id>-<version>.safetensors``). The caller
    serialises calls that must not interleave (a delete with a sweep)."""

    name: Tier = "disk"

    def __init__(self, root: str | os.PathLike, *, pin_memory: bool = False,
                 read_bps: float | None = None) -> None:
        self.root = Path(root)
        self._root = os.fspath(self.root)
        #: Read files into pinned memory (CUDA: the copy to the device is then a DMA).
        self.pin_memory = pin_memory
        #: Bytes a second reads may take, all readers together; ``None``: as fast as the disk.
        self.read_bps = read_bps
        self._throttle_lock = threading.Lock()
        self._throttle_until = 0.0
        self.root.mkdir(parents=True, exist_ok=True)
        self.writes = 0
        self.reads = 0
        #: Files refused for content: checksum mismatch or non-finite values.
        self.corrupt = 0

    @classmethod
    def of(cls, config: TierConfig) -> DiskTier:
        """The disk tier of ``config`` (its files read into pinned memory where the device is CUDA)."""
        return cls(config.root, pin_memory=config.pin_memory and config.device.type == "cuda",
                   read_bps=config.disk_read_bps)

    def path(self, key: KVKey) -> Path:
        return Path(self._file(key))

    def _file(self, key: KVKey) -> str:
        """:meth:`path` as a string, built without pathlib (~20 µs a path on a busy core; a
        request may name 200 files)."""
        fact_id, version = key
        return f"{self._root}/{fact_id[:2]}/{fact_id}-{int(version)}.safetensors"

    def contains(self, key: KVKey) -> bool:
        return os.path.exists(self._file(key))

    def nbytes(self, key: KVKey) -> int:
        """Size of ``key``'s file; 0 when there is none."""
        try:
            return os.stat(self._file(key)).st_size
        except OSError:
            return 0

    def put(self, key: KVKey, kv: FactKV, fingerprint: str) -> bool:
        """Write ``kv`` atomically: a reader sees the old file, the new one, or none. Always room."""
        from safetensors.torch import save

        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {"k": kv.k.detach().to("cpu").contiguous(), "v": kv.v.detach().to("cpu").contiguous()}
        check_finite(tensors["k"], tensors["v"], f"KV of fact {key[0]} v{key[1]}")
        metadata = {
            "sha256": _digest(tensors["k"], tensors["v"]),
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
        self.writes += 1
        return True

    def get(self, key: KVKey, fingerprint: str) -> FactKV:
        """``key``'s KV on the CPU (see :meth:`get_blocking`)."""
        k, v, position = self.get_blocking(key, fingerprint)
        return FactKV(k, v, position)

    def get_blocking(self, key: KVKey, fingerprint: str) -> tuple[torch.Tensor, torch.Tensor, int]:
        """K, V (on the CPU, views of one buffer, pinned when ``pin``) and position of ``key``;
        :class:`KVMissingError` when there is no usable file, :class:`StaleKVError` when it was
        made under another fingerprint. Safe to call from many threads at once: the read, the
        checksum and the finiteness check all run without the GIL."""
        path = self.path(key)
        try:
            data = self._read_file(path)
            meta, tensors = _parse_safetensors(data)
            k, v = tensors["k"], tensors["v"]
        except FileNotFoundError:
            raise KVMissingError(f"no KV file for fact {key[0]} v{key[1]}") from None
        except Exception as exc:
            logger.warning("unreadable KV file %s: %s", path, exc)
            raise KVMissingError(f"unreadable KV file for fact {key[0]} v{key[1]}: {exc}") from exc
        if meta.get("format") != FILE_FORMAT or meta.get("fact_id") != key[0] or meta.get("kv_version") != str(key[1]):
            raise KVMissingError(f"KV file {path.name} does not hold fact {key[0]} v{key[1]}")
        check_fingerprint(key, meta.get("fingerprint"), fingerprint, f"file {path.name}")
        if k.shape != v.shape or k.shape[1] != int(meta.get("num_tokens", -1)):
            raise KVMissingError(f"KV file {path.name} is inconsistent")
        # Files written before checksums have none: they still get the finiteness check.
        expected = meta.get("sha256")
        try:
            if expected is not None and _digest(k, v) != expected:
                raise KVMissingError(f"KV file {path.name} fails its checksum (corrupted on disk)")
            check_finite(k, v, f"KV file {path.name}")
        except (KVMissingError, NonFiniteKVError) as exc:
            self.corrupt += 1
            # Gone, so the re-encode that follows is the only reader, and a file is counted once.
            _unlink(path)
            logger.warning("%s; removed it, the fact is re-encoded", exc)
            raise KVMissingError(str(exc)) from None
        self.reads += 1
        return k, v, int(meta["position"])

    def cached(self, key: KVKey) -> bool:
        """Whether ``key``'s whole file sits in the OS page cache (a read would not wait for the
        disk): ``cachestat`` of the file (Linux 6.5+), else ``mincore`` of it mapped; neither
        reads anything. (A ``preadv(RWF_NOWAIT)`` probe would say the same but start readahead
        of what it missed, warming the file.)"""
        try:
            fd = os.open(self._file(key), os.O_RDONLY)
        except OSError:
            return False
        try:
            return _resident(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    def _read_file(self, path: Path) -> torch.Tensor:
        """The whole file in one ``preadv`` into a (pinned, where that is the tier's setting)
        byte tensor: no per-tensor copies, and the GIL is released for the read."""
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)
            view = buffer.numpy().data
            done = 0
            while done < size:
                n = os.preadv(fd, [view[done:]], done)
                if n <= 0:
                    raise OSError(f"{path.name}: file ended at byte {done} of {size}")
                done += n
        finally:
            os.close(fd)
        if self.read_bps:
            self._throttle(size)
        return buffer

    def _throttle(self, nbytes: int) -> None:
        """Hold the reader until ``nbytes`` fit the ``read_bps`` budget, shared by every reader:
        a disk that delivers that many bytes a second (a network volume, a busy drive)."""
        with self._throttle_lock:
            now = time.monotonic()
            self._throttle_until = max(self._throttle_until, now) + nbytes / self.read_bps  # type: ignore[operator]
            wait = self._throttle_until - now
        if wait > 0:
            time.sleep(wait)

    def remove(self, key: KVKey) -> bool:
        return _unlink(self.path(key))

    def remove_fact(self, fact_id: str) -> None:
        """Every version of ``fact_id``, and temp files of writes that never finished."""
        folder = self.root / fact_id[:2]
        if folder.is_dir():
            for p in folder.glob(f"{fact_id}-*.safetensors"):
                _unlink(p)
            for p in folder.glob(f".{fact_id}-*.tmp"):
                _unlink(p)

    def read_metadata(self, key: KVKey) -> dict[str, str] | None:
        """The safetensors metadata of ``key``'s file, or ``None`` when absent or unreadable."""
        from safetensors import safe_open

        try:
            with safe_open(str(self.path(key)), framework="pt", device="cpu") as f:
                return dict(f.metadata() or {})
        except Exception:
            return None

    def sweep(self, live: Mapping[str, int]) -> tuple[set[KVKey], int]:
        """Remove temp files, KV files of no live fact version and scratch folders of a measurement
        a crash interrupted; return (files kept, files removed)."""
        kept: set[KVKey] = set()
        removed = 0
        for folder in self.root.iterdir():
            if not folder.is_dir():
                continue
            if folder.name.startswith(CALIBRATION_PREFIX):
                # The store's folder is this process's alone (its lock) and sweeps run when it
                # opens, before its measurement starts: a scratch folder here is a dead one's.
                removed += sum(1 for p in folder.rglob("*") if p.is_file())
                shutil.rmtree(folder, ignore_errors=True)
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
        return {"disk_writes": self.writes, "disk_reads": self.reads, "disk_corrupt": self.corrupt}

    def close(self) -> None:
        """Nothing to release: every write is complete (fsynced) when ``put`` returns."""


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.syscall.restype = ctypes.c_long
        return libc
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return None


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


#: ``cachestat``'s number in the generic syscall table (x86-64 and arm64 alike).
_SYS_CACHESTAT = 451
_has_cachestat = sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")


def _cached_pages(libc: ctypes.CDLL, fd: int) -> int | None:
    """Pages of ``fd`` in the page cache, from one ``cachestat`` call (a quarter of the
    ``mmap``/``mincore``/``munmap`` probe's time); ``None`` where the kernel has no cachestat."""
    global _has_cachestat
    if not _has_cachestat:
        return None
    whole, stat = _CachestatRange(0, 0), _Cachestat()  # len 0: to the end of the file
    if libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(whole), ctypes.byref(stat), 0) != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):  # an older kernel, a seccomp filter
            _has_cachestat = False
        return None
    return int(stat.nr_cache)


def _resident(fd: int, size: int) -> bool:
    """Whether the first ``size`` bytes of ``fd`` are in the page cache."""
    libc = _libc()
    if libc is None or size <= 0:
        return False
    pages = _cached_pages(libc, fd)
    if pages is not None:
        return pages >= -(-size // mmap.PAGESIZE)
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        return False
    try:
        # The first and the last page: files are written and read whole, and a full scan costs
        # ~4x more (a request may probe ~200 files).
        vec = (ctypes.c_ubyte * 1)()
        last = (size - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        for offset in {0, last}:
            if libc.mincore(addr + offset, 1, vec) != 0 or not vec[0] & 1:
                return False
        return True
    finally:
        libc.munmap(addr, size)


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8, "I8": torch.int8}


def _parse_safetensors(data: torch.Tensor) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Metadata and tensors of a safetensors file held in the byte tensor ``data``; the tensors
    are views of it (safetensors' own loader copies each tensor out of its mmap)."""
    raw = data.numpy()
    if raw.nbytes < 8:
        raise ValueError("too short for a safetensors file")
    (n,) = struct.unpack("<Q", raw[:8].tobytes())
    if n > raw.nbytes - 8:
        raise ValueError("header longer than the file")
    header = json.loads(raw[8 : 8 + n].tobytes())
    meta = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]]
        shape = [int(d) for d in info["shape"]]
        if not 0 <= start <= end <= raw.nbytes - 8 - n:
            raise ValueError(f"tensor {name} lies outside the file")
        t = data[8 + n + start : 8 + n + end].view(dtype)
        if t.numel() != math.prod(shape):
            raise ValueError(f"tensor {name} has {t.numel()} values for shape {shape}")
        tensors[name] = t.view(shape)
    return meta, tensors


def _digest(k: torch.Tensor, v: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in (k, v):
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def _unlink(path: Path) -> bool:
    """Remove ``path``; whether it was there."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


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
