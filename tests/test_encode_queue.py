"""The store's background encoding queue: pausing it (what the engine's start-up measurement of
its own speed does, so that ingestion does not make the engine look slower than it is)."""

from __future__ import annotations

import threading
import time

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
