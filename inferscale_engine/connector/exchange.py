"""Fact KV handed between processes through named shared memory.

Whoever holds the facts (an :class:`~inferscale_engine.engine.InferScaleEngine`, or the
``inferscale serve --vllm-url`` front end of a separate ``vllm serve``) is the *owner*: it
copies each span a request injects into a shared segment (:meth:`KVExchange.stage`) and sends
the span's :class:`Location` with the request, in ``kv_transfer_params``. vLLM's worker
processes (one per tensor-parallel rank) map the segment by its descriptor and read the span
where it lies (:class:`ExchangeReader`). Captures go the other way: the owner reserves room
for the rows a request encodes, the worker writes them there, the owner reads them once the
request has finished.

Segments are files in ``/dev/shm`` for a CPU owner, and device memory shared through CUDA IPC
handles for a CUDA one (same host: vLLM's workers open the owner's allocation). A segment is
named by a random id; a worker opens each one once. Only descriptors travel: never pickles,
since ``kv_transfer_params`` come from HTTP clients of vLLM's server.

An owner whose vLLM runs in its own process (``KVExchange(local=True)``, the in-process
engine) copies nothing and keeps no books: the plan, which never leaves the process, carries
the spans' FactKVs themselves (:attr:`SharedKV.spans`), and the worker waits for each span's
``FactKV.ready`` event on the device.
A CUDA owner of another process records one of a ring of interprocess events after its
staging copies and sends the slot with the plan (:attr:`SharedKV.ready`): the worker's stream
waits for it, so neither side blocks on the host.

Layouts: a span of ``n`` tokens is ``K[layers, n, heads, head_dim]`` then ``V`` alike, both
contiguous, at a byte offset; a capture adds ``filled[layers, n, heads]`` bytes after them,
which each rank sets for the heads it wrote, so the owner knows every row was computed.
"""

from __future__ import annotations

import base64
import bisect
import itertools
import logging
import os
import re
import threading
import uuid
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import torch

from inferscale_engine.errors import ConnectorError
from inferscale_engine.kv import FactKV

logger = logging.getLogger(__name__)

#: New segments hold at least this much (a span larger than this gets a segment of its own).
SEGMENT_BYTES = 256 << 20
#: Segments may grow to this many bytes to keep spans no request uses any more where they lie
#: (an engine passes ``EngineConfig.staged_kv_gib``'s).
RETAIN_BYTES = 4 * SEGMENT_BYTES
_ALIGN = 256
_SHM_DIR = "/dev/shm"
# inferscale-<owner pid>-<uuid>: the pid lets a later owner remove what a killed one left behind.
_SHM_NAME = re.compile(r"^inferscale-(\d+)-[0-9a-f]{32}$")


class Geometry(NamedTuple):
    """What every span of one model looks like: ``layers`` attention layers of ``heads`` KV
    heads (all ranks together) of ``head_dim``, in ``dtype`` (a torch dtype name)."""

    layers: int
    heads: int
    head_dim: int
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ConnectorError(f"unknown KV dtype {self.dtype!r}")
        return dtype

    def kv_bytes(self, n: int) -> int:
        """Bytes of one of K or V for ``n`` tokens."""
        return self.layers * n * self.heads * self.head_dim * self.torch_dtype.itemsize

    @classmethod
    def of_model(cls, model_config: Any) -> Geometry:
        """From a vLLM ``ModelConfig``."""
        from vllm.config import ParallelConfig

        return cls(
            model_config.get_num_layers(ParallelConfig()),
            model_config.get_total_num_kv_heads(),
            model_config.get_head_size(),
            str(model_config.dtype).removeprefix("torch."),
        )


class Location(NamedTuple):
    """Where the KV of a span of ``tokens`` tokens (or a capture's room) lies: ``offset`` bytes
    into ``segment``; its keys were encoded at ``position`` (0 for captures)."""

    segment: str
    offset: int
    position: int
    tokens: int


