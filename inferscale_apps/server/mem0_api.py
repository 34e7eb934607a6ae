"""Memory endpoints: the Mem0 platform API that the ``mem0ai`` clients call, on InferScale's store.

Routes (every one with and without its trailing slash)::

    GET    /v1/ping/                          key check; the client's constructor calls it
    POST   /v1/memories/                      add (1.x client, which sends output_format; without
                                              it InferScale's own contract: infer=false)
    POST   /v3/memories/add/                  add (2.x client; Mem0's default: infer=true)
    POST   /v1/memories/search/               search {query, user_id, limit}
    POST   /v2/memories/search/  /v3/memories/search/   search {query, filters | entity ids, top_k}
    POST   /v1/memories/prefetch/             {user_id}: InferScale's own; move the user's memories'
                                              KV from disk to memory before a session starts
    GET    /v1/memories/?user_id=             list, by entity ids in the query
    POST   /v2/memories/  /v3/memories/       list {filters | entity ids}, ?page=&page_size=
    DELETE /v1/memories/?user_id=|agent_id=|run_id=|app_id=
    GET|PUT|DELETE /v1/memories/{id}/         one memory
    GET    /v1/memories/{id}/history/         its ADD / UPDATE / DELETE events, also once deleted
    GET    /v1/entities/                      users, agents, runs and apps that have memories
    DELETE /v2/entities/{type}/{name}/        forget one of them

Entities. The store keys facts by one user id: a memory with a ``user_id`` is stored under it
(so chat requests with ``user`` = that id recall it), one with only an agent, run or app id
under ``@agent:<id>`` (``@run:``, ``@app:``). The other ids are kept in the fact's metadata
under ``_entities`` and filtered on here; clients never see that key.

Ownership. Mem0 scopes per-id calls by API key, and its clients send no user with them, so
without entity ids a per-id call may touch any memory (the key holder owns the store). A
caller that names itself (``user_id`` / ``agent_id`` / ``run_id`` / ``app_id`` query
parameter, or ``X-User-Id``) gets 404 for a memory that is not its own.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Request

from inferscale_apps.server.errors import APIError, api_error
from inferscale_apps.server.state import ServerState, State, header_user
from inferscale_engine.errors import check_utf8
from inferscale_engine.memory.encoding import engine_generate
from inferscale_engine.memory.text.extraction import extract_actions
from inferscale_engine.memory.validation import RESERVED_USER_PREFIXES

ENTITY_KEYS = ("user_id", "agent_id", "run_id", "app_id")
MAX_USER_ID = 128  # the store's limit
MAX_ENTITY_ID = MAX_USER_ID - len("@agent:")  # agent/run/app-only memories are stored under "@agent:<id>"
ENTITY_TYPES = {"user": "user_id", "agent": "agent_id", "run": "run_id", "app": "app_id"}
META_KEY = "_entities"
#: Filter keys this server evaluates; anything else is refused rather than ignored, since an
#: ignored filter would widen a search or a delete.
_OPS = ("eq", "ne", "in", "nin")
#: Deepest AND / OR / NOT nesting accepted; checked before recursing, so a deeper filter is a 400,
#: not a RecursionError (real filters nest two or three levels).
MAX_FILTER_DEPTH = 32
#: Largest page number accepted (a page past the last one is empty, never an error).
MAX_PAGE = 2**31 - 1

#: Mem0's metadata filter is an equality on each key; we keep it at that.
_EXTRACTION_MAX_TOKENS = 512


@dataclass(frozen=True)
class Entities:
    user_id: str | None = None
    agent_id: str | None = None
    run_id: str | None = None
    app_id: str | None = None

    def any(self) -> bool:
        return any(getattr(self, k) for k in ENTITY_KEYS)

    def store_key(self) -> str:
        if self.user_id:
            return self.user_id
        for k in ("agent_id", "run_id", "app_id"):
            v = getattr(self, k)
            if v:
                return f"@{k[:-3]}:{v}"
        raise AssertionError("no entity id")

    def extra(self) -> dict[str, str]:
        return {k: getattr(self, k) for k in ("agent_id", "run_id", "app_id") if getattr(self, k)}


def user_of_key(key: str) -> str | None:
    """The ``user_id`` of a store key: None for the key of an agent, run or app memory."""
    return None if key.startswith(RESERVED_USER_PREFIXES) else key


def entities_of(item: Any) -> dict[str, str | None]:
    """The four entity ids of a stored fact (``user_id`` is None for agent/run/app-only ones)."""
    extra = (item.metadata or {}).get(META_KEY) or {}
    return {"user_id": user_of_key(item.user_id), "agent_id": extra.get("agent_id"), "run_id": extra.get("run_id"),
            "app_id": extra.get("app_id")}


def memory_dict(item: Any, **more: Any) -> dict[str, Any]:
    """Mem0's memory object, plus InferScale's ``handle`` (what a chat prompt cites)."""
    meta = dict(item.metadata or {})
    meta.pop(META_KEY, None)
    out: dict[str, Any] = {"id": item.id, "memory": item.memory, **entities_of(item), "hash": item.hash,
                           "metadata": meta, "categories": [], "created_at": item.created_at,
                           "updated_at": item.updated_at}
    if item.score is not None:
        out["score"] = item.score
    out["handle"] = item.handle
    out.update(more)
    return out


# ---------------------------------------------------------------------------- filters


Pred = Callable[[dict[str, Any]], bool]


def _every(preds: list[Pred]) -> Pred:
    return lambda e: all(p(e) for p in preds)


def _some(preds: list[Pred]) -> Pred:
    return lambda e: any(p(e) for p in preds)


def _none(preds: list[Pred]) -> Pred:
    return lambda e: not any(p(e) for p in preds)


def _metadata_equals(want: dict[str, Any]) -> Pred:
    return lambda e: all(e["metadata"].get(k) == v for k, v in want.items())


@dataclass(frozen=True)
class Selection:
    """A compiled filter."""

    pred: Pred  # over ``entities_of`` + ``{"metadata": ...}``
    users: set[str] | None  # the store users worth scanning (None: all of them)
    pinned: bool  # names an entity id by equality in every OR branch, so it cannot reach everyone


def compile_filters(f: Any, error: Callable[[str], Exception], depth: int = 0) -> Selection:
    """Compile Mem0's filter object; ``error(message)`` makes the exception for a bad one."""
    if not isinstance(f, dict):
        raise error("filters must be an object")
    if depth > MAX_FILTER_DEPTH:
        raise error(f"filters are nested too deep (AND / OR / NOT at most {MAX_FILTER_DEPTH} levels)")
    preds: list[Pred] = []
    users: set[str] | None = None
    pinned = False

    def narrow(s: set[str] | None) -> None:
        nonlocal users
        if s is not None:
            users = s if users is None else users & s

    for key, value in f.items():
        if key in ("AND", "OR", "NOT"):
            if not isinstance(value, list) or not value:
                raise error(f"filters.{key} must be a non-empty list")
            parts = [compile_filters(v, error, depth + 1) for v in value]
            ps = [p.pred for p in parts]
            if key == "AND":
                preds.append(_every(ps))
                for p in parts:
                    narrow(p.users)
                pinned |= any(p.pinned for p in parts)
            elif key == "OR":
                preds.append(_some(ps))
                if all(p.users is not None for p in parts):
                    narrow(set[str]().union(*(p.users for p in parts if p.users is not None)))
                pinned |= all(p.pinned for p in parts)
            else:  # "not alice" is everyone else: a NOT pins nothing
                preds.append(_none(ps))
        elif key in ENTITY_KEYS:
            pred, ids = _entity_pred(key, value, error)
            preds.append(pred)
            pinned |= bool(ids)
            if key == "user_id":
                narrow(ids)
        elif key == "metadata":
            if not isinstance(value, dict):
                raise error("filters.metadata must be an object of key: value equalities")
            preds.append(_metadata_equals(value))
        else:
            raise error(f"filter {key!r} is not supported by this server (supported: AND, OR, NOT, "
                        f"{', '.join(ENTITY_KEYS)}, metadata)")
    return Selection(_every(preds), users, pinned)


