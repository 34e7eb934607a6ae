"""``InferScaleStore``: a LangGraph ``BaseStore`` whose items are InferScale memory facts.

LangGraph agents keep long-term memory in a store (``graph.compile(store=...)``,
``create_agent(..., store=...)``), reached from nodes and tools as ``runtime.store``. Swap
``InMemoryStore`` for this class and each item becomes a fact of one user in the engine's
memory store: persisted, searchable with a semantic query, and readable as a **handle** that an
InferScale model (``ChatInferScale``) replaces with the fact's precomputed KV.

Decisions (see docs/langchain.md, "LangGraph store"):

* **Namespace → user.** The label at ``user_index`` (default 0: ``("alice", "memories")``;
  ``-1`` for ``("memories", "alice")``) is the ``user_id`` that owns the item's fact, so its
  handle resolves only for that user: give ``ChatInferScale`` the same ``user_id``. The whole
  namespace and the key are kept in the fact's metadata; two namespaces of one user never mix.
* **Text.** An item's fact text is the first of the ``fields`` (``index={"fields": [...]}``,
  default ``text``, ``content``, ``data``, ``memory``, ``$``; dotted paths reach nested keys)
  that holds a non-empty string; ``"$"`` stands for the whole value as JSON. A value with none
  of the fields is stored as its JSON but not ranked by a query (LangGraph skips missing
  fields too). The rest of the value is kept in metadata and comes back as it was put.
* **Reads.** ``mode="handles"`` (default): in every value read back (``get`` and ``search``)
  the text field holds the fact's handle, so agent code that pastes ``item.value["text"]`` into
  a prompt gets injected KV with no other change; a ``"$"`` item gets ``value["handle"]``.
  ``mode="text"`` reads values exactly as put, as ``InMemoryStore`` does. A handle written back
  (read-modify-write) is stored as the text it stands for.
* **Search.** With a ``query``: the memory store's semantic search (cosine, best first, scores
  on the ``SearchItem``), then ``filter``, ``offset`` and ``limit``; items put with
  ``index=False`` come after the ranked ones, unscored. Without: namespace by namespace, in the
  order items were first put, as ``InMemoryStore`` lists them.
* **Batches** read the state from before the batch, then apply the puts (the last put of a key
  wins), as ``InMemoryStore`` does; a batch's new items of one user are committed in one
  transaction. ``list_namespaces`` lists namespaces that hold items (an emptied one is gone).
* Only items put through this class are visible to it; other facts of the user (chat history,
  ``InferScaleMemory``) are not items, but they share the user's semantic search.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import weakref
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from langgraph.store.base import (
    BaseStore,
    GetOp,
    InvalidNamespaceError,
    Item,
    ListNamespacesOp,
    MatchCondition,
    Op,
    PutOp,
    Result,
    SearchItem,
    SearchOp,
)

from inferscale_integrations._common import (
    SOURCE_KEY,
    EngineConstructors,
    EngineRef,
    RecallMode,
    check_mode,
    check_user_id,
    checks_arguments,
    expand_handles,
)

if TYPE_CHECKING:
    from inferscale_engine import InferScaleEngine
    from inferscale_engine.memory import MemoryItem, MemoryStore

SOURCE = "langgraph"
#: Metadata key of a fact that is a LangGraph item: ``{"namespace", "key", "value", "field", "indexed"}``.
ITEM_KEY = "langgraph"
#: The fields an item's text is taken from, first present wins (``index={"fields": [...]}`` overrides).
DEFAULT_FIELDS = ("text", "content", "data", "memory", "$")
WHOLE = "$"  # the field of an item stored as its JSON
_MAX_K = 1000  # the memory store's largest search

Namespace = tuple[str, ...]


class _Keys:
    """(namespace, key) → fact id of each user's items in one memory store, shared by every
    InferScaleStore on it, built from the store on first use of a user and kept by our writes
    (a fact deleted behind our back is noticed when read)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.users: dict[str, dict[tuple[Namespace, str], str]] = {}


_KEYS: weakref.WeakKeyDictionary[MemoryStore, _Keys] = weakref.WeakKeyDictionary()
_KEYS_LOCK = threading.Lock()


def _keys_of(store: MemoryStore) -> _Keys:
    with _KEYS_LOCK:
        keys = _KEYS.get(store)
        if keys is None:
            keys = _KEYS[store] = _Keys()
        return keys


def _path(field: str) -> list[str]:
    return field.split(".")


