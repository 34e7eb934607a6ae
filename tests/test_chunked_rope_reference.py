"""Facts encoded separately at position 0 and injected elsewhere equal an independent reference:
HF transformers running the same prompt with a block attention mask (each fact sees only itself,
at its serving positions)."""

from __future__ import annotations

import pytest
import torch

from inferscale_apps.bench.exactness import encode_spans, text_case
from inferscale_engine import InferScaleEngine


def _block_mask(head: int, facts: list[int], tail: int) -> torch.Tensor:
    """Additive 4D mask: head causal; each fact causal within itself only; tail sees everything."""
    total = head + sum(facts) + tail
    allowed = torch.zeros(total, total, dtype=torch.bool)
    causal = torch.tril(torch.ones(total, total, dtype=torch.bool))
    allowed[:head, :head] = True
    start = head
    for n in facts:
        allowed[start : start + n, start : start + n] = True
        start += n
    allowed[start:, :] = True
    allowed &= causal
    mask = torch.zeros(total, total)
    mask[~allowed] = torch.finfo(torch.float32).min
    return mask[None, None]


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_separately_encoded_facts_match_block_mask_reference(arch, request):
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(arch)
    with InferScaleEngine(model=path, device="cpu", dtype="float32", max_model_len=2048, max_logprobs=1000,
                          recompute=0) as engine:
        head, facts, tail = text_case(engine)
        spans = encode_spans(engine, head, facts, exact=False, key="ref")
        ours = engine.generate_segments([head, *spans, tail], max_tokens=1, first_logprobs=1000)

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager")
    ids = torch.tensor([head + [t for f in facts for t in f] + tail])
    mask = _block_mask(len(head), [len(f) for f in facts], len(tail))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(ids.shape[1])[None]).logits[0, -1]
    reference = torch.log_softmax(logits, dim=-1)

    got = torch.full_like(reference, float("nan"))
    for token, lp in ours.first_logprobs.items():
        got[token] = lp
    assert not torch.isnan(got).any(), "need the whole distribution"
    assert torch.allclose(got, reference, atol=1e-3), (got - reference).abs().max()
    # And the mask matters: full causal attention (exact context) gives something else.
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=ids).logits[0, -1], dim=-1)
    assert (full - reference).abs().max() > 1e-2
