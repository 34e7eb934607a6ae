"""``bench locomo``: LoCoMo question answering, the same retrieval answered three ways.

* ``inject`` – retrieved memories go into the prompt as handles; their KV (encoded at ingest
  with a context window of ``w`` turns) is injected, only the question is prefilled.
* ``prompt`` – the very same token ids sent without injection (memories pasted as text, the
  Mem0 way). Identical tokens for every ``w``: it is computed once per ``k``.
* ``full``   – the whole conversation pasted as text, where it fits the model's context.

Setup (see ``docs/benchmarks-locomo.md``):

* **Ingest.** Every turn becomes one memory ``"[{session date}] {speaker}: {text}"`` (plus
  ``" [shares {blip_caption}]"`` when the turn shared a photo), imported in conversation order
  into one store user per conversation with ``MemoryStore.import_conversation``, one store
  per ``w``. The store's context window is then exactly "the ``w`` previous turns of the
  conversation", whoever said them (``--encoding window``: one prefill per turn), or at least
  ``w`` of them (``--encoding sliding``: one prefill per ``w`` turns, ~``(w+1)/2`` times fewer
  prefill tokens at large ``w``).
* **Retrieval** follows the reference (Mem0) LoCoMo setup: top-``k`` memories *per speaker*
  (``2k`` in all) by cosine similarity to the question, searched in that conversation's store
  and split by who said the turn – the same ranking a per-speaker store would give. The
  retrieved turns are listed in conversation order. Retrieval is computed once per question
  and shared by every mode, ``w`` and ``k``.
* **Recompute** (``--recompute R,…``, the engine's quality knob): inject rows are answered once per
  ``R``. The ``R`` retrieved memories most similar to the question move to the end of the list
  (each group keeps conversation order) and are prefilled as text after the injected rest; at
  ``R >= 2k`` that is the prompt itself. With the engine's ``recompute_tokens="header:M"``
  the next ``M`` best-ranked go just before them (``relevance-last-R+M``), so the headers it
  repairs are the most relevant injected memories'. ``--order conversation`` keeps the list as
  it is and recomputes its last ``R`` memories (and ``M`` headers) instead.
* **Answers**: greedy, ``max_tokens=32``; categories 1-4 (5, adversarial, is skipped).
* **Score**: token F1 with the upstream LoCoMo scorer (``snap-research/locomo``
  ``task_eval/evaluation.py``): lower-case, drop punctuation and commas, drop ``a an the and``,
  Porter-stem, whitespace tokens; category 1 splits gold and prediction on ``,`` and averages
  the best match per gold sub-answer; category 3 keeps the gold answer before the first ``;``.
* **Fair baseline.** Every inject row is scored against the prompt row with the *identical*
  memory order (the same token ids: the bench checks it), so its ratio measures the injection,
  not the reordering. The prompt is answered once per order a row serves (``order``:
  ``conversation``, ``relevance-last-R`` or ``relevance-last-R+M``).
* **Noise floor.** The prompt in another order against the prompt in conversation order, per
  category: what moving memories around alone does to F1, the yardstick for an inject row's
  ratio. Every order the inject rows serve counts; when they serve none but the conversation's,
  the prompt is answered once more in ``relevance-last-k`` order (half the memories moved).
* **Agreement** (inject rows): how often the injected answer equals the same-order prompt
  answer after normalisation, and their mean token F1.

Rows: ``{mode, w, k, order, n_questions, f1, f1_by_category, agreement, ttft_ms}``; inject rows add
``recompute`` and ``inject_over_prompt_ci95``, a paired-bootstrap 95% interval of their F1 over the
same-order prompt F1 (``category_over_prompt_ci95`` per category); prompt rows of another order
add the noise floor, ``over_conversation_order`` with ``noise_floor_ci95`` and
``category_noise_floor_ci95``. Answers are cached in ``--workdir`` (stores included), so an
interrupted run resumes where it stopped; ``--score-only`` scores such a cache (one that came back
from a device run cut short, say) with no engine, by the same keys (:class:`AnswerTable`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import lzma
import os
import re
import shutil
import string
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from inferscale_apps.bench.locomo_data import (
    CATEGORIES,
    Conversation,
    Question,
    default_data_path,
    load_locomo,
)
from inferscale_apps.bench.locomo_oracle import Oracle, Region, header_tokens, recovered, splice
from inferscale_engine.runtime import facts_from
from inferscale_engine.token_recompute import TokenSet
from inferscale_engine.types import EncodeWindow, Span

if TYPE_CHECKING:
    from inferscale_engine.engine import InferScaleEngine
    from inferscale_engine.memory import MemoryStore

logger = logging.getLogger(__name__)

SYSTEM = "You answer questions about a conversation from memories.\nMemories:\n"
INSTRUCTION = "Answer in a few words."
MODES = ("prompt", "inject", "full")
ORDERS = ("relevance", "conversation")
CONVERSATION = "conversation"


# ====================================================================== scoring (upstream LoCoMo)


def _stemmer() -> tuple[Any, str]:
    try:
        from nltk.stem import PorterStemmer

        return PorterStemmer().stem, "nltk-porter"
    except ImportError:  # pragma: no cover - nltk is in the bench environment
        logger.warning("nltk is not installed: LoCoMo F1 without Porter stemming (not the upstream scorer)")
        return (lambda w: w), "none"


_STEM, STEMMER = _stemmer()
_ARTICLES = re.compile(r"\b(a|an|the|and)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(s: Any) -> str:
    """Upstream ``normalize_answer``: drop commas, lower-case, drop punctuation, drop a/an/the/and."""
    s = str(s).replace(",", "").lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def f1_score(prediction: Any, ground_truth: Any) -> float:
    """Upstream token F1 over Porter-stemmed normalised tokens."""
    pred = [_STEM(w) for w in normalize_answer(prediction).split()]
    gold = [_STEM(w) for w in normalize_answer(ground_truth).split()]
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def f1_multi(prediction: Any, ground_truth: Any) -> float:
    """Upstream multi-hop F1: mean over gold sub-answers of the best-matching predicted one."""
    preds = [p.strip() for p in str(prediction).split(",")]
    golds = [g.strip() for g in str(ground_truth).split(",")]
    return float(np.mean([max(f1_score(p, g) for p in preds) for g in golds]))


def score(prediction: Any, answer: Any, category: int) -> float:
    """The upstream per-question score for categories 1-4."""
    answer = str(answer)
    if category == 3:
        answer = answer.split(";")[0].strip()
    if category == 1:
        return f1_multi(prediction, answer)
    if category in (2, 3, 4):
        return f1_score(prediction, answer)
    raise ValueError(f"category {category} is not scored here")


def agreement(a: Sequence[str], b: Sequence[str]) -> dict[str, float] | None:
    """Exact match rate after normalisation and mean token F1 between paired answers."""
    if not a:
        return None
    exact, f1s = [], []
    for x, y in zip(a, b, strict=True):
        nx, ny = normalize_answer(x), normalize_answer(y)
        exact.append(nx == ny)
        f1s.append(1.0 if nx == ny else f1_score(x, y))
    return {"exact_match": float(np.mean(exact)), "f1": float(np.mean(f1s))}


# ====================================================================== embeddings


def _cached_embedder(device: str) -> Any:
    """One embedder for every store of the run, remembering each text's vector: turns are
    embedded once for all ``w`` (and questions once for all ``k``)."""
    from inferscale_engine.memory.text.embedder import Embedder

    class CachedEmbedder(Embedder):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.cache: dict[str, np.ndarray] = {}

        def embed(self, texts: Sequence[str], *, progress: bool = False) -> np.ndarray:
            missing = list(dict.fromkeys(t for t in texts if t not in self.cache))
            if missing:
                vecs = super().embed(missing, progress=progress)
                self.cache.update(zip(missing, vecs))
            if not texts:
                return super().embed(texts)
            return np.stack([self.cache[t] for t in texts]).astype(np.float32, copy=False)

    return CachedEmbedder(device=device)


# ====================================================================== the run


@dataclass(frozen=True)
class _Job:
    conv: Conversation
    question: Question
    mode: str  # inject | prompt | full | exact
    w: int | None
    k: int | None
    messages: tuple[tuple[str, str], ...]
    key: str
    recompute: int = 0
    segments: tuple[Any, ...] | None = None  # resolved segments, sent as they are (exact control)


def _records(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The cached answers of a JSONL file's lines, skipping a line cut short by an interruption."""
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "key" in rec:
            yield rec


