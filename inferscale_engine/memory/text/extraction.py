"""Mem0-style memory extraction (``add(..., infer=True)``), by the store's ``generate`` model.

Two model calls, as in Mem0: (1) extract short facts from the conversation, (2) decide for
each against the most similar existing memories whether to ADD it, UPDATE or DELETE an
existing one, or do NONE. Both answers are JSON, parsed leniently (code fences, text around
the object), then checked: a text that is no memory (empty, ``...``, the prompt's own example)
or an id the model was not shown is dropped, logged – never a guess. A reply with nothing
usable left is reported as failed, so a caller never takes it for "nothing to remember".
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from inferscale_engine.errors import FactNotFoundError

if TYPE_CHECKING:
    from inferscale_engine.memory.encoding import ChatGenerate
    from inferscale_engine.memory.item import MemoryItem

logger = logging.getLogger(__name__)

Generate = Callable[[list[dict[str, str]]], str]

MAX_FACT_CHARS = 1000
MAX_FACTS = 32

FACT_EXTRACTION_PROMPT = """You extract facts worth remembering about the user from a conversation.
Facts are short sentences: preferences, personal details, plans, people, events, dates.
Reply with JSON only, in exactly this form: {"facts": ["first fact", "second fact"]}
Reply {"facts": []} when nothing is worth remembering.

Example conversation:
User: Hi, I'm John. I work as a nurse and I'm vegetarian.
Assistant: Nice to meet you, John!
Example reply: {"facts": ["Name is John", "Works as a nurse", "Is vegetarian"]}"""

UPDATE_PROMPT = """You manage a memory store. Compare the new facts with the existing memories.
For every new fact choose one event:
- ADD: information that is not in memory yet (id "new").
- UPDATE: changes or adds detail to an existing memory (its id, and the full updated text).
- DELETE: contradicts an existing memory, which must be removed (its id).
- NONE: already in memory.

Existing memories:
{existing}

New facts:
{facts}

Reply with JSON only, in exactly this form:
{{"memory": [{{"id": "new", "text": "...", "event": "ADD"}}, {{"id": "0", "text": "...", "event": "UPDATE"}}]}}"""


#: The prompts' format samples ("..." too, which fails the letter-or-digit test): a model that
#: copies one has not answered.
_PLACEHOLDERS = frozenset({"first fact", "second fact"})
#: The example conversation's facts, each with the word a conversation that really says it
#: contains: "Is vegetarian" can be a true fact, "Name is John" from a talk without John is not.
_SAMPLE_FACTS = {"name is john": "john", "works as a nurse": "nurse", "is vegetarian": "vegetarian"}


@dataclass(frozen=True)
class Action:
    event: str  # ADD | UPDATE | DELETE
    text: str | None = None
    fact_id: str | None = None


@dataclass(frozen=True)
class Extraction:
    """The outcome of :func:`extract_actions`.

    ``failed_reply`` is the model's reply that could not be used (not the JSON asked for, or
    nothing valid in it); then ``actions`` is empty and nothing should be stored. When it is
    None, an empty ``actions`` means the model validly found nothing to do.
    """

    actions: list[Action]
    failed_reply: str | None = None


def memory_text(text: Any, evidence: str) -> str | None:
    """``text`` stripped when it can be stored as a memory, else None: not a string, empty, too
    long, without a letter or digit (``...``, ``…``), a prompt's placeholder, or one of the
    prompt's example facts that ``evidence`` (what the model was shown) does not support."""
    if not isinstance(text, str) or len(text) > MAX_FACT_CHARS:
        return None
    text = text.strip()
    key = text.casefold().rstrip(".")
    if not any(c.isalnum() for c in text) or key in _PLACEHOLDERS:
        return None
    word = _SAMPLE_FACTS.get(key)
    if word is not None and word not in evidence.casefold():
        return None
    return text


def parse_json_object(text: str) -> dict[str, Any] | None:
    """The first JSON object in ``text`` (code fences and surrounding prose tolerated)."""
    if not isinstance(text, str):
        return None
    cleaned = re.sub(r"```(?:json)?", "", text)
    decoder = json.JSONDecoder()
    for m in re.finditer(r"\{", cleaned):
        try:
            obj, _ = decoder.raw_decode(cleaned, m.start())
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    return None


def parse_facts(text: str, conversation: str) -> list[str] | None:
    """Facts from the extraction reply about ``conversation``; ``None`` when the reply is not the
    JSON asked for, or lists facts of which none is valid (:func:`memory_text`)."""
    obj = parse_json_object(text)
    if obj is None or not isinstance(obj.get("facts"), list):
        return None
    facts: list[str] = []
    dropped: list[Any] = []
    for f in obj["facts"]:
        fact = memory_text(f, conversation)
        if fact is None:
            dropped.append(f)
        elif fact not in facts:
            facts.append(fact)
    if dropped:
        logger.warning("memory extraction: dropped %d invalid fact(s): %.300r", len(dropped), dropped)
    if obj["facts"] and not facts:
        return None
    return facts[:MAX_FACTS]


