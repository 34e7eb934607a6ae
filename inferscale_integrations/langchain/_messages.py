"""LangChain messages ⇄ the engine's chat messages, and LangChain's side of tool calling.

The engine takes ``[{"role", "content"}]`` and renders them with the model's own chat template;
handles may sit anywhere in a content string. Tool calls go through
:mod:`inferscale_engine.tool_calls` (shared by the integrations and the server): with a chat template that
renders tools, an ``AIMessage``'s calls become the message's ``tool_calls`` and a
``ToolMessage`` a ``"tool"`` message, for the template to lay out as the model was trained;
otherwise both become text (``<tool_call>`` / ``<tool_response>`` blocks).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
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
from langchain_core.messages.tool import ToolCallChunk, tool_call_chunk

from inferscale_engine import tool_calls as tc
from inferscale_engine.prompting import engine_role


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


def openai_message(message: BaseMessage) -> dict[str, Any]:
    """A LangChain message as an OpenAI-style chat message (calls' arguments as dicts)."""
    entry: dict[str, Any] = {"role": message_role(message), "content": _text_of(message)}
    if isinstance(message, AIMessage) and message.tool_calls:
        entry["tool_calls"] = [
            {"type": "function", "id": c.get("id"), "function": {"name": c["name"], "arguments": c.get("args", {})}}
            for c in message.tool_calls
        ]
    if isinstance(message, ToolMessage):
        entry["tool_call_id"] = message.tool_call_id
    return entry


def langchain_call_chunks(calls: Sequence[tc.ToolCall]) -> list[ToolCallChunk]:
    """The parsed calls as ``AIMessageChunk.tool_call_chunks`` (one whole call per chunk)."""
    return [tool_call_chunk(name=c.name, args=json.dumps(c.arguments), id=c.id, index=i) for i, c in enumerate(calls)]
