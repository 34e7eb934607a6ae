"""Measured speeds of a store's KV tiers: what the engine's cost model weighs a cold read by.

Disk: KV files written through the disk tier itself (same folder, so the same filesystem; same
reader, checksum, finiteness check and ``disk_read_bps`` throttle), dropped from the OS page
cache (``posix_fadvise(DONTNEED)`` after ``fsync``: clean pages go), then read back on the
tiers' reader pool the way a request's cold facts are: one fact-sized file alone, many in
parallel, and many tiny ones in parallel. A parallel read of ``n`` files of ``b`` bytes is taken
to cost ``latency + n * b / bandwidth + n * file_s``: ``file_s`` is each file's own host work
(opening, parsing, checking it), which the reader threads share, and which dominates reads of
small facts. Host to device: one pinned buffer copied to the device. Each takes a fraction of a
second; nothing is hard-coded.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from inferscale_engine.kv import FactKV
from inferscale_engine.memory.kv.disk_tier import CALIBRATION_PREFIX, DiskTier

if TYPE_CHECKING:
    from inferscale_engine.memory.kv.tiers import KVTiers

_FINGERPRINT = "calibration"


@dataclass(frozen=True)
class TierSpeeds:
    """Bytes a second from disk (cold, parallel reads) and host to device, with the per-read
    latency of the disk; ``host_to_device_bytes_per_s`` is ``None`` on a CPU engine."""

    disk_bytes_per_s: float
    disk_latency_s: float
    #: Whether the files were really read past the page cache (``False``: the filesystem keeps
    #: them in memory, e.g. tmpfs, and the figure is a memory copy).
    disk_cold: bool
    host_to_device_bytes_per_s: float | None
    #: Seconds of each file's own host work in a parallel read (see the module docstring).
    disk_file_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure(tiers: KVTiers, *, files: int = 16, file_bytes: int = 2 << 20) -> TierSpeeds:
    """Measure ``tiers``' disk and host-to-device speeds (see the module docstring)."""
    disk_bps, latency, file_s, cold = _measure_disk(tiers, files, file_bytes)
    h2d = _measure_host_to_device(tiers.device) if tiers.device.type == "cuda" else None
    return TierSpeeds(disk_bps, latency, cold, h2d, file_s)


def _measure_disk(tiers: KVTiers, files: int, file_bytes: int) -> tuple[float, float, float, bool]:
    """Bandwidth, latency and per-file host seconds of parallel reads (see the module
    docstring), and whether the files were read past the page cache."""
    root = tiers.root / f"{CALIBRATION_PREFIX}{uuid.uuid4().hex[:8]}"
    disk = DiskTier(root, pin_memory=tiers.disk.pin_memory, read_bps=tiers.disk.read_bps)
    try:
        # Fact-like files: [layers, tokens, heads, dim] bf16 K and V, ``file_bytes`` together,
        # and tiny ones of one token.
        tokens = max(1, file_bytes // (2 * 8 * 8 * 128 * 2))
        keys = [(f"{i:016x}", 1) for i in range(files + 1)]
        tiny = [(f"{i:016x}", 2) for i in range(files)]
        for key in keys + tiny:
            k = torch.randn(8, tokens if key[1] == 1 else 1, 8, 128, dtype=torch.bfloat16)
            disk.put(key, FactKV(k, k.clone(), 0), _FINGERPRINT)
        cold = all([_drop_cached(disk, key) for key in keys + tiny])
        size = disk.path(keys[0]).stat().st_size

        def read(key: tuple[str, int]) -> None:
            disk.get_blocking(key, _FINGERPRINT)

        t0 = time.perf_counter()
        read(keys[0])
        one = time.perf_counter() - t0
        # A slow disk (a throttled one) gets fewer files: the measurement stays near 1/4 s.
        n = max(2, min(files, int(0.25 / max(one, 1e-9))))
        with ThreadPoolExecutor(tiers.read_threads) as pool:
            t0 = time.perf_counter()
            list(pool.map(read, keys[1 : n + 1]))
            many = time.perf_counter() - t0
            t0 = time.perf_counter()
            list(pool.map(read, tiny[:n]))
            small = time.perf_counter() - t0
        # one = latency + size / bps + file_s; many = latency + n * (size / bps + file_s);
        # small = latency + n * file_s (their bytes are next to nothing).
        per_file = max((many - one) / (n - 1), 1e-9)  # size / bps + file_s
        latency = max(0.0, one - per_file)
        file_s = min(max(0.0, (small - latency) / n), per_file)
        # Noise can leave nothing to the bytes: then count all of the parallel read as bytes.
        bps = size / (per_file - file_s) if per_file > file_s else n * size / max(many, 1e-9)
        return bps, latency, file_s, cold
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _drop_cached(disk: DiskTier, key: tuple[str, int]) -> bool:
    """Drop a file's pages from the page cache; whether they are gone."""
    if not hasattr(os, "posix_fadvise"):  # pragma: no cover - not on Linux
        return False
    fd = os.open(disk.path(key), os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return not disk.cached(key)


def _measure_host_to_device(device: torch.device, nbytes: int = 64 << 20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(4):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best
