"""``python -m inferscale_apps.bench.kernel``: the fused injection kernel against the GPU's
memory bandwidth and against the unfused path (gather, torch rotation, scatter copy).

Checks correctness first (every path == the torch reference, bit for bit after the cast), then
times one injection of ``k`` separately stored facts into every layer of a Llama-3.1-8B-shaped
cache, the per-step table build included.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from inferscale_engine.connector.table import InjectionTable, SpanRows
from inferscale_engine.kv import FactKV
from inferscale_engine.rope import RopeTable, rotate


def _table(rotary_dim: int, max_pos: int, theta: float, device: str) -> RopeTable:
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None]
    return RopeTable(angles.cos().float().to(device), angles.sin().float().to(device), rotary_dim, True)


def run(k: int, fact_tokens: int, layers: int, heads: int, dim: int, block_size: int, repeats: int) -> dict:
    from inferscale_engine.connector.rope_triton import cache_pointers, inject_rows

    dev, dtype = torch.device("cuda"), torch.bfloat16
    n = k * fact_tokens
    blocks = (n + block_size - 1) // block_size * 4
    rope = _table(dim, 8192, 500000.0, "cuda")
    # vLLM 0.26 FlashAttention layout: (blocks, heads, block_size, 2*dim), K|V packed in the last axis.
    caches = [torch.zeros(blocks, heads, block_size, 2 * dim, dtype=dtype, device=dev) for _ in range(layers)]
    views = [c.transpose(1, 2).split(dim, dim=-1) for c in caches]
    key_ptrs, value_ptrs = cache_pointers([kc for kc, _ in views], dev), cache_pointers([vc for _, vc in views], dev)
    facts = [FactKV(torch.randn(layers, fact_tokens, heads, dim, dtype=dtype, device=dev),
                    torch.randn(layers, fact_tokens, heads, dim, dtype=dtype, device=dev), 0) for _ in range(k)]
    span_deltas = np.random.default_rng(0).integers(-500, 3000, k)
    slots_np = np.random.default_rng(1).permutation(blocks * block_size)[:n].astype(np.int64)
    slots = torch.from_numpy(slots_np).to(dev)
    deltas = torch.repeat_interleave(torch.from_numpy(span_deltas), fact_tokens).to(dev)

    def parts(source: list[FactKV]) -> list[SpanRows]:
        return [SpanRows(f, 0, fact_tokens, int(d)) for f, d in zip(source, span_deltas)]

    def fused() -> None:
        inject_rows(InjectionTable.build(parts(facts), slots_np, dev), rope, key_ptrs, value_ptrs, views[0][0])

    def fused_by_layer_groups() -> None:  # what a host-tier promotion does, one group per event
        table = InjectionTable.build(parts(facts), slots_np, dev)
        bounds = [0, layers // 4, layers // 2, layers]
        for start, stop in zip(bounds, bounds[1:]):
            inject_rows(table, rope, key_ptrs, value_ptrs, views[0][0], layers=(start, stop))

    def unfused() -> None:
        rotated = rotate(torch.cat([f.k for f in facts], dim=1), deltas, rope)
        v_all = torch.cat([f.v for f in facts], dim=1)
        for i, (kc, vc) in enumerate(views):
            b, o = slots // block_size, slots % block_size
            kc[b, o] = rotated[i]
            vc[b, o] = v_all[i]

    want_k = rotate(torch.cat([f.k for f in facts], dim=1), deltas, rope)
    want_v = torch.cat([f.v for f in facts], dim=1)
    checks = {}
    for name, fn in (("fused", fused), ("fused_by_layer_groups", fused_by_layer_groups), ("unfused", unfused)):
        for c in caches:
            c.zero_()
        fn()
        got_k = torch.stack([kc[slots // block_size, slots % block_size] for kc, _ in views])
        got_v = torch.stack([vc[slots // block_size, slots % block_size] for _, vc in views])
        checks[name] = {
            "max_abs_err_k": (got_k.float() - want_k.float()).abs().max().item(),
            "bitwise_equal_k": (got_k == want_k).float().mean().item(),
            "v_equal": bool(torch.equal(got_v, want_v)),
        }

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / repeats * 1e3  # us

    fused_us, unfused_us = timed(fused), timed(unfused)
    moved = 4 * layers * n * heads * dim * facts[0].k.element_size()  # read K,V + write K,V
    return {
        "k": k, "rows": n, "layers": layers, "kv_heads": heads, "head_dim": dim,
        "bytes_moved": moved,
        "fused_us": fused_us, "unfused_us": unfused_us,
        "fused_GBps": moved / fused_us / 1e3, "unfused_GBps": moved / unfused_us / 1e3,
        "checks": checks,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ks", default="5,50,200")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = [run(int(k), 28, 32, 8, 128, 16, 50) for k in args.ks.split(",")]
    for r in rows:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "kernel", "env": {"gpu": torch.cuda.get_device_name(0)}, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
