"""OpenAI's tool calling on ``/v1/chat/completions``: a request's ``tools``, ``tool_choice`` and
tool messages checked and handed to :func:`inferscale_engine.tool_calls.use_tools` (the one path
the in-process LangChain model takes too), and the answer's calls in OpenAI's shape.

The pydantic schemas (schemas.py) check the shapes; this module checks what they cannot: that
``tool_choice`` names a tool of the request, that a ``"tool"`` message answers a call made before
it, that a call's ``arguments`` are a JSON object, that a tool's ``parameters`` are a JSON schema.
Each refusal is a :class:`ToolRequestError` with the parameter it is about and an error code.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from inferscale_apps.server.schemas import ChatCompletionRequest
from inferscale_engine import tool_calls as tc
from inferscale_engine.errors import InferScaleError, InvalidSchemaError
from inferscale_engine.prompting import check_json_schema, engine_role


class ToolRequestError(InferScaleError):
    """A request the server refuses with a 400: what is wrong, the parameter, the error code."""

    def __init__(self, message: str, param: str, code: str) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as :func:`~inferscale_engine.tool_calls.template_messages` takes
    them: text content, assistants' calls with their arguments parsed, tools' ``tool_call_id``."""
    out: list[dict[str, Any]] = []
    called: set[str] = set()
    for i, m in enumerate(req.messages):
        if m.role == "function":
            raise ToolRequestError(f"messages[{i}]: role 'function' (legacy function calling) is not supported; "
                                   "send the result as a 'tool' message with its tool_call_id", f"messages.{i}.role",
                                   "unsupported_parameter")
        try:
            content = m.text()
        except ValueError as exc:
            raise ToolRequestError(f"messages[{i}]: {exc}", f"messages.{i}.content", "invalid_request") from None
        entry: dict[str, Any] = {"role": engine_role(m.role), "content": content}
        if m.tool_calls:
            if m.role != "assistant":
                raise ToolRequestError(f"messages[{i}]: only assistant messages carry tool_calls, not {m.role!r} ones",
                                       f"messages.{i}.tool_calls", "invalid_tool_call")
            entry["tool_calls"] = [_call(call, f"messages.{i}.tool_calls.{j}") for j, call in enumerate(m.tool_calls)]
            called.update(call.id for call in m.tool_calls)
        if m.role == "tool":
            if not m.tool_call_id:
                raise ToolRequestError(f"messages[{i}]: a 'tool' message needs the tool_call_id of the call it answers",
                                       f"messages.{i}.tool_call_id", "invalid_tool_message")
            if m.tool_call_id not in called:
                raise ToolRequestError(f"messages[{i}]: tool_call_id {m.tool_call_id!r} answers no call of an earlier "
                                       "assistant message's tool_calls", f"messages.{i}.tool_call_id",
                                       "invalid_tool_message")
            entry["tool_call_id"] = m.tool_call_id
        out.append(entry)
    return out


def _call(call: Any, param: str) -> dict[str, Any]:
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise ToolRequestError(f"{param}.function.arguments is not valid JSON: {arguments[:200]!r}",
                                   f"{param}.function.arguments", "invalid_tool_call") from None
    if not isinstance(arguments, dict):
        raise ToolRequestError(f"{param}.function.arguments must be a JSON object, got {type(arguments).__name__}",
                               f"{param}.function.arguments", "invalid_tool_call")
    # Arguments as a dict: chat templates write them with ``tojson`` (a string would come out quoted).
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def tool_use(req: ChatCompletionRequest, messages: Sequence[dict[str, Any]], *, structured: dict[str, Any] | None,
             native: bool) -> tc.ToolUse:
    """How the request's generation renders, constrains and reads tool calls (``structured``:
    its ``response_format``'s constraint; ``native``: the chat template renders tools)."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    for k, tool in enumerate(tools):
        # Checked for every tool, as OpenAI does: a forced call's schema is made of them.
        if "parameters" in tool["function"]:
            try:
                check_json_schema(tool["function"]["parameters"], f"tools[{k}].function.parameters")
            except InvalidSchemaError as exc:
                raise ToolRequestError(str(exc), f"tools.{k}.function.parameters", "invalid_json_schema") from None
    names = tc.tool_names(tools)
    duplicate = next((n for k, n in enumerate(names) if n in names[:k]), None)
    if duplicate is not None:
        raise ToolRequestError(f"tools: two tools are named {duplicate!r}", "tools", "invalid_tools")
    choice: Any = req.tool_choice
    if not isinstance(choice, str) and choice is not None:
        choice = choice.model_dump()
    if choice not in (None, "none", "auto") and not tools:
        raise ToolRequestError(f"tool_choice {choice!r} needs tools: the request has none", "tool_choice",
                               "invalid_tool_choice")
    try:
        return tc.use_tools(messages, tools, choice, parallel=req.parallel_tool_calls is not False,
                            structured=structured, native=native)
    except ValueError as exc:  # a choice of no tool of the request, or forced beside a response_format
        raise ToolRequestError(str(exc), "tool_choice", "invalid_tool_choice") from None


def openai_tool_calls(calls: Sequence[tc.ToolCall]) -> list[dict[str, Any]]:
    """Calls as a response message's ``tool_calls`` (arguments as a JSON string, as OpenAI's)."""
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in calls]
