"""``bench throughput``: many concurrent users, each asking one question over k retrieved facts."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from inferscale_apps.bench.common import SyntheticWorkload, median, percentile

if TYPE_CHECKING:
    from collections.abc import Coroutine

    from inferscale_engine.engine import InferScaleEngine
    from inferscale_engine.types import GenerationResult


def run_throughput(
    engine: InferScaleEngine,
    users: list[int],
    *,
    k: int = 50,
    output_tokens: int = 32,
    fact_tokens: int = 28,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Rows ``{mode, users, k, req_per_s, tok_per_s, ttft_ms_p50, ttft_ms_p95}``.

    ``tok_per_s`` counts prompt and generated tokens (what the engine processed or skipped
    prefilling), ``out_tok_per_s`` generated tokens only.
    """
    work = SyntheticWorkload.build(engine, pool=max(4 * k, 64), fact_tokens=fact_tokens, seed=seed)

    async def wave(n: int, mode: str) -> dict[str, Any]:
        requests: list[Coroutine[Any, Any, GenerationResult]] = []
        for _ in range(n):
            picks, q = work.sample(k), work.question()
            segs = work.inject_segments(picks, q) if mode == "inject" else work.prompt_segments(picks, q)
            requests.append(engine.agenerate_segments(
                segs, user_id=f"user-{len(requests)}", mode=mode, max_tokens=output_tokens, ignore_eos=True))
        start = time.perf_counter()
        results = await asyncio.gather(*requests)
        wall = time.perf_counter() - start
        ttfts = [r.ttft_s * 1e3 for r in results]
        return {
            "mode": mode, "users": n, "k": k,
            "req_per_s": n / wall,
            "tok_per_s": sum(r.usage.total_tokens for r in results) / wall,
            "out_tok_per_s": sum(r.usage.completion_tokens for r in results) / wall,
            "ttft_ms_p50": median(ttfts), "ttft_ms_p95": percentile(ttfts, 95),
        }

    async def all_waves() -> list[dict[str, Any]]:
        # Warm-up at the largest wave: its first run in a process compiles kernels for batch
        # shapes no smaller wave reached (a cold 100-user inject wave measured 64 req/s on the
        # H200, the next ones 150).
        for mode in ("prompt", "inject"):
            await wave(max(users), mode)
        rows = []
        for n in users:
            for mode in ("prompt", "inject"):
                rows.append(await wave(n, mode))
        return rows

    return asyncio.run(all_waves())