def _at(value: Mapping[str, Any], field: str) -> Any:
    node: Any = value
    for part in _path(field):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _without(value: dict[str, Any], field: str) -> dict[str, Any]:
    out = copy.deepcopy(value)
    node: Any = out
    *parents, leaf = _path(field)
    for part in parents:
        node = node[part]
    del node[leaf]
    return out


def _with(value: dict[str, Any], field: str, text: str) -> dict[str, Any]:
    out = copy.deepcopy(value)
    node: Any = out
    *parents, leaf = _path(field)
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = text
    return out


def _time(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp)


class InferScaleStore(EngineConstructors, BaseStore):
    """LangGraph store on an InferScale memory store: items are facts of the namespace's user.

    Args:
        engine / model: the engine (or model alias, shared per process) whose memory store keeps
            the items; build nothing until first used.
        memory_store: a :class:`~inferscale_engine.memory.MemoryStore` to use instead (a
            retrieval-only one works too: no engine, so no KV, but handles and search).
        user_index: which namespace label is the user id (0: ``(user_id, ...)``, -1:
            ``(..., user_id)``).
        index: ``{"fields": [...]}``, the value fields an item's text comes from, first present
            wins (LangGraph's ``IndexConfig``; ``dims`` and ``embed`` are ignored: the memory
            store embeds with its own model).
        mode: ``"handles"`` (text fields read back as handles, for InferScale models) or
            ``"text"`` (values read back exactly as put, for any model).

    Example:
        ```python
        from langgraph.graph import StateGraph
        from inferscale_integrations.langchain import ChatInferScale
        from inferscale_integrations.langgraph import InferScaleStore

        store = InferScaleStore(model="smollm2")            # was InMemoryStore()
        store.put(("alice", "memories"), "dog", {"text": "My dog is called Rex."})
        hits = store.search(("alice", "memories"), query="pet", limit=3)
        hits[0].value["text"]                                 # '<<mem:…>>': injected by ChatInferScale(user_id="alice")
        graph = builder.compile(store=store)
        ```
    """

    supports_ttl = False

    @checks_arguments
    def __init__(
        self,
        *,
        engine: InferScaleEngine | None = None,
        model: str | None = None,
        memory_store: MemoryStore | None = None,
        user_index: int = 0,
        index: Mapping[str, Any] | None = None,
        mode: RecallMode = "handles",
        engine_options: dict[str, Any] | None = None,
    ) -> None:
        if isinstance(user_index, bool) or not isinstance(user_index, int):
            raise TypeError(f"user_index must be an int, got {user_index!r}")
        fields = (index or {}).get("fields") or list(DEFAULT_FIELDS)
        if isinstance(fields, str) or not all(isinstance(f, str) and f for f in fields):
            raise ValueError(f"index['fields'] must be a list of field names, got {fields!r}")
        self.user_index = user_index
        self.fields: list[str] = list(fields)
        self.mode = check_mode(mode)
        self._memory_store = memory_store
        self._engine = EngineRef(engine, model, engine_options) if memory_store is None else None

    @property
    def memory_store(self) -> MemoryStore:
        """The InferScale memory store holding the items."""
        if self._memory_store is None:
            assert self._engine is not None
            self._memory_store = self._engine.get().memory
        return self._memory_store

    def wait(self, timeout: float | None = None) -> None:
        """Block until every item's KV is encoded (its handle then resolves without waiting)."""
        self.memory_store.wait_for_encoding(timeout)

    # ------------------------------------------------------------------ BaseStore

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        """Run ``ops``: reads see the store as it was before the batch; then the puts apply."""
        results: list[Result] = []
        puts: dict[tuple[Namespace, str], PutOp] = {}
        for op in ops:
            if isinstance(op, GetOp):
                results.append(self._get(tuple(op.namespace), str(op.key)))
            elif isinstance(op, SearchOp):
                results.append(self._search(op))
            elif isinstance(op, ListNamespacesOp):
                results.append(self._list_namespaces(op))
            elif isinstance(op, PutOp):
                puts[(tuple(op.namespace), str(op.key))] = op
                results.append(None)
            else:
                raise ValueError(f"unknown store operation {type(op).__name__}")
        if puts:
            self._apply(list(puts.values()))
        return results

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        ops = list(ops)
        return await asyncio.to_thread(self.batch, ops)

    # ------------------------------------------------------------------ users and items

    def _user(self, namespace: Namespace) -> str:
        try:
            label = namespace[self.user_index]
        except IndexError:
            need = self.user_index + 1 if self.user_index >= 0 else -self.user_index
            raise InvalidNamespaceError(
                f"namespace {namespace!r} has no label at user_index={self.user_index}, the user the item "
                f"belongs to: this store needs namespaces of at least {need} labels"
            ) from None
        try:
            return check_user_id(label)
        except ValueError as exc:
            raise InvalidNamespaceError(f"namespace {namespace!r:.120}: its label at user_index={self.user_index} "
                                        f"is the user the item belongs to, and {exc}") from None

    def _users_under(self, prefix: Namespace) -> list[str]:
        """The users whose items may lie under ``prefix``."""
        if 0 <= self.user_index < len(prefix):
            return [self._user(prefix)]
        return self.memory_store.user_ids()

    def _index(self, user: str) -> dict[tuple[Namespace, str], str]:
        keys = _keys_of(self.memory_store)
        with keys.lock:
            found = keys.users.get(user)
            if found is None:
                found = keys.users[user] = {
                    (tuple(meta["namespace"]), meta["key"]): item.id
                    for item, meta in self._items_of(user)
                }
            return found

    def _items_of(self, user: str) -> list[tuple[MemoryItem, dict[str, Any]]]:
        out = []
        for item in self.memory_store.get_all(user_id=user):
            meta = (item.metadata or {}).get(ITEM_KEY)
            if isinstance(meta, dict) and isinstance(meta.get("namespace"), list) and "key" in meta:
                out.append((item, meta))
        return out

    def _fact(self, namespace: Namespace, key: str) -> MemoryItem | None:
        from inferscale_engine.errors import FactNotFoundError

        user = self._user(namespace)
        keys = _keys_of(self.memory_store)
        with keys.lock:
            fact_id = self._index(user).get((namespace, key))
            if fact_id is None:
                return None
            try:
                return self.memory_store.get(fact_id, user_id=user)
            except FactNotFoundError:  # deleted by another API of the store
                self._index(user).pop((namespace, key), None)
                return None

    def _value(self, item: MemoryItem, meta: dict[str, Any], *, read: bool) -> dict[str, Any]:
        """The item's value: as put (``read=False``, or ``mode="text"``), else with its handle."""
        field, rest = meta.get("field", WHOLE), meta.get("value") or {}
        handles = read and self.mode == "handles"
        if field == WHOLE:
            value = copy.deepcopy(rest)
            if handles:
                value["handle"] = item.handle
            return value
        return _with(rest, field, item.handle if handles else item.memory)

    def _to_item(self, item: MemoryItem, meta: dict[str, Any], score: float | None = None,
                 search: bool = False) -> Item:
        namespace, value = tuple(meta["namespace"]), self._value(item, meta, read=True)
        created, updated = _time(item.created_at), _time(item.updated_at)
        if search:
            return SearchItem(namespace, meta["key"], value, created, updated, score=score)
        return Item(value=value, key=meta["key"], namespace=namespace, created_at=created, updated_at=updated)

    # ------------------------------------------------------------------ reads

    def _get(self, namespace: Namespace, key: str) -> Item | None:
        item = self._fact(namespace, key)
        if item is None:
            return None
        return self._to_item(item, item.metadata[ITEM_KEY])

    def _candidates(self, op: SearchOp) -> list[tuple[MemoryItem, dict[str, Any]]]:
        """Items under the prefix that pass the filter, namespace by namespace in first-put order."""
        from langgraph.store.memory import _compare_values  # LangGraph's own filter semantics

        prefix = tuple(op.namespace_prefix)
        found = []
        for user in self._users_under(prefix):
            for item, meta in self._items_of(user):
                namespace = tuple(meta["namespace"])
                if namespace[: len(prefix)] != prefix:
                    continue
                if op.filter:
                    value = self._value(item, meta, read=False)
                    if not all(_compare_values(value.get(k), v) for k, v in op.filter.items()):
                        continue
                found.append((item, meta))
        found.sort(key=lambda pair: pair[0].created_at)
        order: dict[Namespace, int] = {}
        for _, meta in found:
            order.setdefault(tuple(meta["namespace"]), len(order))
        found.sort(key=lambda pair: order[tuple(pair[1]["namespace"])])
        return found

    def _search(self, op: SearchOp) -> list[SearchItem]:
        candidates = self._candidates(op)
        start, stop = max(op.offset, 0), max(op.offset, 0) + max(op.limit, 0)
        if not op.query or not candidates:
            return [self._to_item(i, m, search=True) for i, m in candidates[start:stop]]  # type: ignore[misc]
        scores = self._scores(op.query, candidates, need=stop)
        ranked = sorted((p for p in candidates if p[0].id in scores), key=lambda p: -scores[p[0].id])
        unscored = [p for p in candidates if p[0].id not in scores]
        return [self._to_item(i, m, scores.get(i.id), search=True)  # type: ignore[misc]
                for i, m in (ranked + unscored)[start:stop]]

    def _scores(self, query: str, candidates: list[tuple[MemoryItem, dict[str, Any]]],
                need: int) -> dict[str, float]:
        """Cosine scores of the indexed candidates, from the memory store's search, per user:
        widening the search until ``need`` candidates are scored or the user's facts run out."""
        wanted: dict[str, set[str]] = {}
        for item, meta in candidates:
            if meta.get("indexed", True):
                wanted.setdefault(item.user_id, set()).add(item.id)
        scores: dict[str, float] = {}
        for user, ids in wanted.items():
            k = min(_MAX_K, max(2 * need, len(ids), 1))
            while True:
                hits = self.memory_store.search(query, user_id=user, k=k)
                found = {h.id: float(h.score or 0.0) for h in hits if h.id in ids}
                if len(found) >= min(need, len(ids)) or len(hits) < k or k == _MAX_K:
                    break
                k = min(_MAX_K, k * 4)
            scores.update(found)
        return scores

    def _list_namespaces(self, op: ListNamespacesOp) -> list[Namespace]:
        from langgraph.store.memory import _does_match  # LangGraph's own prefix/suffix/wildcard rules

        prefixes = [c.path for c in op.match_conditions or () if c.match_type == "prefix"]
        prefix: Namespace = tuple(prefixes[0]) if prefixes and "*" not in prefixes[0] else ()
        namespaces: set[Namespace] = set()
        for user in self._users_under(prefix):
            namespaces.update(tuple(meta["namespace"]) for _, meta in self._items_of(user))
        conditions: tuple[MatchCondition, ...] = tuple(op.match_conditions or ())
        kept = [ns for ns in namespaces if all(_does_match(c, ns) for c in conditions)]
        if op.max_depth is not None:
            kept = list({ns[: op.max_depth] for ns in kept})
        return sorted(kept)[op.offset : op.offset + op.limit]

    # ------------------------------------------------------------------ writes

    def _text_of(self, value: dict[str, Any], index: Literal[False] | list[str] | None) -> tuple[str, str, bool]:
        """(field, text, indexed) of a value: the first configured field holding a non-empty
        string, or ``"$"`` (the value's JSON), indexed only when ``"$"`` is one of the fields
        (as LangGraph skips missing fields)."""
        fields = index if isinstance(index, list) and index else self.fields
        for field in fields:
            if field == WHOLE:
                return WHOLE, json.dumps(value, ensure_ascii=False), index is not False
            text = _at(value, field)
            if isinstance(text, str) and text.strip():
                return field, text, index is not False
        return WHOLE, json.dumps(value, ensure_ascii=False), False

    def _apply(self, puts: list[PutOp]) -> None:
        store = self.memory_store
        by_user: dict[str, list[PutOp]] = {}
        for op in puts:
            by_user.setdefault(self._user(tuple(op.namespace)), []).append(op)
        keys = _keys_of(store)
        for user, ops in by_user.items():
            new: list[tuple[Namespace, str, str, dict[str, Any]]] = []
            with keys.lock:
                index = self._index(user)
                for op in ops:
                    namespace, key = tuple(op.namespace), str(op.key)
                    current = self._fact(namespace, key)
                    if op.value is None:
                        if current is not None:
                            store.delete(current.id, user_id=user)
                            index.pop((namespace, key), None)
                        continue
                    value = json.loads(json.dumps(dict(op.value)))  # a copy, JSON-checked like the store's metadata
                    field, text, indexed = self._text_of(value, op.index)
                    text = expand_handles(text, store=store, user_id=user)  # a value read back with handles
                    if field != WHOLE:
                        value = _with(value, field, text)
                    meta = {
                        SOURCE_KEY: SOURCE,
                        ITEM_KEY: {
                            "namespace": list(namespace), "key": key,
                            "value": value if field == WHOLE else _without(value, field),
                            "field": field, "indexed": indexed,
                        },
                    }
                    if current is None:
                        new.append((namespace, key, text, meta))
                        continue
                    if current.memory != text:
                        store.update(current.id, text, user_id=user)
                    store.update_metadata(current.id, meta, user_id=user)
                if new:
                    items = store.add_texts([t for _, _, t, _ in new], user_id=user, metadata=[m for *_, m in new])
                    for (namespace, key, _, _), item in zip(new, items):
                        index[(namespace, key)] = item.id

    def __repr__(self) -> str:
        return f"InferScaleStore(user_index={self.user_index}, fields={self.fields!r}, mode={self.mode!r})"
