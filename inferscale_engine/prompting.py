"""How memories and conversations become prompts, shared by the chatbot, the server and the
integrations, so that a fact is encoded after exactly the text that precedes it when served.

* **Recall → messages**: :func:`memory_system_message` and :func:`with_memories` put memory
  handles into a system message.
* **Context of a fact**: :func:`memory_context` (the system head before the first recalled
  memory) and :func:`encode_context` (a conversation turn, as the integrations store them) are
  the chat-template text up to where a fact's own text starts.
* **Usage → dict** (:func:`usage_dict`, :func:`openai_usage`), **message roles**
  (:func:`engine_role`) and **response_format → structured output** (:func:`structured_options`).

No vLLM import: anything with the engine's ``render`` or ``tokenizer`` will do.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from inferscale_engine.errors import InvalidSchemaError
from inferscale_engine.types import Usage

logger = logging.getLogger(__name__)

#: Chosen by measurement on SmolLM2-135M (docs/cli.md): with this sentence the model answers
#: from a single recalled first-person fact 5/5 times, against 3/5 with the bare first one.
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant. Use what you remember when you answer."
MEMORY_HEADER = "Things you remember about the user:"

#: Stands where a fact's text will be, so the rendered template can be cut there; invisible
#: separators so that no real message contains it.
_MARKER = "\u2063INFERSCALE-FACT\u2063"

#: How a fact will sit in prompts, which decides the context it is encoded after:
#: ``"chat"`` as a chat message's content, ``"buffer"`` as a ``"Human: ..."`` line of a transcript.
EncodeStyle = Literal["chat", "buffer"]

#: Role names of other APIs (LangChain, LlamaIndex, OpenAI) → the roles chat templates know.
_ROLES = {
    "human": "user",
    "ai": "assistant",
    "chatbot": "assistant",
    "model": "assistant",
    "function": "tool",
    "developer": "system",
}


def engine_role(role: str) -> str:
    """The chat-template role of ``role`` (``"human"`` → ``"user"``, ``"developer"`` → ``"system"``...)."""
    return _ROLES.get(role, role)


# ------------------------------------------------------------------------------ recall → messages


def memory_system_message(handles: Sequence[str], system_prompt: str | None = DEFAULT_SYSTEM_PROMPT) -> str:
    """The system message that carries memories as handles (one per line, after a header).

    Everything before the first handle is static text, so its KV is encoded once and reused
    by every user and turn (see :mod:`inferscale_engine.engine`).
    """
    parts = [system_prompt.rstrip()] if system_prompt else []
    if handles:
        parts.append(MEMORY_HEADER)
        parts.extend(handles)
    return "\n".join(parts)


def with_memories(
    messages: Sequence[dict[str, str]], handles: Sequence[str], system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
) -> list[dict[str, str]]:
    """``messages`` with the memory handles added to their system message (created if absent)."""
    out = [dict(m) for m in messages]
    if not handles:
        return out
    if out and out[0].get("role") in ("system", "developer"):
        out[0] = {"role": "system", "content": memory_system_message(handles, out[0].get("content") or None)}
    else:
        out.insert(0, {"role": "system", "content": memory_system_message(handles, system_prompt)})
    return out


# ------------------------------------------------------------------------------ context of a fact


def memory_context(engine: Any, system_prompt: str | None = DEFAULT_SYSTEM_PROMPT) -> list[str] | None:
    """``context`` for ``store.add``: the rendered system message up to the first memory handle.

    That is exactly what precedes a recalled memory in the prompt (the only or first one), so
    a memory encoded after it is injected with the very KV a prefill would compute. ``None``
    when the engine has no chat template (the store then encodes after previous memories).
    """
    render = getattr(engine, "render", None)
    if render is None:
        return None
    try:
        text, _ = render([{"role": "system", "content": memory_system_message([_MARKER], system_prompt)},
                          {"role": "user", "content": "."}])
    except (ValueError, TypeError):
        logger.debug("no chat template: new memories are encoded after the previous ones")
        return None
    head = text[: text.index(_MARKER)]
    # The store encodes after "\n".join(context) + "\n": give it the head without that "\n".
    return [head[:-1]] if head.endswith("\n") else None


def chat_prefix(engine: Any, messages: list[dict[str, str]]) -> str | None:
    """Chat-template text of ``messages`` up to where the content :data:`_MARKER` stands for starts."""
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    except Exception:  # a template that rejects the role order: fall back to the store's window
        return None
    if not isinstance(text, str) or _MARKER not in text:
        return None
    return text[: text.index(_MARKER)]


def _speaker(role: str, prefixes: tuple[str, str]) -> str:
    human, ai = prefixes
    return human if role == "user" else ai if role == "assistant" else role.capitalize()


def encode_context(
    engine: Any,
    previous: Sequence[tuple[str, str]],
    role: str,
    *,
    style: EncodeStyle = "chat",
    prefixes: tuple[str, str] = ("Human", "AI"),
) -> list[str] | None:
    """The text a new fact is encoded after (the store's explicit ``context``), or None.

    A fact encoded alone starts at position 0, where a model's first token becomes an attention
    sink: injected in the middle of a prompt, such KV derails small models. So facts are encoded
    where they will be used: after the chat template's opening (system prompt included) and the
    ``previous`` turns in the same layout as prompts show them (chat messages, or transcript
    lines), ending where the fact's own text starts. The store joins context and fact with a
    newline, which ChatML-style templates have there too.
    """
    if style == "chat":
        messages = [{"role": r, "content": c} for r, c in previous] + [{"role": role, "content": _MARKER}]
        prefix = chat_prefix(engine, messages)
    else:
        head = chat_prefix(engine, [{"role": "user", "content": _MARKER}])
        if head is None:
            return None
        lines = "".join(f"{_speaker(r, prefixes)}: {c}\n" for r, c in previous)
        prefix = head + lines + f"{_speaker(role, prefixes)}: "
    if not prefix:
        return None
    # The store appends "\n" after the context; a prefix already ending in one keeps it exact.
    return [prefix.removesuffix("\n")]


# ------------------------------------------------------------------------------ output format


def structured_options(response_format: Any) -> dict[str, Any] | None:
    """The engine's ``structured`` option for an OpenAI-style ``response_format`` (None for
    none, or for ``{"type": "text"}``); :class:`InvalidSchemaError` for a ``json_schema`` that
    is not a valid JSON schema (:func:`check_json_schema`), ValueError for any other format."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidSchemaError("response_format.json_schema must be an object: {'name': ..., 'schema': {...}}")
        if not isinstance(spec.get("name"), str) or not spec["name"]:
            raise InvalidSchemaError("response_format.json_schema.name is required: a non-empty string naming the format")
        if "schema" not in spec:
            raise InvalidSchemaError("response_format.json_schema.schema is required: the JSON schema to follow")
        return {"json": check_json_schema(spec["schema"], "response_format.json_schema.schema")}
    raise ValueError(
        "response_format must be {'type': 'json_object'} or "
        f"{{'type': 'json_schema', 'json_schema': {{'name': ..., 'schema': {{...}}}}}}, got {response_format!r}"
    )


