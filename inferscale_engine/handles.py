"""The one fact-handle format.

A handle is the short string that frameworks carry around instead of a fact's text:

    <<mem:3f9a0c1d2e4b5a69:9c1e8b7d6a5f4e3c>>
          fact id (16 hex)  MAC (16 hex)

The MAC is HMAC-SHA256 over ``user_id`` and ``fact_id`` with a per-store secret, so a handle
cannot be forged, altered, or replayed by another user: :meth:`HandleCodec.verify` recomputes
it for the requesting user. Existence and model fingerprint are checked by the store that
resolves the fact id, not here.
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass

from inferscale_engine.errors import ForgedHandleError, HandleError, MalformedHandleError

__all__ = [
    "HANDLE_PATTERN",
    "Handle",
    "HandleCodec",
    "HandleError",
    "ForgedHandleError",
    "MalformedHandleError",
    "find_handles",
    "split_on_handles",
]

_ID_HEX = 16
_MAC_HEX = 16

# Matches anything handle-shaped, so malformed ones are reported rather than sent as text.
_LOOSE = re.compile(r"<<mem:([^<>\s]*)>>")
HANDLE_PATTERN = re.compile(rf"<<mem:([0-9a-f]{{{_ID_HEX}}}):([0-9a-f]{{{_MAC_HEX}}})>>")


@dataclass(frozen=True, slots=True)
class Handle:
    """A parsed handle: where it sits in the text and which fact it names."""

    fact_id: str
    mac: str
    start: int
    end: int

    @property
    def text(self) -> str:
        return f"<<mem:{self.fact_id}:{self.mac}>>"


def find_handles(text: str) -> list[Handle]:
    """All handles in ``text``, in order. Raises :class:`MalformedHandleError` on a bad one."""
    handles = []
    for m in _LOOSE.finditer(text):
        strict = HANDLE_PATTERN.fullmatch(m.group(0))
        if strict is None:
            raise MalformedHandleError(f"malformed memory handle {m.group(0)[:64]!r}")
        handles.append(Handle(strict.group(1), strict.group(2), m.start(), m.end()))
    return handles


def split_on_handles(text: str) -> tuple[list[str], list[Handle]]:
    """Split ``text`` into ``len(handles) + 1`` text pieces around its handles.

    ``pieces[0] + handles[0].text + pieces[1] + ... == text`` always holds.
    """
    handles = find_handles(text)
    pieces, cursor = [], 0
    for h in handles:
        pieces.append(text[cursor : h.start])
        cursor = h.end
    pieces.append(text[cursor:])
    return pieces, handles


class HandleCodec:
    """Mints and verifies handles with one store's secret."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("handle secret must be at least 16 bytes")
        self._secret = secret

    def _mac(self, user_id: str, fact_id: str) -> str:
        msg = f"{len(user_id)}:{user_id}|{fact_id}".encode()
        return hmac.digest(self._secret, msg, "sha256").hex()[:_MAC_HEX]  # one-shot: no HMAC object per handle

    def make(self, user_id: str, fact_id: str) -> str:
        if not re.fullmatch(rf"[0-9a-f]{{{_ID_HEX}}}", fact_id):
            raise ValueError(f"fact id must be {_ID_HEX} lowercase hex digits, got {fact_id!r}")
        return f"<<mem:{fact_id}:{self._mac(user_id, fact_id)}>>"

    def verify(self, handle: Handle | str, user_id: str) -> str:
        """Return the fact id if ``handle`` was minted for ``user_id`` by this store."""
        if isinstance(handle, str):
            found = find_handles(handle)
            if len(found) != 1 or found[0].text != handle.strip():
                raise MalformedHandleError(f"not a single memory handle: {handle[:64]!r}")
            handle = found[0]
        if not hmac.compare_digest(handle.mac, self._mac(user_id, handle.fact_id)):
            raise ForgedHandleError(forged_handle_message(handle.text, user_id))
        return handle.fact_id


def forged_handle_message(handle: str, user_id: str) -> str:
    # The owner is not named: over HTTP that would tell one tenant another's user id.
    return (
        f"memory handle {handle} was not issued to user_id {user_id!r}: it belongs to another user, or was "
        "forged or altered. Give the LLM the same user_id as the memory (or retriever) that recalled it"
    )
