"""Per-user memory whose facts carry precomputed KV (Mem0-style API).

``MemoryStore`` keeps facts in SQLite (or in PostgreSQL, shared by replicas), embeddings in a per-user vector index and each fact's
KV in device / host / disk tiers; it is also the engine's ``FactSource``: it turns the
handles in a prompt into spans whose KV the engine injects. See ``docs/memory.md``.
"""

from inferscale_engine.memory.item import MemoryItem
from inferscale_engine.memory.store import MemoryStore

__all__ = ["MemoryItem", "MemoryStore"]