#: Keywords whose values are data, not schemas: a ``$ref`` in them is no reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def check_json_schema(schema: Any, where: str = "schema") -> dict[str, Any]:
    """``schema`` if it is a JSON schema output can be constrained by: an object its metaschema
    accepts (the draft its ``$schema`` names, else 2020-12), whose ``$ref``\\ s within the
    document resolve. :class:`InvalidSchemaError` otherwise, naming the place (``where``
    prefixes it): vLLM's grammar compilers refuse such a schema only once the request reaches
    the engine, after its prompt was laid out and staged."""
    from jsonschema import Draft202012Validator, SchemaError
    from jsonschema.validators import validator_for
    from referencing import Registry
    from referencing.exceptions import Unresolvable
    from referencing.jsonschema import DRAFT202012, specification_with

    if not isinstance(schema, dict):
        raise InvalidSchemaError(f"{where} must be a JSON schema object, got {type(schema).__name__}")
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as exc:
        raise InvalidSchemaError(f"{where}{exc.json_path.removeprefix('$')} is not valid: {exc.message}") from None
    except RecursionError:
        raise InvalidSchemaError(f"{where} is nested too deeply") from None
    dialect = schema.get("$schema")
    spec = specification_with(dialect, default=DRAFT202012) if isinstance(dialect, str) else DRAFT202012
    resolver = Registry().resolver_with_root(spec.create_resource(schema))
    # (node, its path, whether its $refs are checked); a loop, not recursion: any depth the
    # metaschema check got through. Not checked: data (``enum`` values...), and subschemas with
    # an ``$id`` of their own, which resolve $refs against it (vLLM's compilers judge those).
    stack: list[tuple[Any, str, bool]] = [(schema, "", True)]
    while stack:
        node, path, refs = stack.pop()
        if isinstance(node, dict):
            refs = refs and (node is schema or "$id" not in node)
            ref = node.get("$ref")
            if refs and isinstance(ref, str):
                try:
                    resolver.lookup(ref)
                except Unresolvable:
                    raise InvalidSchemaError(f"{where}{path}.$ref {ref!r} leads nowhere: only references within "
                                             "the schema ('#/$defs/...') are followed") from None
            stack.extend((v, f"{path}.{k}", refs and k not in _DATA_KEYWORDS) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]", refs) for i, v in enumerate(node))
        elif isinstance(node, float) and not math.isfinite(node):
            # Python's JSON reads NaN and Infinity; the grammar compilers' JSON has no such numbers.
            raise InvalidSchemaError(f"{where}{path} is {node}, not a finite number")
    return schema


# ------------------------------------------------------------------------------ usage


def usage_dict(usage: Usage) -> dict[str, int]:
    """The engine's token counts, flat (the integrations' ``token_usage`` / ``usage``)."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "injected_tokens": usage.injected_tokens,
        "cached_tokens": usage.cached_tokens,
        "memories_injected": usage.memories_injected,
        "memories_recomputed": usage.memories_recomputed,
    }


def total_usage(usages: Iterable[Usage]) -> Usage:
    """One usage for several generations (a batch)."""
    usages = list(usages)
    return Usage(
        prompt_tokens=sum(u.prompt_tokens for u in usages),
        completion_tokens=sum(u.completion_tokens for u in usages),
        injected_tokens=sum(u.injected_tokens for u in usages),
        cached_tokens=sum(u.cached_tokens for u in usages),
        memories_injected=sum(u.memories_injected for u in usages),
        memories_recomputed=sum(u.memories_recomputed for u in usages),
        memories_as_text=sum(u.memories_as_text for u in usages),
    )


def openai_usage(usage: Usage) -> dict[str, Any]:
    """OpenAI's ``usage`` object (cached tokens under ``prompt_tokens_details``), plus ours."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "injected_tokens": usage.injected_tokens,
        # How many memories were injected, and how many prefilled (recomputed) as text: with the
        # default quality knob a request of up to 4 memories injects none (injected_tokens 0).
        "memories_injected": usage.memories_injected,
        "memories_recomputed": usage.memories_recomputed,
        "memories_as_text": usage.memories_as_text,
        # Where each memory's KV came from: the cost model's choice (docs/engine.md).
        "memory_mix": dataclasses.asdict(usage.memory_mix) if usage.memory_mix is not None else None,
    }
