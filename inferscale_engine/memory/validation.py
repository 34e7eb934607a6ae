"""What the memory store accepts from its callers: every argument is checked before any work.

Errors are ``TypeError`` / ``ValueError`` naming the argument, so the server can answer 4xx
with the message as is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from inferscale_engine.errors import TooLargeError, check_utf8

MAX_USER_ID = 128
MAX_K = 1000
#: One fact's text, in UTF-8 bytes. A fact is served inside a prompt: far more than any context.
MAX_TEXT_BYTES = 64 << 10
#: One fact's metadata, as compact JSON: it is returned with the fact in every listing and search.
MAX_METADATA_BYTES = 64 << 10
#: Nesting of metadata. Deeper documents were stored, then failed to serialise in every listing.
MAX_METADATA_DEPTH = 20


#: Store keys under which the Mem0 API keeps memories of an agent, a run or an app alone
#: (``@agent:<id>``...): never a person's user id, so chats and framework classes refuse them.
RESERVED_USER_PREFIXES = ("@agent:", "@run:", "@app:")


def check_user(user_id: Any) -> str:
    if (
        not isinstance(user_id, str) or not user_id.strip() or len(user_id) > MAX_USER_ID
        or not user_id.isprintable()
    ):
        raise ValueError(f"user_id must be a non-empty string of at most {MAX_USER_ID} printable characters, "
                         f"got {user_id!r:.80}")
    return user_id


def check_person(user_id: Any) -> str:
    """:func:`check_user`, and no reserved store key (:data:`RESERVED_USER_PREFIXES`): the id of
    whoever a chat or a framework class serves."""
    user_id = check_user(user_id)
    if user_id.startswith(RESERVED_USER_PREFIXES):
        raise ValueError(f"user_id {user_id!r:.80} is reserved: ids starting with "
                         f"{', '.join(RESERVED_USER_PREFIXES)} hold agent, run and app memories")
    return user_id


def check_k(k: Any) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise ValueError(f"k must be an integer from 1 to {MAX_K}, got {k!r}")
    return k


def check_text(text: Any, what: str = "memory text") -> str:
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"{what} is empty")
    check_utf8(text, what)
    if len(text) > MAX_TEXT_BYTES // 4 and len(text.encode()) > MAX_TEXT_BYTES:
        raise TooLargeError(f"{what} is {len(text.encode())} bytes, more than the limit of {MAX_TEXT_BYTES}")
    return text


def texts_of(messages_or_text: Any) -> list[str]:
    if isinstance(messages_or_text, str):
        return [check_text(messages_or_text)]
    if isinstance(messages_or_text, Mapping):
        messages_or_text = [messages_or_text]
    if not isinstance(messages_or_text, (list, tuple)):
        raise TypeError(f"add() takes a string or a list of message dicts, got {type(messages_or_text).__name__}")
    if not messages_or_text:
        raise ValueError("no messages to add")
    texts = []
    for i, m in enumerate(messages_or_text):
        if not isinstance(m, Mapping):
            raise TypeError(f"message {i} must be a dict with 'role' and 'content', got {type(m).__name__}")
        role, content, name = m.get("role"), m.get("content"), m.get("name")
        if not isinstance(role, str) or not isinstance(content, str):
            raise TypeError(f"message {i} needs string 'role' and 'content'")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"message {i}: 'name' must be a string")
        if not role.strip():
            raise ValueError(f"message {i} has an empty role")
        check_text(content, f"message {i} content")
        speaker = name.strip() if name and name.strip() else role.strip().capitalize()
        texts.append(f"{speaker}: {content}")
    return texts


def check_metadata(metadata: Any) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a dict, got {type(metadata).__name__}")
    _check_depth(metadata, 1)  # first: a deep document makes json.dumps itself recurse
    try:
        text = json.dumps(dict(metadata), separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise TypeError(f"metadata must be JSON-serialisable: {exc}") from None
    if len(text) > MAX_METADATA_BYTES // 4 and len(text.encode()) > MAX_METADATA_BYTES:
        raise TooLargeError(f"metadata is {len(text.encode())} bytes as JSON, more than the limit of {MAX_METADATA_BYTES}")
    return json.loads(text)


def _check_depth(value: Any, depth: int) -> None:
    if depth > MAX_METADATA_DEPTH:
        raise ValueError(f"metadata is nested more than {MAX_METADATA_DEPTH} levels deep")
    if isinstance(value, Mapping):
        for v in value.values():
            if isinstance(v, (Mapping, list, tuple)):
                _check_depth(v, depth + 1)
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, (Mapping, list, tuple)):
                _check_depth(v, depth + 1)


def check_context(context: Any) -> list[str] | None:
    if context is None:
        return None
    if isinstance(context, str) or not isinstance(context, (list, tuple)) \
            or not all(isinstance(c, str) for c in context):
        raise TypeError("context must be a list of strings")
    return [check_utf8(c, "context") for c in context]


def turn_texts(turns: Any) -> list[str]:
    """``(speaker, text)`` turns as the ``"speaker: text"`` facts an import stores."""
    if isinstance(turns, (str, bytes)) or not isinstance(turns, Sequence):
        raise TypeError("turns must be a list of (speaker, text) pairs")
    texts = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, (tuple, list)) or len(turn) != 2:
            raise TypeError(f"turn {i} must be a (speaker, text) pair")
        speaker, text = turn
        if not isinstance(speaker, str) or not isinstance(text, str):
            raise TypeError(f"turn {i}: speaker and text must be strings")
        if not text.strip():
            raise ValueError(f"turn {i} has empty text")
        texts.append(f"{speaker.strip()}: {text}" if speaker.strip() else text)
    return texts


def check_metadata_per_turn(metadata_per_turn: Any, turns: int) -> list[dict[str, Any]]:
    if metadata_per_turn is None:
        return [{} for _ in range(turns)]
    if len(metadata_per_turn) != turns:
        raise ValueError(f"metadata_per_turn has {len(metadata_per_turn)} entries for {turns} turns")
    return [check_metadata(m) for m in metadata_per_turn]


def check_sliding_group(group: Any) -> int | None:
    if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 1):
        raise ValueError(f"sliding_group must be None or an integer >= 1, got {group!r}")
    return group


def check_store_options(window: Any, index: Any, encode_queue: int, encode_batch: int,
                        encode_batch_tokens: int | None) -> None:
    """The settings of a store that no default can repair."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an integer >= 0, got {window!r}")
    if index not in ("auto", "exact", "faiss"):
        raise ValueError(f"index must be 'auto', 'exact' or 'faiss', got {index!r}")
    if encode_queue < 1 or encode_batch < 1 or (encode_batch_tokens is not None and encode_batch_tokens < 1):
        raise ValueError("encode_queue, encode_batch and encode_batch_tokens must be >= 1")
