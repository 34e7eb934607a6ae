"""The background encoding of a memory store: a bounded queue and the thread that drains it.

``add`` returns once a fact is committed; its ``(fact id, kv version)`` job waits here. The
thread takes whatever is queued, up to ``batch`` jobs / ``batch_tokens`` prefill tokens, and
hands it to the store in one call, so one batched prefill encodes many facts while a chat
request arriving meanwhile waits behind at most one batch. A job that fails, or that is
dropped when the store closes, is not retried here: the fact stays unencoded and the store
encodes it on demand when it is resolved (or on ``reencode``).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence

logger = logging.getLogger(__name__)

Job = tuple[str, int]  # (fact id, kv version)


class EncodeQueue:
    """Jobs waiting to be encoded; ``run(batch)`` encodes a batch, ``tokens(job)`` sizes a job."""

    def __init__(self, run: Callable[[list[Job]], None], tokens: Callable[[Job], int], *, maxsize: int,
                 batch: int, batch_tokens: int) -> None:
        self._run = run
        self._tokens = tokens
        self.batch = batch
        self.batch_tokens = batch_tokens
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=maxsize)  # None: stop()'s wake-up
        self._idle = threading.Condition()
        self._inflight = 0  # queued or being encoded: what wait_idle waits for
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._running = threading.Lock()  # held while a batch is encoded, and by paused()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="inferscale-memory-encoder", daemon=True)
        self._thread.start()

    @property
    def inflight(self) -> int:
        with self._idle:
            return self._inflight

    def put(self, jobs: Sequence[Job]) -> None:
        """Queue ``jobs``; waits while the queue is full (backpressure on ``add``)."""
        with self._idle:
            self._inflight += len(jobs)
        for n, job in enumerate(jobs):
            while True:
                if self._stopping:
                    with self._idle:
                        self._inflight -= len(jobs) - n
                        self._idle.notify_all()
                    return
                try:
                    self._queue.put(job, timeout=0.1)
                    break
                except queue.Full:
                    continue

    def wait_idle(self, timeout: float | None = None) -> None:
        """Until every queued job ran; ``TimeoutError`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._inflight > 0:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"{self._inflight} memory facts still waiting to be encoded")
                self._idle.wait(remaining)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No batch is encoded inside the block (the one running finishes first; queued jobs
        wait): for measuring the engine's speed without ingestion sharing it."""
        with self._running:
            yield

    def stop(self, timeout: float = 300) -> int:
        """Let the batch in flight finish, drop the rest; returns how many jobs were dropped."""
        self._stopping = True
        with contextlib.suppress(queue.Full):  # full: the worker finds a job, then sees _stopping
            self._queue.put_nowait(None)
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        dropped = 0
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                dropped += 1
        with self._idle:
            self._inflight = 0
            self._idle.notify_all()
        return dropped

    def _done(self, n: int) -> None:
        with self._idle:
            self._inflight = max(0, self._inflight - n)
            self._idle.notify_all()

    def _work(self) -> None:
        carry: Job | None = None
        while not self._stopping:
            # Blocks until a job or stop()'s wake-up comes: an idle store's thread never wakes (a
            # timed poll took the GIL ten times a second from whatever the process serves).
            first = carry if carry is not None else self._queue.get()
            carry = None
            if first is None:
                continue
            batch = [first]
            tokens = self._tokens(first)
            while len(batch) < self.batch and tokens < self.batch_tokens:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    break
                n = self._tokens(job)
                if tokens + n > self.batch_tokens:
                    carry = job  # first of the next batch
                    break
                batch.append(job)
                tokens += n
            try:
                with self._running:
                    self._run(batch)
            except Exception:  # never let the encoder thread die
                logger.exception("memory encoder thread: unexpected error")
            finally:
                self._done(len(batch))
        if carry is not None:
            self._done(1)
