"""The LoCoMo dataset, read one way for everything that uses it: the benchmark
(:mod:`inferscale_apps.bench.locomo`), ``inferscale memory import-locomo`` and the memory
micro-benchmarks, so that what the CLI stores is the very text the benchmark scores.

Every turn is one memory ``"[{session date}] {speaker}: {text}"``, plus ``" [shares
{blip_caption}]"`` when the turn shared a photo (:attr:`Turn.memory`); with ``resolve_dates``,
relative dates in the text ("yesterday") carry the date the session date gives them
(:func:`~inferscale_engine.memory.text.dates.resolve_relative_dates`).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from inferscale_engine.memory.text.dates import parse_session_date, resolve_relative_dates

CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}
ENV_DATA = "INFERSCALE_LOCOMO"


def default_data_path() -> Path:
    """``$INFERSCALE_LOCOMO``, else ``shared/data/locomo/locomo10.json`` next to the repository."""
    env = os.environ.get(ENV_DATA)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "shared" / "data" / "locomo" / "locomo10.json"


@dataclass(frozen=True)
class Turn:
    index: int  # position in the conversation (0-based)
    dia_id: str  # "D<session>:<turn>"
    speaker: str
    date: str
    text: str  # the raw turn text (relative dates resolved if asked), photo caption appended
    session: int = 0  # the session's number (1-based)

    @property
    def memory(self) -> str:
        """What is stored: ``"[date] speaker: text"``."""
        return f"[{self.date}] {self.speaker}: {self.text}"


@dataclass(frozen=True)
class Question:
    index: int  # position in the conversation's ``qa`` list (stable across subsets)
    question: str
    answer: str
    category: int
    evidence: tuple[str, ...]


@dataclass
class Conversation:
    sample_id: str
    speakers: tuple[str, str]
    turns: list[Turn]
    questions: list[Question] = field(default_factory=list)

    @property
    def user_id(self) -> str:
        return f"locomo-{self.sample_id}"


def speaker_user(prefix: str, sample_id: str, speaker: str) -> str:
    """The store user of one speaker of one conversation (the CLI import's layout)."""
    name = f"{prefix}-{sample_id}-{speaker}" if prefix else f"{sample_id}-{speaker}"
    return name.replace(" ", "_")


def load_locomo(
    path: str | os.PathLike | None = None,
    *,
    conversations: int | None = None,
    questions_per_category: int | None = None,
    max_turns: int | None = None,
    categories: Collection[int] | None = None,
    resolve_dates: bool = False,
) -> list[Conversation]:
    """LoCoMo conversations with their category 1-4 questions (first ``questions_per_category``
    of each category, in dataset order; only ``categories`` when given). ``max_turns`` keeps the
    first turns only, and only the questions whose evidence lies in them (small CI runs).
    ``resolve_dates`` writes the absolute date after each relative one in a turn's text,
    resolved against its session's date."""
    if categories is not None and not set(categories) <= set(CATEGORIES):
        raise ValueError(f"categories must be among {sorted(CATEGORIES)}, got {sorted(categories)}")
    path = Path(path) if path else default_data_path()
    if not path.exists():
        raise FileNotFoundError(f"LoCoMo data not found at {path} (pass --data or set ${ENV_DATA})")
    data = json.loads(path.read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of LoCoMo samples")  # noqa: TRY004  (bad file, not a bad call)
    out: list[Conversation] = []
    for sample in data[:conversations] if conversations else data:
        conv = sample.get("conversation") if isinstance(sample, dict) else None
        if not isinstance(conv, dict) or "speaker_a" not in conv or "speaker_b" not in conv:
            raise ValueError(f"{path}: sample {len(out)} has no 'conversation' with speakers")
        turns = _turns(conv, resolve_dates)
        if max_turns is not None:
            turns = turns[:max_turns]
        questions = _questions(sample.get("qa") or [], {t.dia_id for t in turns} if max_turns is not None else None,
                               questions_per_category, set(categories) if categories is not None else set(CATEGORIES))
        out.append(Conversation(str(sample.get("sample_id", len(out))), (conv["speaker_a"], conv["speaker_b"]),
                                turns, questions))
    return out


def _turns(conv: dict, resolve_dates: bool) -> list[Turn]:
    turns: list[Turn] = []
    n = 1
    while f"session_{n}" in conv:
        date = str(conv.get(f"session_{n}_date_time", "")).strip()
        when = parse_session_date(date) if resolve_dates else None
        for t in conv[f"session_{n}"]:
            text = str(t["text"]).strip()
            if when is not None:
                text = resolve_relative_dates(text, when)
            caption = t.get("blip_caption")
            if caption:
                text = f"{text} [shares {str(caption).strip()}]"
            if text:
                turns.append(Turn(len(turns), t["dia_id"], str(t["speaker"]).strip(), date, text, n))
        n += 1
    return turns


def _questions(qas: list[dict], kept_ids: set[str] | None, per_category: int | None,
               categories: set[int]) -> list[Question]:
    """Questions of ``categories``; with ``kept_ids``, only those whose evidence lies in those turns."""
    counts: Counter[int] = Counter()
    questions = []
    for i, qa in enumerate(qas):
        cat = int(qa.get("category", 0))
        if cat not in categories or "answer" not in qa:
            continue
        evidence = tuple(str(e) for e in qa.get("evidence") or ())
        if kept_ids is not None and (not evidence or not all(e in kept_ids for e in evidence)):
            continue
        if per_category is not None and counts[cat] >= per_category:
            continue
        counts[cat] += 1
        questions.append(Question(i, str(qa["question"]), str(qa["answer"]), cat, evidence))
    return questions
