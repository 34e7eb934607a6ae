"""The record the memory store hands out (Mem0-shaped)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any


def text_hash(text: str) -> str:
    """Mem0's content hash of a memory (md5 of the text)."""
    return hashlib.md5(text.encode("utf-8")).hexdigest()


@dataclass
class MemoryItem:
    """One memory fact of one user.

    ``handle`` is the string to put in a prompt instead of the fact's text; the engine replaces
    it with the fact's tokens and injects their precomputed KV. ``encoded`` says whether that KV
    was ready when this item was made (a fact is searchable before it is encoded).
    """

    id: str
    memory: str
    user_id: str
    handle: str
    score: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: str = ""
    updated_at: str = ""
    encoded: bool = False

    @property
    def hash(self) -> str:
        return text_hash(self.memory)

    def to_dict(self) -> dict[str, Any]:
        """Mem0-like dict: ``id, memory, user_id, hash, metadata, created_at, updated_at[, score], handle``."""
        out: dict[str, Any] = {
            "id": self.id,
            "memory": self.memory,
            "user_id": self.user_id,
            "hash": self.hash,
            "metadata": dict(self.metadata),
            "created_at": self.created_at,
            "updated_at": self.updated_at,
        }
        if self.score is not None:
            out["score"] = self.score
        out["handle"] = self.handle
        return out
