"""What the LangChain and LlamaIndex integrations share: the engine factory, recall, handle expansion.

Nothing here imports a framework, so both integrations (and tests) can use it.

**Engine sharing.** Every integration class takes ``engine=`` (an :class:`InferScaleEngine`) or
``model=`` (an alias such as ``"smollm2"`` or a local folder). ``model=`` goes through
:func:`get_engine`, which builds at most one engine per model per process and hands the same
object to every class that asks: a memory, a retriever and a chat model naming the same model
share one vLLM engine and one memory store, which handles require (a handle minted by one store
resolves only in that store). An engine passed explicitly is registered under its model name,
so later ``model=`` look-ups find it instead of loading a second copy.

**Recall.** Memories are conversation turns. :func:`recall` returns, in conversation order, the
turns of the ``recent_turns`` most recent turns plus the turns holding the ``k`` facts most
relevant to the query (the store's semantic search), each turn whole (the user message and the
reply): a hit on an answer brings its question along, so the model sees who said what.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import logging
import sys
import threading
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self, TypeVar, cast

from pydantic import AfterValidator

from inferscale_engine.config import check_recompute
from inferscale_engine.prompting import EncodeStyle, encode_context
from inferscale_engine.request import GenerationOptions
from inferscale_engine.types import DEFAULT_USER

if TYPE_CHECKING:
    from inferscale_engine import InferScaleEngine
    from inferscale_engine.memory import MemoryItem, MemoryStore

logger = logging.getLogger(__name__)

#: How memories reach the prompt: ``"handles"`` (fact handles, injected as KV by an InferScale
#: LLM) or ``"text"`` (the fact text pasted, for any LLM).
RecallMode = Literal["handles", "text"]
RECALL_MODES = ("handles", "text")

#: Metadata keys the integrations write on every fact they store.
ROLE_KEY = "role"  # "user" | "assistant" | "system" | "tool"
TURN_KEY = "turn_id"  # facts of one conversation turn share it
SESSION_KEY = "session_id"  # conversation (thread) the fact was said in
SOURCE_KEY = "source"  # "langchain" | "llamaindex"

_WARNED_SHARED: set[str] = set()

#: A ``recompute`` field of an LLM class: the engine's one rule (``check_recompute``), applied
#: when the class is built, so a bad default fails there, in the words a bad per-call value gets.
Recompute = Annotated[int | None, AfterValidator(lambda value: value if value is None else check_recompute(value))]


def check_user_id(user_id: Any) -> str:
    """``user_id``, or ``ValueError`` unless the memory store takes it as a person's id
    (:func:`~inferscale_engine.memory.validation.check_person`)."""
    from inferscale_engine.memory.validation import check_person

    return check_person(user_id)


def generation_options(
    fields: Mapping[str, Any], extra: Mapping[str, Any], call: Mapping[str, Any], *, stop: Sequence[str] | None
) -> GenerationOptions:
    """One call's options, built (and so checked) once, before any work: an LLM class's fields
    (``fields``, a None one unset), then its extra ``SamplingParams`` (``model_kwargs``,
    ``sampling_kwargs``), then the call's keywords. Stop sequences: the extra's or the call's,
    else the class's ``stop``. A bad option raises ``InvalidOptionError`` naming it, in the
    words the engine and the HTTP server use."""
    options = {name: value for name, value in fields.items() if value is not None}
    options.update(extra)
    options.update(call)
    stops = options.pop("stop", None) or stop
    if stops:
        options["stop"] = list(stops)
    return GenerationOptions.from_kwargs(**options)


def user_of(cls: type, user_id: Any) -> str:
    """The user of a class given ``user_id``: checked (:func:`check_user_id`), or the shared
    user, with a warning, when it is None."""
    if user_id is None:
        warn_if_shared_user(cls, None)
        return DEFAULT_USER
    return check_user_id(user_id)


def check_arguments(cls: type, data: Any, fields: Iterable[str], *, user: bool = True) -> None:
    """Reject a misspelled argument with the closest known name, and warn, once per class, when
    ``user_id`` is missing (a multi-user app that forgot it would mix its users' memories).

    A class's ``_ARGUMENT_ALIASES`` maps names other classes use for one of its arguments to that
    argument (``{"search_kwargs": "k"}``), so they and their misspellings name it too.
    """
    if not isinstance(data, dict):
        return
    known = set(fields)
    unknown = sorted(k for k in data if k not in known)
    if unknown:
        aliases: Mapping[str, str] = getattr(cls, "_ARGUMENT_ALIASES", {})
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, known | set(aliases), n=1)
            hints.append(f"{name!r} (did you mean {aliases.get(close[0], close[0])!r}?)" if close else repr(name))
        raise ValueError(f"{cls.__name__} got unknown argument{'s' if len(unknown) > 1 else ''} {', '.join(hints)}")
    if user:
        warn_if_shared_user(cls, data.get("user_id"))


_Init = TypeVar("_Init", bound=Callable[..., None])


def checks_arguments(init: _Init) -> _Init:
    """Decorate the ``__init__`` of a class that is not a pydantic model: a misspelled keyword
    argument gets :func:`check_arguments`' error, naming the closest argument, instead of
    Python's bare ``TypeError``."""
    params = inspect.signature(init).parameters.values()
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        check_arguments(type(self), kwargs, names, user=False)
        init(self, *args, **kwargs)

    return cast(_Init, checked)


def warn_if_shared_user(cls: type, user_id: str | None) -> None:
    if user_id is not None or cls.__name__ in _WARNED_SHARED:
        return
    from inferscale_engine.errors import SharedUserWarning

    _WARNED_SHARED.add(cls.__name__)
    warnings.warn(
        f"{cls.__name__} was built without user_id, so it reads and writes the memories of the shared "
        f"user {DEFAULT_USER!r}; pass user_id=... (one per end user) so users do not see each other's memories",
        SharedUserWarning,
        stacklevel=_caller_level(),
    )


_LIBRARY_PATHS = ("/pydantic/", "/inferscale_integrations/", "/langchain", "/llama_index/")


def _caller_level() -> int:
    """The stack level of the user's line that built the class (past pydantic and the frameworks)."""
    level, frame = 2, sys._getframe(2)
    while frame.f_back is not None and any(part in frame.f_code.co_filename for part in _LIBRARY_PATHS):
        frame, level = frame.f_back, level + 1
    return level


_WARNED_FOREIGN: set[str] = set()


def warn_foreign_handles(model: str, texts: Iterable[str], fix: str) -> None:
    """Warn, once per model class, that memory handles reached a model that is not InferScale:
    it would otherwise get the raw ``<<mem:…>>`` strings without a word."""
    from inferscale_engine.handles import HANDLE_PATTERN

    if model in _WARNED_FOREIGN or not any(HANDLE_PATTERN.search(t) for t in texts):
        return
    _WARNED_FOREIGN.add(model)
    warnings.warn(
        f"{model} received memory handles (<<mem:…>>), which only an InferScale model resolves: it sees the "
        f"raw strings. {fix}, or build the memory or retriever with mode='text'",
        UserWarning,
        stacklevel=_caller_level(),
    )


def pydantic_fields(cls: Any) -> set[str]:
    """A pydantic model's field names and aliases: what its constructor accepts."""
    names = set()
    for name, info in cls.model_fields.items():
        names.add(name)
        if isinstance(info.alias, str):
            names.add(info.alias)
        if isinstance(info.validation_alias, str):
            names.add(info.validation_alias)
    return names


_ENGINES: dict[str, InferScaleEngine] = {}
_ENGINES_LOCK = threading.Lock()


def _engine_keys(model: str) -> list[str]:
    """Registry keys of ``model``: the alias (case-insensitive), or the folder and its real path."""
    from pathlib import Path

    from inferscale_engine.models import MODEL_ALIASES

    keys = [model.strip().lower() if _looks_like_alias(model) else model]
    if keys[0] not in MODEL_ALIASES:
        path = Path(model).expanduser()
        if path.is_dir():
            keys.append(str(path.resolve()))
    return keys


def _looks_like_alias(model: str) -> bool:
    return "/" not in model and "\\" not in model


def get_engine(model: str = "smollm2", **options: Any) -> InferScaleEngine:
    """The process-wide engine for ``model``, built on first use (options apply only then).

    Building a vLLM engine takes seconds to minutes and holds the model's weights and a paged
    KV cache, so classes never build their own: they all come here.
    """
    keys = _engine_keys(model)
    with _ENGINES_LOCK:
        for key in keys:
            engine = _ENGINES.get(key)
            if engine is not None and not getattr(engine, "closed", False):
                if options:
                    logger.debug("engine for %r already built; ignoring options %s", model, sorted(options))
                return engine
        from inferscale_engine import InferScaleEngine

        engine = InferScaleEngine(model, **options)
        _register_locked(engine, extra_keys=keys)
        _close_at_exit(engine)
        return engine


def _close_at_exit(engine: InferScaleEngine) -> None:
    """Engines this factory built are closed at interpreter exit, store first (its encoder
    thread must not run into a half-torn-down vLLM)."""
    import atexit
    import weakref

    ref = weakref.ref(engine)

    def close() -> None:
        eng = ref()
        if eng is not None:
            try:
                eng.close()
            except Exception:  # pragma: no cover - exiting anyway
                logger.debug("closing engine at exit failed", exc_info=True)

    atexit.register(close)


def register_engine(engine: InferScaleEngine) -> InferScaleEngine:
    """Make ``engine`` the shared engine of its model (what an explicit ``engine=`` does)."""
    with _ENGINES_LOCK:
        _register_locked(engine)
    return engine


def _register_locked(engine: InferScaleEngine, extra_keys: Iterable[str] = ()) -> None:
    keys = set(extra_keys)
    config = getattr(engine, "config", None)
    if config is not None and isinstance(getattr(config, "model", None), str):
        keys.update(_engine_keys(config.model))
    if isinstance(getattr(engine, "model_path", None), str):
        keys.add(engine.model_path)
    for key in keys:
        current = _ENGINES.get(key)
        if current is None or current is engine or getattr(current, "closed", False):
            _ENGINES[key] = engine


def forget_engines() -> None:
    """Drop the registry (does not close the engines; tests use it)."""
    with _ENGINES_LOCK:
        _ENGINES.clear()


class EngineRef:
    """How every integration class holds its engine, in a private ``_engine`` set once when the
    class is built (as ``langchain_ollama``'s ChatOllama keeps ``_client``): the engine passed as
    ``engine=`` (registered at once, so later ``model=`` look-ups share it), else the shared
    engine of ``model``, looked up on first use (building one takes seconds to minutes, which a
    constructor should not cost) and kept from then on."""

    __slots__ = ("_engine", "model", "options")

    def __init__(self, engine: InferScaleEngine | None, model: str | None, options: dict[str, Any] | None = None) -> None:
        self._engine = register_engine(engine) if engine is not None else None
        self.model = model
        self.options = dict(options or {})

    def get(self, model: str | None = None) -> InferScaleEngine:
        """The engine; ``model`` (another than the held one's) asks for that model's shared engine."""
        if model is not None and model != self.model:
            return get_engine(model, **self.options)
        if self._engine is None:
            self._engine = get_engine(self.model or "smollm2", **self.options)
        return self._engine

    @property
    def model_name(self) -> str:
        return model_name_of(self._engine, self.model)

    def __deepcopy__(self, memo: dict[int, Any]) -> EngineRef:
        return self  # an engine is shared, never copied (pydantic deep-copies private attributes)


class OnEngine:
    """``get_engine()`` and ``store`` of a class that keeps an :class:`EngineRef` in ``_engine``
    (a mixin: put it before a pydantic base)."""

    if TYPE_CHECKING:
        _engine: EngineRef

    def get_engine(self) -> InferScaleEngine:
        """The engine whose memory store keeps the facts (built or shared on first use)."""
        return self._engine.get()

    @property
    def store(self) -> MemoryStore:
        return self.get_engine().memory


class EngineConstructors:
    """``from_engine`` / ``from_model``, as llama-index-memory-mem0 offers ``from_client`` /
    ``from_config``: the two ways to say which engine a class uses."""

    @classmethod
    def from_engine(cls, engine: InferScaleEngine, **kwargs: Any) -> Self:
        """On ``engine`` (shared from then on with every class that names its model)."""
        return cls(engine=engine, **kwargs)  # type: ignore[call-arg]

    @classmethod
    def from_model(cls, model: str = "smollm2", engine_options: dict[str, Any] | None = None, **kwargs: Any) -> Self:
        """On the shared engine of ``model``, built with ``engine_options`` if this is the first use."""
        return cls(model=model, engine_options=engine_options or {}, **kwargs)  # type: ignore[call-arg]


def model_name_of(engine: InferScaleEngine | None, model: str | None) -> str:
    if engine is not None:
        config = getattr(engine, "config", None)
        name = getattr(config, "model", None)
        if isinstance(name, str) and name:
            return name
    return model or "smollm2"


def check_mode(mode: str) -> str:
    if mode not in RECALL_MODES:
        raise ValueError(f"mode must be one of {RECALL_MODES}, got {mode!r}")
    return mode


# ---------------------------------------------------------------------------------------- facts


def new_turn_id() -> str:
    return uuid.uuid4().hex[:16]


def role_of(item: MemoryItem) -> str:
    meta = item.metadata or {}
    role = meta.get(ROLE_KEY)
    if isinstance(role, str) and role:
        return role
    # Facts the store made from message dicts read "User: ..." / "Assistant: ...".
    text = item.memory or ""
    if text.startswith("Assistant:"):
        return "assistant"
    return "user"


def content_of(item: MemoryItem, mode: str) -> str:
    """What goes into the prompt for ``item``: its handle, or its text."""
    return item.handle if mode == "handles" else item.memory


def save_messages(
    store: MemoryStore,
    messages: Sequence[tuple[str, str]],
    *,
    user_id: str,
    session_id: str | None = None,
    source: str,
    turn_id: str | None = None,
    extra_metadata: dict[str, Any] | None = None,
    style: EncodeStyle | None = "chat",
    prefixes: tuple[str, str] = ("Human", "AI"),
) -> list[MemoryItem]:
    """Store ``(role, content)`` messages as one fact each; they form one turn.

    Each fact's text is the message content exactly, so a handle standing in for the content
    means the very same tokens; role, turn and session go in metadata. Each fact is encoded in
    the background after the turns before it in the session (the store's ``window`` of them)
    laid out as prompts will show them (:func:`encode_context`); ``style=None`` leaves the
    context to the store (its window of previous facts, newline-joined).
    """
    messages = [(r, c) for r, c in messages if isinstance(c, str) and c.strip()]
    if not messages:
        return []
    turn_id = turn_id or new_turn_id()
    engine = getattr(store, "encoder", None)  # the engine that encodes the store's facts (None: retrieval only)
    previous: list[tuple[str, str]] = []
    if style is not None and engine is not None:
        window = int(getattr(store, "window", 5))
        earlier = all_items(store, user_id=user_id, session_id=session_id)
        turns: list[list[MemoryItem]] = []
        for item in earlier:
            if turns and _turn_of(turns[-1][0]) == _turn_of(item):
                turns[-1].append(item)
            else:
                turns.append([item])
        for turn in turns[-window:] if window else []:
            previous.extend((role_of(i), i.memory) for i in turn)
    items: list[MemoryItem] = []
    for role, content in messages:
        metadata = {ROLE_KEY: role, TURN_KEY: turn_id, SOURCE_KEY: source, **(extra_metadata or {})}
        if session_id is not None:
            metadata[SESSION_KEY] = session_id
        context = None
        if style is not None and engine is not None:
            context = encode_context(engine, previous, role, style=style, prefixes=prefixes)
        items.extend(store.add(content, user_id=user_id, metadata=metadata, context=context, infer=False))
        previous.append((role, content))
    return items


def all_items(store: MemoryStore, *, user_id: str, session_id: str | None = None) -> list[MemoryItem]:
    """Every fact of ``user_id`` (of one session when given), oldest first."""
    items = list(store.get_all(user_id=user_id))
    if session_id is not None:
        items = [i for i in items if (i.metadata or {}).get(SESSION_KEY) == session_id]
    return _chronological(items)


def _chronological(items: list[MemoryItem]) -> list[MemoryItem]:
    # The store lists facts in insertion order; created_at breaks nothing (a stable sort).
    def key(item: MemoryItem) -> Any:
        created = getattr(item, "created_at", None)
        return (created is None, _sortable(created))

    return sorted(items, key=key)


def _sortable(value: Any) -> Any:
    if value is None:
        return 0.0
    if hasattr(value, "timestamp"):
        return value.timestamp()
    if isinstance(value, (int, float)):
        return float(value)
    return str(value)


def _turn_of(item: MemoryItem) -> str:
    return str((item.metadata or {}).get(TURN_KEY) or item.id)


@dataclass
class Recalled:
    """One recalled fact, with its search score when it was a hit."""

    item: MemoryItem
    score: float | None


def recall(
    store: MemoryStore,
    *,
    user_id: str,
    query: str | None,
    k: int,
    recent_turns: int,
    session_id: str | None = None,
    min_score: float | None = None,
) -> list[Recalled]:
    """Facts to show the model, whole turns, in conversation order (see module docstring).

    ``recent_turns`` come from ``session_id`` when given (the running conversation); search hits
    come from everything the user ever said.
    """
    everything = all_items(store, user_id=user_id)
    if not everything:
        return []
    session = [i for i in everything if session_id is None or (i.metadata or {}).get(SESSION_KEY) == session_id]
    chosen_turns: set[str] = set()
    if recent_turns > 0:
        turns_in_order: list[str] = []
        for item in session:
            t = _turn_of(item)
            if not turns_in_order or turns_in_order[-1] != t:
                if t in turns_in_order:
                    turns_in_order.remove(t)
                turns_in_order.append(t)
        chosen_turns.update(turns_in_order[-recent_turns:])
    scores: dict[str, float] = {}
    if k > 0 and query and query.strip():
        for hit in store.search(query, user_id=user_id, k=k):
            score = getattr(hit, "score", None)
            if min_score is not None and score is not None and score < min_score:
                continue
            chosen_turns.add(_turn_of(hit))
            if score is not None:
                scores[hit.id] = float(score)
    return [Recalled(i, scores.get(i.id)) for i in everything if _turn_of(i) in chosen_turns]


def recall_for(owner: Any, query: str | None) -> list[Recalled]:
    """:func:`recall` with the settings of an integration class (its ``store``, ``user_id``,
    ``session_id``, ``k``, ``recent_turns`` and, where it has one, ``min_score``)."""
    return recall(owner.store, user_id=owner.user_id, query=query, k=owner.k, recent_turns=owner.recent_turns,
                  session_id=owner.session_id, min_score=getattr(owner, "min_score", None))


def search(
    store: MemoryStore, *, user_id: str, query: str, k: int, min_score: float | None = None
) -> list[MemoryItem]:
    hits = list(store.search(query, user_id=user_id, k=k)) if k > 0 else []
    if min_score is not None:
        hits = [h for h in hits if h.score is None or h.score >= min_score]
    return hits


def item_metadata(item: MemoryItem, *, user_id: str) -> dict[str, Any]:
    """Metadata safe to put next to a handle: ids, score, role and times, never the fact text."""
    meta: dict[str, Any] = {
        "fact_id": item.id,
        "user_id": user_id,
        "score": None if item.score is None else float(item.score),
    }
    for key, value in (item.metadata or {}).items():
        if key in ("memory", "text", "content", "data"):
            continue
        if isinstance(value, (str, int, float, bool)) or value is None:
            meta.setdefault(key, value)
    for attr in ("created_at", "updated_at"):
        value = getattr(item, attr, None)
        if value is not None:
            meta[attr] = value.isoformat() if hasattr(value, "isoformat") else value
    encoded = getattr(item, "encoded", None)
    if encoded is not None:
        meta["encoded"] = bool(encoded)
    return meta


# ---------------------------------------------------------------------------------- expansion


def expand_handles(text: str, *, store: MemoryStore, user_id: str) -> str:
    """``text`` with every handle replaced by its fact's text (for LLMs that are not InferScale).

    Each handle is checked for ``user_id`` exactly as the engine checks it, so a forged or
    foreign handle raises :class:`~inferscale_engine.errors.ForgedHandleError` here too.
    """
    from inferscale_engine.handles import split_on_handles

    pieces, handles = split_on_handles(text)
    if not handles:
        return text
    out = [pieces[0]]
    for handle, piece in zip(handles, pieces[1:]):
        out.append(fact_text(store, handle.text, user_id=user_id))
        out.append(piece)
    return "".join(out)


def fact_text(store: MemoryStore, handle: str, *, user_id: str) -> str:
    from inferscale_engine.errors import FactNotFoundError, ForgedHandleError
    from inferscale_engine.handles import find_handles, forged_handle_message

    (parsed,) = find_handles(handle)
    forged = ForgedHandleError(forged_handle_message(parsed.text, user_id))
    try:
        expected = store.handle(parsed.fact_id, user_id=user_id)
    except FactNotFoundError:
        store.get(parsed.fact_id)  # re-raises when the fact does not exist at all
        raise forged from None  # it exists but is someone else's: what the engine says too
    if expected != parsed.text:
        raise forged
    return store.get(parsed.fact_id, user_id=user_id).memory
