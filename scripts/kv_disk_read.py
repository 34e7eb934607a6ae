"""Disk-tier read bandwidth, cold (page cache dropped per file) and warm, for k fact files of a
Llama-3.1-8B shape (28 tokens: 3.67 MB of bf16 KV each), no engine:

    python scripts/kv_disk_read.py [--k 50] [--repeats 5] [--root DIR]

``parallel``: ``KVTiers.get_many`` as a store reads a request's disk-tier facts (the reader pool,
one ``preadv`` per file into a pinned buffer on CUDA, checksum and finiteness check off the GIL).
``serial``: the same files through safetensors' own loader one after the other, with the same
checksum and finiteness check, then to the device, as the disk tier read them before (build
f3ccae6). Medians of ``--repeats``; compare with ``scripts/disk_raw.sh`` (dd).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from inferscale_engine.kv import FactKV, check_finite
from inferscale_engine.memory.kv.tiers import KVTiers
from inferscale_engine.testing import kv_digest


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--root", default=None)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    root = tempfile.mkdtemp(prefix="kv-disk-read-", dir=args.root)
    try:
        tiers = KVTiers(root, device=device, device_bytes=2 << 30, host_bytes=2 << 30)
        keys = [(f"{i:016x}", 1) for i in range(args.k)]
        for key in keys:
            k = torch.randn(32, 28, 8, 128, dtype=torch.bfloat16)
            tiers.put(key, FactKV(k, k.clone(), 0), "fp")
        nbytes = sum(tiers.path(key).stat().st_size for key in keys)

        def drop(cold: bool) -> None:
            for key in keys:
                tiers.evict(key, to="disk")
                if cold:
                    fd = os.open(tiers.path(key), os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)

        def parallel() -> None:
            tiers.get_many(keys, "fp")
            if device == "cuda":
                torch.cuda.synchronize()

        def serial() -> None:
            from safetensors import safe_open

            for key in keys:
                with safe_open(str(tiers.path(key)), framework="pt", device="cpu") as f:
                    k, v = f.get_tensor("k"), f.get_tensor("v")
                kv_digest(k, v)  # what every read checks
                check_finite(k, v, "KV")
                FactKV(k.to(device), v.to(device), 0)

        for name, read in (("parallel", parallel), ("serial", serial)):
            for cold in (True, False):
                times = []
                for _ in range(args.repeats):
                    drop(cold)
                    if not cold:
                        for key in keys:  # into the page cache
                            tiers.path(key).read_bytes()
                    t0 = time.perf_counter()
                    read()
                    times.append(time.perf_counter() - t0)
                t = statistics.median(times)
                print(f"{name:8s} {'cold' if cold else 'warm'}: {args.k} files, {nbytes / 1e6:.0f} MB in "
                      f"{1e3 * t:.1f} ms = {nbytes / t / 1e9:.2f} GB/s", flush=True)
        tiers.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
