"""Tool calls in and out of a local chat model, for every integration (no framework imported).

* **Tools in**: a chat template that knows tools (Qwen2.5, Llama 3.1, Hermes...) renders the
  OpenAI-style schemas itself (:meth:`InferScaleEngine.render` passes ``tools=`` to it), and the
  assistant's earlier ``tool_calls`` and the ``"tool"`` results too. A template that does not
  gets the schemas in a system message (:func:`tools_system_text`) and the calls and results as
  text, in the Hermes/Qwen convention most open chat models were trained on.
* **Calls out**: :func:`parse_tool_calls` reads ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`` blocks, and a bare (or fenced) JSON object naming a bound tool, which small
  models emit as often as the tags. :class:`ToolCallStream` does the same on a stream: text is
  passed on as it comes until something may be a call, and the calls come at the end.
* **Forced calls** (``tool_choice`` "any" or a tool's name): :func:`forced_call_schema` is the
  JSON schema of a call to one of the allowed tools, for structured-output (guided) decoding,
  so the call is well-formed and names an allowed tool however small the model.

:func:`use_tools` puts these together for one generation; the LangChain model and the HTTP
server both go through it, so a request renders, decodes and parses the same either way.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_FENCED = re.compile(r"```(?:json|JSON)?\s*\n?(.*?)(?:```|$)", re.DOTALL)

TOOLS_HEADER = (
    "You can call tools. These are the tools you have, as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call a tool, reply with only this, once per call:\n"
    '<tool_call>\n{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}\n</tool_call>\n'
    "Tool results come back in messages from the tool. When you have what you need, answer normally."
)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: a bound tool's name, its arguments, a fresh id."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def function_of(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """The ``{"name", "description", "parameters"}`` part of an OpenAI-style tool."""
    inner = tool.get("function")
    return inner if isinstance(inner, Mapping) else tool


def tool_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    return [str(function_of(t).get("name")) for t in tools]


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template renders ``tools`` (as transformers decides it too)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def tools_system_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """Tool schemas as a system message, for a chat template that does not render tools."""
    return TOOLS_HEADER.format(tools="\n".join(json.dumps(dict(function_of(t))) for t in tools))


def format_call(name: str, arguments: Mapping[str, Any]) -> str:
    """A call as text, for a chat template that does not render ``tool_calls``."""
    return f"{OPEN}\n" + json.dumps({"name": name, "arguments": dict(arguments)}) + f"\n{CLOSE}"


def format_result(content: str) -> str:
    """A tool's result as text, for a chat template that does not render ``"tool"`` messages."""
    return f"<tool_response>\n{content}\n</tool_response>"


def template_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]], *, native: bool
) -> list[dict[str, Any]]:
    """Chat messages with tool calls and results, as the model's chat template takes them.

    ``messages``: ``{"role", "content"}`` dicts; an assistant's may carry ``"tool_calls": [{"id",
    "type": "function", "function": {"name", "arguments": {...}}}]`` and a ``"tool"`` one its
    ``"tool_call_id"``. ``native``: the template renders tools, calls and results itself (see
    :func:`template_renders_tools`), so they stay as they are; otherwise calls and results become
    text and ``tools`` a system message (:func:`tools_system_text`).
    """
    if native:
        return [dict(m) for m in messages]
    out: list[dict[str, Any]] = []
    for message in messages:
        entry = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
        calls = message.get("tool_calls")
        if calls:
            text = "\n".join(format_call(function_of(c)["name"], function_of(c).get("arguments") or {}) for c in calls)
            entry["content"] = f"{message['content']}\n{text}" if message["content"] else text
        if message["role"] == "tool":
            entry["content"] = format_result(message["content"])
        out.append(entry)
    if tools:
        block = tools_system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


# --------------------------------------------------------------------------------- choice


