"""One thread that drives vLLM for every caller.

Two engines, one interface (:class:`Loop`): :class:`AsyncEngineLoop` runs vLLM's default
``AsyncLLM``, whose engine core (scheduler and model) lives in processes of its own, on an
event loop of its own thread, as ``vllm serve`` does; :class:`EngineLoop` owns an in-process
``LLMEngine`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), which is not thread-safe, and steps it.
Either way all work (chat requests from many threads or event loops, fact encoding) is queued
to the loop, and vLLM batches whatever is in flight.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import EllipsisType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.outputs import RequestOutput
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

Listener = Callable[["RequestOutput | BaseException", float], object]


@dataclass
class _Submission:
    request_id: str
    prompt: dict[str, Any]
    params: SamplingParams
    listener: Listener
    submitted: float = field(default_factory=time.perf_counter)


class Loop:
    """Runs requests on one vLLM engine; results go back through per-request listeners.

    A listener gets each ``RequestOutput`` (cumulative) with the time it arrived, or the
    exception that ended the request. It runs on the loop thread: keep it short.
    """

    def submit(self, prompt: dict[str, Any], params: SamplingParams, listener: Listener) -> str:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        """Whether the loop thread is still alive (after ``close()``: a step outlived its wait)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    # -- blocking helpers -------------------------------------------------------------------

    def run(self, prompt: dict[str, Any], params: SamplingParams) -> tuple[RequestOutput, float]:
        """Submit and wait; returns the final output and time-to-first-token in seconds."""
        outputs = list(self.iterate(prompt, params))
        return outputs[-1][0], outputs[0][1]

    def iterate(self, prompt: dict[str, Any], params: SamplingParams, start: float | None = None):
        """Yield ``(output, seconds since start)`` as vLLM produces them; ``start``: a
        ``time.perf_counter()`` reading, the submission by default."""
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        start = time.perf_counter() if start is None else start
        request_id = self.submit(prompt, params, lambda out, t: inbox.put((out, t)))
        try:
            while True:
                out, t = inbox.get()
                if isinstance(out, BaseException):
                    raise out
                yield out, t - start
                if out.finished:
                    return
        except GeneratorExit:
            self.abort(request_id)
            raise

    async def aiterate(self, prompt: dict[str, Any], params: SamplingParams, start: float | None = None):
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()
        start = time.perf_counter() if start is None else start
        request_id = self.submit(prompt, params, lambda out, t: loop.call_soon_threadsafe(inbox.put_nowait, (out, t)))
        finished = False
        try:
            while True:
                out, t = await inbox.get()
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                finished = out.finished
                yield out, t - start
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)


class ThreadedAsyncLoop(Loop):
    """Requests as tasks on an event loop of this loop's own thread: submit, abort and close
    from any thread. Subclasses say how a request runs (:meth:`_run`) and what closing releases
    (:meth:`_shutdown`)."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._ids = itertools.count()
        self._tasks: dict[str, tuple[asyncio.Task, Listener]] = {}
        self._closed = False

    def submit(self, prompt: dict[str, Any], params: SamplingParams, listener: Listener) -> str:
        if self._closed:
            raise RuntimeError("engine is closed")
        request_id = f"is-{next(self._ids)}"
        work = self._request(request_id, prompt, params)
        self._loop.call_soon_threadsafe(self._start, request_id, work, listener)
        return request_id

    def _request(self, request_id: str, prompt: dict[str, Any], params: SamplingParams) -> Any:
        """What :meth:`_run` gets, built in the caller's thread."""
        return prompt, params

    async def _run(self, request_id: str, work: Any, listener: Listener) -> None:
        raise NotImplementedError

    async def _shutdown(self) -> None:
        """Release what requests used, on the loop's thread, once every request is cancelled."""

    def _start(self, request_id: str, work: Any, listener: Listener) -> None:
        task = self._loop.create_task(self._track(request_id, work, listener))
        self._tasks[request_id] = (task, listener)

    async def _track(self, request_id: str, work: Any, listener: Listener) -> None:
        try:
            await self._run(request_id, work, listener)
        except asyncio.CancelledError:
            pass  # aborted: the request is aborted on its way out
        except Exception as exc:  # bad prompt, or the engine died: this request learns why
            tell(listener, exc, request_id)
        finally:
            self._tasks.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        def cancel() -> None:
            entry = self._tasks.get(request_id)
            if entry is not None:
                entry[0].cancel()

        if not self._closed:
            self._loop.call_soon_threadsafe(cancel)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def stop() -> None:
            for task, listener in list(self._tasks.values()):
                tell(listener, RuntimeError("engine closed"), "")
                task.cancel()
            await self._shutdown()

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=60)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)


