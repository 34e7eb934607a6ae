"""The connector's worker half: lives in each vLLM worker process (one per tensor-parallel rank;
the worker's connector, built with role WORKER) and moves KV between the paged cache and the
spans' shared memory (:mod:`inferscale_engine.connector.exchange`), taking its own rank's KV heads.

Injection rotates each span's keys from its encode positions to its serving positions and
writes them with the attention backend's own write op, or with the fused Triton writer
(:mod:`inferscale_engine.connector.rope_triton`) where the cache layout is known. Capture
requests are ordinary prefills whose rows the half copies out of the paged cache after the
forward pass where the layout is known (full CUDA graph replays included), else out of the
wrapped KV write as vLLM makes it. Where a load names positions to recompute
(``EngineConfig.recompute_tokens``), their rows are computed again once injected: as extra rows
of the step's own forward pass (:mod:`inferscale_engine.connector.forward_recompute`) where the
step can carry them, else in a pass of their own before it
(:mod:`inferscale_engine.connector.blend`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from inferscale_engine import vllm_compat as compat
from inferscale_engine.connector.blend import GraphedRecompute, LayerwiseRecompute, PrefixReader, RowWriter
from inferscale_engine.connector.exchange import ExchangeReader, Geometry, Location
from inferscale_engine.connector.forward_recompute import ForwardRecompute
from inferscale_engine.connector.plan import (
    CaptureSlots,
    InferScaleConnectorMetadata,
    LoadPieces,
    LoadRequest,
    position_slots,
)
from inferscale_engine.connector.table import InjectionTable, SpanColumns
from inferscale_engine.errors import ConnectorError
from inferscale_engine.kv import FactKV
from inferscale_engine.rope import RopeTable, rotate

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext

logger = logging.getLogger(__name__)


class ConnectorWorker:
    """The worker half of :class:`~inferscale_engine.connector.connector.InferScaleConnector`:
    its worker-side methods, handed each step's metadata by it."""

    def __init__(self, block_size: int, fused: bool, in_forward: bool = True) -> None:
        """``fused``: write injected KV with the Triton kernel where it knows the layout;
        ``in_forward``: recompute rows inside vLLM's forward pass where a step can carry them."""
        self._block_size = block_size
        self._fused = fused
        self._in_forward = in_forward
        # Per layer [blocks, block_size, heads, head_dim] K/V views of vLLM's cache, and the Triton
        # writer's per-layer addresses; once known (False: the backend's layout is not known).
        self._paged: list[tuple[torch.Tensor, torch.Tensor]] | bool | None = None
        self._fused_views: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | bool | None = None
        self._reader = ExchangeReader()
        self._ropes: dict[str, RopeTable] = {}
        self._heads: tuple[int, int] | None = None  # this rank's KV heads [first, last)
        self._geometry: Geometry | None = None
        self._at: dict[str, Location] = {}  # where this step's spans and capture rooms lie
        self._spans: dict[Location, FactKV] = {}  # span views by location, for spans in flight
        self._rooms: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._layers: list[tuple[str, Any]] = []
        self._writers: dict[str, Any] = {}
        self._step = 0
        # This step's captures: read from the cache after the forward pass where its layout is
        # known, else taken from the wrapped KV write.
        self._cache_captures: list[CaptureSlots] = []
        self._hooked_captures: list[CaptureSlots] = []
        self._matched_step = -1
        self._matches: list[tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]] = []
        self._forward: ForwardRecompute | None = None  # where the runner can carry rows
        self._runner_checked = False
        self._recompute: LayerwiseRecompute | None = None  # built on the first load that asks
        self._graphed_recompute: GraphedRecompute | None = None
        self._warned_recompute = False

    def start_load_kv(self, meta: InferScaleConnectorMetadata, forward_context: ForwardContext) -> None:
        """Take this step's metadata: map new segments, queue every injection ahead of the
        forward pass, and arm this step's captures."""
        if not self._layers:
            self._install(forward_context)
        self._step += 1
        if meta.segments:
            self._reader.map(meta.segments)
        if meta.geometry is not None and meta.geometry != self._geometry:
            self._check_geometry(meta.geometry)
        self._at = meta.at
        if meta.captures and self._paged_views(forward_context):
            self._cache_captures = meta.captures
        else:
            self._hooked_captures = meta.captures
        if meta.loads:
            in_hand = self._inject(meta.loads, forward_context)
            chosen = [index for index, load in enumerate(meta.loads) if _recomputes(load)]
            if chosen:
                riding = self._riding()
                if riding is None or not riding.start([meta.loads[i] for i in chosen], [in_hand[i] for i in chosen],
                                                      self._paged_views(forward_context), self._block_size,
                                                      forward_context):
                    self._recompute_rows(meta.loads, in_hand, forward_context)

    def wait_for_save(self) -> None:
        """Read this step's captures out of the cache, queued behind the forward pass."""
        if self._cache_captures:
            self._read_captures()

    def end_step(self) -> None:
        """Forget this step's captures (vLLM cleared its metadata)."""
        self._cache_captures, self._hooked_captures = [], []

    def _install(self, forward_context: ForwardContext) -> None:
        """Wrap every attention layer's KV write once, to see what vLLM writes; find this rank's
        KV heads and the model's rotary tables."""
        self._layers = compat.attention_layers(forward_context)
        self._ropes = _rope_tables(self._layers)
        for index, (name, layer) in enumerate(self._layers):
            # Bound per layer through the default: a closure would see the loop's last index.
            def after_write(
                key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, _index: int = index
            ) -> None:
                if self._hooked_captures:
                    self._capture(_index, key, value, slot_mapping)

            self._writers[name] = compat.wrap_kv_cache_update(layer, after_write)
        logger.debug("InferScaleConnector hooked %d attention layers", len(self._layers))

    def _riding(self) -> ForwardRecompute | None:
        """What puts recomputed rows into the forward pass (None: the runner cannot carry them),
        hooked into the runner and its attention layers on the first step that recomputes (that
        step runs the separate pass: its batch is laid out already); a model that never
        recomputes is never hooked."""
        if self._forward is None and self._in_forward and not self._runner_checked:
            self._runner_checked = True
            runner = compat.running_runner()
            if runner is not None and compat.extra_rows_supported(runner):
                self._forward = ForwardRecompute(runner, self._layers,
                                                 lambda loads: _rows_in_forward(loads, paged=bool(self._paged)))
                logger.debug("InferScaleConnector: recomputed rows ride the forward pass from the next step")
        return self._forward

    def _check_geometry(self, g: Geometry) -> None:
        """Check the owner's KV fits this model, and find this rank's KV heads: with tensor
        parallelism rank r of R holds heads [r*H/R, (r+1)*H/R), or one replicated head where
        R > H (vLLM's split)."""
        layer = self._layers[0][1]
        local, dim = int(layer.num_kv_heads), int(layer.head_size)
        rank, ranks = compat.tensor_parallel_rank()
        first, last = rank_heads(g.heads, local, rank, ranks)
        if g.layers != len(self._layers) or g.head_dim != dim or last > g.heads:
            raise ConnectorError(
                f"KV of {g.layers} layers x {g.heads} heads x {g.head_dim} does not fit this model "
                f"({len(self._layers)} attention layers, {local} KV heads of {dim} on rank {rank} of {ranks})"
            )
        self._geometry, self._heads = g, (first, last)
        self._spans.clear()

    def _span(self, location: Location) -> FactKV:
        """This rank's heads of the span at ``location`` (views of shared memory)."""
        kv = self._spans.get(location)
        if kv is None:
            assert self._geometry is not None and self._heads is not None
            kv = self._reader.span(location, self._geometry, self._heads)
            self._spans[location] = kv
            while len(self._spans) > _SPAN_VIEWS:
                del self._spans[next(iter(self._spans))]
        return kv

    def _room(self, capture_id: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """This rank's heads of a capture's room: K, V and ``filled`` views (None: the
        request is gone)."""
        room = self._rooms.get(capture_id)
        if room is None:
            location = self._at.get(capture_id)
            if location is None:
                return None
            assert self._geometry is not None and self._heads is not None
            k, v, filled = self._reader.views(location, self._geometry, flags=True)
            heads = slice(*self._heads)
            room = self._rooms[capture_id] = (k[:, :, heads], v[:, :, heads], filled[:, :, heads])
            while len(self._rooms) > _SPAN_VIEWS:
                del self._rooms[next(iter(self._rooms))]
        return room


    def _inject(
        self, loads: list[LoadRequest], forward_context: ForwardContext
    ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Write every load's rows; returns, per load, the K (rotated) and V rows written
        ``[layers, stop - start, heads, head_dim]`` where the torch path had them in hand."""
        # Thousands of spans a step with many requests at large k: the plans' columns, sliced
        # and offset by numpy; per span only its KV is looked up (shared memory) or taken from
        # the plan (an owner in this process). Shapes need no check per span: the owner checked
        # each against the geometry (KVExchange.stage, or where a span entered the engine), and
        # _check_geometry that against the model.
        if len(loads) == 1:  # one request's step: its columns as they come (each copy costs µs, cold)
            one = loads[0].pieces
            kvs = list(self._load_kvs(one))
            row, position, count = one.row, one.position, one.count
            slots = loads[0].slots(self._block_size)
        else:
            pieces = [load.pieces for load in loads]
            kvs = []
            for p in pieces:
                kvs.extend(self._load_kvs(p))
            row = np.concatenate([p.row for p in pieces])
            position = np.concatenate([p.position for p in pieces])
            count = np.concatenate([p.count for p in pieces])
            slots = np.concatenate([load.slots(self._block_size) for load in loads])
        encoded_at = np.fromiter((kv.position for kv in kvs), dtype=np.int64, count=len(kvs))
        spans = SpanColumns(kvs, row, count, position - encoded_at - row)
        device = compat.layer_kv_cache(self._layers[0][1], forward_context).device
        if device.type == "cuda":
            self._wait_ready(kvs, loads, device)
        if self._fused and device.type == "cuda" and self._fused_ready(forward_context):
            self._inject_fused(spans, slots, device)
            return [None] * len(loads)
        k, v = self._inject_torch(spans, slots, device, forward_context)
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        at = 0
        for load in loads:
            rows = load.stop - load.start
            out.append((k[:, at : at + rows], v[:, at : at + rows]))
            at += rows
        return out

    def _load_kvs(self, pieces: LoadPieces) -> Sequence[FactKV]:
        """This rank's heads of the KV of every span of ``pieces``."""
        assert self._geometry is not None and self._heads is not None
        if pieces.kvs is not None:  # by reference, from an owner in this process
            if self._heads == (0, self._geometry.heads):
                return pieces.kvs
            first, last = self._heads
            return [kv.heads(first, last) for kv in pieces.kvs]
        at = self._at
        try:
            locations = [at[key] for key in pieces.keys]
        except KeyError as exc:
            raise ConnectorError(f"span {exc.args[0]!r} has no KV location") from None
        return [*map(self._span, locations)]

    def _wait_ready(self, kvs: list[FactKV], loads: list[LoadRequest], device: torch.device) -> None:
        """Queue the writes behind the copies that made the spans' KV, on the device: the
        owner's gathers (spans held by reference) or its staging copies (a ring event)."""
        events = {id(kv.ready): kv.ready for kv in kvs if kv.ready is not None}
        for load in loads:
            if load.ready is not None:
                event = self._reader.event(load.ready)
                events[id(event)] = event
        stream = torch.cuda.current_stream(device)
        for event in events.values():
            stream.wait_event(event)

    def _paged_views(self, forward_context: ForwardContext) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Every layer's K/V cache as ``[blocks, block_size, heads, head_dim]`` views, where the
        backend's layout is known; found once, since caches never move once allocated."""
        if self._paged is None:
            views = [compat.paged_kv_views(layer, compat.layer_kv_cache(layer, forward_context)) for _, layer in self._layers]
            self._paged = views if all(views) else False  # type: ignore[assignment]
        return self._paged or None  # type: ignore[return-value]

    def _fused_ready(self, forward_context: ForwardContext) -> bool:
        """Whether the Triton writer knows this cache layout (per-layer rope or an unknown layout
        go the torch way)."""
        if self._fused_views is None:
            from inferscale_engine.connector.rope_triton import cache_pointers

            views = self._paged_views(forward_context)
            ropes = self._ropes
            one_table = len({id(ropes[name]) for name, _ in self._layers}) == 1
            if one_table and views:
                device = views[0][0].device
                keys, values = [kc for kc, _ in views], [vc for _, vc in views]
                self._fused_views = (cache_pointers(keys, device), cache_pointers(values, device), keys[0])
            else:
                self._fused_views = False
        return bool(self._fused_views)

    def _inject_fused(self, spans: SpanColumns, slots: np.ndarray, device: torch.device) -> None:
        """Rotate and write every layer's rows in one Triton launch, queued ahead of the forward
        pass on its stream."""
        from inferscale_engine.connector.rope_triton import inject_rows

        assert isinstance(self._fused_views, tuple)
        key_ptrs, value_ptrs, view = self._fused_views
        table = InjectionTable.build_columns(spans, slots, device)
        inject_rows(table, self._ropes[self._layers[0][0]], key_ptrs, value_ptrs, view)

    def _inject_torch(
        self, spans: SpanColumns, slots: np.ndarray, device: torch.device, forward_context: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference path (CPU, or layouts the Triton writer does not know): gather, rotate,
        write through the backend's own KV write op. Returns the K (rotated) and V written."""
        ks, vs = [], []
        for kv, row, count in zip(spans.kv, spans.row.tolist(), spans.count.tolist()):
            k, v = kv.k, kv.v
            if row or count != k.shape[1]:  # cut by a chunked prefill: its rows in this chunk
                k, v = k[:, row : row + count], v[:, row : row + count]
            ks.append(k)
            vs.append(v)
        k, v = _gathered(ks, device), _gathered(vs, device)
        # numpy: torch.repeat_interleave took up to ms on a busy 2-core box, np.repeat µs. Left
        # on the host: rotate checks them and looks up their angles there, with no device sync.
        deltas = torch.from_numpy(np.repeat(spans.delta, spans.count))
        slot_mapping = torch.from_numpy(slots).to(device)
        k = self._rotate(k, deltas)
        for index, (name, layer) in enumerate(self._layers):
            cache = compat.layer_kv_cache(layer, forward_context)
            self._writers[name](layer, k[index].to(cache.dtype), v[index].to(cache.dtype), cache, slot_mapping)
        return k, v

    def _recompute_rows(
        self, loads: list[LoadRequest], in_hand: list[tuple[torch.Tensor, torch.Tensor] | None],
        forward_context: ForwardContext,
    ) -> None:
        """Compute the chosen injected rows of each load again, over its whole prefix
        (:mod:`inferscale_engine.connector.blend`), before the forward pass reads them: replayed
        as a CUDA graph where the cache's layout is known and every chosen row is kept."""
        if self._recompute is None:
            model = compat.running_model()
            if model is None:
                raise ConnectorError("token-level recompute found no vLLM model runner calling the connector")
            self._recompute = LayerwiseRecompute(model, [name for name, _ in self._layers])
        views = self._paged_views(forward_context)
        device = compat.layer_kv_cache(self._layers[0][1], forward_context).device
        for load, hand in zip(loads, in_hand):
            if load.recompute is None or load.recompute_ids is None:
                continue
            if views is None and (hand is None or load.start):
                # The cache's layout is unknown here, and rows below start came from vLLM's
                # prefix cache: the prefix is not in hand to attend over.
                if not self._warned_recompute:
                    self._warned_recompute = True
                    logger.warning("token-level recompute skipped: part of a prefix came from vLLM's prefix "
                                   "cache, whose layout this attention backend does not expose")
                continue
            slots = position_slots(load.block_ids, load.recompute, self._block_size)
            if views is not None and load.recompute_keep is None and device.type == "cuda":
                prefix_slots = position_slots(load.block_ids, np.arange(load.stop), self._block_size)
                if self._graphed(views, forward_context, device).run(load.recompute_ids, load.recompute, slots,
                                                                     prefix_slots):
                    continue
            on_device = torch.from_numpy(slots).to(device)

            def write(index: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      _slots: torch.Tensor = on_device) -> None:
                where = _slots if len(rows) == len(_slots) else _slots[rows]
                self._write_rows(index, where, k, v, compat.layer_kv_cache(self._layers[index][1], forward_context))

            positions = torch.from_numpy(load.recompute).to(device)
            if views is None:
                assert hand is not None
                prefix, writer = _live_rows(hand, positions, write)
            else:
                prefix, writer = self._prefix_reader(load, views, device), write
            self._recompute.run(torch.from_numpy(load.recompute_ids).to(device), positions, prefix, writer,
                                keep=load.recompute_keep)

    def _graphed(self, views: list[tuple[torch.Tensor, torch.Tensor]], forward_context: ForwardContext,
                 device: torch.device) -> GraphedRecompute:
        if self._graphed_recompute is None:
            assert self._recompute is not None
            size = views[0][0].shape[1]

            def read(index: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                block, offset = slots // size, slots % size
                return views[index][0][block, offset], views[index][1][block, offset]

            caches = [compat.layer_kv_cache(layer, forward_context) for _, layer in self._layers]  # never move
            self._graphed_recompute = GraphedRecompute(
                self._recompute, read, lambda index, slots, k, v: self._write_rows(index, slots, k, v, caches[index]),
                device)
        return self._graphed_recompute

    def _write_rows(self, index: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cache: torch.Tensor) -> None:
        """Write rows of layer ``index`` to ``cache`` ``slots`` with the backend's own write."""
        name, layer = self._layers[index]
        self._writers[name](layer, k.to(cache.dtype), v.to(cache.dtype), cache, slots)

    def _prefix_reader(
        self, load: LoadRequest, views: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
    ) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the request's rows ``[0, stop)`` read from the cache by its block table."""
        where = torch.from_numpy(position_slots(load.block_ids, np.arange(load.stop), self._block_size)).to(device)
        size = views[0][0].shape[1]
        block, offset = where // size, where % size
        return lambda index: (views[index][0][block, offset], views[index][1][block, offset])

    def _rotate(self, k: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        tables = [self._ropes[name] for name, _ in self._layers]
        if all(t is tables[0] for t in tables):
            return rotate(k, deltas, tables[0])
        out = torch.empty_like(k)
        for index, table in enumerate(tables):  # per-layer rope (e.g. local/global layers)
            out[index] = rotate(k[index], deltas, table)
        return out

    def _read_captures(self) -> None:
        """Copy this step's capture rows out of the paged cache, all layers at once. Queued behind
        the forward pass on its stream, so it reads what vLLM wrote, whether the KV writes ran
        eagerly or inside a full CUDA graph (whose replay no wrapper sees)."""
        todo = [(room, cap) for cap in self._cache_captures if (room := self._room(cap.capture_id)) is not None]
        self._cache_captures = []
        if not todo:
            return  # requests aborted
        views = self._paged
        assert isinstance(views, list)
        slots = np.fromiter((s for _, cap in todo for s in cap.slots), dtype=np.int64)
        # Pinned: a plain copy would wait for the forward pass queued ahead of it.
        key_cache = views[0][0]  # [blocks, block_size, heads, head_dim]
        where = torch.from_numpy(slots).pin_memory().to(key_cache.device, non_blocking=True)
        block, offset = where // key_cache.shape[1], where % key_cache.shape[1]
        k = torch.stack([kc[block, offset] for kc, _ in views])
        v = torch.stack([vc[block, offset] for _, vc in views])
        at = 0
        for (keys, values, filled), cap in todo:
            rows = slice(cap.first_row, cap.first_row + len(cap.slots))
            keys[:, rows] = k[:, at : at + len(cap.slots)]
            values[:, rows] = v[:, at : at + len(cap.slots)]
            filled[:, rows] = 1
            at += len(cap.slots)

    def _capture(self, index: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if self._matched_step != self._step:
            self._match(slot_mapping[: key.shape[0]])
        for (keys, values, filled), batch_rows, rows in self._matches:
            keys[index, rows] = key[batch_rows].to(keys.dtype)
            values[index, rows] = value[batch_rows].to(values.dtype)
            filled[index, rows] = 1

    def _match(self, slot_mapping: torch.Tensor) -> None:
        """Find, once per step, which rows of the batch belong to which capture range."""
        self._matched_step = self._step
        self._matches = []
        for cap in self._hooked_captures:
            room = self._room(cap.capture_id)
            if room is None or not cap.slots:
                continue  # request was aborted
            wanted = torch.tensor(cap.slots, dtype=slot_mapping.dtype, device=slot_mapping.device)
            ordered, order = torch.sort(wanted)
            where = torch.searchsorted(ordered, slot_mapping).clamp_(max=len(ordered) - 1)
            hit = ordered[where] == slot_mapping
            batch_rows = hit.nonzero().squeeze(1)
            if batch_rows.numel():
                self._matches.append((room, batch_rows, order[where[batch_rows]] + cap.first_row))


def rank_heads(heads: int, local: int, rank: int, ranks: int) -> tuple[int, int]:
    """The KV heads ``[first, last)`` that tensor-parallel rank ``rank`` of ``ranks`` holds of a
    model's ``heads``, ``local`` on each rank: ``[r*H/R, (r+1)*H/R)``, or one replicated head
    where ``R > H`` (vLLM's split)."""
    first = rank * heads // ranks
    return first, first + local


def _recomputes(load: LoadRequest) -> bool:
    return load.recompute is not None and load.recompute_ids is not None


def _rows_in_forward(loads: Sequence[LoadRequest], paged: bool) -> int:
    """The rows a step with ``loads`` carries in its forward pass: every recomputed row, where
    each load keeps all it recomputes (CacheBlend's selection keeps the separate pass, which
    drops the other rows after the second layer) and its prefix can be read (from the cache, or,
    where its layout is not known, a load starting at 0 has it all in hand); else none."""
    chosen = [load for load in loads if _recomputes(load)]
    if any(load.recompute_keep is not None for load in chosen) or (not paged and any(load.start for load in chosen)):
        return 0
    return sum(len(load.recompute) for load in chosen if load.recompute is not None)


def _live_rows(
    hand: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor, write: RowWriter,
) -> tuple[PrefixReader, RowWriter]:
    """A prefix reader over the rows a load injected (``hand``: ``[layers, stop, heads, head_dim]``,
    K rotated), and a writer that writes the cache and those rows too, as the cache would show
    them. A layer's rows are copied on its first write: they may be the stored spans' own."""
    copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def read(index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return copies.get(index) or (hand[0][index], hand[1][index])

    def write_both(index: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        write(index, rows, k, v)
        if index not in copies:
            copies[index] = (hand[0][index].clone(), hand[1][index].clone())
        keys, values = copies[index]
        keys[positions[rows]] = k.to(keys.dtype)
        values[positions[rows]] = v.to(values.dtype)

    return read, write_both


def _gathered(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``parts`` concatenated along the token axis, on ``device``: one copy where they lie on one
    device (no call per span), else each moved there first."""
    try:
        return torch.cat(parts, dim=1).to(device)
    except RuntimeError:  # spans on several devices (a host tier's beside a device tier's)
        return torch.cat([part.to(device) for part in parts], dim=1)


#: Span and capture views a worker keeps (a request's spans are all injected in one step, or a
#: few with chunked prefill: this covers every span of many requests in flight).
_SPAN_VIEWS = 8192


def _rope_tables(layers: list[tuple[str, Any]]) -> dict[str, RopeTable]:
    """The rotary table of every attention layer, from the model's own rotary modules (one
    table per module, shared by the layers that share it)."""
    by_module: dict[int, RopeTable] = {}
    tables: dict[str, RopeTable] = {}
    for name, rope in compat.rotary_embeddings(layers).items():
        if id(rope) not in by_module:
            by_module[id(rope)] = RopeTable.from_module(rope).to(rope.cos_sin_cache.device)
        tables[name] = by_module[id(rope)]
    return tables