def parse_actions(text: str, ids: dict[str, str], evidence: str) -> list[Action] | None:
    """Actions from the update reply; ``ids`` maps the short ids shown to the model to fact ids,
    ``evidence`` is the text it was shown (new facts and existing memories).

    An entry is dropped (logged) when its text is no memory (:func:`memory_text`), its id was not
    shown, or an earlier entry already changes that memory. ``None`` when the reply is not the
    JSON asked for, or none of its entries is valid (NONE is valid: the model said "no change").
    """
    obj = parse_json_object(text)
    if obj is None or not isinstance(obj.get("memory"), list):
        return None
    actions: list[Action] = []
    touched: set[str] = set()
    dropped: list[Any] = []
    said_none = False
    for entry in obj["memory"]:
        if not isinstance(entry, dict):
            dropped.append(entry)
            continue
        event = str(entry.get("event", "")).strip().upper()
        new_text = memory_text(entry.get("text"), evidence)
        fact_id = ids.get(str(entry.get("id", "")).strip())
        if event == "NONE":
            said_none = True
        elif event == "ADD" and new_text:
            actions.append(Action("ADD", text=new_text))
        elif event == "UPDATE" and new_text and fact_id and fact_id not in touched:
            touched.add(fact_id)
            actions.append(Action("UPDATE", text=new_text, fact_id=fact_id))
        elif event == "DELETE" and fact_id and fact_id not in touched:
            touched.add(fact_id)
            actions.append(Action("DELETE", fact_id=fact_id))
        else:
            dropped.append(entry)
    if dropped:
        logger.warning("memory update decision: dropped %d invalid action(s): %.300r", len(dropped), dropped)
    if obj["memory"] and not actions and not said_none:
        return None
    return actions


def extract_actions(
    generate: Generate,
    conversation: Sequence[str],
    similar: Callable[[str], list[tuple[str, str]]],
) -> Extraction:
    """Run both model calls; ``similar(fact)`` gives ``(fact_id, text)`` of related memories."""
    talk = "\n".join(conversation)
    reply = generate([
        {"role": "system", "content": FACT_EXTRACTION_PROMPT},
        {"role": "user", "content": "Conversation:\n" + talk},
    ])
    facts = parse_facts(reply, talk)
    if facts is None:
        logger.warning("memory extraction: model reply is not the JSON asked for or holds no valid fact; "
                       "storing nothing (%.200r)", reply)
        return Extraction([], failed_reply=reply)
    if not facts:
        return Extraction([])
    existing: dict[str, str] = {}
    for fact in facts:
        for fact_id, text in similar(fact):
            existing.setdefault(fact_id, text)
    if not existing:  # nothing to reconcile with: every fact is new
        return Extraction([Action("ADD", text=f) for f in facts])
    short = {str(i): fid for i, fid in enumerate(existing)}  # small ids: models copy them reliably
    listing = "\n".join(f'- id "{i}": {existing[fid]}' for i, fid in short.items())
    reply = generate([
        {"role": "user", "content": UPDATE_PROMPT.format(existing=listing, facts="\n".join(f"- {f}" for f in facts))},
    ])
    actions = parse_actions(reply, short, "\n".join([*facts, *existing.values()]))
    if actions is None:
        logger.warning("memory update decision: model reply is not the JSON asked for or holds no valid action; "
                       "storing nothing (%.200r)", reply)
        return Extraction([], failed_reply=reply)
    return Extraction(actions)


class _Store(Protocol):
    """The store API extraction acts through (a protocol: the store calls extraction)."""

    def search(self, query: str, *, user_id: str, k: int = ...) -> list[MemoryItem]: ...

    def add(self, messages: Any, *, user_id: str, metadata: dict[str, Any] | None = ...) -> list[MemoryItem]: ...

    def update(self, fact_id: str, text: str, *, user_id: str | None = ...) -> MemoryItem: ...

    def delete(self, fact_id: str, *, user_id: str | None = ...) -> None: ...


def infer_facts(store: _Store, generate: ChatGenerate, conversation: Sequence[str], *, user_id: str,
                metadata: dict[str, Any]) -> list[MemoryItem]:
    """``store.add(..., infer=True)``: extract, then apply each action through the store's own
    API; an action the store refuses (its fact was deleted meanwhile, bad text) is skipped."""

    def similar(fact: str) -> list[tuple[str, str]]:
        return [(it.id, it.memory) for it in store.search(fact, user_id=user_id, k=5)]

    out: list[MemoryItem] = []
    for action in extract_actions(lambda messages: generate(messages, user_id), conversation, similar).actions:
        try:
            # parse_actions gives an ADD its text, an UPDATE both, a DELETE its fact id.
            if action.event == "ADD":
                out.extend(store.add(action.text, user_id=user_id, metadata=metadata))
            elif action.event == "UPDATE" and action.fact_id is not None and action.text is not None:
                out.append(store.update(action.fact_id, action.text, user_id=user_id))
            elif action.event == "DELETE" and action.fact_id is not None:
                store.delete(action.fact_id, user_id=user_id)
        except (FactNotFoundError, ValueError, TypeError) as exc:
            logger.warning("memory extraction: skipping %s: %s", action, exc)
    return out
