"""What a fact is encoded after: the one place that builds the context of a fact's KV.

A fact's KV depends on the tokens before it, so every fact is encoded after a context that
resembles what precedes it when it is served:

* **window**: ``prefix`` + the ``window`` facts of the same user before it, ``"\\n"``-joined
  (the oldest dropped until the fact fits the model);
* **explicit**: the caller's ``context=`` texts (+ the facts of the same call before it);
  never shortened: a context that does not fit is an error;
* **sliding**: an import encodes ``group`` consecutive facts in one prefill, after the
  ``window`` facts before the group; each fact's context is then everything before it in
  that prefill.

The store keeps the ids and text of each context, so a fact is re-encoded (missing file,
new model) after the same text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from inferscale_engine.errors import ContextOverflowError
from inferscale_engine.types import EncodeWindow


@dataclass(frozen=True)
class Context:
    ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Chunk:
    """One prefill of an import: its window and, per capture range, the index of its fact."""

    window: EncodeWindow
    facts: tuple[int, ...]

    @classmethod
    def per_fact(cls, contexts: Sequence[Sequence[int]], token_ids: Sequence[Sequence[int]]) -> list["Chunk"]:
        """One prefill per fact, after its own context."""
        return [cls(EncodeWindow.single(ids, ctx), (i,)) for i, (ctx, ids) in enumerate(zip(contexts, token_ids))]


class ContextBuilder:
    """Contexts for one model (``tokenize``, ``max_model_len``) and one store (``window``, ``prefix``)."""

    def __init__(self, tokenize: Callable[[str], Sequence[int]], max_model_len: int, *, window: int,
                 prefix: str = "") -> None:
        self._tokenize = tokenize
        self.max_model_len = max_model_len
        self.window = window
        self.prefix = prefix

    def tokenize(self, text: str) -> tuple[int, ...]:
        return tuple(int(t) for t in self._tokenize(text)) if text else ()

    def fact_tokens(self, text: str) -> tuple[int, ...]:
        """The token ids of a fact's text, which must leave room in the model's context."""
        ids = self.tokenize(text)
        if not ids:
            raise ValueError("memory text produces no tokens")
        if len(ids) >= self.max_model_len:
            raise ContextOverflowError(
                f"memory of {len(ids)} tokens does not fit the model's context of {self.max_model_len} tokens"
            )
        return ids

    def fit(self, prev: Sequence[str], n: int, *, strict: bool, prefix: str) -> Context:
        """``prefix + "\\n".join(prev) + "\\n"`` before a fact of ``n`` tokens, dropping the
        oldest texts until it fits (``strict``: raise instead)."""
        prev = list(prev)
        while True:
            text = prefix + ("\n".join(prev) + "\n" if prev else "")
            ids = self.tokenize(text)
            if len(ids) + n < self.max_model_len:
                return Context(ids, text)
            if strict or not prev:  # nothing left to drop: the prefix alone is too long
                raise ContextOverflowError(
                    f"context of {len(ids)} tokens plus a memory of {n} does not fit the model's context "
                    f"of {self.max_model_len} tokens"
                )
            prev = prev[1:]

    def window_context(self, before: Sequence[str], n: int) -> Context:
        """Window context of one fact of ``n`` tokens; ``before``: the texts of the facts before it."""
        return self.fit(self._last(before), n, strict=False, prefix=self.prefix)

    def for_new(self, before: Sequence[str], texts: Sequence[str], token_ids: Sequence[Sequence[int]],
                explicit: Sequence[str] | None = None) -> list[Context]:
        """Contexts of new facts added together after the facts ``before`` them; ``explicit``
        replaces the window of earlier facts (and the prefix)."""
        out = []
        prior: list[str] = []
        for text, ids in zip(texts, token_ids):
            if explicit is not None:
                out.append(self.fit(list(explicit) + self._last(prior), len(ids), strict=True, prefix=""))
            else:
                out.append(self.window_context(list(before) + prior, len(ids)))
            prior.append(text)
        return out

    def sliding(self, before: Sequence[str], texts: Sequence[str], token_ids: Sequence[Sequence[int]],
                group: int) -> tuple[list[Context], list[Chunk]]:
        """Sliding-chunk encoding of new facts: their contexts, and the prefills that encode them."""
        all_texts = list(before) + list(texts)
        newline = self.tokenize("\n")
        contexts: list[Context] = [Context((), "")] * len(texts)
        chunks = []
        i = 0
        while i < len(texts):
            head = self.window_context(all_texts[: len(before) + i], len(token_ids[i]))
            ids, text = list(head.ids), head.text
            ranges: list[tuple[int, int]] = []
            facts: list[int] = []
            j = i
            while j < len(texts) and j - i < group:
                sep = newline if ranges else ()
                if ranges and len(ids) + len(sep) + len(token_ids[j]) >= self.max_model_len:
                    break
                ids.extend(sep)
                if sep:
                    text += texts[j - 1] + "\n"
                contexts[j] = Context(tuple(ids), text)
                ranges.append((len(ids), len(token_ids[j])))
                facts.append(j)
                ids.extend(token_ids[j])
                j += 1
            chunks.append(Chunk(EncodeWindow(tuple(ids), tuple(ranges)), tuple(facts)))
            i = j
        return contexts, chunks

    def retokenized(self, text: str | None, n: int) -> tuple[int, ...]:
        """A stored context text under this model's tokenizer, before a fact of ``n`` tokens."""
        return self.trim(self.tokenize(text or ""), n)

    def trim(self, ids: Sequence[int], n: int) -> tuple[int, ...]:
        """``ids`` without their oldest tokens as far as a fact of ``n`` tokens needs to fit."""
        return tuple(ids[max(0, len(ids) + n - self.max_model_len + 1) :])

    def _last(self, texts: Sequence[str]) -> list[str]:
        return list(texts[-self.window :]) if self.window else []
