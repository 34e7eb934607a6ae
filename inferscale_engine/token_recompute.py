"""Which rows of each injected memory the engine recomputes at serving time
(``EngineConfig.recompute_tokens``).

A memory's KV was encoded after other context than the one it is served after. Recomputing a
few of its rows inside the injected region, each attending over the whole served prefix
(:mod:`inferscale_engine.connector.blend`), repairs what those rows carry; the CPU oracles
(``bench locomo --oracle``) measured the date headers among the sets that recover most.

The rule is the engine's, not the model's: it reads only a memory's token ids and their text.

* ``header``: each memory's tokens up to and including the one that completes its first colon
  followed by whitespace, looked for in its first :data:`HEADER_TOKENS` tokens (LoCoMo's
  ``[1:56 pm on 8 May, 2023] Caroline:``: the time's colon has no space after it; a fact
  ``"User: likes tea"``: ``User:``). A memory without one has no header: nothing recomputed.
* ``header:M``: the headers of the last ``M`` memories only: the most relevant ones where the
  caller lists memories most relevant last, as ``recompute=R`` assumes. A row costs about what
  a prefilled token does, so a budget is a count of rows whatever k is; all the headers of k=50
  short memories are most of their rows (docs/benchmarks-locomo.md).
* ``first:N``: each memory's first ``N`` tokens (EPIC's chunk starts; all of a memory shorter
  than ``N``).
* ``deviating:P``: CacheBlend's selection. Every memory row is a candidate; the worker computes
  the first layer for them all, and from the second layer on keeps the ``P`` % whose
  second-layer K/V deviate most from the injected rows (:attr:`TokenSet.keep`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: Tokens of a memory the header rule looks at: a header longer than this is not a header.
HEADER_TOKENS = 32

_SPEC = re.compile(r"^(header|first|deviating)(?::(\d+))?$")
_COLON = re.compile(r":\s")


@dataclass(frozen=True)
class TokenSet:
    """A parsed ``recompute_tokens`` value: ``kind`` ``"header"`` (of the last ``size``
    memories; 0: of all), ``"first"`` (``size`` tokens) or ``"deviating"`` (``size`` %)."""

    kind: str
    size: int = 0

    @classmethod
    def parse(cls, spec: str) -> TokenSet:
        """``"header"``, ``"header:M"`` (M >= 1), ``"first:N"`` (N >= 1) or ``"deviating:P"``
        (1 <= P <= 100); a ``ValueError`` that names them otherwise."""
        m = _SPEC.match(spec) if isinstance(spec, str) else None
        if m is not None:
            kind, given = m.group(1), m.group(2)
            size = int(given or 0)
            most = 100 if kind == "deviating" else size  # only a share has a bound above
            if (given is None and kind == "header") or (given is not None and 1 <= size <= most):
                return cls(kind, size)
        raise ValueError("recompute_tokens must be 'header', 'header:M' (M >= 1), 'first:N' (N >= 1) or "
                         f"'deviating:P' (1 <= P <= 100), or None: off; got {spec!r}")

    @property
    def last_memories(self) -> int | None:
        """How many memories, counted from the last, the set takes rows of; None: every one."""
        return self.size if self.kind == "header" and self.size else None

    @property
    def keep(self) -> float | None:
        """Share of the candidate rows the worker keeps from the second layer on (``deviating``);
        None: all of them."""
        return self.size / 100 if self.kind == "deviating" else None

    def rows(self, token_ids: Sequence[int], detokenize: Callable[[Sequence[int]], str]) -> int:
        """How many of a memory's first tokens this set recomputes (or, ``deviating``, offers)."""
        if self.kind == "first":
            return min(self.size, len(token_ids))
        if self.kind == "deviating":
            return len(token_ids)
        return header_tokens(token_ids[:HEADER_TOKENS], detokenize)


def header_tokens(token_ids: Sequence[int], detokenize: Callable[[Sequence[int]], str]) -> int:
    """Tokens up to and including the one that completes the first colon followed by whitespace
    in the text of ``token_ids`` (0: none)."""
    text = detokenize(token_ids)
    m = _COLON.search(text)
    if m is None:
        return 0
    return tokens_spelling(token_ids, detokenize, m.start() + 1)  # up to and including the colon


def tokens_spelling(token_ids: Sequence[int], detokenize: Callable[[Sequence[int]], str], chars: int) -> int:
    """The fewest first tokens of ``token_ids`` whose text holds its first ``chars`` characters."""
    for n in range(1, len(token_ids) + 1):
        if len(detokenize(token_ids[:n])) >= chars:
            return n
    return len(token_ids)


def positions(spans: Sequence[tuple[Sequence[int], bool]], rows: Callable[[Sequence[int]], int],
              last_memories: int | None = None) -> list[int]:
    """Prompt positions to recompute: ``spans`` are the injected region's spans in order, each as
    (token ids, whether it is a memory), ``rows`` a memory's count of first tokens to recompute
    (:meth:`TokenSet.rows`), of the last ``last_memories`` memories only where given; heads and
    separators are never chosen."""
    skip = 0 if last_memories is None else max(0, sum(memory for _, memory in spans) - last_memories)
    out: list[int] = []
    at = 0
    for token_ids, memory in spans:
        if memory:
            if skip:
                skip -= 1
            else:
                out.extend(range(at, at + rows(token_ids)))
        at += len(token_ids)
    return out
