"""``bench exactness``: KV injection against plain prompt injection of the very same token ids.

``exact``: every fact encoded after exactly the tokens that precede it in the served prompt, so
injection must reproduce the plain run (greedy tokens identical, logits equal to float noise).
``w0``: every fact encoded alone; the difference is the approximation, measured, not asserted.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from inferscale_engine.types import EncodeWindow, GenerationResult, Span

if TYPE_CHECKING:
    from inferscale_engine.engine import InferScaleEngine


def encode_spans(
    engine: InferScaleEngine,
    head: Sequence[int],
    facts: Sequence[Sequence[int]],
    *,
    exact: bool,
    key: str,
    one_by_one: bool = False,
) -> list[Span]:
    """Facts as spans, each encoded after head + the facts before it (``exact``) or alone; in one
    batch, or each in its own forward pass (``one_by_one``: the same KV, rounded another way)."""
    windows, context = [], list(head)
    for ids in facts:
        windows.append(EncodeWindow.single(ids, context if exact else ()))
        context = context + list(ids)
    kvs = [engine.encode([w])[0] for w in windows] if one_by_one else engine.encode(windows)
    return [Span(f"{key}:{i}", tuple(ids), kv[0]) for i, (ids, kv) in enumerate(zip(facts, kvs))]


def compare(reference: GenerationResult, candidate: GenerationResult) -> dict[str, Any]:
    """Greedy agreement and the largest first-token logprob difference over shared top tokens."""
    ref_lp, cand_lp = reference.first_logprobs or {}, candidate.first_logprobs or {}
    shared = set(ref_lp) & set(cand_lp)
    diff = max((abs(ref_lp[t] - cand_lp[t]) for t in shared), default=math.nan)
    first_divergence = next(
        (i for i, (a, b) in enumerate(zip(reference.token_ids, candidate.token_ids)) if a != b),
        None if reference.token_ids == candidate.token_ids else min(len(reference.token_ids), len(candidate.token_ids)),
    )
    return {
        "greedy_match": reference.token_ids == candidate.token_ids,
        "max_logit_diff": diff,
        "first_divergence": first_divergence,
        "compared_logprobs": len(shared),
    }


def run_case(
    engine: InferScaleEngine,
    head: Sequence[int],
    facts: Sequence[Sequence[int]],
    tail: Sequence[int],
    *,
    max_tokens: int = 32,
    logprobs: int = 20,
) -> list[dict[str, Any]]:
    """Rows ``{mode: exact|w0, arch, dtype, greedy_match, max_logit_diff, ...}`` for one prompt."""
    flat = list(head) + [t for f in facts for t in f] + list(tail)
    sampling: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0, "first_logprobs": logprobs}
    reference = engine.generate_segments([flat], mode="prompt", **sampling)
    hf = engine.vllm_config.model_config.hf_config
    rows = []
    for mode, exact in (("exact", True), ("w0", False)):
        spans = encode_spans(engine, head, facts, exact=exact, key=f"exactness-{mode}-{random.getrandbits(32)}")
        result = engine.generate_segments([list(head), *spans, list(tail)], mode="inject", **sampling)
        if result.usage.injected_tokens == 0:
            raise RuntimeError("nothing was injected; the comparison would be vacuous")
        rows.append({
            "mode": mode,
            "arch": hf.model_type,
            "dtype": str(engine.dtype).removeprefix("torch."),
            **compare(reference, result),
            "prompt_tokens": len(flat),
            "injected_tokens": result.usage.injected_tokens,
        })
    return rows


def rounding_floor(
    engine: InferScaleEngine, head: Sequence[int], facts: Sequence[Sequence[int]], tail: Sequence[int], *, logprobs: int = 20
) -> float:
    """The largest first-token logprob difference between two exact encodings of the same facts
    that differ only in batching (one batch vs one forward pass each): what this device's
    rounding alone moves, the yardstick for ``exact``'s ``max_logit_diff`` in low precision."""
    sampling: dict[str, Any] = {"max_tokens": 1, "temperature": 0.0, "first_logprobs": logprobs}
    served = []
    for one_by_one in (False, True):
        spans = encode_spans(engine, head, facts, exact=True, one_by_one=one_by_one, key=f"floor-{one_by_one}-{random.getrandbits(32)}")
        served.append(engine.generate_segments([list(head), *spans, list(tail)], mode="inject", **sampling))
    return float(compare(*served)["max_logit_diff"])


def random_case(engine: InferScaleEngine, *, k: int = 8, fact_tokens: int = 28, seed: int = 0) -> tuple[list[int], list[list[int]], list[int]]:
    """Head, facts and tail of random tokens (for random-weight models with no tokenizer)."""
    rng = random.Random(seed)
    hi = min(engine.vocab_size, 32000) - 1
    draw = lambda n: [rng.randint(min(100, hi // 2), hi) for _ in range(n)]  # noqa: E731
    return draw(64), [draw(fact_tokens) for _ in range(k)], draw(24)


def text_case(engine: InferScaleEngine) -> tuple[list[int], list[list[int]], list[int]]:
    """A small memory chat, for models with a tokenizer and chat template."""
    facts = [
        "Caroline adopted a dog named Rex last spring.",
        "Caroline works as a nurse at the city hospital.",
        "Caroline's favourite food is mushroom risotto.",
        "Caroline is training for the Berlin marathon in September.",
        "Caroline's sister Mia lives in Lisbon.",
    ]
    head = engine.tokenize("<|im_start|>system\nYou are a helpful assistant. Things you remember about the user:\n")
    fact_ids = [engine.tokenize(f + "\n") for f in facts]
    tail = engine.tokenize("<|im_end|>\n<|im_start|>user\nWhat is the name of my dog?<|im_end|>\n<|im_start|>assistant\n")
    return head, fact_ids, tail
