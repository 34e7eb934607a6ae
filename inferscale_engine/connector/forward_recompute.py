"""Token-level recompute riding vLLM's own forward pass (``EngineConfig.recompute_tokens``), in
the connector's worker half.

:mod:`~inferscale_engine.connector.blend` recomputes the chosen rows of the injected region in a
pass of its own before vLLM's: every linear layer reads its weights a second time, ~13 ms for
~100 rows on an H100 (Llama-3.1-8B shape) against a ~10 ms request. Here the rows join the
step's batch instead, past its scheduled tokens in the padding tail
(:class:`~inferscale_engine.vllm_compat.ExtraRows`): their prompt token ids, their served
positions and their cache slots. vLLM's forward pass computes them with the request's own
tokens, in the same weight reads, and its KV write puts each layer's rows over the injected ones
before that layer's attention, so the request's tokens attend over them as over a prompt's.

In a full CUDA graph (the engine's default on CUDA), vLLM's own attention covers the rows too:
each run of consecutive rows of one request becomes a sequence of the step's FlashAttention 3
call, in a spare request slot of the graph
(:class:`~inferscale_engine.vllm_compat.FullGraphSequences`), and nothing of InferScale's runs
inside the replay. Elsewhere only the rows' own attention is InferScale's: vLLM's covers the
scheduled tokens. After it, each layer's rows attend causally over their request's prefix in
the cache, the rows just written included, into the layer's output rows:

- FlashAttention (CUDA): one call of its paged varlen kernel a layer (:class:`PagedRuns`), each
  run of consecutive rows a sequence over its request's pages, as vLLM's own call for a prefill.
- Another CUDA backend whose layout is known: the prefixes gathered by block table, one fused
  SDPA call under a per-request mask (:class:`PagedPrefix`). On an H100 this was ~30 eager torch
  ops and 0.3 ms of host time a layer (k=50; docs/benchmarks-locomo.md), while the GPU waited
  between vLLM's graph pieces.
- The CPU backend, whose layout is not known: the prefix is the rows this step injected, kept
  in hand with each layer's recomputed rows written over them, float32 in chunks.

Only rules that keep every row they recompute ride the pass (``header``, ``first:N``).
CacheBlend's selection (``deviating:P``) drops most rows after the second layer, and in the
forward pass every row runs every layer's linear layers: on the CPU with Qwen2.5-Coder-0.5B that
cost 2–4x the separate pass (which drops them), so it keeps the separate pass. So does a step
that cannot carry its rows (past the batch's buffers, a full graph with too few spare request
slots or of another runner or backend).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from inferscale_engine import vllm_compat as compat
from inferscale_engine.connector.blend import attend_chunked, attend_fused
from inferscale_engine.connector.plan import position_slots

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext

    from inferscale_engine.connector.plan import LoadRequest

#: Per layer ``[blocks, block_size, kv_heads, head_dim]`` K and V views of the paged cache.
PagedViews = Sequence[tuple[torch.Tensor, torch.Tensor]]
#: What a load injected this step (``[layers, stop - start, kv_heads, head_dim]`` K rotated, V).
InHand = tuple[torch.Tensor, torch.Tensor]


class ForwardRecompute:
    """Recomputes the chosen rows of a step's loads inside that step's forward pass."""

    def __init__(self, runner: Any, layers: Sequence[tuple[str, Any]],
                 rows_for: Callable[[Sequence[LoadRequest]], int]) -> None:
        """``runner``: the vLLM model runner; ``layers``: its attention layers in model order;
        ``rows_for(loads)``: the rows a step with these loads carries (0: it recomputes with
        blend.py, or not at all)."""
        def step_rows(scheduler_output: Any) -> tuple[int, int]:
            loads = getattr(scheduler_output.kv_connector_metadata, "loads", ())
            rows = rows_for(loads)
            return rows, sum(len(_run_bounds(load.recompute)) - 1 for load in loads
                             if rows and load.recompute is not None)

        self._extra = compat.ExtraRows(runner, step_rows)
        self._last = len(layers) - 1
        self._head_dims = [int(layer.head_size) for _, layer in layers]
        self._scales = [compat.attention_scale(layer) for _, layer in layers]
        varlen = [compat.paged_varlen_attention(layer) for _, layer in layers]
        self._varlen: list[compat.PagedVarlenAttention] | None = varlen if all(varlen) else None  # type: ignore[assignment]
        self._step: _Step | None = None
        for index, (_, layer) in enumerate(layers):
            compat.wrap_attention_forward(layer, functools.partial(_after_attention, self, index))

    def start(self, loads: Sequence[LoadRequest], in_hand: Sequence[InHand | None], views: PagedViews | None,
              block_size: int, forward_context: ForwardContext) -> bool:
        """Put this step's rows of ``loads`` (each with ``recompute`` and ``recompute_ids``, every
        row kept) into its batch; False where the step does not carry them (the caller recomputes
        them itself)."""
        extra = self._extra
        rows = sum(len(load.recompute) for load in loads if load.recompute is not None)
        if not rows or extra.rows != rows:
            return False
        if extra.full:  # a full graph's forward context tells nothing: the runner padded it for the rows
            return views is not None and self._start_in_full_graph(loads, views, block_size)
        if compat.step_row_count(forward_context) < extra.scheduled + rows:
            return False
        if views is None and any(hand is None or load.start for load, hand in zip(loads, in_hand)):
            return False
        device = extra.device
        positions, on_device = self._write_rows(loads, block_size, compat.step_slot_mappings(forward_context))
        bounds = np.cumsum([0, *(len(load.recompute) for load in loads)])  # type: ignore[arg-type]
        step = _Step(first=extra.scheduled, rows=rows, positions=on_device,
                     parts=[slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])])
        if views is not None and self._varlen is not None:
            step.runs = PagedRuns.build(loads, views, block_size, device)
        elif views is not None:
            step.paged = PagedPrefix.build(loads, views, positions, block_size, device)
        else:
            step.in_hand = [_HandPrefix(hand[0], hand[1]) for hand in in_hand]  # type: ignore[index]
        self._step = step
        return True

    def _start_in_full_graph(self, loads: Sequence[LoadRequest], views: PagedViews, block_size: int) -> bool:
        """The rows as sequences of the step's own attention, inside its full graph's replay
        (:class:`~inferscale_engine.vllm_compat.FullGraphSequences`): no attention of ours."""
        extra = self._extra
        assert extra.full_graph is not None
        runs = PagedRuns.build(loads, views, block_size, extra.device)
        if not extra.full_graph.write(extra.requests, extra.scheduled, runs.cu_seqlens_q, runs.seqused_k,
                                      runs.block_table, runs.max_seqlen_q, runs.max_seqlen_k, runs.cu_host):
            return False
        self._write_rows(loads, block_size, extra.full_graph.slot_mappings)
        return True

    def _write_rows(self, loads: Sequence[LoadRequest], block_size: int,
                    slot_mappings: Sequence[torch.Tensor]) -> tuple[np.ndarray, torch.Tensor]:
        """Write the rows' prompt token ids, positions and cache slots past the step's scheduled
        tokens, in one upload; returns their positions, on the host and on the device."""
        positions = np.concatenate([np.asarray(load.recompute) for load in loads]).astype(np.int64)
        slots = np.concatenate([position_slots(load.block_ids, np.asarray(load.recompute), block_size)
                                for load in loads])
        ids = np.concatenate([load.recompute_ids for load in loads])
        rows = len(positions)
        staged = _to_device(np.concatenate([ids, positions, slots]).astype(np.int64), self._extra.device)
        self._extra.write(staged[:rows], staged[rows : 2 * rows], staged[2 * rows :], slot_mappings)
        return positions, staged[rows : 2 * rows]

    def _attend(self, index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                output: torch.Tensor) -> None:
        """After vLLM's attention at layer ``index``: the rows' own, over their prefixes."""
        step = self._step
        if step is None:
            return
        if (self._extra.rows, self._extra.scheduled) != (step.rows, step.first):
            self._step = None  # left by a step that ended early: never attend into another step's rows
            return
        if index == self._last:
            self._step = None  # nothing reads the last layer's output rows: its KV write was all
            return
        at, dim, scale = step.at, self._head_dims[index], self._scales[index]
        q = query[at].reshape(step.rows, -1, dim)
        if step.runs is not None:
            assert self._varlen is not None
            step.runs.attend(index, self._varlen[index], q, output.view(output.shape[0], -1)[at].view(step.rows, -1, dim))
            return
        if step.paged is not None:
            out = step.paged.attend(index, q, scale)
        else:
            k, v = key[at].reshape(step.rows, -1, dim), value[at].reshape(step.rows, -1, dim)
            outs = []
            assert step.in_hand is not None
            for part, hand in zip(step.parts, step.in_hand):
                keys, values = hand.write(index, step.positions[part], k[part], v[part])
                outs.append(attend_chunked(q[part], keys, values, step.positions[part], scale))
            out = torch.cat(outs)
        output.view(output.shape[0], -1)[at] = out.to(output.dtype)


@dataclass
class _Step:
    """The rows one step carries: rows ``[first, first + rows)`` of its batch, by load (``parts``
    of them); the prefix they attend over."""

    first: int
    rows: int
    positions: torch.Tensor
    parts: list[slice]
    runs: PagedRuns | None = None
    paged: PagedPrefix | None = None
    in_hand: list[_HandPrefix] | None = None

    @property
    def at(self) -> slice:
        return slice(self.first, self.first + self.rows)


@dataclass
class PagedRuns:
    """The rows as FlashAttention sequences over the paged cache (CUDA, FlashAttention): each run
    of consecutive positions of one load is a sequence whose last row sits at the run's last
    position and reads the load's keys up to it through the load's pages. The kernel's
    bottom-right causal mask then gives each row its own prefix ``[0, position]``: one call a
    layer, reading the cache in place, with no gather and no mask."""

    views: PagedViews
    cu_seqlens_q: torch.Tensor  # [runs + 1] int32
    seqused_k: torch.Tensor  # [runs] int32
    block_table: torch.Tensor  # [runs, pages] int32: each run's load's pages
    max_seqlen_q: int
    max_seqlen_k: int
    cu_host: np.ndarray  # cu_seqlens_q on the host

    @classmethod
    def build(cls, loads: Sequence[LoadRequest], views: PagedViews, block_size: int,
              device: torch.device) -> PagedRuns:
        """The runs of ``loads``' rows (``load.recompute``, load after load, as the step
        carries them)."""
        page = int(views[0][0].shape[1])  # the kernel's page: the cache's, whatever the scheduler's block
        lengths, ends, owners, tables = [], [], [], []
        for owner, load in enumerate(loads):
            rows = np.asarray(load.recompute)
            bounds = _run_bounds(rows)
            lengths.append(np.diff(bounds))
            ends.append(rows[bounds[1:] - 1])
            owners.append(np.full(len(bounds) - 1, owner))
            tables.append(position_slots(load.block_ids, np.arange(0, load.stop, page), block_size) // page)
        table = np.zeros((len(loads), max(map(len, tables))), dtype=np.int64)
        for owner, pages in enumerate(tables):
            table[owner, : len(pages)] = pages
        run_lengths, run_ends = np.concatenate(lengths), np.concatenate(ends)
        runs = len(run_lengths)
        # One upload; each part starts 16-byte aligned, as the kernel's own arguments do.
        parts = [np.concatenate([[0], np.cumsum(run_lengths)]), run_ends + 1, table[np.concatenate(owners)].ravel()]
        at = np.cumsum([0, *(-(-len(part) // 4) * 4 for part in parts)])
        flat = np.zeros(at[-1], dtype=np.int32)
        for start, part in zip(at, parts):
            flat[start : start + len(part)] = part
        staged = _to_device(flat, device)
        cu_seqlens_q, seqused_k, block_table = (staged[a : a + len(part)] for a, part in zip(at, parts))
        return cls(views, cu_seqlens_q, seqused_k, block_table.view(runs, table.shape[1]),
                   int(run_lengths.max()), int(run_ends.max()) + 1, parts[0])

    def attend(self, index: int, attention: compat.PagedVarlenAttention, q: torch.Tensor, out: torch.Tensor) -> None:
        """Layer ``index``'s attention of the rows' queries ``q`` ``[rows, heads, head_dim]``
        over their loads' prefixes, into ``out`` (the same shape)."""
        k, v = self.views[index]
        attention(q, k, v, out, self.cu_seqlens_q, self.max_seqlen_q, self.seqused_k, self.max_seqlen_k,
                  self.block_table)


