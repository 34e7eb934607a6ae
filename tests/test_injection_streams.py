"""KV made on another CUDA stream is injected only once it is there (CUDA only).

vLLM's worker runs on a stream of its own, and the tiers hand out KV gathered on the caller's
stream, behind a host-tier promotion's copies when there was one. ``FactKV.ready`` is the event
recorded after that copy; the connector waits for it on the device before writing.
"""

from __future__ import annotations

import pytest
import torch

from inferscale_engine import InferScaleEngine, Span
from inferscale_engine.kv import FactKV
from inferscale_engine.testing import spin_gpu

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(600),
]


def test_injection_waits_for_kv_still_being_copied(tiny_llama):
    with InferScaleEngine(model=tiny_llama, device="cuda", dtype="bfloat16", max_model_len=512, recompute=0) as engine:
        fact = engine.tokenize("My dog is called Rex.")
        question = engine.tokenize(" What is my dog called?")
        kv = engine.encode_fact(fact)
        torch.cuda.synchronize()
        landed = engine.generate_segments([Span("streams:landed", tuple(fact), kv), question], max_tokens=4)

        # The KV lands only after ~0.5 s of work queued on a side stream; until then its
        # tensors hold zeros. A connector that did not wait would inject the zeros.
        side = torch.cuda.Stream()
        k, v = torch.zeros_like(kv.k), torch.zeros_like(kv.v)
        with torch.cuda.stream(side):
            spin_gpu(1_000_000_000)
            k.copy_(kv.k)
            v.copy_(kv.v)
            ready = torch.cuda.Event()
            ready.record(side)
        late = FactKV(k, v, kv.position, ready)
        injected = engine.generate_segments([Span("streams:late", tuple(fact), late), question], max_tokens=4)
        assert ready.query()  # the request could not finish before the copy
    assert injected.usage.injected_tokens == len(fact)
    assert injected.token_ids == landed.token_ids  # the same KV as when it had landed first