class AsyncEngineLoop(ThreadedAsyncLoop):
    """vLLM's ``AsyncLLM`` (engine core in its own processes) on an event loop of its own
    thread. ``make_engine`` builds it there, so its output handler runs on that loop."""

    def __init__(self, make_engine: Callable[[], AsyncLLM], name: str = "inferscale-engine") -> None:
        super().__init__(name)

        async def make() -> AsyncLLM:
            return make_engine()

        try:
            self.engine = asyncio.run_coroutine_threadsafe(make(), self._loop).result()
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            raise

    async def _run(self, request_id: str, work: Any, listener: Listener) -> None:
        prompt, params = work
        async for out in self.engine.generate(prompt, params, request_id):
            tell(listener, out, request_id)

    async def _shutdown(self) -> None:
        self.engine.shutdown()
        # Dropped now: vLLM's __del__ shuts it down again, which at interpreter exit (module
        # globals gone) prints a TypeError.
        del self.engine


def tell(listener: Listener, out: RequestOutput | BaseException, request_id: str) -> None:
    """Hand ``out`` to a request's listener, now; its failure is logged, never the loop's."""
    try:
        listener(out, time.perf_counter())
    except Exception:  # a caller's listener must not stop the engine
        logger.exception("listener for %s failed", request_id)


class EngineLoop(Loop):
    """Serialises access to one in-process ``LLMEngine``."""

    def __init__(self, engine: LLMEngine, name: str = "inferscale-engine") -> None:
        self._engine = engine
        self._inbox: queue.SimpleQueue[_Submission | tuple[str, str] | None] = queue.SimpleQueue()
        self._listeners: dict[str, Listener] = {}
        self._ids = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, prompt: dict[str, Any], params: SamplingParams, listener: Listener) -> str:
        if self._closed:
            raise RuntimeError("engine is closed")
        request_id = f"is-{next(self._ids)}"
        self._inbox.put(_Submission(request_id, prompt, params, listener))
        return request_id

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._inbox.put(None)
            self._thread.join(timeout=30)

    # -- the loop ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            busy = self._engine.has_unfinished_requests()
            item: _Submission | tuple[str, str] | EllipsisType | None
            try:
                item = self._inbox.get(block=not busy, timeout=None)
            except queue.Empty:
                item = ...
            while item is not ...:
                if item is None:
                    self._fail_all(RuntimeError("engine closed"))
                    return
                self._accept(item)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = ...
            if self._engine.has_unfinished_requests():
                self._step()

    def _accept(self, item: _Submission | tuple[str, str]) -> None:
        if isinstance(item, tuple):
            _, request_id = item
            if self._listeners.pop(request_id, None) is not None:
                self._engine.abort_request([request_id])
            return
        try:
            # A TokensPrompt built as a plain dict (prompt_token_ids, cache_salt).
            self._engine.add_request(item.request_id, item.prompt, item.params)  # type: ignore[arg-type]
        except Exception as exc:  # bad prompt (too long, bad token ids): this request only
            item.listener(exc, time.perf_counter())
            return
        self._listeners[item.request_id] = item.listener

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as exc:
            logger.exception("vLLM step failed; failing in-flight requests")
            self._fail_all(exc)
            return
        now = time.perf_counter()
        for out in outputs:
            listener = self._listeners.get(out.request_id)
            if listener is None:
                continue
            if out.finished:
                del self._listeners[out.request_id]
            try:
                listener(out, now)  # type: ignore[arg-type]  # a generating engine: no pooling outputs
            except Exception:  # a caller's listener must not stop the engine
                logger.exception("listener for %s failed", out.request_id)

    def _fail_all(self, exc: BaseException) -> None:
        listeners, self._listeners = self._listeners, {}
        if listeners:
            try:
                self._engine.abort_request(list(listeners))
            except Exception:
                logger.exception("abort after failure failed")
        for listener in listeners.values():
            listener(exc, time.perf_counter())
