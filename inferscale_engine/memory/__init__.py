"""Per-user memory whose facts carry precomputed KV (Mem0-style API).

``MemoryStore`` keeps facts in SQLite (or in PostgreSQL, shared by replicas), embeddings in a per-user vector index and each fact's
KV in device / host / disk tiers; it is also the engine's ``FactSource``: it turns the
handles in a prompt into spans whose KV the engine injects. See ``docs/memory.md``.

Where each concept lives (imports go down this list, never up; the front door's leaf modules
``item``, ``validation`` and ``encoding`` may be imported from anywhere below it)::

    store.py        the front door: MemoryStore
    item.py         what it hands out (MemoryItem)
    validation.py   what it accepts from callers
    encoding.py     what it needs from a model (Encoder, ChatGenerate)
    load.py         opening a store: facts and encoded flags brought up to date
    replica.py      following the other replicas of a shared store
    kv/             the KV: tiers (device, host, disk), DMA, tier speeds; the keeper and its queue
    meta/           the metadata: database (SQLite, PostgreSQL), folder and secret, live facts, vector index
    text/           text: encoding context, splitting, extraction, embeddings
"""

from inferscale_engine.memory.item import MemoryItem
from inferscale_engine.memory.store import MemoryStore
from inferscale_engine.memory.text.splitting import split_facts

__all__ = ["MemoryItem", "MemoryStore", "split_facts"]
