"""What the two memory tiers share: the page layout, the paged tier, and the copies of pages.

A fact of ``n`` tokens takes ``ceil(n / page_tokens)`` pages, each
``[layers, 2, page_tokens, kv_heads, head_dim]`` (:class:`PageLayout`), the same in the device
slab and in the host tier's chunks, so a fact moves between them as page copies, never converted.
:class:`PagedTier` is what both tiers are: an LRU of entries (a fact's pages) over a free list.
:class:`PageMover` queues the copies: on CUDA, on a side stream (promotions, reads of host pages)
and, for evictions, on a stream of its own; the caller's slab accesses and the side stream's
copies wait for each other on the device, never on the host. A batch copies one range per run of
pages that lie one after the other on both sides (:func:`page_runs`).
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from inferscale_engine.kv import FactKV
from inferscale_engine.memory.kv.backend import KVKey, TierBackend
from inferscale_engine.memory.kv.dma import ByteCopier, Sources

__all__ = ["Entry", "PageLayout", "PageMover", "PagedTier", "Written", "page_runs", "take"]


@dataclass(frozen=True)
class Written:
    """An eviction's copy to the host: its event, and its place in the order evictions are
    queued on their one stream (a later one ends after every earlier one)."""

    seq: int
    event: torch.cuda.Event


@dataclass
class Entry:
    """A fact cached in a memory tier: the pages it holds in that tier."""

    pages: list[int]
    num_tokens: int
    position: int
    fingerprint: str
    #: CUDA, host tier: the eviction copy writing these pages, until it is known to be done.
    written: Written | None = None


class PageLayout:
    """The page shape of one store's KV, known from the first fact stored or read."""

    def __init__(self, page_tokens: int) -> None:
        self.page_tokens = page_tokens
        #: layers, kv heads, head dim, dtype; set once.
        self.geometry: tuple[int, int, int, torch.dtype] | None = None
        self.page_bytes = 0

    def fix(self, kv: FactKV) -> bool:
        """Take the geometry of ``kv`` (``ValueError`` when it differs from the one taken
        before); whether this was the first."""
        layers, _, heads, dim = kv.k.shape
        geometry = (layers, heads, dim, kv.k.dtype)
        if kv.v.shape != kv.k.shape or kv.v.dtype != kv.k.dtype:
            raise ValueError(f"K {tuple(kv.k.shape)}/{kv.k.dtype} and V {tuple(kv.v.shape)}/{kv.v.dtype} differ")
        if self.geometry is None:
            self.geometry = geometry
            self.page_bytes = layers * 2 * self.page_tokens * heads * dim * kv.k.element_size()
            return True
        if geometry != self.geometry:
            raise ValueError(f"KV geometry {geometry} does not match this store's {self.geometry}")
        return False

    def page_shape(self) -> tuple[int, ...]:
        layers, heads, dim, _ = self.geometry  # type: ignore[misc]
        return (layers, 2, self.page_tokens, heads, dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.geometry[3]  # type: ignore[index]

    def fact_bytes(self, num_tokens: int) -> int | None:
        """Bytes of K and V of ``num_tokens`` tokens; ``None`` before the geometry is known."""
        geometry = self.geometry
        if geometry is None:
            return None
        layers, heads, dim, dtype = geometry
        return 2 * layers * num_tokens * heads * dim * dtype.itemsize

    def to_pages(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``[layers, n, heads, dim]`` K and V as ``[pages, layers, 2, page_tokens, heads, dim]``."""
        layers, n, heads, dim = k.shape
        pt = self.page_tokens
        m = max(1, math.ceil(n / pt))
        out = torch.zeros((layers, 2, m * pt, heads, dim), dtype=k.dtype, device=k.device)
        out[:, 0, :n] = k
        out[:, 1, :n] = v
        return out.view(layers, 2, m, pt, heads, dim).permute(2, 0, 1, 3, 4, 5).contiguous()

    @staticmethod
    def pages_to_block(pages: torch.Tensor) -> torch.Tensor:
        """``[pages, layers, 2, page_tokens, heads, dim]`` as a ``[2, layers, tokens, heads, dim]`` block."""
        m, layers, _, pt, heads, dim = pages.shape
        return pages.permute(2, 1, 0, 3, 4, 5).reshape(2, layers, m * pt, heads, dim)


class PageMover:
    """Copies of pages between the memory tiers' pools, and the stream order around them."""

    def __init__(self, device: torch.device, layout: PageLayout) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.layout = layout
        # CUDA: every copy between the tiers runs on a side stream. The caller's slab accesses
        # wait for the side stream's last copy, and a copy waits for the caller's last slab
        # access (it may reuse the pages that one read) rather than for all its queued work.
        self._side: torch.cuda.Stream | None = None
        # Evictions copy to the host on a stream of their own, from a device-side copy of the
        # pages, so promotions into those slab pages need not wait for PCIe (see copy_out).
        self._out: torch.cuda.Stream | None = None
        self._copiers: dict[torch.cuda.Stream, ByteCopier] = {}
        self._evictions = 0  # evictions queued on the eviction stream so far (Written.seq)
        self._side_done: torch.cuda.Event | None = None
        self._caller_done: torch.cuda.Event | None = None

    def copy(self, dst: Sources, dst_pages: list[int], src: Sources, src_pages: list[int]) -> int:
        """Copy pages between pools (the slab, the host chunks, a buffer), page ``src_pages[i]``
        of ``src`` to page ``dst_pages[i]`` of ``dst``, a range per run of pages that lie one
        after the other on both sides; returns how many ranges. A pool's page ``p`` is page
        ``p % n`` of its tensor ``p // n``, ``n`` the pages of its first tensor (the host
        tier's chunks; other pools are one tensor). On CUDA: one batch of DMAs on the side stream."""
        if not self.cuda:
            return copy_on_host(dst, dst_pages, src, src_pages)
        with self._side_work() as side:
            return self._dma(side, dst, dst_pages, src, src_pages)

    def copy_out(self, dst: Sources, dst_pages: list[int], slab: torch.Tensor, slab_pool: Sources,
                 slab_pages: list[int]) -> Written | None:
        """Copy slab pages to host pages; on CUDA, the copy writing the host pages.

        A promotion that needs the room waits for nothing slower than a device-side copy: the
        side stream gathers the pages into a buffer (device memory bandwidth), after which the
        slab pages can take new facts; the buffer goes to the host on the eviction stream, over
        PCIe, while the side stream copies the promoted facts the other way. Readers of those
        host pages wait for the returned event (:meth:`wait_written`)."""
        if not self.cuda:
            copy_on_host(dst, dst_pages, slab_pool, slab_pages)
            return None
        with self._side_work() as side, torch.cuda.stream(side):
            staged = slab.index_select(0, self.index(slab_pages))
        gathered = self._side_done
        assert gathered is not None
        # Behind everything queued on the side stream so far: the gather, and any promotion
        # still reading host pages this copy may now overwrite.
        out = self.out_stream()
        out.wait_event(gathered)
        staged.record_stream(out)  # its memory is not reused before the copy out of it ends
        self._dma(out, dst, dst_pages, Sources.of([staged]), list(range(len(slab_pages))))
        written = torch.cuda.Event()
        written.record(out)
        self._evictions += 1
        return Written(self._evictions, written)

    def wait_written(self, entries: list[Entry]) -> None:
        """Order the side stream after the evictions still writing these host entries' pages:
        after the latest of them, which ends after the others (one stream), so a batch of facts
        evicted one by one costs one event query, not one each."""
        latest = max((e.written for e in entries if e.written is not None), key=lambda w: w.seq, default=None)
        if latest is not None and not latest.event.query():
            self.side_stream().wait_event(latest.event)
        for e in entries:
            e.written = None

    def synchronize(self) -> None:
        """Wait on the host for every copy queued (before the host itself writes pages)."""
        for stream in (self._side, self._out):
            if stream is not None:
                stream.synchronize()

    def after_side(self) -> None:
        """Order the caller's stream after the side stream's last copy."""
        if self._side_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._side_done)

    def mark_caller(self) -> torch.cuda.Event | None:
        """Mark the caller's last slab access, for copies reusing its pages to wait for; the
        event, on CUDA."""
        if not self.cuda:
            return None
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        self._caller_done = done
        return done

    def side_stream(self) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def out_stream(self) -> torch.cuda.Stream:
        """The stream evictions copy to the host on."""
        if self._out is None:
            self._out = torch.cuda.Stream(self.device)
        return self._out

    def index(self, pages: list[int]) -> torch.Tensor:
        """Page numbers on the device without a host wait: a plain copy from pageable memory
        would first wait for everything queued on the stream (another request's forward pass,
        copies in flight)."""
        index = torch.tensor(pages, dtype=torch.long)
        if not self.cuda:
            return index
        return index.pin_memory().to(self.device, non_blocking=True)

    @contextlib.contextmanager
    def _side_work(self) -> Iterator[torch.cuda.Stream]:
        """The side stream, after the caller's last access to the pages (they may have been read
        or written there last); the caller's next access waits for what the block queued."""
        side = self.side_stream()
        if self._caller_done is not None:
            side.wait_event(self._caller_done)
        yield side
        done = torch.cuda.Event()
        done.record(side)
        self._side_done = done

    def _dma(self, stream: torch.cuda.Stream, dst: Sources, dst_pages: list[int], src: Sources,
             src_pages: list[int]) -> int:
        """Queue the page copies on ``stream``: one batch, a range per run of pages that lie one
        after the other on both sides; returns how many ranges."""
        r = page_ranges(dst, dst_pages, src, src_pages)
        pb = self.layout.page_bytes
        copier = self._copiers.get(stream)
        if copier is None:
            copier = self._copiers[stream] = ByteCopier(stream)
        copier.copy(_ranges(dst, r.dst_which), r.dst_index * pb, _ranges(src, r.src_which), r.src_index * pb,
                    r.lengths * pb)
        return len(r.lengths)


class PagedTier(TierBackend):
    """A memory tier: facts as entries of pages, least recently used first, over a free list.

    Free lists are taken from the end, a slice at a time (:func:`take`), and pages go back in the
    order they were held: pages taken together lie one after the other as often as they can, and
    a batch copies one range per run of them rather than one per page."""

    def __init__(self, layout: PageLayout, mover: PageMover) -> None:
        self.layout = layout
        self.mover = mover
        #: Facts held, least recently used first.
        self.entries: OrderedDict[KVKey, Entry] = OrderedDict()
        self.free: list[int] = []

    def allocate(self) -> None:
        """Size the tier once the layout's geometry is known (again: nothing)."""

    @abc.abstractmethod
    def insert(self, key: KVKey, pages: torch.Tensor, num_tokens: int, position: int, fingerprint: str) -> bool:
        """Hold a fact given as pages (:meth:`PageLayout.to_pages`) if there is room; whether it did."""

    def contains(self, key: KVKey) -> bool:
        return key in self.entries

    def put(self, key: KVKey, kv: FactKV, fingerprint: str) -> bool:
        self.layout.fix(kv)
        self.allocate()  # the layout may have been fixed through another tier
        self.remove(key)
        return self.insert(key, self.layout.to_pages(kv.k, kv.v), kv.num_tokens, kv.position, fingerprint)

    def remove(self, key: KVKey) -> bool:
        entry = self.entries.pop(key, None)
        if entry is None:
            return False
        self.free += entry.pages
        return True

    def close(self) -> None:
        """Nothing to release: the pages are memory, freed with the tier."""

    def pages(self, key: KVKey) -> list[int]:
        """The pages ``key`` holds in this tier (``KeyError`` when it holds none)."""
        return self.entries[key].pages

    def hand_out(self, block: torch.Tensor, facts: list[tuple[int, int, int]]) -> list[FactKV]:
        """FactKVs of facts laid out one after the other in ``block`` (``[2, layers, tokens,
        heads, dim]``, contiguous, just copied from a tier's pages), given as ``(tokens, pages,
        position)`` each."""
        rows, start = [], 0
        for tokens, pages, position in facts:  # each fact's rows, then its page padding
            rows.append((start, tokens, position))
            start += pages * self.layout.page_tokens
        # One event for all: readers on other streams (vLLM's worker) wait for this copy on the
        # device, and copies reusing the pages it read wait for it too.
        return FactKV.rows_of(block, rows, self.mover.mark_caller())


def take(free: list[int], m: int) -> list[int]:
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
    """Each page's tensor in ``pool`` and its index there (see :meth:`PageMover.copy`)."""
    return np.divmod(np.array(pages, dtype=np.int64), _tensor_pages(pool))


class PageRanges(NamedTuple):
    """Page copies merged into ranges: per range, each side's tensor and first page, and its length."""

    dst_which: np.ndarray
    dst_index: np.ndarray
    src_which: np.ndarray
    src_index: np.ndarray
    lengths: np.ndarray


def page_ranges(dst: Sources, dst_pages: list[int], src: Sources, src_pages: list[int]) -> PageRanges:
    """The ranges :meth:`PageMover.copy` copies, on the device or on the host alike."""
    few = _interval_ranges(dst, dst_pages, src, src_pages)
    if few is not None:  # as a promotion of facts that lie together usually is: no numpy pass
        return PageRanges(*(np.array(column, dtype=np.int64) for column in zip(*few)))
    dst_which, dst_index = _split_pages(dst, dst_pages)
    src_which, src_index = _split_pages(src, src_pages)
    starts, lengths = page_runs(dst_which, dst_index, src_which, src_index)
    return PageRanges(dst_which[starts], dst_index[starts], src_which[starts], src_index[starts], lengths)


def _interval_ranges(
    dst: Sources, dst_pages: list[int], src: Sources, src_pages: list[int]
) -> list[tuple[int, int, int, int, int]] | None:
    """When both sides' pages are each one interval (a promotion of facts lying together): the
    ranges as ``(dst tensor, dst page, src tensor, src page, pages)``, cut where either side
    passes into its pool's next tensor (the host tier's chunks); else ``None``."""
    n = len(dst_pages)
    if not n or not (one_interval(dst_pages) and one_interval(src_pages)):
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


def one_interval(pages: list[int]) -> bool:
    """Whether ``pages`` (not empty) are consecutive and increasing, as a promotion leaves them."""
    return pages == list(range(pages[0], pages[0] + len(pages)))


def _tensor_pages(pool: Sources) -> int:
    """Pages in each tensor of ``pool`` but maybe its last (unbounded for a one-tensor pool)."""
    return pool.tensors[0].shape[0] if len(pool.tensors) > 1 else 1 << 62


def _locate(pool: Sources, page: int) -> tuple[int, int]:
    """Page ``page`` of ``pool`` as (its tensor, its index there); see :meth:`PageMover.copy`."""
    return divmod(page, _tensor_pages(pool))


def copy_on_host(dst: Sources, dst_pages: list[int], src: Sources, src_pages: list[int]) -> int:
    """:meth:`PageMover.copy` done by the host, a range per run of pages (CPU pools only)."""
    r = page_ranges(dst, dst_pages, src, src_pages)
    for dw, d, sw, s, n in zip(r.dst_which.tolist(), r.dst_index.tolist(), r.src_which.tolist(),
                               r.src_index.tolist(), r.lengths.tolist()):
        dst.tensors[dw][d : d + n].copy_(src.tensors[sw][s : s + n])
    return len(r.lengths)


def _ranges(pool: Sources, which: np.ndarray) -> Sources:
    """``pool``'s tensor of each range, as :class:`ByteCopier` takes them."""
    return Sources([pool.tensors[i] for i in which.tolist()], pool.address[which], pool.nbytes[which])
