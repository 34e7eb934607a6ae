"""Tool calls read from generated text, on a stream and whole; forced-call schemas; LangChain's
messages for templates with and without native tools. No engine: pure text handling."""

from __future__ import annotations

import json

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

from inferscale_engine import tool_calls as tc
from inferscale_integrations.langchain import ChatInferScale
from inferscale_integrations.testing import langchain_openai_message

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"]}}}
NOW = {"type": "function", "function": {"name": "now", "description": "The time.", "parameters": {}}}


@pytest.mark.parametrize("text, visible", [
    ('Sure.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>', "Sure."),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}', ""),  # stopped before the closing tag
    ('{"name": "add", "arguments": {"a": 2, "b": 3}}', ""),  # bare JSON (a forced call)
    ('```json\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n```', ""),  # Qwen-Coder's habit
    ('{"name": "add", "arguments": "{\\"a\\": 2, \\"b\\": 3}"}', ""),  # arguments as a JSON string
])
def test_calls_are_read_in_every_form_small_models_write(text: str, visible: str) -> None:
    shown, calls = tc.parse_tool_calls(text, ["add"])
    assert shown == visible
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 2, "b": 3})]
    assert calls[0].id.startswith("call_")


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',  # not a bound tool
    '{"name": "add", "arguments": {"a": 2}}\n{"name": "sub", "arguments": {"a": 5}}',  # one of them is no bound tool
    '```python\nprint(1)\n```',
    "The answer is 5.",
])
def test_anything_else_stays_text(text: str) -> None:
    shown, calls = tc.parse_tool_calls(text, ["add"])
    assert calls == [] and shown == text.strip()


def test_json_lines_are_parallel_calls_and_repeats_count_once() -> None:
    text = '{"name": "add", "arguments": {"a": 1, "b": 2}}\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n' \
           '{"name": "add", "arguments": {"a": 3, "b": 4}}\n{"name": "add", "argu'  # cut off by max_tokens
    shown, calls = tc.parse_tool_calls(text, ["add"])
    assert shown == "" and [c.arguments for c in calls] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]


def test_stream_shows_text_until_a_call_may_start() -> None:
    pieces = ["Let me ", "add.", " <tool", '_call>\n{"name": "add", ', '"arguments": {"a": 1, "b": 2}}\n</tool_call>']
    stream = tc.ToolCallStream(["add"])
    shown = [stream.feed(p) for p in pieces]
    assert shown == ["Let me", " add.", "", "", ""]
    rest, calls = stream.finish()
    assert rest == "" and [c.arguments for c in calls] == [{"a": 1, "b": 2}]

    plain = tc.ToolCallStream(["add"])
    out = "".join(plain.feed(p) for p in ["  The answer", " is 3.\n"])
    rest, calls = plain.finish()
    assert out + rest == "The answer is 3." and calls == []

    bare = tc.ToolCallStream(["add"])
    assert bare.feed('{"name": "add",') == "" and bare.feed(' "arguments": {"a": 1, "b": 1}}') == ""
    assert bare.finish()[1][0].name == "add"


def test_forced_choice_schema() -> None:
    assert tc.chosen_tools([ADD, NOW], "auto") is None and tc.chosen_tools([ADD, NOW], None) is None
    assert tc.chosen_tools([ADD, NOW], "any") == ["add", "now"]
    assert tc.chosen_tools([ADD, NOW], {"type": "function", "function": {"name": "now"}}) == ["now"]
    with pytest.raises(ValueError, match="names no bound tool"):
        tc.chosen_tools([ADD], "multiply")
    one = tc.forced_call_schema([ADD, NOW], ["add"])
    assert one["properties"]["name"] == {"type": "string", "enum": ["add"]}
    assert one["properties"]["arguments"]["required"] == ["a", "b"]
    both = tc.forced_call_schema([ADD, NOW], ["add", "now"])
    assert [o["properties"]["name"]["enum"] for o in both["anyOf"]] == [["add"], ["now"]]
    assert both["anyOf"][1]["properties"]["arguments"]["type"] == "object"


def test_one_generation_with_tools() -> None:
    """What ``use_tools`` gives the engine and how it reads the answer (the LangChain model and
    the server both generate through it)."""
    ask = [{"role": "user", "content": "2+3?"}]
    forced = tc.use_tools(ask, [ADD, NOW], "required", native=True)
    assert forced.tools == [ADD, NOW] and forced.messages == ask
    assert forced.structured == {"json": tc.forced_call_schema([ADD, NOW], ["add", "now"])}
    with pytest.raises(ValueError, match="cannot both"):
        tc.use_tools(ask, [ADD], "add", structured={"json_object": True}, native=True)
    off = tc.use_tools(ask, [ADD], "none", native=False)  # no tools shown, nothing read as a call
    assert off.messages == ask and off.read('{"name": "add", "arguments": {}}') == ('{"name": "add", "arguments": {}}', [])
    two = '{"name": "add", "arguments": {"a": 1, "b": 2}}\n{"name": "add", "arguments": {"a": 3, "b": 4}}'
    assert [c.arguments for c in tc.use_tools(ask, [ADD], native=False).read(two)[1]] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    assert [c.arguments for c in tc.use_tools(ask, [ADD], parallel=False, native=False).read(two)[1]] == [{"a": 1, "b": 2}]


def test_bind_tools_rejects_a_choice_of_no_bound_tool() -> None:
    llm = ChatInferScale(model="qwen2.5-coder-0.5b", user_id="t")  # construction only: no engine is built
    with pytest.raises(ValueError, match="names no bound tool"):
        llm.bind_tools([ADD], tool_choice="multiply")


def test_messages_for_templates_with_and_without_tools() -> None:
    history = [
        SystemMessage("Be brief."),
        HumanMessage("2+3?"),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 2, "b": 3}, "id": "c1", "type": "tool_call"}]),
        ToolMessage("5", tool_call_id="c1"),
    ]
    native = tc.template_messages([langchain_openai_message(m) for m in history], [ADD], native=True)
    assert native[0] == {"role": "system", "content": "Be brief."}  # the template adds the tools
    assert native[2]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert native[3] == {"role": "tool", "content": "5", "tool_call_id": "c1"}  # templates that pair them need it
    text = tc.template_messages([langchain_openai_message(m) for m in history], [ADD], native=False)
    assert text[0]["content"].startswith("Be brief.\n\nYou can call tools.") and '"name": "add"' in text[0]["content"]
    assert json.loads(text[2]["content"].split("\n")[1]) == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert text[3]["content"] == "<tool_response>\n5\n</tool_response>"
