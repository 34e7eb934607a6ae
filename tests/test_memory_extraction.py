"""Mem0-style extraction: lenient JSON parsing and the two-call flow (no engine needed)."""

from __future__ import annotations

import pytest
from probes import logged

from inferscale_engine.memory.text.extraction import (
    Action,
    Extraction,
    extract_actions,
    memory_text,
    parse_actions,
    parse_facts,
    parse_json_object,
)


def test_parse_json_object_tolerates_fences_and_prose():
    assert parse_json_object('```json\n{"facts": ["a"]}\n```') == {"facts": ["a"]}
    assert parse_json_object('Sure! Here you go: {"facts": []} Hope this helps {oops') == {"facts": []}
    assert parse_json_object('{broken {"facts": ["x"]}') == {"facts": ["x"]}
    assert parse_json_object("no json here") is None
    assert parse_json_object("[1, 2]") is None
    assert parse_json_object("") is None
    assert parse_json_object(None) is None  # type: ignore[arg-type]


def test_parse_facts():
    talk = "User: I'm John and I'm a nurse."
    assert parse_facts('{"facts": ["Name is John", " Is a nurse ", "", 3, "Name is John"]}', talk) == [
        "Name is John", "Is a nurse",
    ]
    assert parse_facts('{"facts": []}', talk) == []
    assert parse_facts('{"fact": ["x"]}', talk) is None
    assert parse_facts("garbage ###", talk) is None
    assert parse_facts('{"facts": "not a list"}', talk) is None


@pytest.mark.parametrize("text", [
    "...", "\u2026", "", "   ", "-- !", "?", None, 3, ["a"], "x" * 1001,
    "first fact", "Second fact.", "Name is John", "works as a nurse",  # the prompts' samples, unsupported
])
def test_memory_text_refuses_what_is_no_memory(text):
    assert memory_text(text, "User: I moved to Rome.") is None


def test_memory_text_keeps_real_facts_also_when_they_read_like_the_example():
    assert memory_text("  Lives in Rome ", "") == "Lives in Rome"
    assert memory_text("3", "") == "3"
    assert memory_text("Likes 🍕", "") == "Likes 🍕"
    assert memory_text("Is vegetarian", "User: I'm vegetarian, no meat please.") == "Is vegetarian"
    assert memory_text("Is vegetarian", "User: I eat anything.") is None


def test_facts_copied_from_the_prompt_make_the_reply_unusable():
    talk = "User: I moved to Rome."
    with logged("inferscale_engine.memory.text.extraction") as messages:
        assert parse_facts('{"facts": ["first fact", "second fact"]}', talk) is None
        assert parse_facts('{"facts": ["...", "Name is John", "Works as a nurse", "Is vegetarian"]}', talk) is None
        assert parse_facts('{"facts": ["...", "Lives in Rome"]}', talk) == ["Lives in Rome"]
    assert any("dropped" in m for m in messages)


def test_parse_actions_maps_short_ids_and_drops_bad_entries():
    ids = {"0": "aaaaaaaaaaaaaaaa", "1": "bbbbbbbbbbbbbbbb"}
    reply = """{"memory": [
        {"id": "new", "text": "Likes tea", "event": "ADD"},
        {"id": "0", "text": "Lives in Rome", "event": "update"},
        {"id": "1", "event": "DELETE"},
        {"id": "7", "text": "unknown id", "event": "UPDATE"},
        {"id": "1", "event": "NONE"},
        {"event": "ADD"},
        "junk"
    ]}"""
    assert parse_actions(reply, ids, "") == [
        Action("ADD", text="Likes tea"),
        Action("UPDATE", text="Lives in Rome", fact_id="aaaaaaaaaaaaaaaa"),
        Action("DELETE", fact_id="bbbbbbbbbbbbbbbb"),
    ]
    assert parse_actions("nonsense", ids, "") is None


IDS = {"0": "aaaaaaaaaaaaaaaa"}