class AnswerCache:
    """Answers already computed (JSONL, append-only), so a run can resume."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.data: dict[str, dict[str, Any]] = {}
        if path is not None and path.exists():
            with path.open() as f:
                self.data.update((rec["key"], rec) for rec in _records(f))

    def get(self, key: str) -> dict[str, Any] | None:
        return self.data.get(key)

    def merge(self, path: str | os.PathLike) -> int:
        """Take the answers another run cached (its ``answers-t*.jsonl``, or that file
        xz-compressed) for every key this cache lacks; returns how many were taken.

        Only answers of the same model, data and answer length belong here. Scoring checks what
        it can: an inject row whose prompt's token ids differ from its prompt row's is refused. A
        file with no cached answer at all (the scored ``--answers`` file, say) is a ValueError."""
        opener = lzma.open if str(path).endswith(".xz") else open
        taken = found = 0
        with opener(path, "rt") as f:
            for rec in _records(f):
                found += 1
                if rec["key"] not in self.data:
                    self.put(rec)
                    taken += 1
        if not found:  # e.g. a --answers file: scored answers, without the keys and prompt hashes
            raise ValueError(f"{path} holds no cached answers: resume from a workdir's answers-t*.jsonl "
                             "(or that file .xz), not from the scored answers a run writes with --answers")
        return taken

    def put(self, rec: dict[str, Any]) -> None:
        self.data[rec["key"]] = rec
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(rec) + "\n")


def _ids_hash(ids: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()[:16]


class AnswerTable:
    """The rows of a run, scored from its cached answers: no engine, no model.

    A bench run fills the cache and reads its rows from here; ``bench locomo --score-only``
    scores an answer file that came back from another machine (a device run cut short, say)
    the same way, by the same keys."""

    def __init__(self, cache: AnswerCache, conversations: list[Conversation], *, recompute: Sequence[int] = (0,),
                 order: str = "relevance", recompute_tokens: str | None = None) -> None:
        if not recompute or min(recompute) < 0:
            raise ValueError("need recompute >= 0")
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        self.cache = cache
        self.conversations = conversations
        self.rs = sorted(set(recompute))
        self.order = order
        # Answers with recomputed memories depend on the order; the stores and the rest do not.
        self.order_tag = "" if order == "relevance" else f"-{order}"
        self.recompute_tokens = recompute_tokens
        # header:M repairs the headers of the last M injected memories: the next best-ranked.
        self._header_memories = (TokenSet.parse(recompute_tokens).last_memories or 0) if recompute_tokens else 0

    def served_order(self, recompute: int, k: int) -> str:
        """The memory order an inject row with ``recompute`` serves at ``k`` (2k memories): the
        R best-ranked last, and with ``recompute_tokens="header:M"`` the next M best-ranked just
        before them (``relevance-last-R+M``), so the headers repaired are the most relevant
        injected memories' ones."""
        n = 2 * k
        if self.order == "conversation" or recompute >= n:
            return CONVERSATION
        headers = self._header_memories
        if headers >= n - recompute:
            headers = 0  # every injected memory repaired: their order is the list's
        if recompute == 0:  # headers alone: the list recompute=M serves
            recompute, headers = headers, 0
        if recompute == 0:
            return CONVERSATION  # relevance_last of every memory keeps them in place
        return f"relevance-last-{recompute}" + (f"+{headers}" if headers else "")

    def prompt_orders(self, k: int) -> list[str]:
        """Orders the prompt is answered in at ``k``: each one an inject row serves, and at least
        one other than the conversation's, for the noise floor."""
        orders = {self.served_order(r, k) for r in self.rs} | {CONVERSATION}
        if orders == {CONVERSATION}:
            orders.add(f"relevance-last-{k}")
        return sorted(orders, key=lambda o: (o != CONVERSATION, o))

    def key(self, conv: Conversation, q: Question, mode: str, w: int | None, k: int | None, r: int = 0,
                   order: str = CONVERSATION) -> str:
        """The answer cache's key of one question's answer in one row (``mode``: prompt, inject,
        full, exact, ``oracle NAME``)."""
        # The turn count is part of the key: --max-turns changes what retrieval can find.
        key: list[Any] = [conv.sample_id, len(conv.turns), q.index, mode, w, k]
        if r:
            key.append(f"r{r}{self.order_tag}")
        if order != CONVERSATION:  # prompt answers: one per memory order
            key.append(order)
        # Injected rows with a token-level recompute (the engine's recompute_tokens) are other KV.
        tokens = self.recompute_tokens
        if tokens is not None and mode not in ("prompt", "full"):  # those rows inject nothing
            key.append(f"tokens:{tokens}")
        return json.dumps(key)

    def rows(self, ws: Sequence[int], ks: Sequence[int], oracles: Sequence[Oracle] = ()) -> list[dict[str, Any]]:
        """Per ``w`` and ``k``: a prompt row per memory order, an inject row per ``recompute``,
        an oracle row per oracle; then the full-conversation row. Rows of answers the cache lacks
        count what it has (``n_questions``)."""
        out: list[dict[str, Any]] = []
        for w in ws:
            for k in ks:
                out.extend(self._prompt_row(w, k, order) for order in self.prompt_orders(k))
                out.extend(self._inject_row(w, k, r) for r in self.rs)
                out.extend(self._oracle_row(w, k, o) for o in oracles)
        out.append(self._row("full", None, None, self._collect("full", None, None)))
        return out

    def _collect(
        self, mode: str, w: int | None, k: int | None, r: int = 0, order: str = CONVERSATION
    ) -> dict[tuple[str, int], tuple[Question, dict[str, Any]]]:
        """Answers in the cache, by ``(sample_id, question index)``."""
        got = {}
        for conv in self.conversations:
            for q in conv.questions:
                rec = self.cache.get(self.key(conv, q, mode, None if mode == "prompt" else w, k, r, order))
                if rec is not None and "answer" in rec:
                    got[(conv.sample_id, q.index)] = (q, rec)
        return got

    def _prompt_row(self, w: int, k: int, order: str) -> dict[str, Any]:
        got = self._collect("prompt", None, k, order=order)
        row = self._row("prompt", w, k, got, order=order)
        if order != CONVERSATION:
            base = self._collect("prompt", None, k)
            row.update(self._compare(got, base, "over_conversation_order", "noise_floor_ci95",
                                     "category_noise_floor_ci95"))
        return row

    def _inject_row(self, w: int, k: int, r: int) -> dict[str, Any]:
        order = self.served_order(r, k)
        got = self._collect("inject", w, k, r)
        base = self._collect("prompt", None, k, order=order)
        mismatched = [key for key, (_, rec) in got.items() if key in base and rec["prompt_hash"] != base[key][1]["prompt_hash"]]
        if mismatched:
            raise RuntimeError(f"inject and same-order prompt requests differ in token ids ({len(mismatched)} questions)")
        pairs = [(rec["answer"], base[key][1]["answer"]) for key, (_, rec) in got.items() if key in base]
        return {**self._row("inject", w, k, got, r=r, order=order),
                "agreement": agreement([a for a, _ in pairs], [b for _, b in pairs]),
                **self._compare(got, base, None, "inject_over_prompt_ci95", "category_over_prompt_ci95")}

    def _oracle_row(self, w: int, k: int, oracle: Oracle) -> dict[str, Any]:
        got = self._collect(f"oracle {oracle.name}", w, k)
        base = self._collect("prompt", None, k)
        pairs = [(rec["answer"], base[key][1]["answer"]) for key, (_, rec) in got.items() if key in base]
        row = {**self._row("oracle", w, k, got), "oracle": oracle.name,
               "agreement": agreement([a for a, _ in pairs], [b for _, b in pairs]),
               **self._compare(got, base, None, "inject_over_prompt_ci95", "category_over_prompt_ci95")}
        inject = self._row("inject", w, k, self._collect("inject", w, k)) if 0 in self.rs else {"f1": None}
        row["recovered"] = recovered(row["f1"], inject["f1"], self._row("prompt", w, k, base)["f1"])
        return row

    @staticmethod
    def _compare(got: dict[tuple[str, int], tuple[Question, dict[str, Any]]],
                 base: dict[tuple[str, int], tuple[Question, dict[str, Any]]],
                 ratio_name: str | None, ci_name: str, category_name: str) -> dict[str, Any]:
        """Paired F1 of ``got`` over ``base`` (the questions both answered): 95% bootstrap
        intervals overall and per category, and the ratio itself under ``ratio_name``."""
        paired = [(q.category, score(rec["answer"], q.answer, q.category), score(base[key][1]["answer"], q.answer, q.category))
                  for key, (q, rec) in got.items() if key in base]
        out: dict[str, Any] = {
            category_name: {str(cat): ratio_ci95([(a, b) for c, a, b in paired if c == cat])
                            for cat in sorted({c for c, _, _ in paired})},
        }
        ci = ratio_ci95([(a, b) for _, a, b in paired])
        if ci is not None:
            out[ci_name] = ci
        if ratio_name is not None:
            den = sum(b for _, _, b in paired)
            out[ratio_name] = sum(a for _, a, _ in paired) / den if den else None
        return out

    def _row(self, mode: str, w: int | None, k: int | None, got: dict[tuple[str, int], tuple[Question, dict[str, Any]]],
             *, r: int = 0, order: str = CONVERSATION) -> dict[str, Any]:
        by_cat: dict[str, list[float]] = {}
        scores = []
        for q, rec in got.values():
            s = score(rec["answer"], q.answer, q.category)
            scores.append(s)
            by_cat.setdefault(str(q.category), []).append(s)
        ttfts = [rec["ttft_s"] for _, rec in got.values() if "ttft_s" in rec]
        return {
            "mode": mode, "w": w, "k": k, **({"recompute": r} if mode == "inject" else {}),
            **({"order": order} if mode != "full" else {}),
            "n_questions": len(scores),
            "f1": float(np.mean(scores)) if scores else None,
            "f1_by_category": {c: float(np.mean(v)) for c, v in sorted(by_cat.items())},
            "agreement": None,
            # Under --concurrency requests queue behind each other: a cost indicator, not TTFT.
            "ttft_ms": float(np.median(ttfts)) * 1e3 if ttfts else None,
        }

    def exact_summary(self, ks: Sequence[int]) -> dict[str, Any]:
        """Per k: agreement of exact-context injection with the prompt answers, and its F1."""
        out = {}
        for k in ks:
            exact = self._collect("exact", None, k)
            ref = self._collect("prompt", None, k)
            pairs = [(rec, ref[key][1]) for key, (_, rec) in exact.items() if key in ref]
            if any(a["prompt_hash"] != b["prompt_hash"] for a, b in pairs):
                raise RuntimeError("exact-control and prompt requests differ in token ids")
            scores = [score(rec["answer"], q.answer, q.category) for q, rec in exact.values()]
            out[str(k)] = {
                "n_questions": len(scores),
                "f1": float(np.mean(scores)) if scores else None,
                "agreement": agreement([a["answer"] for a, _ in pairs], [b["answer"] for _, b in pairs]),
            }
        return out

    def answers(self) -> list[dict[str, Any]]:
        """Every question's answers, for inspection (``--answers``)."""
        by_question: dict[tuple[str, int, int], dict[str, str]] = {}
        for key, r in self.cache.data.items():
            if "answer" not in r:
                continue
            sid, n_turns, qi, mode, w, k, *recompute = json.loads(key)
            name = mode if mode == "full" else f"{mode} k={k}" + ("" if w is None else f" w={w}")
            by_question.setdefault((sid, n_turns, qi), {})[name + "".join(f" {x}" for x in recompute)] = r["answer"]
        return [{"sample_id": conv.sample_id, "qa_index": q.index, "category": q.category, "question": q.question,
                 "gold": q.answer, "answers": by_question.get((conv.sample_id, len(conv.turns), q.index), {})}
                for conv in self.conversations for q in conv.questions]


