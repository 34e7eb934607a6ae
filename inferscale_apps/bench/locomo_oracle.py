"""Oracles for ``bench locomo --oracle``: how much answer quality each set of repaired tokens buys.

An injected memory's KV was encoded after the ``w`` turns before it in the conversation, not
after what precedes it in the served prompt. An oracle splices the *prompt's own* KV (every
memory encoded after exactly its served prefix, as ``--exact-control`` does) into a chosen set
of token rows of the injected region and keeps the stored KV elsewhere. The F1 an oracle
recovers bounds what recomputing that token set at serving time can recover, so the set to
build a mechanism for is chosen from these numbers, before building it.

Sets (each a name for ``--oracle``, comma-separated):

* ``header`` – each memory's ``[date] Speaker:`` header (EPIC-like, and the dates temporal
  questions need).
* ``first:N`` – each memory's first ``N`` tokens (EPIC's chunk starts).
* ``top:R`` – every token of the ``R`` memories most similar to the question, left in place.
* ``deviating:P`` – the ``P`` % of memory tokens whose values deviate most from the prompt's
  (CacheBlend's selection, here with the true deviation over every layer rather than a guess
  from the first).
* ``separators`` – the text between memories (encoded once after the prompt's head).
* ``all`` – every memory and separator: the exact control, the ceiling of every other set.

Values, not keys, measure the deviation: keys carry RoPE at the position they were encoded at,
values carry none, so they compare without a rotation.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from inferscale_engine.kv import FactKV
from inferscale_engine.token_recompute import tokens_spelling
from inferscale_engine.types import Span

_SPEC = re.compile(r"^(header|separators|all)$|^(first|top|deviating):(\d+)$")


@dataclass(frozen=True)
class Oracle:
    """One token set: ``kind`` (header, first, top, deviating, separators, all) and its size."""

    kind: str
    size: int = 0

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.size}" if self.kind in ("first", "top", "deviating") else self.kind


def parse_oracles(spec: str) -> list[Oracle]:
    """``"header,first:4,top:2"`` as oracles; a clear ``ValueError`` for anything else."""
    out = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        m = _SPEC.match(part)
        if m is None:
            raise ValueError(f"unknown oracle {part!r}: use header, separators, all, first:N, top:R or deviating:P")
        if m.group(1):
            out.append(Oracle(m.group(1)))
        else:
            size = int(m.group(3))
            if size < 1 or (m.group(2) == "deviating" and size > 100):
                raise ValueError(f"oracle {part!r}: N, R >= 1 and 1 <= P <= 100")
            out.append(Oracle(m.group(2), size))
    if not out:
        raise ValueError("--oracle needs at least one token set")
    return out


@dataclass(frozen=True)
class Region:
    """The injected region of one served prompt, both ways.

    ``parts`` are the segments between the head and the tail: memory spans (stored KV) and
    separator token lists; ``exact`` holds each part's KV encoded after exactly its served
    prefix; ``headers`` each memory part's header length in tokens; ``relevance`` each memory
    part's rank by similarity to the question (0: best)."""

    head: list[int]
    parts: list[Span | list[int]]
    tail: list[int]
    exact: list[FactKV]
    headers: dict[int, int]
    relevance: dict[int, int]

    def memories(self) -> list[int]:
        return [i for i, p in enumerate(self.parts) if isinstance(p, Span)]


def header_tokens(engine: Any, token_ids: Sequence[int]) -> int:
    """How many of a memory's first tokens spell its ``[date] Speaker:`` header (0: none)."""
    text = engine.detokenize(token_ids)
    close = text.find("]")
    end = text.find(": ", close)
    if close < 0 or "[" not in text[:close] or end < 0:
        return 0
    return tokens_spelling(token_ids, engine.detokenize, end + 1)


def selection(oracle: Oracle, region: Region) -> tuple[dict[int, torch.Tensor], bool]:
    """Per memory part, a mask of the rows that take the prompt's KV; and whether separators do."""
    memories = region.memories()
    masks = {i: torch.zeros(len(region.parts[i].token_ids), dtype=torch.bool) for i in memories}  # type: ignore[union-attr]
    if oracle.kind == "all":
        for m in masks.values():
            m[:] = True
    elif oracle.kind == "header":
        for i, m in masks.items():
            m[: region.headers[i]] = True
    elif oracle.kind == "first":
        for m in masks.values():
            m[: oracle.size] = True
    elif oracle.kind == "top":
        for i, m in masks.items():
            m[:] = region.relevance[i] < oracle.size
    elif oracle.kind == "deviating":
        deviation = torch.cat([value_deviation(region.parts[i], region.exact[i]) for i in memories])  # type: ignore[arg-type]
        n = max(1, round(len(deviation) * oracle.size / 100))
        chosen = torch.zeros(len(deviation), dtype=torch.bool)
        chosen[torch.topk(deviation, n).indices] = True
        at = 0
        for m in masks.values():
            m[:] = chosen[at : at + len(m)]
            at += len(m)
    return masks, oracle.kind in ("separators", "all")


def value_deviation(span: Span, exact: FactKV) -> torch.Tensor:
    """Per token, the squared distance of the stored values from the prompt's, over every layer
    and head, relative to the prompt's own (layers differ in scale)."""
    assert span.kv is not None
    stored, truth = span.kv.v.float(), exact.v.to(span.kv.v.device).float()
    per_layer = (stored - truth).pow(2).sum((2, 3)) / truth.pow(2).sum((2, 3)).clamp_min(1e-12)  # [layers, n]
    return per_layer.sum(0).cpu()


def splice(region: Region, oracle: Oracle, tag: str) -> list[Any]:
    """The segments to serve: each memory's stored KV with the oracle's rows replaced by the
    prompt's (adjacent rows of one source stay one span), separators exact where it says so."""
    masks, exact_separators = selection(oracle, region)
    segments: list[Any] = [region.head]
    for i, part in enumerate(region.parts):
        if not isinstance(part, Span):
            segments.append(Span(f"{tag}:{oracle.name}:{i}", tuple(part), region.exact[i]) if exact_separators else part)
            continue
        assert part.kv is not None
        mask = masks[i].tolist()
        start = 0
        for end in range(1, len(mask) + 1):
            if end == len(mask) or mask[end] != mask[start]:
                source = region.exact[i] if mask[start] else part.kv
                segments.append(Span(f"{tag}:{oracle.name}:{i}:{start}:{int(mask[start])}",
                                     part.token_ids[start:end], source.rows(start, end)))
                start = end
    segments.append(region.tail)
    return segments


def recovered(oracle_f1: float | None, inject_f1: float | None, prompt_f1: float | None) -> float | None:
    """Share of the prompt's F1 lead over injection that an oracle wins back (1: all of it)."""
    if None in (oracle_f1, inject_f1, prompt_f1) or prompt_f1 == inject_f1:
        return None
    return (oracle_f1 - inject_f1) / (prompt_f1 - inject_f1)  # type: ignore[operator]
