"""CPU micro-benchmark of the per-span Python on the injection path (no GPU needed).

Times, at ``--spans`` retrieved facts of ``--tokens`` tokens each (k=200 by default):

* ``table build``: :meth:`InjectionTable.build` on the same FactKVs every time (``warm``: what a
  chunked prefill's later steps see) and on fresh FactKV objects every time (``cold``: a
  request's first step, since tiers hand out new views per read), made as the tiers make them
  (:meth:`FactKV.rows_of`, no views) or as views one by one;
* ``tier views``: making those 200 FactKVs, in bulk or one by one;
* ``exchange stage``: staging those spans for a request, copied into shared memory (``cold``) or
  by reference (``local``, an in-process owner: stage and unstage);
* ``worker _inject``: the connector's worker half (pieces' columns, slots, table build), cold and
  warm (spans in shared memory) and local (spans by reference, carried by the plan);
* ``scheduler alloc``: the scheduler half's ``update_state_after_alloc`` (the plan's pieces).

FactKVs are rows of one ``[2, layers, rows, heads, dim]`` block, as the tiers hand them out.
With ``--device cpu`` (the default) the table is built for the CPU, so the pinned upload is
skipped: this times the Python part only; ``--device cuda`` adds the pinned copy and upload
(queued, not waited for). Run: ``python scripts/bench_table_build.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import torch

from inferscale_engine.connector.exchange import ExchangeReader, Geometry, KVExchange
from inferscale_engine.connector.plan import (
    InjectionPlan,
    LoadRequest,
)
from inferscale_engine.connector.scheduler import ConnectorScheduler
from inferscale_engine.connector.table import InjectionTable, SpanRows
from inferscale_engine.connector.worker import ConnectorWorker
from inferscale_engine.kv import FactKV


def _views(block: torch.Tensor, spans: int, tokens: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Each span's K and V rows of ``block``, cut as a device-tier read cuts them (two splits)."""
    return block[0, :, : spans * tokens].split(tokens, dim=1), block[1, :, : spans * tokens].split(tokens, dim=1)


def _facts(block: torch.Tensor, spans: int, tokens: int) -> list[FactKV]:
    """Fresh FactKVs of ``block``'s rows, one per span (new objects: nothing cached on them), as
    the tiers hand them out (:meth:`FactKV.rows_of`: no views)."""
    return FactKV.rows_of(block, [(i * tokens, tokens, i * 7) for i in range(spans)])


def _facts_one_by_one(block: torch.Tensor, spans: int, tokens: int) -> list[FactKV]:
    """The same views, each FactKV built on its own (its layout read from torch when used)."""
    ks, vs = _views(block, spans, tokens)
    return [FactKV(k, v, i * 7) for i, (k, v) in enumerate(zip(ks, vs))]


def _timed(fn: Callable[[], object], setup: Callable[[], object], repeat: int) -> list[float]:
    """Microseconds per call of ``fn`` (``setup`` runs untimed before each, then the GPU drains)."""
    out = []
    for _ in range(repeat):
        setup()
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1e6)
    return out