class LocomoBench:
    """Stores, retrieval and answers of one ``bench locomo`` run."""

    def __init__(
        self,
        engine: InferScaleEngine,
        conversations: list[Conversation],
        *,
        ks: Sequence[int],
        ws: Sequence[int],
        encoding: str = "window",
        max_tokens: int = 32,
        concurrency: int = 16,
        workdir: str | os.PathLike | None = None,
        device_kv_bytes: int = 256 << 20,
        host_kv_bytes: int = 1 << 30,
        full: bool = True,
        exact_control: bool = False,
        oracles: Sequence[Oracle] = (),
        after_head: bool = False,
        recompute: Sequence[int] = (0,),
        order: str = "relevance",
        resume_answers: str | os.PathLike | None = None,
        resolve_dates: bool = False,
    ) -> None:
        if encoding not in ("window", "sliding"):
            raise ValueError(f"encoding must be 'window' or 'sliding', got {encoding!r}")
        if not ks or min(ks) < 1 or not ws or min(ws) < 0:
            raise ValueError("need k >= 1 and w >= 0")
        self.engine = engine
        self.conversations = conversations
        self.ks, self.ws = sorted(set(ks)), sorted(set(ws))
        self.encoding = encoding
        self.max_tokens = max_tokens
        self.concurrency = max(1, concurrency)
        self.full = full
        self.exact_control = exact_control
        self.oracles = list(oracles)
        # Memories encoded after the served prompt's opening (chat template + system text),
        # the store's context_prefix, instead of starting at position 0.
        self.context_prefix = self._served_head() if after_head else ""
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="inferscale-locomo-")).expanduser()
        # Turns with resolved dates are other memories: other stores, other answers.
        self.resolve_dates = resolve_dates
        self.run_dir = self.workdir / (f"{engine.fingerprint}-{encoding}{'-after-head' if after_head else ''}"
                                       f"{'-dates' if resolve_dates else ''}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cache = AnswerCache(self.run_dir / f"answers-t{max_tokens}.jsonl")
        if resume_answers is not None:
            logger.info("%d answers taken from %s", self.cache.merge(resume_answers), resume_answers)
        self.table = AnswerTable(self.cache, conversations, recompute=recompute, order=order,
                                 recompute_tokens=engine.config.recompute_tokens)
        self.embedder = _cached_embedder(str(engine.config.device))
        self.stores: dict[int, MemoryStore] = {}
        self.tier_bytes = (device_kv_bytes, host_kv_bytes)
        # Seconds per phase that did work, kept in the workdir so a resumed run still reports them.
        self._timings_path = self.run_dir / "timings.json"
        self.timings: dict[str, float] = (
            json.loads(self._timings_path.read_text()) if self._timings_path.exists() else {}
        )
        self.full_skipped: dict[str, str] = {}

    # -------------------------------------------------------------- lifecycle

    def close(self) -> None:
        for store in self.stores.values():
            store.close()
        self.stores.clear()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocomoBench:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- ingest

    def store(self, w: int) -> MemoryStore:
        from inferscale_engine.memory import MemoryStore

        if w not in self.stores:
            self.stores[w] = MemoryStore(
                self.engine, self.run_dir / f"w{w}", window=w, context_prefix=self.context_prefix,
                embedder=self.embedder,
                index="exact", device_kv_bytes=self.tier_bytes[0], host_kv_bytes=self.tier_bytes[1],
            )
        return self.stores[w]

    def ingest(self) -> None:
        """Import every conversation into the store of every ``w`` (skipping finished imports)."""
        t0 = time.perf_counter()
        all_texts = [t.memory for c in self.conversations for t in c.turns]
        all_texts += [q.question for c in self.conversations for q in c.questions]
        self.embedder.embed(all_texts, progress=True)
        self._time("embed_s", t0)
        for w in self.ws:
            store = self.store(w)
            t0 = time.perf_counter()
            imported = False
            for conv in self.conversations:
                have = store.get_all(user_id=conv.user_id)
                if len(have) == len(conv.turns) and [i.memory for i in have] == [t.memory for t in conv.turns]:
                    continue  # imported by an earlier run of this workdir
                if have:
                    store.delete_all(user_id=conv.user_id)
                group = w if self.encoding == "sliding" and w > 0 else None
                logger.info("importing %s (%d turns) at w=%d", conv.sample_id, len(conv.turns), w)
                store.import_conversation(
                    [(f"[{t.date}] {t.speaker}", t.text) for t in conv.turns],
                    user_id=conv.user_id,
                    metadata_per_turn=[{"turn": t.index, "dia_id": t.dia_id, "speaker": t.speaker} for t in conv.turns],
                    sliding_group=group,
                    progress=True,
                )
                imported = True
            store.wait_for_encoding()
            if imported:
                self._time(f"ingest_w{w}_s", t0)

    def _time(self, name: str, t0: float) -> None:
        self._record({name: time.perf_counter() - t0})

    def _record(self, seconds: dict[str, float]) -> None:
        self.timings.update({name: round(s, 1) for name, s in seconds.items()})
        self._timings_path.write_text(json.dumps(self.timings, indent=1))

    # -------------------------------------------------------------- retrieval

    def retrieve(self) -> dict[tuple[str, int], list[tuple[int, str]]]:
        """Per question: every turn ``(index, speaker)`` ranked by similarity (best first)."""
        store = self.store(self.ws[0])
        ranking = {}
        t0 = time.perf_counter()
        for conv in self.conversations:
            n = len(conv.turns)
            for q in conv.questions:
                hits = store.search(q.question, user_id=conv.user_id, k=min(n, 1000))
                ranking[(conv.sample_id, q.index)] = [(int(h.metadata["turn"]), h.metadata["speaker"]) for h in hits]
        self._time("retrieval_s", t0)
        return ranking

    @staticmethod
    def pick(ranked: list[tuple[int, str]], speakers: Sequence[str], k: int) -> list[int]:
        """Top-``k`` turns of each speaker, in conversation order."""
        chosen: list[int] = []
        for spk in speakers:
            chosen += [i for i, s in ranked if s == spk][:k]
        return sorted(chosen)

    @staticmethod
    def arrange(turns: list[int], ranked: list[tuple[int, str]], order: str) -> list[int]:
        """``turns`` in ``order``: as listed, or with the R best-ranked moved last
        (``relevance-last-R``) and the next M just before them (``relevance-last-R+M``)."""
        if order == CONVERSATION:
            return turns
        best, _, then = order.removeprefix("relevance-last-").partition("+")
        ids = [i for i, _ in ranked]
        if then:
            turns = relevance_last(turns, ids, int(best) + int(then))
        return relevance_last(turns, ids, int(best))

    # -------------------------------------------------------------- answering

    def _handles(self, w: int) -> dict[str, dict[int, str]]:
        store = self.store(w)
        return {c.sample_id: {int(i.metadata["turn"]): i.handle for i in store.get_all(user_id=c.user_id)}
                for c in self.conversations}

    def _served_head(self) -> str:
        """The prompt text every served question starts with, up to its first memory."""
        mark = "<<inferscale-first-memory>>"
        msgs = self.messages([mark], "?")
        text, _ = self.engine.render([{"role": r, "content": c} for r, c in msgs])
        return text[: text.index(mark)]

    @staticmethod
    def messages(memories: Iterable[str], question: str) -> tuple[tuple[str, str], ...]:
        return (("system", SYSTEM + "\n".join(memories)), ("user", f"{question} {INSTRUCTION}"))

    def _run_jobs(self, jobs: list[_Job], desc: str, timing: str) -> None:
        todo = [j for j in jobs if self.cache.get(j.key) is None]
        if not todo:
            return
        t0 = time.perf_counter()
        with tqdm(total=len(todo), desc=desc, unit="q") as bar:
            self._generate(todo, bar)
        self._time(timing, t0)

    def _generate(self, jobs: list[_Job], bar: tqdm) -> None:
        """Answer ``jobs``, ``concurrency`` at a time, into the answer cache."""

        async def one(job: _Job, sem: asyncio.Semaphore) -> None:
            from inferscale_engine.errors import ContextOverflowError

            async with sem:
                msgs = [{"role": r, "content": c} for r, c in job.messages]
                sampling: dict[str, Any] = {
                    "user_id": job.conv.user_id, "max_tokens": self.max_tokens, "temperature": 0.0}
                try:
                    if job.segments is not None:
                        res = await self.engine.agenerate_segments(
                            list(job.segments), mode="inject", recompute=job.recompute, **sampling)
                    else:
                        res = await self.engine.agenerate(
                            msgs, mode="prompt" if job.mode == "full" else job.mode, recompute=job.recompute,
                            **sampling)
                except ContextOverflowError as exc:
                    rec: dict[str, Any] = {"key": job.key, "skipped": str(exc)}
                else:
                    rec = {
                        "key": job.key, "answer": res.text, "prompt_hash": _ids_hash(res.prompt_token_ids),
                        "prompt_tokens": res.usage.prompt_tokens, "injected_tokens": res.usage.injected_tokens,
                        "ttft_s": res.ttft_s,
                    }
                self.cache.put(rec)
                bar.update(1)

        async def all_jobs() -> None:
            sem = asyncio.Semaphore(self.concurrency)
            await asyncio.gather(*(one(j, sem) for j in jobs))

        asyncio.run(all_jobs())

    def answer(self) -> None:
        """Generate every answer the rows need (cached ones are reused)."""
        ranking = self.retrieve()
        for w in self.ws:
            with facts_from(self.engine, self.store(w)):
                handles = self._handles(w)
                jobs = []
                for conv in self.conversations:
                    for q in conv.questions:
                        ranked = ranking[(conv.sample_id, q.index)]
                        for k in self.ks:
                            turns = self.pick(ranked, conv.speakers, k)
                            # The prompt answer does not depend on w (same token ids): once, at the first w.
                            if w == self.ws[0]:
                                for order in self.table.prompt_orders(k):
                                    msgs = self.messages(
                                        (handles[conv.sample_id][i] for i in self.arrange(turns, ranked, order)),
                                        q.question)
                                    jobs.append(_Job(conv, q, "prompt", None, k, msgs,
                                                     self.table.key(conv, q, "prompt", None, k, order=order)))
                            for r in self.table.rs:
                                order = self.table.served_order(r, k)
                                msgs = self.messages(
                                    (handles[conv.sample_id][i] for i in self.arrange(turns, ranked, order)), q.question)
                                jobs.append(_Job(conv, q, "inject", w, k, msgs, self.table.key(conv, q, "inject", w, k, r), r))
                self._run_jobs([j for j in jobs if j.mode == "prompt"], f"prompt k={','.join(map(str, self.ks))}",
                               "answer_prompt_s")
                for r in self.table.rs:
                    self._run_jobs([j for j in jobs if j.mode == "inject" and j.recompute == r],
                                   f"inject w={w} recompute={r}", f"answer_inject_w{w}_r{r}{self.table.order_tag}_s")
        if self.exact_control:
            self._answer_exact(ranking)
        if self.oracles:
            self._answer_oracles(ranking)
        if self.full:
            self._answer_full()

    def _answer_exact(self, ranking: dict[tuple[str, int], list[tuple[int, str]]]) -> None:
        """Control: the same prompts with every memory's KV encoded after exactly the tokens
        that precede it in the served prompt (separators folded into the memory before them).
        Injection then computes what the prompt run computes, so its disagreement with the
        prompt answers is the numeric noise floor (bf16, batch shapes), not the approximation."""
        w = self.ws[0]
        with facts_from(self.engine, self.store(w)):
            handles = self._handles(w)
            pending = []
            for conv in self.conversations:
                for q in conv.questions:
                    for k in self.ks:
                        key = self.table.key(conv, q, "exact", None, k)
                        if self.cache.get(key) is not None:
                            continue
                        turns = self.pick(ranking[(conv.sample_id, q.index)], conv.speakers, k)
                        msgs = self.messages((handles[conv.sample_id][i] for i in turns), q.question)
                        segs = self.engine.resolve([{"role": r, "content": c} for r, c in msgs], user_id=conv.user_id)
                        # resolve() puts token ids first and last, spans only between them.
                        head, parts, tail = list(segs[0]), segs[1:-1], list(segs[-1])  # type: ignore[arg-type]
                        groups: list[list[int]] = []
                        for seg in parts:
                            if isinstance(seg, Span):
                                groups.append(list(seg.token_ids))
                            else:
                                groups[-1].extend(int(t) for t in seg)
                        ids, ranges = list(head), []
                        for g in groups:
                            ranges.append((len(ids), len(g)))
                            ids.extend(g)
                        window = EncodeWindow(tuple(ids), tuple(ranges))
                        pending.append((conv, q, k, key, msgs, head, groups, tail, window))
        # A round at a time, encoded then answered: every memory's KV of every prompt lives on
        # the engine's device until its answer is in, so all of them at once do not fit (4,620
        # prompts of up to ~3,000 tokens, at k=30, ran an H200 out of memory).
        per_round = self.concurrency
        spent = {"exact_control_encode_s": 0.0, "exact_control_answer_s": 0.0}
        with tqdm(total=len(pending), desc="exact control", unit="q") as bar:
            for start in range(0, len(pending), per_round):
                t0 = time.perf_counter()
                jobs = []
                round_ = pending[start : start + per_round]
                kvs = self.engine.encode([p[-1] for p in round_])
                for (conv, q, k, key, msgs, head, groups, tail, _), kv_list in zip(round_, kvs):
                    tag = hashlib.sha256(key.encode()).hexdigest()[:16]
                    spans = [Span(f"locomo-exact:{tag}:{i}", tuple(g), kv) for i, (g, kv) in enumerate(zip(groups, kv_list))]
                    jobs.append(_Job(conv, q, "exact", None, k, msgs, key, segments=(head, *spans, tail)))
                t1 = time.perf_counter()
                self._generate(jobs, bar)
                spent["exact_control_encode_s"] += t1 - t0
                spent["exact_control_answer_s"] += time.perf_counter() - t1
        if pending:
            self._record(spent)

    def _answer_oracles(self, ranking: dict[tuple[str, int], list[tuple[int, str]]]) -> None:
        """Inject rows (conversation order, nothing recomputed) with each oracle's token set of
        the injected region taking the prompt's own KV (see :mod:`locomo_oracle`)."""
        for w in self.ws:
            with facts_from(self.engine, self.store(w)):
                handles = self._handles(w)
                pending = []
                for conv in self.conversations:
                    for q in conv.questions:
                        for k in self.ks:
                            keys = {o.name: self.table.key(conv, q, f"oracle {o.name}", w, k) for o in self.oracles}
                            if all(self.cache.get(key) is not None for key in keys.values()):
                                continue
                            ranked = ranking[(conv.sample_id, q.index)]
                            turns = self.pick(ranked, conv.speakers, k)
                            msgs = self.messages((handles[conv.sample_id][i] for i in turns), q.question)
                            segs = self.engine.resolve([{"role": r, "content": c} for r, c in msgs], user_id=conv.user_id)
                            head, parts, tail = list(segs[0]), [  # type: ignore[arg-type]
                                p if isinstance(p, Span) else [int(t) for t in p] for p in segs[1:-1]], list(segs[-1])  # type: ignore[arg-type]
                            if any(isinstance(p, Span) and p.kv is None for p in parts):
                                raise RuntimeError("an oracle needs every memory's KV resident: raise the tier sizes")
                            ids, ranges = list(head), []
                            for p in parts:
                                n = len(p.token_ids) if isinstance(p, Span) else len(p)
                                ranges.append((len(ids), n))
                                ids.extend(p.token_ids if isinstance(p, Span) else p)
                            rank = {t: j for j, t in enumerate(sorted(turns, key=[i for i, _ in ranked].index))}
                            memory_parts = [i for i, p in enumerate(parts) if isinstance(p, Span)]
                            pending.append((conv, q, k, keys, msgs, head, parts, tail, EncodeWindow(tuple(ids), tuple(ranges)),
                                            {i: rank[t] for i, t in zip(memory_parts, turns)}))
                # A round at a time, as the exact control: the prompt's KV of every part lives on
                # the device until the round's answers are in.
                with tqdm(total=len(pending) * len(self.oracles), desc=f"oracles w={w}", unit="answer") as bar:
                    for start in range(0, len(pending), self.concurrency):
                        round_ = pending[start : start + self.concurrency]
                        jobs = []
                        for item, exact in zip(round_, self.engine.encode([p[8] for p in round_])):
                            conv, q, k, keys, msgs, head, parts, tail, _, relevance = item
                            region = Region(head, parts, tail, exact,
                                            {i: header_tokens(self.engine, p.token_ids) for i, p in enumerate(parts)
                                             if isinstance(p, Span)}, relevance)
                            tag = "locomo-oracle:" + hashlib.sha256(keys[self.oracles[0].name].encode()).hexdigest()[:16]
                            jobs += [_Job(conv, q, "oracle", w, k, msgs, keys[o.name], segments=tuple(splice(region, o, tag)))
                                     for o in self.oracles if self.cache.get(keys[o.name]) is None]
                        bar.update(len(round_) * len(self.oracles) - len(jobs))  # answered by an earlier run
                        self._generate(jobs, bar)

    def _answer_full(self) -> None:
        jobs = []
        for conv in self.conversations:
            if not conv.questions:
                continue
            msgs = self.messages((t.memory for t in conv.turns), conv.questions[0].question)
            text, _ = self.engine.render([{"role": r, "content": c} for r, c in msgs])
            n = len(self.engine.tokenize(text))
            if n + self.max_tokens > self.engine.max_model_len:
                self.full_skipped[conv.sample_id] = (
                    f"{n} prompt tokens + {self.max_tokens} > the model's context of {self.engine.max_model_len}"
                )
                continue
            for q in conv.questions:
                jobs.append(_Job(conv, q, "full", None, None, self.messages((t.memory for t in conv.turns), q.question),
                                 self.table.key(conv, q, "full", None, None)))
        self._run_jobs(jobs, "full conversation", "answer_full_s")

    # -------------------------------------------------------------- rows

    def rows(self) -> list[dict[str, Any]]:
        return self.table.rows(self.ws, self.ks, self.oracles)

    def exact_summary(self) -> dict[str, Any] | None:
        """Per k: agreement of exact-context injection with the prompt answers, and its F1."""
        return self.table.exact_summary(self.ks) if self.exact_control else None

    def answers(self) -> list[dict[str, Any]]:
        """Every question's answers, for inspection (``--answers``)."""
        return self.table.answers()

    def describe(self) -> dict[str, Any]:
        cats = Counter(q.category for c in self.conversations for q in c.questions)
        return {
            "data": str(default_data_path()),
            "conversations": [c.sample_id for c in self.conversations],
            "turns": sum(len(c.turns) for c in self.conversations),
            "questions": sum(cats.values()),
            "questions_by_category": {str(c): n for c, n in sorted(cats.items())},
            "encoding": self.encoding,
            "context_prefix": self.context_prefix,
            "resolve_dates": self.resolve_dates,
            "retrieval": "top-k per speaker (2k memories), listed in conversation order",
            "baseline": "each inject row against the prompt with the identical memory order",
            "recompute": self.table.rs,
            "order": self.table.order,
            "max_tokens": self.max_tokens,
            "concurrency": self.concurrency,
            "stemmer": STEMMER,
            "embedder": self.embedder.name,
            "full_skipped": self.full_skipped,
            "exact_control": self.exact_summary(),
            "oracles": [o.name for o in self.oracles],
            "recompute_tokens": self.engine.config.recompute_tokens,
            "timings_s": dict(self.timings),
        }


def run_locomo(
    engine: InferScaleEngine,
    *,
    ks: Sequence[int],
    ws: Sequence[int],
    data: str | os.PathLike | None = None,
    conversations: int | None = None,
    questions_per_category: int | None = None,
    max_turns: int | None = None,
    categories: Sequence[int] | None = None,
    resolve_dates: bool = False,
    answers_path: str | os.PathLike | None = None,
    **options: Any,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows and a description of the run (goes into the JSON's ``env``). ``resolve_dates``: every
    turn's relative dates resolved against its session date, for every mode alike."""
    convs = load_locomo(data, conversations=conversations, questions_per_category=questions_per_category,
                        max_turns=max_turns, categories=categories, resolve_dates=resolve_dates)
    with LocomoBench(engine, convs, ks=ks, ws=ws, resolve_dates=resolve_dates, **options) as bench:
        bench.ingest()
        bench.answer()
        rows = bench.rows()
        info = bench.describe()
        if data:
            info["data"] = str(data)
        if answers_path:
            _write_answers(answers_path, bench.answers())
    return rows, info


def score_locomo(
    answers: str | os.PathLike,
    *,
    ks: Sequence[int],
    ws: Sequence[int],
    data: str | os.PathLike | None = None,
    conversations: int | None = None,
    questions_per_category: int | None = None,
    max_turns: int | None = None,
    categories: Sequence[int] | None = None,
    resolve_dates: bool = False,
    recompute: Sequence[int] = (0,),
    order: str = "relevance",
    recompute_tokens: str | None = None,
    oracles: Sequence[Oracle] = (),
    exact_control: bool = False,
    answers_path: str | os.PathLike | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows and a description, as :func:`run_locomo` gives them, scored from an answer cache
    (``answers-t*.jsonl`` or ``.xz``) with no engine: the same questions (same data and
    selection) and the same grid as the run that answered them."""
    if not Path(answers).is_file():
        raise FileNotFoundError(f"no answer cache at {answers}")
    convs = load_locomo(data, conversations=conversations, questions_per_category=questions_per_category,
                        max_turns=max_turns, categories=categories, resolve_dates=resolve_dates)
    cache = AnswerCache(None)
    cache.merge(answers)
    table = AnswerTable(cache, convs, recompute=recompute, order=order, recompute_tokens=recompute_tokens)
    rows = table.rows(sorted(set(ws)), sorted(set(ks)), oracles)
    cats = Counter(q.category for c in convs for q in c.questions)
    info = {"data": str(data or default_data_path()), "answers_scored": str(answers),
            "conversations": [c.sample_id for c in convs], "questions": sum(cats.values()),
            "questions_by_category": {str(c): n for c, n in sorted(cats.items())},
            "recompute": table.rs, "order": table.order, "recompute_tokens": recompute_tokens,
            "stemmer": STEMMER, "exact_control": table.exact_summary(sorted(set(ks))) if exact_control else None}
    if answers_path:
        _write_answers(answers_path, table.answers())
    return rows, info


def _write_answers(path: str | os.PathLike, answers: list[dict[str, Any]]) -> None:
    """``--answers``: one JSON line per question."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(json.dumps(a) for a in answers) + "\n")


def ratio_ci95(pairs: Sequence[tuple[float, float]], *, rounds: int = 2000, seed: int = 0) -> list[float] | None:
    """95% paired-bootstrap interval of ``mean(a) / mean(b)`` over ``(a, b)`` per question: F1
    of a few dozen short answers is noisy, and a ratio of two such means more so."""
    if len(pairs) < 2:
        return None
    a, b = np.array(pairs, dtype=np.float64).T
    idx = np.random.default_rng(seed).integers(0, len(pairs), (rounds, len(pairs)))
    den = b[idx].mean(1)
    ratios = a[idx].mean(1)[den > 0] / den[den > 0]
    if not len(ratios):
        return None
    return [float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))]


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (w, k, recompute): inject F1 over the same-order prompt F1 (with its 95% bootstrap
    interval), the worst category's ratio, the agreement, and the noise floor at that k (the
    widest interval of a prompt in another order over the prompt in conversation order)."""
    prompt = {(r["w"], r["k"], r["order"]): r for r in rows if r["mode"] == "prompt"}
    out = []
    for r in rows:
        base = prompt.get((r["w"], r["k"], r.get("order")))
        if r["mode"] == "inject" and r["f1"] is not None and base and base["f1"]:
            ci = r.get("inject_over_prompt_ci95") or ["", ""]
            cats = {c: v / base["f1_by_category"][c] for c, v in r["f1_by_category"].items()
                    if base["f1_by_category"].get(c)}
            worst = min(cats, key=cats.__getitem__) if cats else None
            floors = [p["noise_floor_ci95"] for (w, k, _), p in prompt.items()
                      if (w, k) == (r["w"], r["k"]) and p.get("noise_floor_ci95")]
            out.append({"w": r["w"], "k": r["k"], "recompute": r.get("recompute", 0), "order": r["order"],
                        "inject_over_prompt": r["f1"] / base["f1"],
                        "worst_category": f"{CATEGORIES[int(worst)]} {cats[worst]:.2f}" if worst else "",
                        "ci95_low": ci[0], "ci95_high": ci[1],
                        "noise_floor_low": min((f[0] for f in floors), default=""),
                        "noise_floor_high": max((f[1] for f in floors), default=""),
                        "exact_match": (r["agreement"] or {}).get("exact_match"),
                        "agreement_f1": (r["agreement"] or {}).get("f1")})
    return out


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows flattened for print_table."""
    out = []
    for r in rows:
        flat = {k: v for k, v in r.items() if k not in ("f1_by_category", "agreement")}
        for c, name in CATEGORIES.items():
            flat[name] = r["f1_by_category"].get(str(c), "")
        if r["agreement"]:
            flat["agree_exact"] = r["agreement"]["exact_match"]
            flat["agree_f1"] = r["agreement"]["f1"]
        out.append(flat)
    return out


def relevance_last(items: Sequence[int], ranked: Sequence[int], n: int) -> list[int]:
    """``items`` with the ``n`` best-ranked of them moved to the end, both groups in their order.

    Served with ``recompute=n``, the memories most likely to answer are the ones prefilled as
    text, after the injected rest; the rest keep the order they were listed in.
    """
    rank = {item: i for i, item in enumerate(ranked)}
    best = set(sorted(items, key=lambda i: rank.get(i, len(rank)))[:n])
    return [i for i in items if i not in best] + [i for i in items if i in best]
