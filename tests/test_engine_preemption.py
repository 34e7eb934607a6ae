"""Preempted requests get their injected KV again when vLLM resumes them."""

from __future__ import annotations

import asyncio

import pytest

from inferscale_apps.bench.exactness import encode_spans, text_case
from inferscale_engine import InferScaleEngine
from inferscale_engine.testing import preempted_requests

pytestmark = pytest.mark.timeout(600)


def test_preempted_requests_reload_injected_kv(tiny_llama):
    """With a KV cache too small for the batch, vLLM preempts and recomputes; on resume the
    connector is asked again and must inject again."""
    with preempted_requests() as preempted, InferScaleEngine(
        model=tiny_llama, device="cpu", dtype="float32", max_model_len=1024, num_gpu_blocks_override=12, max_num_seqs=8,
        recompute=0,
    ) as engine:
        head, facts, tail = text_case(engine)
        spans = encode_spans(engine, head, facts, exact=True, key="pre")
        alone = engine.generate_segments([head, *spans, tail], max_tokens=300, ignore_eos=True)

        async def crowd():
            return await asyncio.gather(*[
                engine.agenerate_segments([head, *spans, tail], user_id=f"u{i}", max_tokens=300, ignore_eos=True)
                for i in range(6)
            ])

        results = asyncio.run(crowd())
    assert preempted, "nothing was preempted; the test proves nothing"
    for r in results:
        assert r.token_ids == alone.token_ids
        assert r.usage.injected_tokens > 0
