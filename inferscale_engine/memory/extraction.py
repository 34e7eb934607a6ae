"""Mem0-style memory extraction (``add(..., infer=True)``), by the store's ``generate`` model.

Two model calls, as in Mem0: (1) extract short facts from the conversation, (2) decide for
each against the most similar existing memories whether to ADD it, UPDATE or DELETE an
existing one, or do NONE. Both answers are JSON, parsed leniently (code fences, text around
the object); anything unusable means "no action", logged – never a guess.
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


@dataclass(frozen=True)
class Action:
    event: str  # ADD | UPDATE | DELETE
    text: str | None = None
    fact_id: str | None = None


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


def parse_facts(text: str) -> list[str] | None:
    """Facts from the extraction reply; ``None`` when the reply is not the JSON asked for."""
    obj = parse_json_object(text)
    if obj is None or not isinstance(obj.get("facts"), list):
        return None
    facts: list[str] = []
    for f in obj["facts"]:
        if isinstance(f, str) and f.strip() and len(f) <= MAX_FACT_CHARS and f.strip() not in facts:
            facts.append(f.strip())
    return facts[:MAX_FACTS]


def parse_actions(text: str, ids: dict[str, str]) -> list[Action] | None:
    """Actions from the update reply; ``ids`` maps the short ids shown to the model to fact ids."""
    obj = parse_json_object(text)
    if obj is None or not isinstance(obj.get("memory"), list):
        return None
    actions: list[Action] = []
    for entry in obj["memory"]:
        if not isinstance(entry, dict):
            continue
        event = str(entry.get("event", "")).strip().upper()
        raw = entry.get("text")
        new_text = raw.strip() if isinstance(raw, str) and raw.strip() and len(raw) <= MAX_FACT_CHARS else None
        fact_id = ids.get(str(entry.get("id", "")).strip())
        if event == "ADD" and new_text:
            actions.append(Action("ADD", text=new_text))
        elif event == "UPDATE" and new_text and fact_id:
            actions.append(Action("UPDATE", text=new_text, fact_id=fact_id))
        elif event == "DELETE" and fact_id:
            actions.append(Action("DELETE", fact_id=fact_id))
        # NONE and anything malformed: nothing to do
    return actions


def extract_actions(
    generate: Generate,
    conversation: Sequence[str],
    similar: Callable[[str], list[tuple[str, str]]],
) -> list[Action]:
    """Run both model calls; ``similar(fact)`` gives ``(fact_id, text)`` of related memories."""
    reply = generate([
        {"role": "system", "content": FACT_EXTRACTION_PROMPT},
        {"role": "user", "content": "Conversation:\n" + "\n".join(conversation)},
    ])
    facts = parse_facts(reply)
    if facts is None:
        logger.warning("memory extraction: model reply is not the JSON asked for; storing nothing (%.200r)", reply)
        return []
    if not facts:
        return []
    existing: dict[str, str] = {}
    for fact in facts:
        for fact_id, text in similar(fact):
            existing.setdefault(fact_id, text)
    if not existing:  # nothing to reconcile with: every fact is new
        return [Action("ADD", text=f) for f in facts]
    short = {str(i): fid for i, fid in enumerate(existing)}  # small ids: models copy them reliably
    listing = "\n".join(f'- id "{i}": {existing[fid]}' for i, fid in short.items())
    reply = generate([
        {"role": "user", "content": UPDATE_PROMPT.format(existing=listing, facts="\n".join(f"- {f}" for f in facts))},
    ])
    actions = parse_actions(reply, short)
    if actions is None:
        logger.warning("memory update decision: model reply is not the JSON asked for; storing nothing (%.200r)", reply)
        return []
    return actions


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
    for action in extract_actions(lambda messages: generate(messages, user_id), conversation, similar):
        try:
            if action.event == "ADD":
                out.extend(store.add(action.text, user_id=user_id, metadata=metadata))  # type: ignore[arg-type]
            elif action.event == "UPDATE":
                out.append(store.update(action.fact_id, action.text, user_id=user_id))  # type: ignore[arg-type]
            elif action.event == "DELETE":
                store.delete(action.fact_id, user_id=user_id)  # type: ignore[arg-type]
        except (FactNotFoundError, ValueError, TypeError) as exc:
            logger.warning("memory extraction: skipping %s: %s", action, exc)
    return out