@dataclass(frozen=True, slots=True)
class SharedKV:
    """Where a plan's KV lies: a :class:`Location` per span key (or capture id), in segments a
    worker maps from their descriptors; ``ready``: the owner's event (ring, slot) that orders
    the worker after the copies that staged it, if any. ``spans``: instead of locations, the
    spans' KV itself, in the plan's order, from an owner in the workers' process (such a plan
    travels as itself, never as JSON)."""

    geometry: Geometry
    at: dict[str, Location]
    segments: dict[str, dict[str, Any]]
    ready: tuple[str, int] | None = None
    spans: tuple[FactKV, ...] | None = field(default=None, compare=False)

    def to_json(self) -> dict[str, Any]:
        if self.spans is not None:
            raise ConnectorError("KV held by reference cannot leave its process")
        data: dict[str, Any] = {"geometry": list(self.geometry), "at": {k: list(loc) for k, loc in self.at.items()},
                                "segments": self.segments}
        if self.ready is not None:
            data["ready"] = list(self.ready)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SharedKV:
        layers, heads, dim, dtype = data["geometry"]
        ready = data.get("ready")
        return cls(
            Geometry(int(layers), int(heads), int(dim), str(dtype)),
            {str(k): Location(str(s), int(o), int(p), int(n)) for k, (s, o, p, n) in data["at"].items()},
            {str(name): dict(d) for name, d in data["segments"].items()},
            (str(ready[0]), int(ready[1])) if ready is not None else None,
        )

    def described(self) -> set[str]:
        """Names of every segment (and event ring) this plan's worker must have mapped."""
        names = {loc.segment for loc in self.at.values()}
        if self.ready is not None:
            names.add(self.ready[0])
        return names


