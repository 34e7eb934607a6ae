"""``python -m inferscale_engine.bench.kernel``: the fused rotate+scatter kernel against the GPU's
memory bandwidth and against the unfused path (torch rotation, then a scatter copy).

Checks correctness first (fused == torch reference, bit for bit after the cast), then times one
injection of ``k`` facts into every layer of a Llama-3.1-8B-shaped cache.
"""

from __future__ import annotations

import argparse
import json

import torch

from inferscale_engine.rope import RopeTable, rotate


def _table(rotary_dim: int, max_pos: int, theta: float, device: str) -> RopeTable:
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None]
    return RopeTable(angles.cos().float().to(device), angles.sin().float().to(device), rotary_dim, True)


def run(k: int, fact_tokens: int, layers: int, heads: int, dim: int, block_size: int, repeats: int) -> dict:
    from inferscale_engine.rope_triton import rotate_and_scatter

    dev, dtype = "cuda", torch.bfloat16
    n = k * fact_tokens
    blocks = (n + block_size - 1) // block_size * 4
    table = _table(dim, 8192, 500000.0, dev)
    # vLLM 0.26 FlashAttention layout: (blocks, heads, block_size, 2*dim), K|V packed in the last axis.
    caches = [torch.zeros(blocks, heads, block_size, 2 * dim, dtype=dtype, device=dev) for _ in range(layers)]
    views = [c.transpose(1, 2).split(dim, dim=-1) for c in caches]
    k_src = torch.randn(layers, n, heads, dim, dtype=dtype, device=dev)
    v_src = torch.randn(layers, n, heads, dim, dtype=dtype, device=dev)
    deltas = torch.randint(-500, 3000, (n,), device=dev)
    slots = torch.randperm(blocks * block_size, device=dev)[:n]

    def fused() -> None:
        rotate_and_scatter(k_src, v_src, deltas, slots, table, [kc for kc, _ in views], [vc for _, vc in views])

    def unfused() -> None:
        rotated = rotate(k_src, deltas, table)
        for i, (kc, vc) in enumerate(views):
            b, o = slots // block_size, slots % block_size
            kc[b, o] = rotated[i]
            vc[b, o] = v_src[i]

    fused()
    got_k = torch.stack([kc[slots // block_size, slots % block_size] for kc, _ in views])
    want_k = rotate(k_src, deltas, table)
    max_err = (got_k.float() - want_k.float()).abs().max().item()
    exact_frac = (got_k == want_k).float().mean().item()

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
    moved = 4 * layers * n * heads * dim * k_src.element_size()  # read K,V + write K,V
    return {
        "k": k, "rows": n, "layers": layers, "kv_heads": heads, "head_dim": dim,
        "bytes_moved": moved,
        "fused_us": fused_us, "unfused_us": unfused_us,
        "fused_GBps": moved / fused_us / 1e3, "unfused_GBps": moved / unfused_us / 1e3,
        "max_abs_err_vs_torch": max_err, "bitwise_equal_fraction": exact_frac,
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