def _report(name: str, us: list[float]) -> None:
    print(f"{name:<28} median {statistics.median(us):8.1f} us   min {min(us):8.1f} us   ({len(us)} runs)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spans", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=28)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=1000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    spans, tokens = args.spans, args.tokens

    device = torch.device(args.device)
    # torch.empty: on the CPU the pages are never touched, so the block costs address space only.
    shape = (2, args.layers, spans * tokens + 64, args.heads, args.dim)
    block = torch.empty(shape, dtype=torch.bfloat16, device=device)
    rng = np.random.default_rng(0)
    deltas = rng.integers(-500, 3000, spans)
    rows = spans * tokens
    slots = rng.permutation(rows * 2)[:rows].astype(np.int64)
    fact = f"[{args.layers}, {tokens}, {args.heads}, {args.dim}]"
    print(f"{spans} spans x {tokens} tokens, FactKV {fact} bf16 views of one block, {device}")

    warm = _facts(block, spans, tokens)
    warm_parts = [SpanRows(f, 0, tokens, int(d)) for f, d in zip(warm, deltas)]
    _report("table build (warm)", _timed(lambda: InjectionTable.build(warm_parts, slots, device), lambda: None, args.repeat))

    cold: list[SpanRows] = []

    def fresh_parts() -> None:
        cold[:] = [SpanRows(f, 0, tokens, int(d)) for f, d in zip(_facts(block, spans, tokens), deltas)]

    _report("table build (cold)", _timed(lambda: InjectionTable.build(cold, slots, device), fresh_parts, args.repeat))

    def fresh_parts_one_by_one() -> None:
        cold[:] = [SpanRows(f, 0, tokens, int(d)) for f, d in zip(_facts_one_by_one(block, spans, tokens), deltas)]

    _report("table build (cold, 1 by 1)",
            _timed(lambda: InjectionTable.build(cold, slots, device), fresh_parts_one_by_one, args.repeat))
    _report("tier views: rows_of", _timed(lambda: _facts(block, spans, tokens), lambda: None, args.repeat))
    _report("tier views: one by one", _timed(lambda: _facts_one_by_one(block, spans, tokens), lambda: None, args.repeat))

    # Worker half: a connector without vLLM behind it; the CPU path's torch writer is replaced by
    # the table build alone, so only the per-span Python is timed.
    keys = [f"fact-{i}" for i in range(spans)]
    geometry = Geometry(args.layers, args.heads, args.dim, "bfloat16")
    exchange = KVExchange(geometry, device)
    _report("exchange stage (cold)", _timed(lambda: exchange.stage(list(zip(keys, _facts(block, spans, tokens)))),
                                            lambda: exchange.unstage(keys), args.repeat))
    shared = exchange.stage(list(zip(keys, _facts(block, spans, tokens))))
    at = shared.at
    plan = InjectionPlan.tiling(keys, [tokens] * spans, shared)
    bs = args.block_size
    block_ids = list(range((rows + bs - 1) // bs))
    load = LoadRequest(block_ids, 0, rows, plan.pieces(0, rows))
    worker = ConnectorWorker(bs, fused=False)
    worker._reader.map(shared.segments)
    worker._geometry, worker._heads, worker._at = geometry, (0, args.heads), at
    layer = SimpleNamespace(kv_cache=torch.empty(0, device=device))
    worker._layers = [(f"layer.{i}", layer) for i in range(args.layers)]
    worker._inject_torch = lambda spans_, slots_, device, fc: InjectionTable.build_columns(spans_, slots_, device)
    forward_context = SimpleNamespace(virtual_engine=0)

    def stage() -> None:
        worker._spans = {}  # every span's views cut again, as for spans staged at new offsets

    _report("worker _inject (cold)", _timed(lambda: worker._inject([load], forward_context), stage, args.repeat))
    # The same views from here on, as for spans staged at the offsets they had before
    _report("worker _inject (warm)", _timed(lambda: worker._inject([load], forward_context), lambda: None, args.repeat))

    # An in-process owner: spans by reference, carried by the plan.
    local = KVExchange(geometry, device, local=True)

    pairs: list[tuple[str, FactKV | None]] = []

    def fresh_pairs() -> None:
        pairs[:] = zip(keys, _facts(block, spans, tokens))

    def stage_local() -> None:
        local.stage(pairs)
        local.unstage(keys)

    _report("exchange stage (local)", _timed(stage_local, fresh_pairs, args.repeat))
    plan_local = InjectionPlan.tiling(keys, [tokens] * spans, local.stage(list(zip(keys, _facts(block, spans, tokens)))))
    load_local = LoadRequest(block_ids, 0, rows, plan_local.pieces(0, rows))
    worker._reader, worker._at, worker._spans = ExchangeReader(), {}, {}
    _report("worker _inject (local)", _timed(lambda: worker._inject([load_local], forward_context), lambda: None,
                                             args.repeat))

    # Scheduler half: claim everything but the last token, as get_num_new_matched_tokens does.
    request = SimpleNamespace(request_id="r")
    blocks = SimpleNamespace(get_block_ids=lambda: (block_ids,))
    claimed = rows - 1

    scheduler = ConnectorScheduler(bs)

    def claim() -> None:
        scheduler._plans = {"r": plan}
        scheduler._claimed = {"r": (0, claimed)}
        scheduler._injected = {}
        scheduler._loads, scheduler._load_at = [], {}

    def alloc() -> None:
        scheduler.update_state_after_alloc(request, blocks, claimed)

    _report("scheduler alloc", _timed(alloc, claim, args.repeat))


if __name__ == "__main__":
    main()
