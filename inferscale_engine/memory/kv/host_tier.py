"""The host tier of a memory store's KV: pages in the slab's layout in CPU memory.

Pages are pinned when CUDA is available and allocated :data:`HOST_CHUNK_BYTES` at a time as the
tier fills (pinning is slow and locks memory), up to ``host_bytes``: page ``p`` is page
``p % chunk_pages`` of chunk ``p // chunk_pages``. A fact makes room for itself by dropping the
least recently used facts (the disk still holds them); the coordinator may first hand the tier
pages of its own (host pages a device fact kept).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inferscale_engine.errors import KVMissingError
from inferscale_engine.kv import FactKV
from inferscale_engine.memory.kv.backend import KVKey, Tier, TierConfig, check_fingerprint
from inferscale_engine.memory.kv.dma import Sources
from inferscale_engine.memory.kv.pages import Entry, PagedTier, PageLayout, PageMover, copy_on_host, take

__all__ = ["HOST_CHUNK_BYTES", "HostTier"]

#: Host-tier pages are pinned this many bytes at a time, as the tier fills.
HOST_CHUNK_BYTES = 64 << 20


class HostTier(PagedTier):
    """Fact KV in host pages (see the module docstring)."""

    name: Tier = "host"

    def __init__(self, config: TierConfig, layout: PageLayout, mover: PageMover) -> None:
        super().__init__(layout, mover)
        self.capacity_bytes = config.host_bytes
        self.pin_memory = config.pin_memory
        self.chunks: list[torch.Tensor] = []
        self.chunk_pages = 0  # 0 until the geometry is known
        self.pages_total = 0  # capacity
        #: Facts dropped for room, or refused for want of it (the disk has them).
        self.drops = 0
        self._pool: Sources | None = None

    def allocate(self) -> None:
        if self.chunk_pages:
            return
        pb = self.layout.page_bytes
        self.pages_total = self.capacity_bytes // pb
        self.chunk_pages = max(1, min(HOST_CHUNK_BYTES // pb, self.pages_total))

    @property
    def pool(self) -> Sources:
        """The chunks, as a copy pool."""
        if self._pool is None:
            self._pool = Sources.of(self.chunks)
        return self._pool

    def take_pages(self, m: int, take_back: Callable[[], bool] | None = None) -> list[int] | None:
        """``m`` free pages: allocating a chunk, calling ``take_back`` (which frees pages the
        caller holds here and says whether it did), or dropping least recently used facts, in
        this order; ``None`` when the whole tier is smaller."""
        if m > self.pages_total:
            self.drops += 1
            return None
        while len(self.free) < m:
            if self._grow() or (take_back is not None and take_back()):
                continue
            if not self.entries:  # the facts holding the room are in flight in this very batch
                self.drops += 1
                return None
            _, old = self.entries.popitem(last=False)
            self.free += old.pages
            self.drops += 1
        return take(self.free, m)

    def insert(self, key: KVKey, pages: torch.Tensor, num_tokens: int, position: int, fingerprint: str,
               take_back: Callable[[], bool] | None = None) -> bool:
        """Hold a fact's pages, written from the host (see :meth:`take_pages` for ``take_back``)."""
        slots = self.take_pages(pages.shape[0], take_back)
        if slots is None:
            return False
        self.mover.synchronize()  # copies still queued may read or write these pages
        copy_on_host(self.pool, slots, Sources.of([pages.to("cpu")]), list(range(len(slots))))
        self.entries[key] = Entry(slots, num_tokens, position, fingerprint)
        return True

    def get(self, key: KVKey, fingerprint: str) -> FactKV:
        entry = self.entries.get(key)
        if entry is None:
            raise KVMissingError(f"fact {key[0]} v{key[1]} is not in the host tier")
        check_fingerprint(key, entry.fingerprint, fingerprint, "host tier")
        self.entries.move_to_end(key)
        return self.read(entry)

    def read(self, entry: Entry) -> FactKV:
        """A fact's KV on the device, without caching it there."""
        m = len(entry.pages)
        buffer = torch.empty((m, *self.layout.page_shape()), dtype=self.layout.dtype, device=self.mover.device)
        self.mover.wait_written([entry])
        self.mover.copy(Sources.of([buffer]), list(range(m)), self.pool, entry.pages)
        self.mover.after_side()
        # contiguous(): a one-page buffer's block is a strided view of it.
        block = self.layout.pages_to_block(buffer).contiguous()
        return self.hand_out(block, [(entry.num_tokens, m, entry.position)])[0]

    def stats(self) -> dict[str, int]:
        return {
            "host_facts": len(self.entries),
            "host_bytes": sum(len(e.pages) for e in self.entries.values()) * self.layout.page_bytes,
            "host_bytes_allocated": sum(c.nbytes for c in self.chunks),
            "host_drops": self.drops,
        }

    def _grow(self) -> bool:
        """Allocate the next chunk, if the tier's capacity has room for one."""
        first = len(self.chunks) * self.chunk_pages
        n = min(self.chunk_pages, self.pages_total - first)
        if n <= 0:
            return False
        self.chunks.append(torch.empty((n, *self.layout.page_shape()), dtype=self.layout.dtype,
                                       pin_memory=self.pin_memory))
        self._pool = None
        self.free += range(first, first + n)
        return True