def chosen_tools(tools: Sequence[Mapping[str, Any]], tool_choice: Any) -> list[str] | None:
    """Names one of which must be called (None: the model decides, or no call: see :func:`calls_off`).

    ``tool_choice``: None / ``"auto"`` (model decides), ``"none"`` (no call), ``"any"`` /
    ``"required"`` / True (some bound tool), a tool's name, or ``{"type": "function",
    "function": {"name": ...}}`` / ``{"name": ...}``.
    """
    names = tool_names(tools)
    if tool_choice in (None, "auto", "none", False):
        return None
    if tool_choice in ("any", "required", True):
        return names
    name = tool_choice
    if isinstance(tool_choice, Mapping):
        name = function_of(tool_choice).get("name")
    if not isinstance(name, str) or name not in names:
        raise ValueError(f"tool_choice {tool_choice!r} names no bound tool; bound tools: {names}")
    return [name]


def calls_off(tool_choice: Any) -> bool:
    return tool_choice in ("none", False)


def forced_call_schema(tools: Sequence[Mapping[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """JSON schema of ``{"name": <one of names>, "arguments": {...}}`` with each tool's own
    parameter schema (``$defs`` hoisted to the top, where their ``$ref``s point once nested)."""
    defs: dict[str, Any] = {}
    options = []
    for tool in tools:
        fn = function_of(tool)
        if fn.get("name") not in names:
            continue
        params = dict(fn.get("parameters") or {"type": "object", "properties": {}})
        defs.update(params.pop("$defs", {}) or {})
        params.setdefault("type", "object")
        options.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [fn["name"]]}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    if defs:
        schema = {**schema, "$defs": defs}
    return schema


# --------------------------------------------------------------------------------- one generation


@dataclass(frozen=True)
class ToolUse:
    """What tools make of one generation (see :func:`use_tools`)."""

    messages: list[dict[str, Any]]  # for the chat template
    tools: list[dict[str, Any]] | None  # for the template to render (None: none, or they are in a message)
    names: list[str]  # the answer is read for calls to these (none: the answer is only text)
    parallel: bool  # False: only the answer's first call is kept
    structured: dict[str, Any] | None  # the engine's ``structured`` option: the caller's, or the forced call's

    def reader(self) -> ToolCallStream | None:
        """A parser for the answer as it streams (None: there are no calls to look for)."""
        return ToolCallStream(self.names, parallel=self.parallel) if self.names else None

    def read(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole answer's visible text and calls, as :meth:`reader` would give them."""
        reader = self.reader()
        if reader is None:
            return text, []
        shown = reader.feed(text)
        rest, calls = reader.finish()
        return shown + rest, calls


def use_tools(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] = (),
    tool_choice: Any = None,
    *,
    parallel: bool = True,
    structured: dict[str, Any] | None = None,
    native: bool,
) -> ToolUse:
    """How one generation renders, constrains and reads tool calls.

    ``messages`` as :func:`template_messages` takes them; ``tool_choice`` as :func:`chosen_tools`
    reads it: ``"none"`` hides the tools (nothing is read as a call) and a forced choice becomes
    guided decoding of :func:`forced_call_schema`, so the answer is exactly one well-formed call.
    ``structured``: the caller's own output constraint (``response_format``); ValueError if a
    forced choice would need a second one, or the choice names no tool in ``tools``.
    """
    bound: list[dict[str, Any]] = [] if calls_off(tool_choice) else [dict(t) for t in tools]
    forced = chosen_tools(bound, tool_choice) if bound else None
    if forced:
        if structured:
            raise ValueError("response_format and a forced tool_choice cannot both constrain one answer")
        structured = {"json": forced_call_schema(bound, forced)}
    return ToolUse(
        messages=template_messages(messages, bound, native=native),
        tools=bound if native and bound else None,
        names=tool_names(bound),
        parallel=parallel,
        structured=structured,
    )


# --------------------------------------------------------------------------------- parsing


def parse_tool_calls(text: str, names: Sequence[str]) -> tuple[str, list[ToolCall]]:
    """``text`` split into what is left to show and the calls it makes to the tools ``names``.

    Tagged ``<tool_call>`` blocks first; without any, fenced JSON blocks, then the whole text as
    one JSON object (or a list of them). Only objects naming a bound tool count; anything else
    stays text.
    """
    known = set(names)
    for pattern in (_TAGGED, _FENCED):
        calls: list[ToolCall] = []
        kept, cursor = [], 0
        for m in pattern.finditer(text):
            found = _calls_in(_loads(m.group(1)), known)
            if not found:
                continue
            calls.extend(found)
            kept.append(text[cursor : m.start()])
            cursor = m.end()
        if calls:
            kept.append(text[cursor:])
            return "".join(kept).strip(), calls
    whole = _calls_in(_json_values(text), known)
    if whole:
        return "", _unique(whole)
    return text.strip(), []


def _json_values(text: str) -> Any:
    """The JSON value ``text`` is, or the list of values it holds one after another (JSON lines:
    small models write parallel calls that way, and repeat one call so); None if it is not JSON."""
    decoder, at, text = json.JSONDecoder(), 0, text.strip()
    values: list[Any] = []
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            # A last value cut off by max_tokens does not void the ones before it.
            return None if not values or text[at] not in "{[" else values
        values.append(value)
        while at < len(text) and text[at].isspace():
            at += 1
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def _unique(calls: list[ToolCall]) -> list[ToolCall]:
    seen: set[str] = set()
    kept = []
    for call in calls:
        key = json.dumps([call.name, call.arguments], sort_keys=True)
        if key not in seen:
            seen.add(key)
            kept.append(call)
    return kept


def _calls_in(payload: Any, known: set[str]) -> list[ToolCall]:
    items = payload if isinstance(payload, list) else [payload]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in known:
            return []
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            args = _loads(args, whole=True) if args.strip() else {}
        if not isinstance(args, dict):
            return []
        calls.append(ToolCall(item["name"], args))
    return calls


def _loads(raw: str, *, whole: bool = False) -> Any:
    raw = raw.strip()
    try:
        return json.loads(raw)
    except ValueError:
        if whole:
            return None
    # Models often stop right after the object or add a stray character: take the first object.
    start = raw.find("{")
    if start < 0:
        return None
    try:
        value, _ = json.JSONDecoder().raw_decode(raw[start:])
    except ValueError:
        return None
    return value


class ToolCallStream:
    """Generated text, fed piece by piece, split into text to show now and calls at the end.

    Text is passed on as it comes until a call may be starting (a ``<tool_call>`` tag or a part
    of one, a code fence, or an answer that opens with ``{`` / ``[``); from there on it is held
    back, and :meth:`finish` parses the whole answer and returns the rest of the visible text and
    the calls. What was shown is always the start of the final visible text.
    """

    _MARKERS = (OPEN, "```")

    def __init__(self, names: Sequence[str], *, parallel: bool = True) -> None:
        """``parallel=False``: only the answer's first call is kept (``parallel_tool_calls``)."""
        self.names = list(names)
        self.parallel = parallel
        self.text = ""
        self.shown = ""
        self._held = False

    def feed(self, piece: str) -> str:
        """Text that can be shown now (may be empty)."""
        self.text += piece
        if self._held:
            return ""
        body = self.text.lstrip()
        if body[:1] in ("{", "["):
            self._held = True
            return ""
        cut = len(body)
        for marker in self._MARKERS:
            at = body.find(marker)
            if at >= 0:
                cut = min(cut, at)
                self._held = True
            else:  # a marker may be starting at the very end
                for n in range(min(len(marker) - 1, len(body)), 0, -1):
                    if body.endswith(marker[:n]):
                        cut = min(cut, len(body) - n)
                        break
        safe = body[:cut].rstrip()  # trailing space may end the text: the final text is stripped
        new = safe[len(self.shown):] if safe.startswith(self.shown) else ""
        self.shown += new
        return new

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest of the visible text, and the calls of the whole answer."""
        visible, calls = parse_tool_calls(self.text, self.names)
        rest = visible[len(self.shown):] if visible.startswith(self.shown) else ""
        return rest, calls if self.parallel else calls[:1]