@dataclass
class PagedPrefix:
    """Every load's prefix ``[0, stop)`` read from the paged cache, one after another, and the
    mask that lets each row see its own load's keys up to its position (CUDA, where the cache's
    layout is known but the backend is not FlashAttention)."""

    views: PagedViews
    blocks: torch.Tensor
    offsets: torch.Tensor
    seen: torch.Tensor  # [rows, keys]
    _masks: dict[int, torch.Tensor]

    @classmethod
    def build(cls, loads: Sequence[LoadRequest], views: PagedViews, positions: np.ndarray, block_size: int,
              device: torch.device) -> PagedPrefix:
        """The prefixes of ``loads``, whose rows lie at ``positions`` (load after load)."""
        key_owner = np.repeat(np.arange(len(loads)), [load.stop for load in loads])
        key_position = np.concatenate([np.arange(load.stop) for load in loads])
        row_owner = np.repeat(np.arange(len(loads)), [len(load.recompute) for load in loads])  # type: ignore[arg-type]
        seen = (key_owner[None] == row_owner[:, None]) & (key_position[None] <= positions[:, None])
        where = _to_device(np.concatenate([position_slots(load.block_ids, np.arange(load.stop), block_size)
                                           for load in loads]), device)
        size = views[0][0].shape[1]
        return cls(views, where // size, where % size, _to_device(seen, device), {})

    def attend(self, index: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Layer ``index``'s attention of the rows' queries ``q`` ``[rows, heads, head_dim]``
        over their requests' prefixes, ``[rows, heads * head_dim]``."""
        keys, values = self.read(index)
        return attend_fused(q, keys, values, self.mask(q.shape[1] // keys.shape[1]), scale)

    def read(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.views[index]
        return k[self.blocks, self.offsets], v[self.blocks, self.offsets]

    def mask(self, group: int) -> torch.Tensor:
        """:func:`~inferscale_engine.connector.blend.attend_fused`'s mask for ``group`` query
        heads per KV head, made once a step."""
        mask = self._masks.get(group)
        if mask is None:
            mask = self._masks[group] = self.seen.repeat(group, 1)
        return mask


@dataclass
class _HandPrefix:
    """A load's prefix as injected this step (``[layers, stop, kv_heads, head_dim]``, the whole
    of it: the load starts at 0), each layer's recomputed rows written over it as they come.
    The rows are this step's own copies (the injection gathered and rotated them), so they are
    written in place."""

    k: torch.Tensor
    v: torch.Tensor

    def write(self, index: int, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer ``index``'s rows and return its K and V."""
        keys, values = self.k[index], self.v[index]
        keys[positions] = k.to(keys.dtype)
        values[positions] = v.to(values.dtype)
        return keys, values


def _run_bounds(rows: np.ndarray) -> np.ndarray:
    """Where the runs of consecutive positions in ``rows`` (sorted) start, and ``len(rows)``."""
    if not len(rows):
        return np.zeros(1, dtype=np.int64)
    return np.concatenate([[0], np.flatnonzero(np.diff(rows) != 1) + 1, [len(rows)]])


def _after_attention(recompute: ForwardRecompute, index: int, *args: torch.Tensor) -> None:
    # The method looked up per call, so a profiler may wrap it on the class.
    recompute._attend(index, *args)


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` on ``device``, queued behind the step's work on CUDA: a copy from pageable
    memory would hold the host until the kernels queued ahead of it (the injection's) ran."""
    host = torch.from_numpy(array)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
