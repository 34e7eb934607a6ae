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

MODES = ("prompt", "inject", "floor")


def run_throughput(
    engine: InferScaleEngine,
    users: list[int],
    *,
    k: int = 50,
    output_tokens: int = 32,
    fact_tokens: int = 28,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Rows ``{mode, users, k, req_per_s, tok_per_s, ttft_ms_p50, ttft_ms_p95, cached_tokens_p50}``
    per wave of ``users`` concurrent requests, one wave per mode:

    * ``prompt``: the facts pasted as tokens;
    * ``inject``: the same tokens, the facts injected as KV;
    * ``floor``: the prompt again, after an untimed wave of the same prompts with other questions
      left head and facts in vLLM's prefix cache: only the questions are computed. It is what
      injection can at best reach in this engine, as ``bench ttft``'s floor is for one request.

    ``tok_per_s`` counts prompt and generated tokens (what the engine processed or skipped
    prefilling), ``out_tok_per_s`` generated tokens only.
    """
    work = SyntheticWorkload.build(engine, pool=max(4 * k, 64), fact_tokens=fact_tokens, seed=seed)

    async def wave(n: int, mode: str) -> dict[str, Any]:
        draws = [(f"user-{i}", work.sample(k), work.question()) for i in range(n)]
        if mode == "floor":  # vLLM's prefix cache is per user: each user primes their own
            await asyncio.gather(*(engine.agenerate_segments(work.prompt_segments(picks, work.question()),
                                                             user_id=user, mode="prompt", max_tokens=1)
                                   for user, picks, _ in draws))
        requests: list[Coroutine[Any, Any, GenerationResult]] = []
        for user, picks, q in draws:
            segs = work.inject_segments(picks, q) if mode == "inject" else work.prompt_segments(picks, q)
            requests.append(engine.agenerate_segments(
                segs, user_id=user, mode="inject" if mode == "inject" else "prompt",
                max_tokens=output_tokens, ignore_eos=True))
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
            "cached_tokens_p50": median([r.usage.cached_tokens for r in results]),
        }

    async def all_waves() -> list[dict[str, Any]]:
        # Warm-up at the largest wave: its first run in a process compiles kernels for batch
        # shapes no smaller wave reached (a cold 100-user inject wave measured 64 req/s on the
        # H200, the next ones 150).
        for mode in MODES:
            await wave(max(users), mode)
        rows = []
        for n in users:
            for mode in MODES:
                rows.append(await wave(n, mode))
        return rows

    return asyncio.run(all_waves())
