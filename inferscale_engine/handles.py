"""The one fact-handle format.

A handle is the short string that frameworks carry around instead of a fact's text:

    <<mem:3f9a0c1d2e4b5a69:9c1e8b7d6a5f4e3c>>
          fact id (16 hex)  MAC (16 hex)

The MAC is HMAC-SHA256 over ``user_id`` and ``fact_id`` with a per-store secret, so a handle
cannot be forged, altered, or replayed by another user: :meth:`HandleCodec.verify` recomputes
it for the requesting user. Existence and model fingerprint are checked by the store that
resolves the fact id, not here.

A codec remembers the handles it found genuine (:data:`VERIFIED_HANDLES` of them, least
recently used dropped first): a request of k memories names k handles, mostly ones served
before, and a remembered one costs a dict lookup instead of an HMAC (~1.5 µs each).
"""

from __future__ import annotations

import functools
import hmac
import re
from dataclasses import dataclass

from inferscale_engine.errors import ForgedHandleError, HandleError, MalformedHandleError

__all__ = [
    "HANDLE_PATTERN",
    "VERIFIED_HANDLES",
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

HANDLE_PATTERN = re.compile(rf"<<mem:([0-9a-f]{{{_ID_HEX}}}):([0-9a-f]{{{_MAC_HEX}}})>>")
# Matches anything handle-shaped (no '<', '>' or whitespace between "<<mem:" and ">>"), so
# malformed ones are reported rather than sent as text; a well-formed one matches the first
# alternative, with its fact id and MAC as groups 1 and 2, and a malformed one the second: one
# pass, where a loose pattern and then a strict fullmatch of each match took 1.4x as long (a
# request names k handles).
_SCAN = re.compile(rf"<<mem:(?:([0-9a-f]{{{_ID_HEX}}}):([0-9a-f]{{{_MAC_HEX}}})|[^<>\s]*)>>")

#: Genuine handles a :class:`HandleCodec` remembers (~0.3 KB each): a few thousand users' working
#: sets of a few hundred memories, and a server's worth of k=200 requests.
VERIFIED_HANDLES = 1 << 15


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


# A request names k handles: find_handles fills each Handle's slots through their descriptors
# rather than calling the frozen dataclass's __init__ (a Python frame and four object.__setattr__
# calls), ~0.55 -> ~0.2 µs a handle. Handle has no __post_init__ and no defaults to skip.
_new_handle = object.__new__
_set_fact_id, _set_mac, _set_start, _set_end = (Handle.__dict__[name].__set__ for name in ("fact_id", "mac", "start", "end"))


def find_handles(text: str) -> list[Handle]:
    """All handles in ``text``, in order. Raises :class:`MalformedHandleError` on a bad one."""
    handles = []
    for m in _SCAN.finditer(text):
        fact_id, mac = m.groups()
        if fact_id is None:
            raise MalformedHandleError(f"malformed memory handle {m.group(0)[:64]!r}")
        h = _new_handle(Handle)
        _set_fact_id(h, fact_id)
        _set_mac(h, mac)
        start, end = m.span()
        _set_start(h, start)
        _set_end(h, end)
        handles.append(h)
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
    """Mints and verifies handles with one store's secret, remembering up to ``remember``
    handles found genuine (see the module docstring)."""

    def __init__(self, secret: bytes, *, remember: int = VERIFIED_HANDLES) -> None:
        if len(secret) < 16:
            raise ValueError("handle secret must be at least 16 bytes")
        self._secret = secret

        def check(user_id: str, fact_id: str, mac: str) -> None:
            if not hmac.compare_digest(mac, _mac(secret, user_id, fact_id)):
                raise ForgedHandleError(forged_handle_message(f"<<mem:{fact_id}:{mac}>>", user_id))

        # lru_cache keeps return values, never exceptions: only verdicts of "genuine" are
        # remembered, keyed by the user, the fact id and the MAC itself, so a forged, altered or
        # another user's handle misses and is refused by a fresh HMAC every time. A codec holds
        # one secret for life (a rotation needs the store closed; the reopened store makes a new
        # codec), so no verdict outlives the secret it was made under.
        self._genuine = functools.lru_cache(maxsize=remember)(check)

    def make(self, user_id: str, fact_id: str) -> str:
        if not re.fullmatch(rf"[0-9a-f]{{{_ID_HEX}}}", fact_id):
            raise ValueError(f"fact id must be {_ID_HEX} lowercase hex digits, got {fact_id!r}")
        return f"<<mem:{fact_id}:{_mac(self._secret, user_id, fact_id)}>>"

    def verify(self, handle: Handle | str, user_id: str) -> str:
        """Return the fact id if ``handle`` was minted for ``user_id`` by this store."""
        if isinstance(handle, str):
            found = find_handles(handle)
            if len(found) != 1 or found[0].text != handle.strip():
                raise MalformedHandleError(f"not a single memory handle: {handle[:64]!r}")
            handle = found[0]
        self._genuine(user_id, handle.fact_id, handle.mac)
        return handle.fact_id


def _mac(secret: bytes, user_id: str, fact_id: str) -> str:
    msg = f"{len(user_id)}:{user_id}|{fact_id}".encode()
    return hmac.digest(secret, msg, "sha256").hex()[:_MAC_HEX]  # one-shot: no HMAC object per handle


def forged_handle_message(handle: str, user_id: str) -> str:
    # The owner is not named: over HTTP that would tell one tenant another's user id.
    return (
        f"memory handle {handle} was not issued to user_id {user_id!r}: it belongs to another user, or was "
        "forged or altered. Give the LLM the same user_id as the memory (or retriever) that recalled it"
    )
