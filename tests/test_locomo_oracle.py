"""``bench locomo --oracle``: splicing the prompt's own KV into chosen rows of the injected region.

A tiny random-weight Llama in float32 serves memories encoded alone (w=0) with separators between
them, so every stored row deviates from what the prompt computes. The oracle that repairs every
row must then serve what the prompt serves; the others must repair exactly the rows they name.
"""

from __future__ import annotations

import pytest
import torch

from inferscale_apps.bench.exactness import compare, encode_spans, text_case
from inferscale_apps.bench.locomo_oracle import (
    Region,
    parse_oracles,
    recovered,
    selection,
    splice,
    value_deviation,
)
from inferscale_engine import InferScaleEngine, Span
from inferscale_engine.types import EncodeWindow

pytestmark = pytest.mark.timeout(600)
SAMPLING = {"max_tokens": 1, "first_logprobs": 1000}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with InferScaleEngine(model=tiny_llama, device="cpu", dtype="float32", max_model_len=2048, max_logprobs=1000,
                          recompute=0) as eng:
        yield eng


@pytest.fixture(scope="module")
def region(engine) -> Region:
    head, facts, tail = text_case(engine)
    separator = engine.tokenize("\n-\n")
    stored = encode_spans(engine, head, facts, exact=False, key="oracle-w0")
    parts: list[Span | list[int]] = []
    for span in stored:
        parts += [span, list(separator)]
    parts.pop()
    ids, ranges = list(head), []
    for p in parts:
        p_ids = list(p.token_ids) if isinstance(p, Span) else p
        ranges.append((len(ids), len(p_ids)))
        ids += p_ids
    (exact,) = engine.encode([EncodeWindow(tuple(ids), tuple(ranges))])
    memories = [i for i, p in enumerate(parts) if isinstance(p, Span)]
    # Relevance: the last memory is the best, the first the worst.
    return Region(list(head), parts, list(tail), exact, {i: 3 for i in memories},
                  {i: len(memories) - 1 - j for j, i in enumerate(memories)})


def _flat(region: Region) -> list[int]:
    return [*region.head, *(t for p in region.parts for t in (p.token_ids if isinstance(p, Span) else p)), *region.tail]


def _served(engine, segments):
    return engine.generate_segments(segments, mode="inject", **SAMPLING)


def test_every_oracle_serves_the_prompt_tokens_and_all_serves_the_prompt(engine, region):
    prompt = engine.generate_segments([_flat(region)], mode="prompt", **SAMPLING)
    stored = compare(prompt, _served(engine, [region.head, *region.parts, region.tail]))["max_logit_diff"]
    gaps = {}
    for oracle in parse_oracles("all,header,first:2,top:1,deviating:30,separators"):
        result = _served(engine, splice(region, oracle, f"t-{oracle.name}"))
        assert result.prompt_token_ids == prompt.prompt_token_ids, oracle
        assert result.usage.injected_tokens > 0
        gaps[oracle.name] = compare(prompt, result)["max_logit_diff"]
    # w=0 memories are far from the prompt; repaired everywhere, injection is the prompt.
    assert stored > 1e-2
    assert gaps["all"] < 1e-4, gaps
    # Any partial repair leaves some of the gap.
    assert all(gap > 1e-4 for name, gap in gaps.items() if name != "all"), gaps


def test_each_set_names_its_rows(region):
    memories = region.memories()
    sizes = {i: len(region.parts[i].token_ids) for i in memories}  # type: ignore[union-attr]

    def rows(spec: str) -> dict[int, int]:
        masks, _ = selection(parse_oracles(spec)[0], region)
        return {i: int(m.sum()) for i, m in masks.items()}

    assert rows("header") == {i: 3 for i in memories}
    assert rows("first:2") == {i: 2 for i in memories}
    assert rows("top:1") == {i: (sizes[i] if i == memories[-1] else 0) for i in memories}
    assert sum(rows("deviating:30").values()) == round(0.3 * sum(sizes.values()))
    assert rows("all") == sizes and selection(parse_oracles("all")[0], region)[1]
    assert sum(rows("separators").values()) == 0 and selection(parse_oracles("separators")[0], region)[1]
    # The deviating rows are those whose values are furthest from the prompt's.
    masks, _ = selection(parse_oracles("deviating:30")[0], region)
    deviation = {i: value_deviation(region.parts[i], region.exact[i]) for i in memories}  # type: ignore[arg-type]
    picked = torch.cat([deviation[i][masks[i]] for i in memories])
    left = torch.cat([deviation[i][~masks[i]] for i in memories])
    assert picked.min() >= left.max() > 0


def test_spliced_spans_keep_each_row_where_it_was(region):
    segments = splice(region, parse_oracles("first:2")[0], "rows")
    spans = [s for s in segments if isinstance(s, Span)]
    # Memory i's first 2 rows come from the prompt's KV, the rest from the stored KV, each at
    # the position its source encoded it at (the worker rotates it to where it is served).
    first = region.memories()[0]
    stored, exact = region.parts[first].kv, region.exact[first]  # type: ignore[union-attr]
    assert spans[0].kv.position == exact.position and torch.equal(spans[0].kv.v, exact.v[:, :2])
    assert spans[1].kv.position == stored.position + 2 and torch.equal(spans[1].kv.v, stored.v[:, 2:])


def test_oracle_names_are_checked():
    assert [o.name for o in parse_oracles("header, first:4,top:2,deviating:15,separators,all")] == [
        "header", "first:4", "top:2", "deviating:15", "separators", "all"]
    for bad in ("", "middle", "first", "first:0", "deviating:101", "top:-1"):
        with pytest.raises(ValueError):
            parse_oracles(bad)
    assert recovered(0.6, 0.5, 0.7) == pytest.approx(0.5)
    assert recovered(0.6, 0.5, 0.5) is None
