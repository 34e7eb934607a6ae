"""The store's background encoding queue: pausing it (what the engine's start-up measurement of
its own speed does, so that ingestion does not make the engine look slower than it is)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from inferscale_engine.memory.kv.encode_queue import EncodeQueue


def test_no_batch_is_encoded_while_paused_and_the_running_one_finishes_first():
    events: list[str] = []
    started = threading.Event()

    def run(batch: list[tuple[str, int]]) -> None:
        events.append(f"start {batch[0][0]}")
        started.set()
        time.sleep(0.2)
        events.append(f"end {batch[0][0]}")

    queue = EncodeQueue(run, lambda job: 1, maxsize=16, batch=1, batch_tokens=100)
    queue.start()
    try:
        queue.put([("a", 1)])
        assert started.wait(10)
        with queue.paused():  # waits for the batch in flight
            events.append("paused")
            queue.put([("b", 1)])
            time.sleep(0.3)  # long enough for the worker to start "b" if it could
            events.append("resumed")
        queue.wait_idle(10)
        assert events == ["start a", "end a", "paused", "resumed", "start b", "end b"]
    finally:
        queue.stop()


def _context_switches(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/status") as f:
        return sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads a thread's context switches from /proc")
def test_an_idle_queues_thread_sleeps_until_a_job_or_stop_comes():
    # A thread that wakes on a timer takes the GIL from whatever the process serves (issue 37);
    # the encoder's thread used to poll its queue ten times a second.
    done = threading.Event()
    queue = EncodeQueue(lambda batch: done.set(), lambda job: 1, maxsize=16, batch=4, batch_tokens=100)
    others = set(threading.enumerate())  # other tests' stores may keep encoder threads alive
    queue.start()
    try:
        (worker,) = [t for t in threading.enumerate() if t.name == "inferscale-memory-encoder" and t not in others]
        assert worker.native_id is not None
        time.sleep(0.2)  # settled in its wait
        before = _context_switches(worker.native_id)
        time.sleep(1.0)
        assert _context_switches(worker.native_id) - before <= 1
        queue.put([("a", 1)])  # a job still wakes it
        assert done.wait(10)
        queue.wait_idle(10)
    finally:
        started = time.monotonic()
        assert queue.stop() == 0
    assert not worker.is_alive() and time.monotonic() - started < 5  # and so does stop()
