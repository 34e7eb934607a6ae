"""LangChain messages ⇄ the engine's chat messages, and prompt-based tool calling.

The engine takes ``[{"role", "content"}]`` and renders them with the model's own chat template;
handles may sit anywhere in a content string. Small local models have no native tool-calling
API, so tools are described in a system message and calls are read back from
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (the Hermes/Qwen convention
that many open chat models were trained on). How well a model follows it is the model's skill.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.tool import ToolCall, tool_call

from inferscale_engine.prompting import engine_role

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

TOOLS_HEADER = (
    "You can call tools. These are the tools you have, as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call a tool, reply with only this, once per call:\n"
    '<tool_call>\n{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}\n</tool_call>\n'
    "Tool results come back in messages from the tool. When you have what you need, answer normally."
)


def _text_of(message: BaseMessage) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict):
            kind = block.get("type")
            if kind == "text" or (kind is None and "text" in block):
                parts.append(str(block.get("text", "")))
            elif kind in ("tool_use", "tool_call", "reasoning", "thinking", "tool_call_chunk"):
                continue  # carried by tool_calls / not part of the visible text
            else:
                raise ValueError(
                    f"InferScale models take text only; got a {kind!r} content block "
                    "(images, audio and files are not supported)"
                )
    return "".join(parts)


def message_role(message: BaseMessage) -> str:
    """The chat-template role of a LangChain message."""
    if isinstance(message, HumanMessage):
        return "user"
    if isinstance(message, AIMessage):
        return "assistant"
    if isinstance(message, SystemMessage):
        return "system"
    if isinstance(message, (ToolMessage, FunctionMessage)):
        return "tool"
    if isinstance(message, ChatMessage):
        return engine_role(message.role)
    raise ValueError(f"unsupported message type {type(message).__name__}")


def format_tool_call(call: Mapping[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": call["name"], "arguments": call.get("args", {})}) + "\n</tool_call>"


def to_engine_messages(
    messages: Sequence[BaseMessage],
    *,
    tools: Sequence[dict[str, Any]] | None = None,
    tool_choice: Any = None,
) -> list[dict[str, str]]:
    """Chat messages for :meth:`InferScaleEngine.generate`; tool schemas go in a system message."""
    out: list[dict[str, str]] = []
    for message in messages:
        role = message_role(message)
        text = _text_of(message)
        if isinstance(message, AIMessage) and message.tool_calls:
            calls = "\n".join(format_tool_call(c) for c in message.tool_calls)
            text = f"{text}\n{calls}" if text else calls
        if role == "tool":
            text = f"<tool_response>\n{text}\n</tool_response>"
        out.append({"role": role, "content": text})
    if tools and tool_choice != "none":
        block = TOOLS_HEADER.format(tools="\n".join(json.dumps(t.get("function", t)) for t in tools))
        if tool_choice in ("any", "required", True):
            block += "\nYou must call at least one tool now."
        elif isinstance(tool_choice, str) and tool_choice not in ("auto",):
            block += f"\nYou must call the tool {tool_choice!r} now."
        elif isinstance(tool_choice, dict):
            name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
            if name:
                block += f"\nYou must call the tool {name!r} now."
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def parse_tool_calls(text: str, tool_names: Sequence[str]) -> tuple[str, list[ToolCall]]:
    """Split generated text into visible text and the tool calls it makes (known tools only)."""
    calls: list[ToolCall] = []
    names = set(tool_names)
    kept: list[str] = []
    cursor = 0
    for m in _TOOL_CALL.finditer(text):
        payload = _loads(m.group(1))
        if not isinstance(payload, dict) or payload.get("name") not in names:
            continue
        args = payload.get("arguments", payload.get("parameters", {}))
        if isinstance(args, str):
            args = _loads(args)
        if not isinstance(args, dict):
            args = {}
        calls.append(tool_call(name=payload["name"], args=args, id=f"call_{uuid.uuid4().hex[:24]}"))
        kept.append(text[cursor : m.start()])
        cursor = m.end()
    if not calls:
        return text, []
    kept.append(text[cursor:])
    return "".join(kept).strip(), calls


def _loads(raw: str) -> Any:
    raw = raw.strip()
    try:
        return json.loads(raw)
    except ValueError:
        # Models often stop right after the object or add a stray character: take the first object.
        start = raw.find("{")
        if start < 0:
            return None
        depth = 0
        for i, ch in enumerate(raw[start:], start):
            depth += ch == "{"
            depth -= ch == "}"
            if depth == 0:
                try:
                    return json.loads(raw[start : i + 1])
                except ValueError:
                    return None
        return None
