"""The device tier of a memory store's KV: one paged slab, preallocated on first use.

The slab is ``[num_pages, layers, 2, page_tokens, kv_heads, head_dim]``
(``torch.empty``, ``device_bytes`` of it): a fact takes pages from a free list, so nothing is
allocated per fact. On a CPU engine the "device" is the CPU and the slab is an ordinary tensor.
Reads hand out rows of *one copy* gathered from the slab for all the facts read (one kernel
whatever their number), so KV in flight never sees its pages reused.
"""

from __future__ import annotations

import torch

from inferscale_engine.errors import KVMissingError
from inferscale_engine.kv import FactKV
from inferscale_engine.memory.kv.backend import KVKey, Tier, TierConfig, check_fingerprint
from inferscale_engine.memory.kv.dma import Sources
from inferscale_engine.memory.kv.pages import Entry, PagedTier, PageLayout, PageMover, one_interval, take

__all__ = ["DeviceTier"]


class DeviceTier(PagedTier):
    """Fact KV in the slab's pages (see the module docstring); LRU order is the coordinator's."""

    name: Tier = "device"

    def __init__(self, config: TierConfig, layout: PageLayout, mover: PageMover) -> None:
        super().__init__(layout, mover)
        self.device = config.device
        self.capacity_bytes = config.device_bytes
        #: The slab (``None`` before the geometry is known, or when the capacity is under a page).
        self.slab: torch.Tensor | None = None
        #: The slab, as a copy pool.
        self.pool: Sources | None = None

    def allocate(self) -> None:
        if self.slab is not None:
            return
        num_pages = self.capacity_bytes // self.layout.page_bytes
        if num_pages > 0:
            self.slab = torch.empty((num_pages, *self.layout.page_shape()), dtype=self.layout.dtype, device=self.device)
            self.pool = Sources.of([self.slab])
            self.free = list(range(num_pages))

    @property
    def pages_total(self) -> int:
        return 0 if self.slab is None else self.slab.shape[0]

    def insert(self, key: KVKey, pages: torch.Tensor, num_tokens: int, position: int, fingerprint: str) -> bool:
        need = pages.shape[0]
        if self.slab is None or need > len(self.free):
            return False
        slots = take(self.free, need)
        self.mover.after_side()
        self.slab.index_copy_(0, self.mover.index(slots), pages.to(self.device, non_blocking=pages.is_pinned()))
        self.mover.mark_caller()
        self.entries[key] = Entry(slots, num_tokens, position, fingerprint)
        return True

    def get(self, key: KVKey, fingerprint: str) -> FactKV:
        entry = self.entries.get(key)
        if entry is None:
            raise KVMissingError(f"fact {key[0]} v{key[1]} is not in the device tier")
        check_fingerprint(key, entry.fingerprint, fingerprint, "device tier")
        self.entries.move_to_end(key)
        return self.read([entry])[0]

    def read(self, entries: list[Entry]) -> list[FactKV]:
        """Every entry's KV as rows of one copy of their pages: one kernel for all, and later
        slab writes never change KV handed out."""
        if not entries:
            return []
        # Gathered in slab order, where a promotion's facts lie one after the other whatever
        # order the request names them in (they were copied in host-page order): one slice.
        order = sorted(range(len(entries)), key=lambda i: entries[i].pages[0])
        block = self._gather([p for i in order for p in entries[i].pages])
        kvs = self.hand_out(block, [(entries[i].num_tokens, len(entries[i].pages), entries[i].position) for i in order])
        out: list[FactKV] = [None] * len(entries)  # type: ignore[list-item]
        for i, kv in zip(order, kvs):
            out[i] = kv
        return out

    def lru(self, need: int, keep: set[KVKey]) -> list[KVKey]:
        """Least recently used facts not in ``keep`` whose pages make ``need`` pages free, or
        every such fact when they cannot; none when ``need`` are free already."""
        free = len(self.free)
        if free >= need:
            return []
        victims = []
        for key, entry in self.entries.items():
            if key not in keep:
                victims.append(key)
                free += len(entry.pages)
                if free >= need:
                    break
        return victims

    def stats(self) -> dict[str, int]:
        total = self.pages_total
        return {
            "device_facts": len(self.entries),
            "device_pages_used": total - len(self.free),
            "device_pages_total": total,
            "device_bytes": 0 if self.slab is None else self.slab.nbytes,
        }

    def _gather(self, pages: list[int]) -> torch.Tensor:
        """Slab pages copied into one new ``[2, layers, tokens, heads, dim]`` block, gathered and
        laid out by one kernel. Pages one after the other, as a promotion leaves them, are
        sliced: no page index goes to the device."""
        assert self.slab is not None
        self.mover.after_side()
        slab = self.slab.permute(2, 1, 0, 3, 4, 5)  # [2, layers, pages, page_tokens, heads, dim]
        first, m = pages[0], len(pages)
        if one_interval(pages):
            block = slab[:, :, first : first + m].clone(memory_format=torch.contiguous_format)
        else:
            block = slab.index_select(2, self.mover.index(pages))
        _, layers, _, pt, heads, dim = block.shape
        return block.view(2, layers, m * pt, heads, dim)
