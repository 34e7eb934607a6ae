"""The one small interface every KV tier has, and the one config the tiers are built from.

A tier (:class:`TierBackend`; LMCache's storage backends have its shape) holds fact KV under a
:data:`KVKey` and answers:

* ``contains(key)`` – whether the tier holds ``key`` (memory tiers: an entry; disk: a file);
* ``put(key, kv, fingerprint)`` – store ``kv`` if the tier has room for it; whether it did. A
  memory tier never makes room by itself: moving a fact down a tier is the coordinator's;
* ``get(key, fingerprint)`` – the KV, ``torch.equal`` to what was put, from this tier alone (no
  promotion); :class:`KVMissingError` when the tier lacks ``key``, :class:`StaleKVError` when it
  was made under another fingerprint;
* ``remove(key)`` – free what the tier holds of ``key``; whether it held any;
* ``stats()`` and ``close()``.

The tiers are :class:`~.device_tier.DeviceTier`, :class:`~.host_tier.HostTier` and
:class:`~.disk_tier.DiskTier`; :class:`~.tiers.KVTiers` builds them from one :class:`TierConfig`
and coordinates them (promotion, eviction order, budgets). The memory tiers are not thread-safe
on their own: the coordinator calls them under its lock.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypedDict, Unpack

import torch

from inferscale_engine.errors import KVMissingError, StaleKVError
from inferscale_engine.kv import FactKV

__all__ = ["KVKey", "KVMissingError", "StaleKVError", "Tier", "TierBackend", "TierConfig", "TierSettings",
           "check_fingerprint"]

KVKey = tuple[str, int]  # (fact id, kv version)

Tier = Literal["device", "host", "disk"]


class _PassedOn(TypedDict, total=False):
    """The :class:`TierConfig` fields a setting of the same name gives as it is."""

    device_bytes: int
    host_bytes: int
    page_tokens: int
    read_threads: int
    disk_read_bps: float | None


class TierSettings(_PassedOn, total=False):
    """Keyword settings of :meth:`TierConfig.of` (and :class:`~.tiers.KVTiers`); each defaults
    to the :class:`TierConfig` field of its name, ``pin_memory=None`` to where CUDA is available."""

    device: str | torch.device
    pin_memory: bool | None


@dataclass(frozen=True)
class TierConfig:
    """What the tiers of one store are built from, checked when made (``ValueError``)."""

    #: The disk tier's folder.
    root: Path
    #: Where the device tier's slab lives (the encoder's device; on a CPU engine the CPU).
    device: torch.device = torch.device("cpu")
    device_bytes: int = 512 << 20
    host_bytes: int = 2 << 30
    page_tokens: int = 16
    #: Pin host-tier pages (CUDA: copies to the device are then DMAs).
    pin_memory: bool = False
    #: Threads reading disk-tier files for requests.
    read_threads: int = 16
    #: Bytes a second disk reads may take, all readers together; ``None``: as fast as the disk.
    disk_read_bps: float | None = None

    def __post_init__(self) -> None:
        if self.page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {self.page_tokens}")
        for name in ("device_bytes", "host_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 bytes, got {getattr(self, name)}")
        if self.read_threads < 1:
            raise ValueError(f"read_threads must be >= 1, got {self.read_threads}")
        if self.disk_read_bps is not None and not self.disk_read_bps > 0:
            raise ValueError(f"disk_read_bps must be > 0 bytes a second or None, got {self.disk_read_bps!r}")

    @classmethod
    def of(
        cls,
        root: str | os.PathLike,
        *,
        device: str | torch.device = "cpu",
        pin_memory: bool | None = None,
        **fields: Unpack[_PassedOn],
    ) -> TierConfig:
        """The config of ``root`` and these settings (:class:`TierSettings`), the rest left at
        their defaults."""
        return cls(root=Path(root), device=torch.device(device),
                   pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory, **fields)


class TierBackend(abc.ABC):
    """One tier of a store's KV (see the module docstring)."""

    #: Which tier this is.
    name: Tier

    @abc.abstractmethod
    def contains(self, key: KVKey) -> bool:
        """Whether this tier holds ``key``."""

    @abc.abstractmethod
    def put(self, key: KVKey, kv: FactKV, fingerprint: str) -> bool:
        """Store ``kv`` under ``key`` if this tier has room for it; whether it did."""

    @abc.abstractmethod
    def get(self, key: KVKey, fingerprint: str) -> FactKV:
        """``key``'s KV from this tier alone: :class:`KVMissingError` when it lacks ``key``,
        :class:`StaleKVError` when the KV was made under another fingerprint."""

    @abc.abstractmethod
    def remove(self, key: KVKey) -> bool:
        """Free what this tier holds of ``key``; whether it held any."""

    @abc.abstractmethod
    def stats(self) -> dict[str, int]:
        """Counts of what this tier holds and did, under names unique across the tiers."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the tier holds open."""


def check_fingerprint(key: KVKey, found: str | None, expected: str, where: str) -> None:
    """Refuse (:class:`StaleKVError`) KV of ``key`` found in ``where`` under fingerprint ``found``."""
    if found != expected:
        raise StaleKVError(
            f"KV of fact {key[0]} v{key[1]} in {where} was encoded under model fingerprint {found!r}, "
            f"this store serves {expected!r}; refusing it"
        )