def _segment_descriptor(name: str, buffer: torch.Tensor) -> dict[str, Any]:
    """What a worker needs to map ``buffer`` (a uint8 segment) in its own process."""
    if buffer.device.type != "cuda":
        return {"name": name, "size": buffer.numel()}
    storage = buffer.untyped_storage()
    (_, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = storage._share_cuda_()
    return {
        "name": name,
        "size": buffer.numel(),
        "cuda": {
            "uuid": str(torch.cuda.get_device_properties(buffer.device).uuid),
            "handle": base64.b64encode(handle).decode(),
            "storage_size": int(size),
            "storage_offset": int(offset),
            "ref_handle": base64.b64encode(ref_handle).decode(),
            "ref_offset": int(ref_offset),
            "event_handle": base64.b64encode(event_handle).decode() if event_handle else None,
            "event_sync": bool(event_sync),
        },
    }


class _Segment:
    """One shared buffer and its free list (byte ranges)."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.name = f"inferscale-{os.getpid()}-{uuid.uuid4().hex}"
        self.size = size
        self.path: str | None = None
        if device.type == "cuda":
            self.buffer = torch.empty(size, dtype=torch.uint8, device=device)
        else:
            _sweep_dead_owners()
            self.path = os.path.join(_SHM_DIR, self.name)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
            self.buffer = torch.from_file(self.path, shared=True, size=size, dtype=torch.uint8)
            weakref.finalize(self, _unlink, self.path)
        self.descriptor = _segment_descriptor(self.name, self.buffer)
        _LOCAL[self.name] = self.buffer
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self.free: list[tuple[int, int]] = [(0, size)]  # (offset, size), by offset

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        return _typed(self._typed, self.buffer, dtype)

    def allocate(self, size: int) -> int | None:
        for i, (offset, room) in enumerate(self.free):
            if room >= size:
                if room == size:
                    del self.free[i]
                else:
                    self.free[i] = (offset + size, room - size)
                return offset
        return None

    def release(self, offset: int, size: int) -> None:
        i = bisect.bisect_left(self.free, (offset, 0))
        if i < len(self.free) and offset + size == self.free[i][0]:  # merge with the next range
            size += self.free.pop(i)[1]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == offset:  # and the previous one
            self.free[i - 1] = (self.free[i - 1][0], self.free[i - 1][1] + size)
        else:
            self.free.insert(i, (offset, size))


#: Segments of owners in this process, by name: an in-process vLLM reads them directly (a process
#: cannot open its own CUDA IPC handle).
_LOCAL: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()


#: Event rings of owners in this process, by name (a process cannot open its own IPC handle).
_LOCAL_RINGS: weakref.WeakValueDictionary[str, _EventRing] = weakref.WeakValueDictionary()

#: Events in an owner's ring. Recording slot i again before a worker waited on its last record
#: only makes that worker wait for later copies, never for too few: no slot is ever "in use".
_RING_EVENTS = 64


class _EventRing:
    """Interprocess CUDA events an owner records after its staging copies; workers open them
    once (the descriptor) and wait on the slot a plan names."""

    def __init__(self, device: torch.device) -> None:
        self.name = f"inferscale-{os.getpid()}-{uuid.uuid4().hex}"
        stream = torch.cuda.current_stream(device)
        self.events = [torch.cuda.Event(interprocess=True) for _ in range(_RING_EVENTS)]
        for event in self.events:
            event.record(stream)  # an IPC handle needs the event made on its device
        self.descriptor = {"name": self.name,
                           "events": [base64.b64encode(e.ipc_handle()).decode() for e in self.events],
                           "uuid": str(torch.cuda.get_device_properties(device).uuid)}
        self._next = itertools.count()
        _LOCAL_RINGS[self.name] = self

    def record(self, stream: torch.cuda.Stream) -> tuple[str, int]:
        slot = next(self._next) % len(self.events)
        self.events[slot].record(stream)
        return self.name, slot


_SWEPT = False


def _sweep_dead_owners() -> None:
    """Once per process: unlink the ``/dev/shm`` segments of owners that no longer run (a killed
    owner's finalizers never ran), so killed servers do not pile up shared memory."""
    global _SWEPT
    if _SWEPT:
        return
    _SWEPT = True
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return
    for name in names:
        match = _SHM_NAME.match(name)
        if match is None:
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            _unlink(os.path.join(_SHM_DIR, name))
        except OSError:  # alive, another user's
            pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class NotHeldError(ConnectorError):
    """:meth:`KVExchange.stage` was given spans without KV whose keys it no longer holds: another
    request's staging gave their room up since :meth:`KVExchange.holds` said yes. Nothing was
    staged; the caller reads those spans' KV and stages again (the engine does)."""

    def __init__(self, keys: list[str]) -> None:
        super().__init__(f"{len(keys)} span(s) staged without KV are no longer held: {', '.join(keys[:3])}")
        self.keys = keys


@dataclass
class _Staged:
    location: Location
    size: int
    refs: int


class KVExchange:
    """The owner's side: stages spans for injection and reserves room for captures. Thread-safe.

    Args:
        geometry: the served model's KV shape.
        device: where segments live (``cuda``: shared through CUDA IPC; ``cpu``: ``/dev/shm``).
        segment_bytes: size of each new segment.
        retain_bytes: spans no request uses any more stay staged, least recently used out first,
            while segments hold no more than this: a span served again is neither copied nor
            cut into views again (its location is the same).
        local: vLLM's workers run in this process: spans are handed over by reference, in the plan
            (no copy, no wait on the host); captures still go through segments.
    """

    def __init__(self, geometry: Geometry, device: torch.device | str, segment_bytes: int = SEGMENT_BYTES,
                 *, local: bool = False, retain_bytes: int = RETAIN_BYTES) -> None:
        self.geometry = geometry
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.segment_bytes = segment_bytes
        self.retain_bytes = retain_bytes
        self.local = local
        self._segments: dict[str, _Segment] = {}
        self._staged: dict[str, _Staged] = {}
        self._retained: OrderedDict[str, _Staged] = OrderedDict()  # staged, unused, oldest first
        self._lock = threading.Lock()
        self._ring: _EventRing | None = None
        self._last_copy: torch.cuda.Event | None = None  # the ring event after the last staging copy

    # ------------------------------------------------------------------ memory

    def _allocate(self, size: int) -> tuple[_Segment, int]:
        """Room for ``size`` bytes (lock held): a free range, else one that retained spans give
        up (oldest first) once segments reach ``retain_bytes``, else a new segment."""
        size = -(-size // _ALIGN) * _ALIGN
        while True:
            for segment in self._segments.values():
                offset = segment.allocate(size)
                if offset is not None:
                    return segment, offset
            held = sum(segment.size for segment in self._segments.values())
            if not self._retained or held + max(size, self.segment_bytes) <= self.retain_bytes:
                break
            _, old = self._retained.popitem(last=False)
            self._release(old.location, old.size)
        segment = _Segment(max(size, self.segment_bytes), self.device)
        self._segments[segment.name] = segment
        logger.debug("KV exchange: new %d MiB segment %s", segment.size >> 20, segment.name)
        offset = segment.allocate(size)
        assert offset is not None
        return segment, offset

    def _release(self, location: Location, size: int) -> None:
        self._segments[location.segment].release(location.offset, -(-size // _ALIGN) * _ALIGN)

    def descriptors(self, names: set[str]) -> dict[str, dict[str, Any]]:
        return {name: self._segments[name].descriptor for name in names}

    def _views(self, location: Location, flags: bool = False) -> tuple[torch.Tensor, ...]:
        return span_views(self._segments[location.segment].buffer, location, self.geometry, flags=flags)

    # ------------------------------------------------------------------ injection

    def holds(self, key: str) -> bool:
        """Whether a span of ``key`` may go to :meth:`stage` without its KV: staged for a request
        in flight, or retained. A retained key this says yes to becomes the most recently used,
        so it is not the next one given up. A local exchange holds nothing this way: it hands
        spans over by reference, so every :meth:`stage` needs the KV itself."""
        if self.local:
            return False
        with self._lock:
            if key in self._retained:
                self._retained.move_to_end(key)
            return self._held(key)

    def _held(self, key: str) -> bool:
        """Whether ``key``'s KV lies staged, in flight or retained (lock held)."""
        return key in self._staged or key in self._retained

    def stage(self, spans: list[tuple[str, FactKV | None]]) -> SharedKV:
        """Make each ``(key, kv)`` readable by vLLM's workers (a key staged twice is staged once
        and counted twice): where every key's KV lies, for the request's plan. Each
        :meth:`stage` is matched by one :meth:`unstage` of the same keys once the request ends.
        A key names one span's KV for good (as :class:`~inferscale_engine.types.Span` keys do):
        a key still staged or retained is not copied again, and its ``kv`` may be ``None`` (see
        :meth:`holds`); :class:`NotHeldError` when such a key is no longer held (nothing staged).
        A local exchange stages nothing: the plan carries the KV (:attr:`SharedKV.spans`)."""
        if self.local:
            # By reference: nothing is copied, and each span's shape was checked where it
            # entered the engine (encoded for this model, or :meth:`check` on a caller's own).
            return self._stage_local(spans)
        for _, kv in spans:  # all refused before any is counted
            if kv is not None:
                self.check(kv)
        out: dict[str, Location] = {}
        copies = []
        # Copies are queued under the lock, and every plan's event recorded after them: a
        # request that finds its keys staged by another is ordered after that one's copies.
        with self._lock:
            held = [self._held(key) for key, _ in spans]
            gone = [key for (key, kv), h in zip(spans, held) if kv is None and not h]
            if gone:
                raise NotHeldError(gone)
            # Held keys first: a new span's room may be one that retained spans give up, and
            # never one of this request's own.
            for key, kv in [s for s, h in zip(spans, held) if h] + [s for s, h in zip(spans, held) if not h]:
                staged = self._staged.get(key)
                if staged is None:
                    staged = self._retained.pop(key, None)
                    if staged is not None:
                        self._staged[key] = staged
                if staged is None:
                    assert kv is not None  # a key without KV is held (checked above)
                    n = kv.num_tokens
                    size = 2 * self.geometry.kv_bytes(n)
                    segment, offset = self._allocate(size)
                    staged = self._staged[key] = _Staged(Location(segment.name, offset, kv.position, n), size, 0)
                    copies.append((staged.location, kv))
                staged.refs += 1
                out[key] = staged.location
            segments = self.descriptors({loc.segment for loc in out.values()})
            ready = self._copy_in(copies)
        if ready is not None:
            segments[ready[0]] = self._ring.descriptor  # type: ignore[union-attr]
        return SharedKV(self.geometry, out, segments, ready)

    def _stage_local(self, spans: list[tuple[str, FactKV | None]]) -> SharedKV:
        # On every injected request's path: the plan holds the spans until the request ends (no
        # table to fill, look up and empty again span by span).
        kvs = tuple(kv for _, kv in spans)
        if any(kv is None for kv in kvs):  # only a caller of stage() of its own gets here
            raise NotHeldError([key for key, kv in spans if kv is None])
        return SharedKV(self.geometry, {}, {}, spans=cast("tuple[FactKV, ...]", kvs))

    def _copy_in(self, copies: list[tuple[Location, FactKV]]) -> tuple[str, int] | None:
        """Copy spans into their rooms (lock held); on CUDA, the ring event (name, slot) for the
        worker's stream to wait for: recorded after these and every earlier staging copy, or
        None when there are none and the last is known done (no wait across processes)."""
        cuda = self.device.type == "cuda"
        stream = torch.cuda.current_stream(self.device) if cuda else None
        if not copies:
            if self._last_copy is None or self._last_copy.query():
                self._last_copy = None
                return None
        else:
            # Per span two strided views and no copy of its own: one foreach copy moves them all
            # (hundreds of spans a request; a copy call per span cost ~0.1 ms on this box's CPU).
            dsts: list[torch.Tensor] = []
            srcs: list[torch.Tensor] = []
            ready: dict[int, Any] = {}
            dtype = self.geometry.torch_dtype
            for location, kv in copies:
                if cuda and kv.ready is not None:
                    ready[id(kv.ready)] = kv.ready
                dsts.extend(span_views(self._segments[location.segment].typed(dtype), location, self.geometry,
                                       typed=True))
                srcs.extend((kv.k, kv.v))
            for event in ready.values():
                stream.wait_event(event)  # type: ignore[union-attr]
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        if not cuda:
            return None
        if self._ring is None:
            self._ring = _EventRing(self.device)
        name, slot = self._ring.record(stream)  # type: ignore[arg-type]
        self._last_copy = self._ring.events[slot]
        return name, slot

    def check(self, kv: FactKV) -> None:
        """:class:`ConnectorError` when ``kv``'s layers, KV heads or head size are not the served model's."""
        layers, _, heads, dim = kv.k.shape
        g = self.geometry
        if (layers, heads, dim) != (g.layers, g.heads, g.head_dim):
            raise ConnectorError(
                f"span KV of shape {tuple(kv.k.shape)} does not fit the served model "
                f"({g.layers} layers, {g.heads} KV heads of {g.head_dim})"
            )

    def unstage(self, keys: list[str]) -> None:
        """Drop one reference to each key; after the last one its room is retained (while
        ``retain_bytes`` allows) or freed. A local exchange has nothing to drop."""
        if self.local:
            return
        with self._lock:
            for key in keys:
                staged = self._staged.get(key)
                if staged is None:
                    continue
                staged.refs -= 1
                if staged.refs <= 0:
                    del self._staged[key]
                    if self.retain_bytes > 0:
                        self._retained[key] = staged
                    else:
                        self._release(staged.location, staged.size)

    # ------------------------------------------------------------------ capture

    def reserve_capture(self, n: int) -> Location:
        """Room for ``n`` captured rows, their ``filled`` flags cleared."""
        with self._lock:
            segment, offset = self._allocate(self._capture_bytes(n))
        location = Location(segment.name, offset, 0, n)
        self._views(location, flags=True)[2].zero_()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # cleared before a worker writes
        return location

    def _capture_bytes(self, n: int) -> int:
        g = self.geometry
        return 2 * g.kv_bytes(n) + g.layers * n * g.heads

    def take_capture(self, location: Location, position: int, *, keep_as: str | None = None) -> FactKV:
        """The captured rows, encoded at ``position``, as a FactKV of the owner's own. The room is
        freed; with ``keep_as``, the key of the span these rows will be served as, it is kept
        instead, as that span's staged KV no request uses yet (its K and V lie as a span's do):
        the span's first request then copies nothing. A local exchange keeps nothing (it stages
        spans by reference)."""
        kept = False
        try:
            k, v, filled = self._views(location, flags=True)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            if not bool(filled.all()):
                raise ConnectorError(
                    "capture incomplete: vLLM did not compute every row of the span (with a KV cache "
                    "layout InferScale cannot read back, full CUDA graphs hide vLLM's KV writes: "
                    "use compilation_config={'cudagraph_mode': 'FULL_AND_PIECEWISE'})"
                )
            kv = FactKV(k.clone(), v.clone(), position)
            if keep_as is not None:
                kept = self._keep(location, position, keep_as)
            return kv
        finally:
            if not kept:
                self.release_capture(location)

    def _keep(self, room: Location, position: int, key: str) -> bool:
        """Retain a capture room as the staged KV of span ``key`` (see :meth:`take_capture`)."""
        if self.local or self.retain_bytes <= 0:
            return False
        with self._lock:
            if room.segment not in self._segments or self._held(key):
                return False
            at = Location(room.segment, room.offset, position, room.tokens)
            self._retained[key] = _Staged(at, self._capture_bytes(room.tokens), 0)
        return True

    def release_capture(self, location: Location) -> None:
        with self._lock:
            if location.segment in self._segments:
                self._release(location, self._capture_bytes(location.tokens))

    def close(self) -> None:
        """Free every segment (a CPU one's file goes at once; workers keep their mappings)."""
        with self._lock:
            for segment in self._segments.values():
                if segment.path is not None:
                    _unlink(segment.path)
            self._segments.clear()
            self._staged.clear()
            self._retained.clear()


def _typed(cache: dict[torch.dtype, torch.Tensor], buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole segment as ``dtype`` elements (its tail bytes dropped), made once."""
    typed = cache.get(dtype)
    if typed is None:
        typed = cache[dtype] = buffer[: buffer.numel() // dtype.itemsize * dtype.itemsize].view(dtype)
    return typed


def span_views(
    buffer: torch.Tensor, location: Location, g: Geometry, flags: bool = False, typed: bool = False,
    heads: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, ...]:
    """``K`` and ``V`` (``[layers, n, heads, head_dim]``) of the span at ``location`` in its
    uint8 segment ``buffer``, and with ``flags`` the capture's ``filled[layers, n, heads]``.

    ``typed``: ``buffer`` is the segment as ``g``'s dtype already (:func:`_typed`), and the views
    are two ``as_strided`` calls, of the KV heads ``[first, last)`` where ``heads`` says: the cheap
    way, for the hundreds of spans a request stages and injects."""
    offset, n = location.offset, location.tokens
    if n <= 0:
        raise ConnectorError(f"KV location of {n} tokens")
    kv_bytes = g.kv_bytes(n)
    end = offset + 2 * kv_bytes + (g.layers * n * g.heads if flags else 0)
    size = buffer.numel() * buffer.element_size()
    if offset < 0 or end > size:
        raise ConnectorError(f"KV at bytes [{offset}, {end}) lies outside its {size}-byte segment")
    if typed:
        first, last = heads or (0, g.heads)
        itemsize = buffer.element_size()
        stride = (n * g.heads * g.head_dim, g.heads * g.head_dim, g.head_dim, 1)
        shape_h = (g.layers, n, last - first, g.head_dim)
        at = offset // itemsize + first * g.head_dim
        return (buffer.as_strided(shape_h, stride, at),
                buffer.as_strided(shape_h, stride, at + kv_bytes // itemsize))
    shape = (g.layers, n, g.heads, g.head_dim)
    dtype = g.torch_dtype
    k = buffer[offset : offset + kv_bytes].view(dtype).view(shape)
    v = buffer[offset + kv_bytes : offset + 2 * kv_bytes].view(dtype).view(shape)
    if not flags:
        return k, v
    filled = buffer[offset + 2 * kv_bytes : end].view(g.layers, n, g.heads)
    return k, v, filled


class ExchangeReader:
    """A worker's side: maps the owners' segments by descriptor (once each) and cuts spans
    and capture rooms out of them, and opens event rings."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._typed: dict[str, dict[torch.dtype, torch.Tensor]] = {}
        self._rings: dict[str, list[torch.cuda.Event]] = {}

    def map(self, descriptors: dict[str, dict[str, Any]]) -> None:
        for name, descriptor in descriptors.items():
            if name in self._buffers or name in self._rings:
                continue
            if "events" in descriptor:
                self._rings[name] = _open_ring(name, descriptor)
            else:
                local = _LOCAL.get(name)
                self._buffers[name] = local if local is not None else _open_segment(name, descriptor)

    def views(self, location: Location, g: Geometry, flags: bool = False) -> tuple[torch.Tensor, ...]:
        return span_views(self._buffer(location), location, g, flags=flags)

    def span(self, location: Location, g: Geometry, heads: tuple[int, int]) -> FactKV:
        """KV heads ``[first, last)`` of the span at ``location`` (two strided views)."""
        typed = _typed(self._typed.setdefault(location.segment, {}), self._buffer(location), g.torch_dtype)
        k, v = span_views(typed, location, g, typed=True, heads=heads)
        return FactKV(k, v, location.position)

    def event(self, ready: tuple[str, int]) -> torch.cuda.Event:
        """The owner's event a plan's ``ready`` names."""
        ring = self._rings.get(ready[0])
        if ring is None:
            raise ConnectorError(f"KV event ring {ready[0]!r} was never described to this worker")
        return ring[ready[1] % len(ring)]

    def _buffer(self, location: Location) -> torch.Tensor:
        buffer = self._buffers.get(location.segment)
        if buffer is None:
            raise ConnectorError(f"KV segment {location.segment!r} was never described to this worker")
        return buffer


def _open_ring(name: str, descriptor: dict[str, Any]) -> list[torch.cuda.Event]:
    local = _LOCAL_RINGS.get(name)
    if local is not None:
        return local.events
    if not _SHM_NAME.match(name):
        raise ConnectorError(f"bad KV event ring name {name!r}")
    device = torch.device("cuda", _cuda_index(descriptor["uuid"]))
    return [torch.cuda.Event.from_ipc_handle(device, base64.b64decode(h)) for h in descriptor["events"]]


def _open_segment(name: str, descriptor: dict[str, Any]) -> torch.Tensor:
    if not _SHM_NAME.match(name):
        raise ConnectorError(f"bad KV segment name {name!r}")
    size = int(descriptor["size"])
    cuda = descriptor.get("cuda")
    if cuda is None:
        path = os.path.join(_SHM_DIR, name)
        # torch.from_file would create a missing file: look first.
        if not os.path.isfile(path) or os.path.getsize(path) < size:
            raise ConnectorError(
                f"cannot map KV segment {path}: the process holding the facts must run on this host"
            )
        return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    index = _cuda_index(cuda["uuid"])
    storage = torch.UntypedStorage._new_shared_cuda(
        index,
        base64.b64decode(cuda["handle"]),
        int(cuda["storage_size"]),
        int(cuda["storage_offset"]),
        base64.b64decode(cuda["ref_handle"]),
        int(cuda["ref_offset"]),
        base64.b64decode(cuda["event_handle"]) if cuda.get("event_handle") else None,
        bool(cuda["event_sync"]),
    )
    return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index)).set_(storage, 0, (size,), (1,))


def _cuda_index(device_uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == device_uuid:
            return i
    raise ConnectorError(f"KV segment lives on GPU {device_uuid}, which this worker cannot see")