def _entity_pred(key: str, value: Any, error: Callable[[str], Exception]) -> tuple[Pred, set[str] | None]:
    """The predicate, and the ids it selects by equality (None for ``ne`` / ``nin``)."""
    # Every id is literal, "*" included: Mem0's wildcard would let any caller that may name a
    # user (an end user's id passed through by an app) read or delete every user's memories.
    if isinstance(value, str):
        return (lambda e: e[key] == value), {value}
    if isinstance(value, dict) and len(value) == 1:
        op, arg = next(iter(value.items()))
        if op in ("eq", "ne") and isinstance(arg, str):
            return ((lambda e: e[key] == arg), {arg}) if op == "eq" else ((lambda e: e[key] != arg), None)
        if op in ("in", "nin") and isinstance(arg, list) and all(isinstance(a, str) for a in arg):
            if op == "in":
                return (lambda e: e[key] in arg), set(arg)
            return (lambda e: e[key] not in arg), None
    raise error(f"filters.{key} must be a string or one of {{{', '.join(_OPS)}: ...}}")


# ---------------------------------------------------------------------------- requests


def _bad(message: str, param: str | None = None, code: str = "invalid_request") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def _not_found(what: str) -> APIError:
    return APIError(404, what, "not_found_error", None, "memory_not_found")


