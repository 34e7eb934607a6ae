"""Tool calling and structured output over ``/v1/chat/completions``, with the real ``openai``
client and LangChain's ``ChatOpenAI``, against the app in-process (uvicorn in a thread).

One tiny random Llama engine for the module: its text is gibberish, so calls are tested where
guided decoding guarantees one (a forced ``tool_choice``), and rendering through the prompt's
token count: what the server renders must be exactly the text written out here by hand. The
engine's guided decoding writes compact JSON (vLLM's ``disable_any_whitespace``) and the tools'
integers are bounded: a random model otherwise fills any budget with whitespace and digits
inside the call (400 tokens were not enough).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from inferscale_engine import tool_calls as tc

openai = pytest.importorskip("openai")

MODEL = "tiny"
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
       "parameters": {"type": "object", "properties": {"a": DIGIT, "b": DIGIT},
                      "required": ["a", "b"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now", "description": "The time.",
       "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is 2 + 3?"}]
#: A conversation after a call: the assistant's call (no text) and the tool's result.
HISTORY = [*ASK,
           {"role": "assistant", "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "2 + 3 = 5"}]
#: A chat template that renders tools, calls and results itself (as Qwen2.5's does).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function | tojson }}</call>{% endfor %}"
    "{% if m.tool_call_id %} (answers {{ m.tool_call_id }}){% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def engine(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from inferscale_engine import InferScaleEngine

    eng = InferScaleEngine(model=tiny_llama, store_path=tmp_path_factory.mktemp("tools-store"),
                           device="cpu", dtype="float32", max_model_len=1024, recompute=0,
                           structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def base(engine: Any) -> Iterator[str]:
    from inferscale_apps.bench.load import serve_app
    from inferscale_apps.server import create_app

    with serve_app(create_app(engine, served_model_name=MODEL, preload_memory=False)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base: str) -> Any:
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(base: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base, timeout=120) as c:
        yield c


#: Room for a forced call of ADD (about 20 tokens).
CALL_TOKENS = 60


def chat(client: Any, messages: list[dict[str, Any]], **kw: Any) -> Any:
    kw.setdefault("max_tokens", CALL_TOKENS)
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def prompt_tokens(engine: Any, messages: list[dict[str, Any]]) -> int:
    """Tokens of ``messages`` rendered by the chat template as they are (no tools added)."""
    return len(engine.tokenize(engine.render(messages)[0]))


def assert_add_call(call: Any) -> None:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "add"
    arguments = json.loads(call.function.arguments)  # a JSON string, as OpenAI sends it
    assert set(arguments) == {"a", "b"} and all(isinstance(v, int) for v in arguments.values())


# ---------------------------------------------------------------------- calls out


def test_a_forced_tool_choice_is_answered_with_an_openai_tool_call(client: Any) -> None:
    r = chat(client, ASK, tools=[ADD, NOW], tool_choice={"type": "function", "function": {"name": "add"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None  # only a call
    assert len(choice.message.tool_calls) == 1
    assert_add_call(choice.message.tool_calls[0])

    required = chat(client, ASK, tools=[ADD, NOW], tool_choice="required", parallel_tool_calls=False)
    assert required.choices[0].finish_reason == "tool_calls"
    assert [c.function.name in ("add", "now") for c in required.choices[0].message.tool_calls] == [True]


def test_a_streamed_call_comes_as_tool_call_deltas(client: Any) -> None:
    forced = {"type": "function", "function": {"name": "add"}}
    whole = chat(client, ASK, tools=[ADD, NOW], tool_choice=forced).choices[0].message.tool_calls[0]
    chunks = list(chat(client, ASK, tools=[ADD, NOW], tool_choice=forced, stream=True,
                       stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)  # nothing shown as text: it was a call
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert [c.index for c in calls] == [0]
    assert_add_call(calls[0])
    assert (calls[0].function.name, calls[0].function.arguments) == (whole.function.name, whole.function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert chunks[-1].usage.completion_tokens > 0

    # No call: the text streams (held back only where a call might start) as it answers whole.
    text = chat(client, ASK, tools=[ADD], max_tokens=12).choices[0].message.content
    streamed = chat(client, ASK, tools=[ADD], max_tokens=12, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text


def test_langchain_chat_openai_binds_tools_over_http(base: str) -> None:
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import ToolMessage
    from pydantic import BaseModel, Field

    class add(BaseModel):  # noqa: N801  (the tool's name)
        """Add two integers."""

        a: int = Field(ge=0, le=9)
        b: int = Field(ge=0, le=9)

    llm = lc.ChatOpenAI(model=MODEL, base_url=base + "/v1", api_key="none", temperature=0, max_tokens=CALL_TOKENS,
                        max_retries=0)
    for choice in ("add", "any"):  # a name; "any" is sent as "required"
        message = llm.bind_tools([add], tool_choice=choice).invoke("What is 2 + 3?")
        assert [c["name"] for c in message.tool_calls] == ["add"], message
        assert set(message.tool_calls[0]["args"]) == {"a", "b"}
        assert message.response_metadata["finish_reason"] == "tool_calls"
        # The call goes back as the model made it, with its result: the conversation goes on.
        call = message.tool_calls[0]
        result = ToolMessage(str(call["args"]["a"] + call["args"]["b"]), tool_call_id=call["id"])
        answer = llm.bind_tools([add]).invoke(["What is 2 + 3?", message, result])
        assert answer.usage_metadata["input_tokens"] > 0
    streamed = None
    for piece in llm.bind_tools([add], tool_choice="add").stream("What is 2 + 3?"):
        streamed = piece if streamed is None else streamed + piece
    assert [c["name"] for c in streamed.tool_calls] == ["add"] and set(streamed.tool_calls[0]["args"]) == {"a", "b"}


# ---------------------------------------------------------------------- what the model sees


def test_tools_and_a_conversation_with_calls_are_rendered_as_text_without_template_support(
        client: Any, engine: Any) -> None:
    """The tiny model's template knows no tools: they go in a system message, the call and its
    result as tagged text, in the in-process classes' layout (arguments as an object, not a
    JSON string inside JSON)."""
    r = chat(client, HISTORY, tools=[ADD], max_tokens=1)
    by_hand = [
        {"role": "system", "content": tc.tools_system_text([ADD])},
        *ASK,
        {"role": "assistant", "content": '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'},
        {"role": "tool", "content": "<tool_response>\n2 + 3 = 5\n</tool_response>"},
    ]
    assert r.usage.prompt_tokens == prompt_tokens(engine, by_hand)

    # "none": the model sees no tools, and nothing it says is read as a call.
    none = chat(client, ASK, tools=[ADD], tool_choice="none", max_tokens=1)
    assert none.usage.prompt_tokens == prompt_tokens(engine, ASK)
    assert none.choices[0].message.tool_calls is None


def test_a_template_that_renders_tools_gets_them_with_the_calls_and_results(
        client: Any, engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's tokenizer renders on copies of itself: each call is given the template.
    render = engine.tokenizer.apply_chat_template
    monkeypatch.setattr(engine.tokenizer, "chat_template", TOOLS_TEMPLATE)
    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", functools.partial(render, chat_template=TOOLS_TEMPLATE))
    r = chat(client, HISTORY, tools=[ADD], max_tokens=1)
    by_hand = ("<|im_start|>system\nTools: " + json.dumps(ADD["function"]) + "<|im_end|>\n"
               "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
               '<|im_start|>assistant\n<call>{"name": "add", "arguments": {"a": 2, "b": 3}}</call><|im_end|>\n'
               "<|im_start|>tool\n2 + 3 = 5 (answers call_1)<|im_end|>\n"
               "<|im_start|>assistant\n")
    assert r.usage.prompt_tokens == len(engine.tokenize(by_hand))
    # In-process, generate() gives the template the same tools.
    assert engine.generate(ASK, tools=[ADD], max_tokens=1).usage.prompt_tokens == \
        len(engine.tokenize(engine.render(ASK, tools=[ADD])[0])) > prompt_tokens(engine, ASK)


# ---------------------------------------------------------------------- structured output


def test_response_format_constrains_the_answer_beside_unforced_tools(client: Any) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = chat(client, ASK, tools=[ADD],
             response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}})
    assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool)


# ---------------------------------------------------------------------- bad input


def _tool_call(arguments: Any) -> dict[str, Any]:
    return {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": arguments}}


@pytest.mark.parametrize("change, param, code", [
    ({"tools": {"type": "function", "function": {"name": "add"}}}, "tools", "invalid_request"),
    ({"tools": [{"type": "custom", "function": {"name": "add"}}]}, "tools.0.type", "invalid_request"),
    ({"tools": [{"type": "function", "function": {"name": 5}}]}, "tools.0.function.name", "invalid_request"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name", "invalid_request"),
    ({"tools": [{"type": "function", "function": {"name": "add", "parameters": "a, b"}}]}, "tools.0.function.parameters",
     "invalid_request"),
    ({"tools": [ADD, ADD]}, "tools", "invalid_tools"),
    ({"tools": [NOW, {"type": "function", "function": {"name": "add", "parameters": {"type": "integr"}}}]},
     "tools.1.function.parameters", "invalid_json_schema"),
    ({"tools": [{"type": "function", "function": {"name": "add", "parameters": {"$ref": "#/$defs/nowhere"}}}],
      "tool_choice": "required"}, "tools.0.function.parameters", "invalid_json_schema"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "multiply"}}}, "tool_choice",
     "invalid_tool_choice"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_tool_choice"),
    ({"tools": [ADD], "tool_choice": "sometimes"}, "tool_choice", "invalid_request"),
    ({"tools": [ADD], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "invalid_tool_choice"),
    ({"tools": [ADD], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "invalid_request"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [_tool_call("{}")]}, {"role": "tool", "content": "5"}]},
     "messages.2.tool_call_id", "invalid_tool_message"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_9", "content": "5"}]}, "messages.1.tool_call_id",
     "invalid_tool_message"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [_tool_call("{a: 2")]}]},
     "messages.1.tool_calls.0.function.arguments", "invalid_tool_call"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [_tool_call("[2, 3]")]}]},
     "messages.1.tool_calls.0.function.arguments", "invalid_tool_call"),
    ({"messages": [{"role": "user", "content": "2+3?", "tool_calls": [_tool_call("{}")]}]}, "messages.0.tool_calls",
     "invalid_tool_call"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "add"}}]}]},
     "messages.1.tool_calls.0.id", "invalid_request"),
    ({"functions": [ADD["function"]]}, "functions", "unsupported_parameter"),
    ({"messages": [*ASK, {"role": "function", "name": "add", "content": "5"}]}, "messages.1.role",
     "unsupported_parameter"),
])
def test_bad_tool_requests_are_400_with_a_code(http: httpx.Client, change: dict[str, Any], param: str,
                                              code: str) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 1, **change}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    assert error["type"] == "invalid_request_error" and error["message"]