@pytest.mark.parametrize("entry", [
    '{"id": "0", "text": "...", "event": "UPDATE"}',  # the prompt's own example text
    '{"id": "0", "text": "\u2026", "event": "UPDATE"}',
    '{"id": "0", "text": "", "event": "UPDATE"}',
    '{"id": "0", "text": "\\t ", "event": "UPDATE"}',
    '{"id": "0", "event": "UPDATE"}',
    '{"id": "0", "text": "*** ---", "event": "UPDATE"}',
    '{"id": "0", "text": "first fact", "event": "UPDATE"}',
    '{"id": "1", "text": "Lives in Rome", "event": "UPDATE"}',  # an id it was not shown
    '{"id": "aaaaaaaaaaaaaaaa", "text": "Lives in Rome", "event": "UPDATE"}',  # the real id, never shown
    '{"text": "Lives in Rome", "event": "UPDATE"}',
    '{"id": "new", "event": "DELETE"}',
    '{"id": "2", "event": "DELETE"}',
    '{"id": "new", "text": "...", "event": "ADD"}',
    '{"id": "0", "text": "Lives in Rome", "event": "MERGE"}',
    '"junk"',
])
def test_parse_actions_refuses_placeholders_and_unshown_ids(entry):
    with logged("inferscale_engine.memory.text.extraction") as messages:
        assert parse_actions('{"memory": [' + entry + ']}', IDS, "- Lives in Rome") is None  # nothing valid left
        # beside a valid action, the bad one is dropped and the valid one kept
        reply = '{"memory": [' + entry + ', {"id": "new", "text": "Likes tea", "event": "ADD"}]}'
        assert parse_actions(reply, IDS, "- Lives in Rome") == [Action("ADD", text="Likes tea")]
    assert any("dropped 1 invalid action" in m for m in messages)


def test_parse_actions_none_is_a_valid_answer_and_one_change_per_memory():
    assert parse_actions('{"memory": [{"id": "0", "event": "NONE"}]}', IDS, "") == []
    assert parse_actions('{"memory": []}', IDS, "") == []
    assert parse_actions('{"memory": [{"id": "0", "text": "...", "event": "UPDATE"}, {"id": "0", "event": "NONE"}]}',
                         IDS, "") == []
    reply = '{"memory": [{"id": "0", "event": "DELETE"}, {"id": "0", "text": "Lives in Rome", "event": "UPDATE"}]}'
    assert parse_actions(reply, IDS, "") == [Action("DELETE", fact_id="aaaaaaaaaaaaaaaa")]


def test_extract_actions_flow():
    calls = []
    replies = iter([
        '{"facts": ["Lives in Rome", "Likes tea"]}',
        '{"memory": [{"id": "0", "text": "Lives in Rome", "event": "UPDATE"}, '
        '{"id": "new", "text": "Likes tea", "event": "ADD"}]}',
    ])

    def generate(messages):
        calls.append(messages)
        return next(replies)

    def similar(fact):
        return [("cccccccccccccccc", "Lives in Paris")] if "Rome" in fact else []

    result = extract_actions(generate, ["User: I moved to Rome. I like tea."], similar)
    assert result == Extraction([
        Action("UPDATE", text="Lives in Rome", fact_id="cccccccccccccccc"),
        Action("ADD", text="Likes tea"),
    ])
    assert len(calls) == 2
    assert "User: I moved to Rome" in calls[0][-1]["content"]
    assert 'id "0": Lives in Paris' in calls[1][-1]["content"]


def test_extract_actions_without_existing_memories_adds_everything():
    replies = iter(['{"facts": ["A", "B"]}'])
    result = extract_actions(lambda m: next(replies), ["User: hi"], lambda f: [])
    assert result == Extraction([Action("ADD", text="A"), Action("ADD", text="B")])


def test_extract_actions_on_garbage_stores_nothing():
    with logged("inferscale_engine.memory.text.extraction") as messages:
        assert extract_actions(lambda m: "lorem ipsum {", ["User: hi"], lambda f: []) == Extraction([], "lorem ipsum {")
    assert any("storing nothing" in m for m in messages)
    replies = iter(['{"facts": ["A"]}', "not json"])
    result = extract_actions(lambda m: next(replies), ["User: hi"], lambda f: [("dddddddddddddddd", "A?")])
    assert result == Extraction([], "not json")


def test_extract_actions_reports_a_reply_with_nothing_valid_as_failed():
    """A model that copied the update prompt's ``"text": "..."`` used to overwrite the memory."""
    replies = iter(['{"facts": ["Lives in Rome"]}', '{"memory": [{"id": "0", "text": "...", "event": "UPDATE"}]}'])
    result = extract_actions(lambda m: next(replies), ["User: I moved to Rome."], lambda f: [("cccccccccccccccc", "Lives in Paris")])
    assert result.actions == [] and result.failed_reply is not None
    replies = iter(['{"facts": ["first fact", "second fact"]}'])
    result = extract_actions(lambda m: next(replies), ["User: hi"], lambda f: [])
    assert result.actions == [] and result.failed_reply is not None
    replies = iter(['{"facts": []}'])
    assert extract_actions(lambda m: next(replies), ["User: hi"], lambda f: []) == Extraction([])  # nothing to remember