async def json_body(request: Request) -> dict[str, Any]:
    """The dependency of the routes that take a body: a JSON object (a 400 otherwise)."""
    try:
        body = await request.json()
    except Exception:  # noqa: BLE001  (any undecodable body is the client's error)
        raise _bad("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    return body


def _entity_arg(src: dict[str, Any], key: str) -> str | None:
    v = src.get(key)
    if v is None or v == "":
        return None
    if not isinstance(v, str):
        raise _bad(f"{key} must be a string", key)
    # Checked here, not only by the store: a listing over an id the store would refuse must
    # be a 400, not an empty success.
    limit = MAX_USER_ID if key == "user_id" else MAX_ENTITY_ID
    if not v.strip() or len(v) > limit or not v.isprintable():
        raise _bad(f"{key} must be a non-empty string of at most {limit} printable characters", key)
    if key == "user_id" and v.startswith(RESERVED_USER_PREFIXES):
        raise _bad(f"user_id {v!r} is reserved for agent, run and app memories", key)
    return v


def _entities_from(src: dict[str, Any]) -> Entities:
    return Entities(**{k: _entity_arg(src, k) for k in ENTITY_KEYS})


async def caller(request: Request) -> Entities:
    """The dependency of the per-id routes: who calls, by the entity ids of the query, and
    ``X-User-Id`` for a ``user_id`` the query does not give."""
    e = _entities_from(dict(request.query_params))
    header = header_user(request)
    if header and not e.user_id:
        e = Entities(header, e.agent_id, e.run_id, e.app_id)
    return e


Body = Annotated[dict[str, Any], Depends(json_body)]
Caller = Annotated[Entities, Depends(caller)]


def _view(item: Any) -> dict[str, Any]:
    meta = dict(item.metadata or {})
    meta.pop(META_KEY, None)
    return {**entities_of(item), "metadata": meta}


def _selection(src: dict[str, Any], what: str) -> Selection:
    """Entity ids given at top level and ``filters``, AND-ed (Mem0 clients send either).

    It must pin an entity id by equality in every branch: metadata, NOT, ``ne`` or ``nin``
    alone would select every user's memories."""
    top = _entities_from(src)
    clauses: list[dict[str, Any]] = [{k: v} for k, v in vars(top).items() if v]
    filters = src.get("filters")
    if filters:
        clauses.append(filters)
    sel = compile_filters({"AND": clauses}, _bad) if clauses else None
    if sel is None or not sel.pinned:
        raise _bad(f"{what} needs at least one of {', '.join(ENTITY_KEYS)} equal to an id (a string, "
                   "{\"eq\": id} or {\"in\": [ids]}), at top level or in filters, and in every OR branch; "
                   "metadata, NOT, ne and nin alone would select every user's memories",
                   "filters", "entity_id_required")
    return sel


def _owned_by(item: Any, who: Entities) -> bool:
    if not who.any():
        return True
    e = entities_of(item)
    if who.user_id and item.user_id != who.user_id:
        return False
    return all(e[k] == v for k, v in who.extra().items())


def _owned(state: ServerState, memory_id: str, who: Entities) -> Any:
    try:
        item = state.store().get(memory_id)
    except (LookupError, ValueError, TypeError, PermissionError):
        raise _not_found(f"memory {memory_id!r} not found") from None
    if not _owned_by(item, who):
        raise _not_found(f"memory {memory_id!r} not found")
    return item


def _matching(state: ServerState, sel: Selection) -> list[Any]:
    s = state.store()
    keys = sorted(sel.users) if sel.users is not None else s.user_ids()
    out: list[Any] = []
    for key in keys:
        out.extend(i for i in s.get_all(user_id=key) if sel.pred(_view(i)))
    return out


async def _run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Store calls (embedding, SQLite, extraction) block: keep them off the event loop. What
    they raise is answered as :func:`~inferscale_apps.server.errors.api_error` maps it."""
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except APIError:
        raise
    except Exception as exc:
        raise api_error(exc) from exc


# ---------------------------------------------------------------------------- routes

router = APIRouter()


def _route(method: str, *paths: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the route at each path, with and without its trailing slash (the schema lists
    the path as written)."""
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for path in paths:
            for p in {path, path.rstrip("/")}:
                router.add_api_route(p, fn, methods=[method], include_in_schema=p == path)
        return fn
    return deco


# ------------------------------------------------------------------ ping


@_route("GET", "/v1/ping/")
def ping() -> dict[str, Any]:
    # The 1.x client adds org_id / project_id to every later call; we accept and ignore them.
    return {"status": "ok", "message": "InferScale memory API", "org_id": "inferscale", "project_id": "default",
            "user_email": None}


# ------------------------------------------------------------------ add


def _texts_of(messages: Any) -> list[tuple[str, str]]:
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    elif isinstance(messages, dict):
        messages = [messages]
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a string, a message or a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with 'role' and 'content'", f"messages.{i}")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts
            if not all(isinstance(p, dict) and p.get("type") in ("text", "input_text") and isinstance(p.get("text"), str) for p in content):
                raise _bad(f"messages[{i}]: only text content is supported", f"messages.{i}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content must be a string", f"messages.{i}.content")
        if m["role"] not in ("system", "developer", "user", "assistant", "tool", "function"):
            raise _bad(f"messages[{i}]: unknown role {m['role']!r}", f"messages.{i}.role")
        out.append((m["role"], content))
    if not any(c.strip() for _, c in out):
        raise _bad("nothing to remember: messages are empty", "messages")
    return out


def _add_inferred(state: ServerState, conversation: list[str], who: Entities, meta: dict[str, Any],
                  context: Any) -> list[dict[str, Any]]:
    """Mem0's two model calls on the co-located engine; a reply we cannot use is a 422, so
    a client never gets an empty success for messages that were not stored."""
    s = state.store()
    key = who.store_key()
    generate = engine_generate(state.engine, max_tokens=_EXTRACTION_MAX_TOKENS)

    def gen(messages: list[dict[str, str]]) -> str:
        return generate(messages, key)

    scope = {k: v for k, v in vars(who).items() if v}

    def similar(fact: str) -> list[tuple[str, str]]:
        hits = s.search(fact, user_id=key, k=20)
        return [(h.id, h.memory) for h in hits if all(entities_of(h)[k] == v for k, v in scope.items())][:5]

    extraction = extract_actions(gen, conversation, similar)
    if extraction.failed_reply is not None:
        raise APIError(422, "infer=true: the served model did not answer the memory extraction prompt with the "
                            "JSON asked for, or nothing in it was usable (empty or placeholder texts, ids of "
                            "memories it was not shown), so nothing was stored. Retry, use a stronger model, "
                            "or send infer=false to store the messages as they are. Its reply began: "
                            f"{extraction.failed_reply[:200]!r}",
                       "invalid_request_error", "infer", "extraction_failed")
    out: list[dict[str, Any]] = []
    for a in extraction.actions:
        # parse_actions gives an ADD its text, an UPDATE both, a DELETE its fact id.
        if a.event == "ADD" and a.text is not None:
            for item in s.add(a.text, user_id=key, metadata=meta, context=context):
                out.append(memory_dict(item, event="ADD"))
        elif a.event == "UPDATE" and a.fact_id is not None and a.text is not None:
            before = _owned(state, a.fact_id, who)
            item = s.update(a.fact_id, a.text, user_id=key)
            out.append(memory_dict(item, event="UPDATE", previous_memory=before.memory))
        elif a.event == "DELETE" and a.fact_id is not None:
            before = _owned(state, a.fact_id, who)
            s.delete(a.fact_id, user_id=key)
            out.append(memory_dict(before, event="DELETE"))
    return out


def _add(state: ServerState, body: dict[str, Any], *, infer_default: bool) -> dict[str, Any] | list[Any]:
    who = _entities_from(body)
    if not who.any():
        raise _bad("add needs at least one of user_id, agent_id, run_id, app_id", "user_id")
    messages = _texts_of(body.get("messages"))
    meta = body.get("metadata") or {}
    if not isinstance(meta, dict):
        raise _bad("metadata must be an object", "metadata")
    if META_KEY in meta:
        raise _bad(f"metadata key {META_KEY!r} is reserved", "metadata")
    if who.extra():
        meta = {**meta, META_KEY: who.extra()}
    infer = body.get("infer", infer_default)
    if not isinstance(infer, bool):
        raise _bad("infer must be true or false", "infer")
    s = state.store()
    key = who.store_key()
    # By default every fact is encoded after the system head that memory_k and `inferscale
    # chat` recall memories under, so the first recalled fact is injected as prefill would be.
    context = body["context"] if "context" in body else state.default_context()
    if infer:
        results = _add_inferred(state, [f"{r.capitalize()}: {c}" for r, c in messages if c.strip()], who, meta, context)
    else:
        # Mem0 with infer=false stores each non-system message's content as it is.
        kept = [(r, c) for r, c in messages if r not in ("system", "developer") and c.strip()]
        if not kept:
            raise _bad("nothing to remember: infer=false stores user and assistant messages, and there are none",
                       "messages")
        # One call, one transaction: a crash keeps the request's messages all or none.
        items = s.add_texts([c for _, c in kept], user_id=key, metadata=[{**meta, "role": r} for r, _ in kept],
                            context=context)
        results = [memory_dict(i, event="ADD") for i in items]
    if body.get("output_format") == "v1.0":
        return results
    return {"results": results}


@_route("POST", "/v1/memories/")
async def add_v1(body: Body, state: State) -> Any:
    # ``output_format`` is a Mem0 platform parameter that the mem0ai clients always send: such
    # a request gets Mem0's semantics (infer defaults to true, contents stored as they are).
    # Without it, InferScale's original contract: infer=false. Either way a message's content is
    # stored as PUT stores it, without a "User: " prefix (prefixed facts were recalled far worse).
    return await _run(_add, state, body, infer_default="output_format" in body)


@_route("POST", "/v3/memories/add/")
async def add_v3(body: Body, state: State) -> Any:
    return await _run(_add, state, body, infer_default=True)


# ------------------------------------------------------------------ search / list


def _search(state: ServerState, body: dict[str, Any], legacy: bool) -> dict[str, Any]:
    query = body.get("query")
    if not isinstance(query, str) or not query.strip():
        raise _bad("query must be a non-empty string", "query")
    try:
        check_utf8(query, "query")  # also when no user in scope has facts to search
    except ValueError as exc:
        raise _bad(str(exc), "query") from None
    top_k = body.get("top_k", body.get("limit", 5 if legacy else 10))
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= 1000:
        raise _bad("top_k must be an integer from 1 to 1000", "top_k")
    threshold = body.get("threshold")
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))):
        raise _bad("threshold must be a number", "threshold")
    sel = _selection(body, "search")
    s = state.store()
    keys = sorted(sel.users) if sel.users is not None else s.user_ids()
    hits: list[Any] = []
    for key in keys:
        n = len(s.get_all(user_id=key))
        if not n:
            continue
        # Ask for every fact of the user when other filters apply: a top-k cut before
        # filtering would drop matches ranked below another run's facts.
        hits.extend(h for h in s.search(query, user_id=key, k=min(n, 1000)) if sel.pred(_view(h)))
    hits.sort(key=lambda h: -(h.score or 0.0))
    if threshold is not None:
        hits = [h for h in hits if (h.score or 0.0) >= threshold]
    return {"results": [memory_dict(h) for h in hits[:top_k]]}


