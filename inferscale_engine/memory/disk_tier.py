"""The disk tier of a memory store's KV: one safetensors file per fact version.

Files are written atomically (temp file in the same folder, fsync, ``os.replace``, fsync of
the folder) and carry the model fingerprint in their metadata, so KV made by another model is
refused, never served. Each file also carries a SHA-256 of its tensor bytes: content that
rotted on disk (or was edited) fails it, is counted in ``corrupt`` and re-encoded, like a
truncated file, never served. Non-finite values are refused both ways: one NaN injected into
vLLM's paged cache outlives its request (see :func:`inferscale_engine.kv.check_finite`).
Disk is write-through and unbounded: every encoded fact has its file
before it enters memory, so the memory tiers above it are pure caches.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch

from inferscale_engine.errors import KVMissingError, StaleKVError
from inferscale_engine.errors import NonFiniteKVError
from inferscale_engine.kv import FactKV, check_finite

logger = logging.getLogger(__name__)

KVKey = tuple[str, int]  # (fact id, kv version)

FILE_FORMAT = "inferscale-kv/1"
_FILE_RE = re.compile(r"^([0-9a-f]{16})-(\d+)\.safetensors$")


class DiskTier:
    """KV files under ``root`` (``root/<2 hex>/<fact id>-<version>.safetensors``). The caller
    serialises calls that must not interleave (a delete with a sweep)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.writes = 0
        self.reads = 0
        #: Files refused for content: checksum mismatch or non-finite values.
        self.corrupt = 0

    def path(self, key: KVKey) -> Path:
        fact_id, version = key
        return self.root / fact_id[:2] / f"{fact_id}-{int(version)}.safetensors"

    def contains(self, key: KVKey) -> bool:
        return self.path(key).exists()

    def put(self, key: KVKey, kv: FactKV, fingerprint: str) -> None:
        """Write ``kv`` atomically: a reader sees the old file, the new one, or none."""
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

    def get_blocking(self, key: KVKey, fingerprint: str) -> tuple[torch.Tensor, torch.Tensor, int]:
        """K, V (on the CPU) and position of ``key``; :class:`KVMissingError` when there is no
        usable file, :class:`StaleKVError` when it was made under another fingerprint."""
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

    def remove(self, key: KVKey) -> None:
        _unlink(self.path(key))

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
        """Remove temp files and KV files of no live fact version; return (files kept, removed)."""
        kept: set[KVKey] = set()
        removed = 0
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

    def close(self) -> None:
        """Nothing to release: every write is complete (fsynced) when ``put`` returns."""


def check_fingerprint(key: KVKey, found: str | None, expected: str, where: str) -> None:
    if found != expected:
        raise StaleKVError(
            f"KV of fact {key[0]} v{key[1]} in {where} was encoded under model fingerprint {found!r}, "
            f"this store serves {expected!r}; refusing it"
        )


def _digest(k: torch.Tensor, v: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in (k, v):
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


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
