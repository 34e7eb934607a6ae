"""Mem0-style extraction: lenient JSON parsing and the two-call flow (no engine needed)."""

from __future__ import annotations

from probes import logged

from inferscale_engine.memory.extraction import (
    Action,
    extract_actions,
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
    assert parse_facts('{"facts": ["Name is John", " Is a nurse ", "", 3, "Name is John"]}') == [
        "Name is John", "Is a nurse",
    ]
    assert parse_facts('{"facts": []}') == []
    assert parse_facts('{"fact": ["x"]}') is None
    assert parse_facts("garbage ###") is None
    assert parse_facts('{"facts": "not a list"}') is None


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
    assert parse_actions(reply, ids) == [
        Action("ADD", text="Likes tea"),
        Action("UPDATE", text="Lives in Rome", fact_id="aaaaaaaaaaaaaaaa"),
        Action("DELETE", fact_id="bbbbbbbbbbbbbbbb"),
    ]
    assert parse_actions("nonsense", ids) is None


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

    actions = extract_actions(generate, ["User: I moved to Rome. I like tea."], similar)
    assert actions == [
        Action("UPDATE", text="Lives in Rome", fact_id="cccccccccccccccc"),
        Action("ADD", text="Likes tea"),
    ]
    assert len(calls) == 2
    assert "User: I moved to Rome" in calls[0][-1]["content"]
    assert 'id "0": Lives in Paris' in calls[1][-1]["content"]


def test_extract_actions_without_existing_memories_adds_everything():
    replies = iter(['{"facts": ["A", "B"]}'])
    actions = extract_actions(lambda m: next(replies), ["User: hi"], lambda f: [])
    assert actions == [Action("ADD", text="A"), Action("ADD", text="B")]


def test_extract_actions_on_garbage_stores_nothing():
    with logged("inferscale_engine.memory.extraction") as messages:
        assert extract_actions(lambda m: "lorem ipsum {", ["User: hi"], lambda f: []) == []
    assert any("storing nothing" in m for m in messages)
    replies = iter(['{"facts": ["A"]}', "not json"])
    assert extract_actions(lambda m: next(replies), ["User: hi"], lambda f: [("dddddddddddddddd", "A?")]) == []