@_route("POST", "/v1/memories/search/")
async def search_v1(body: Body, state: State) -> Any:
    return await _run(_search, state, body, True)


@_route("POST", "/v2/memories/search/", "/v3/memories/search/")
async def search_v2(body: Body, state: State) -> Any:
    return await _run(_search, state, body, False)


def _prefetch(state: ServerState, body: dict[str, Any]) -> dict[str, Any]:
    user = body.get("user_id")
    if not isinstance(user, str) or not user:
        raise _bad("user_id must be a non-empty string", "user_id")
    return {"user_id": user, "started": state.store().prefetch(user)}


@_route("POST", "/v1/memories/prefetch/")
async def prefetch(body: Body, state: State) -> Any:
    """InferScale's own: a session of ``user_id`` starts, so its memories' KV moves from disk
    to memory now and its first request injects it (search does this for what it finds)."""
    return await _run(_prefetch, state, body)


def _page_number(value: Any, name: str, default: int, most: int) -> int:
    """A page or page size from the query (a string) or the body (JSON): an integer from 1 to
    ``most``; ``Infinity``, ``NaN``, floats, booleans and numeric strings other than digits
    are refused (``int()`` would overflow on some and round others)."""
    if value is None or value == "":
        return default
    if isinstance(value, str) and re.fullmatch(r"[0-9]{1,10}", value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        raise _bad(f"{name} must be an integer from 1 to {most}", name)
    return value


def _page_links(request: Request) -> Callable[[int, int], str]:
    """``next`` / ``previous`` of a listing: the request's path and query with another page, so
    that following one keeps the entity ids given in the query (a POST's body is sent again)."""
    kept = [(k, v) for k, v in request.query_params.multi_items() if k not in ("page", "page_size")]
    return lambda page, size: f"{request.url.path}?{urlencode([*kept, ('page', page), ('page_size', size)])}"


def _list(state: ServerState, src: dict[str, Any], page: Any, page_size: Any,
          link: Callable[[int, int], str]) -> dict[str, Any]:
    items = _matching(state, _selection(src, "listing memories"))
    if page is None and page_size is None:
        return {"count": len(items), "next": None, "previous": None, "results": [memory_dict(i) for i in items]}
    page = _page_number(page, "page", 1, MAX_PAGE)
    page_size = _page_number(page_size, "page_size", 100, 1000)
    pages = max(1, math.ceil(len(items) / page_size))
    chunk = items[(page - 1) * page_size : page * page_size]
    return {
        "count": len(items),
        "next": link(page + 1, page_size) if page < pages else None,
        "previous": link(page - 1, page_size) if page > 1 else None,
        "results": [memory_dict(i) for i in chunk],
    }


@_route("GET", "/v1/memories/")
async def list_v1(request: Request, state: State) -> Any:
    q = dict(request.query_params)
    return await _run(_list, state, q, q.pop("page", None), q.pop("page_size", None), _page_links(request))


@_route("POST", "/v2/memories/", "/v3/memories/")
async def list_v2(body: Body, request: Request, state: State) -> Any:
    q = request.query_params
    page, size = q.get("page", body.pop("page", None)), q.get("page_size", body.pop("page_size", None))
    return await _run(_list, state, body, page, size, _page_links(request))


def _delete_all(state: ServerState, src: dict[str, Any]) -> dict[str, Any]:
    s = state.store()
    items = _matching(state, _selection(src, "delete_all"))
    for i in items:
        s.delete(i.id)
    return {"message": "Memories deleted successfully!", "deleted": len(items)}


@_route("DELETE", "/v1/memories/")
async def delete_all(request: Request, state: State) -> Any:
    return await _run(_delete_all, state, dict(request.query_params))


# ------------------------------------------------------------------ one memory


@_route("GET", "/v1/memories/{memory_id}/")
async def get_one(memory_id: str, who: Caller, state: State) -> Any:
    return await _run(lambda: memory_dict(_owned(state, memory_id, who)))


def _update(state: ServerState, memory_id: str, body: dict[str, Any], who: Entities) -> dict[str, Any]:
    if not who.user_id and isinstance(body.get("user_id"), str):  # InferScale's older body field
        who = Entities(body["user_id"], who.agent_id, who.run_id, who.app_id)
    item = _owned(state, memory_id, who)
    text, meta = body.get("text"), body.get("metadata")
    for k in ("timestamp", "expiration_date"):
        if body.get(k) is not None:
            raise _bad(f"{k} is not supported by this server", k)
    if text is None and meta is None:
        raise _bad("update needs text or metadata", "text")
    if text is not None and (not isinstance(text, str) or not text.strip()):
        raise _bad("text must be a non-empty string", "text")
    if meta is not None and not isinstance(meta, dict):
        raise _bad("metadata must be an object", "metadata")
    if meta is not None and META_KEY in meta:
        raise _bad(f"metadata key {META_KEY!r} is reserved", "metadata")
    s = state.store()
    if text is not None:
        item = s.update(memory_id, text, user_id=item.user_id)
    if meta is not None:
        kept = (item.metadata or {}).get(META_KEY)
        item = s.update_metadata(memory_id, {**meta, **({META_KEY: kept} if kept else {})}, user_id=item.user_id)
    return {"message": "Memory updated successfully!", **memory_dict(item)}


@_route("PUT", "/v1/memories/{memory_id}/")
async def update_one(memory_id: str, body: Body, who: Caller, state: State) -> Any:
    return await _run(_update, state, memory_id, body, who)


def _delete(state: ServerState, memory_id: str, who: Entities) -> dict[str, Any]:
    item = _owned(state, memory_id, who)
    state.store().delete(memory_id, user_id=item.user_id)
    return {"message": "Memory deleted successfully!"}


@_route("DELETE", "/v1/memories/{memory_id}/")
async def delete_one(memory_id: str, who: Caller, state: State) -> Any:
    return await _run(_delete, state, memory_id, who)


def _history(state: ServerState, memory_id: str, who: Entities) -> list[dict[str, Any]]:
    s = state.store()
    events = s.history(memory_id)
    if not events:
        raise _not_found(f"memory {memory_id!r} not found")
    try:
        item = s.get(memory_id)
    except Exception:  # noqa: BLE001  (deleted: the events still say whose it was)
        item = None
    if item is not None:
        _owned(state, memory_id, who)
        owner, meta = entities_of(item), memory_dict(item)["metadata"]
    else:
        # Deleted: its events keep only the store key, so a caller naming an agent or run of
        # a user's memory cannot be told apart from a stranger and gets the 404.
        key = str(events[0].get("user_id"))
        if who.any() and key != who.store_key():
            raise _not_found(f"memory {memory_id!r} not found")
        owner = {"user_id": user_of_key(key), "agent_id": None, "run_id": None, "app_id": None}
        meta = {}
    return [{"id": e["id"], "memory_id": memory_id, "input": [], "old_memory": e["old_memory"],
             "new_memory": e["new_memory"], "event": e["event"], **owner, "metadata": meta,
             "created_at": e["created_at"], "updated_at": e["created_at"]} for e in events]


@_route("GET", "/v1/memories/{memory_id}/history/")
async def history(memory_id: str, who: Caller, state: State) -> Any:
    return await _run(_history, state, memory_id, who)


# ------------------------------------------------------------------ entities


def _entities(state: ServerState) -> dict[str, Any]:
    s = state.store()
    seen: dict[tuple[str, str], dict[str, Any]] = {}
    for key in s.user_ids():
        for item in s.get_all(user_id=key):
            for kind, field in ENTITY_TYPES.items():
                name = entities_of(item)[field]
                if not name:
                    continue
                e = seen.setdefault((kind, name), {"id": f"{kind}:{name}", "name": name, "type": kind,
                                                    "total_memories": 0, "created_at": item.created_at,
                                                    "updated_at": item.updated_at, "owner": None,
                                                    "organization": None, "metadata": None})
                e["total_memories"] += 1
                e["created_at"] = min(e["created_at"], item.created_at)
                e["updated_at"] = max(e["updated_at"], item.updated_at)
    results = list(seen.values())
    return {"count": len(results), "next": None, "previous": None, "results": results}


@_route("GET", "/v1/entities/")
async def entities(state: State) -> Any:
    return await _run(_entities, state)


def _delete_entity(state: ServerState, kind: str, name: str) -> dict[str, Any]:
    if kind not in ENTITY_TYPES:
        raise _bad(f"entity type must be one of {', '.join(ENTITY_TYPES)}", "type")
    field = ENTITY_TYPES[kind]
    items = _matching(state, compile_filters({field: name}, _bad))
    if not items:
        raise APIError(404, f"{kind} {name!r} has no memories", "not_found_error", None, "entity_not_found")
    s = state.store()
    for i in items:
        s.delete(i.id)
    return {"message": "Entity deleted successfully!", "deleted": len(items)}


@_route("DELETE", "/v2/entities/{kind}/{name}/", "/v1/entities/{kind}/{name}/")
async def delete_entity(kind: str, name: str, state: State) -> Any:
    return await _run(_delete_entity, state, kind, name)
