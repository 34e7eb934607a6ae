"""Replicas sharing one store, under load: ``N`` ``inferscale serve`` processes on one PostgreSQL
database, driven by the load generator (:mod:`inferscale_apps.bench.load`) with each simulated
user's operations going to the replicas in turn (a fact added through one replica is asked
about through the next). Prints the load report: errors, request rate, p50/p95 per operation.

    python -m inferscale_apps.bench.replicas --replicas 2 --users 8 --duration 60

``--first-ask N`` measures instead what a replica's change-feed follower buys: N times, a new
user's facts are added through the first replica and, ``--gap`` seconds later, the last one is
asked about through the second; prints that first ask's latency (``max_tokens=1``: about its
time to first token) and whether it injected KV. Run it with ``--follow-interval 1`` (encoded
in the background as it arrives) against the default (the replica encodes the fact on the miss,
in the ask).

Without ``--store`` a throwaway PostgreSQL cluster is started (Debian's binaries) and removed
afterwards; ``--store sqlite`` runs one replica on the embedded store instead (the baseline).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from inferscale_apps.bench.load import percentile, run_load


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _replica(model: str, store: str, home: Path, extra: list[str], timeout: float = 600) -> Iterator[str]:
    port = _free_port()
    home.mkdir(parents=True, exist_ok=True)
    log = (home / "server.log").open("w")
    # --recompute 0: every memory of an ask is injected, so the load generator's check that each
    # ask injects KV holds (the default prefills a prompt's last memories as text).
    cmd = [sys.executable, "-m", "inferscale_apps.cli", "serve", "--model", model, "--port", str(port),
           "--store", store, "--log-level", "warning", "--recompute", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "INFERSCALE_HOME": str(home)})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"replica exited ({proc.returncode}): {(home / 'server.log').read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica did not come up in {timeout:g}s")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def first_asks(urls: list[str], *, count: int, gap: float, model: str, prior: int = 5) -> dict[str, Any]:
    """``count`` times: a new user's ``prior`` facts and one more added through ``urls[0]``;
    ``gap`` seconds later the last one asked about through ``urls[-1]``. The asks' latencies."""
    add_on = httpx.Client(base_url=urls[0], timeout=300)
    ask_on = httpx.Client(base_url=urls[-1], timeout=300)
    run = uuid.uuid4().hex[:8]
    latencies: list[float] = []
    as_text = errors = 0
    for i in range(count):
        user = f"first-ask-{run}-{i}"
        for text in [f"I visited city number {j} in {2000 + j}." for j in range(prior)] + [f"My locker code is {4100 + i}."]:
            r = add_on.post("/v1/memories/", json={"messages": text, "user_id": user})
            r.raise_for_status()
        handle = r.json()["results"][0]["handle"]
        time.sleep(gap)
        t0 = time.perf_counter()
        r = ask_on.post("/v1/chat/completions", json={
            "model": model, "user": user, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": f"Things you remember about the user:\n{handle}"},
                         {"role": "user", "content": "What is my locker code?"}]})
        elapsed = time.perf_counter() - t0
        if r.status_code != 200:
            errors += 1
            print(f"ask failed: {r.status_code} {r.text[:300]}", file=sys.stderr)
            continue
        usage = r.json()["usage"]
        as_text += int(usage.get("memories_as_text", 0) > 0 or usage.get("injected_tokens", 0) == 0)
        latencies.append(elapsed)
    ms = [1000 * v for v in latencies]
    return {"asks": count, "gap_s": gap, "errors": errors, "not_injected": as_text,
            "p50_ms": percentile(ms, 50), "p95_ms": percentile(ms, 95), "mean_ms": sum(ms) / len(ms) if ms else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m inferscale_apps.bench.replicas", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2, help="inferscale serve processes (default %(default)s)")
    p.add_argument("--store", default=None, help="postgresql:// URL (default: a throwaway cluster), or 'sqlite'")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--serve-option", action="append", default=[], help="passed to each inferscale serve (repeatable)")
    p.add_argument("--follow-interval", type=float, default=None,
                   help="each replica's follow_interval (seconds; 0: encode facts from other replicas on the miss)")
    p.add_argument("--first-ask", type=int, default=0, metavar="N",
                   help="measure N first asks on the last replica of facts added through the first, instead of the load")
    p.add_argument("--gap", type=float, default=3.0, help="--first-ask: seconds between the add and the ask")
    p.add_argument("--json", default=None, help="write the load report here")
    args = p.parse_args(argv)
    if args.store == "sqlite" and args.replicas != 1:
        p.error("an embedded (sqlite) store has one process: --replicas 1")
    serve_options = list(args.serve_option)
    if args.follow_interval is not None:
        serve_options += ["--engine-option", f"follow_interval={json.dumps(args.follow_interval or None)}"]

    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="inferscale-replicas-")))
        store = args.store
        if store is None:
            from inferscale_apps.bench.postgres import throwaway_cluster

            store = stack.enter_context(throwaway_cluster()).new_database()
        elif store == "sqlite":
            store = str(work / "store")
        urls = []
        t0 = time.perf_counter()
        for i in range(args.replicas):  # one at a time: replicas starting together only slow each other down
            urls.append(stack.enter_context(_replica(args.model, store, work / f"replica-{i}", serve_options)))
        print(f"{args.replicas} replica(s) up in {time.perf_counter() - t0:.0f}s: {' '.join(urls)}", file=sys.stderr)
        if args.first_ask:
            result = first_asks(urls, count=args.first_ask, gap=args.gap, model=args.model)
            print(json.dumps({"follow_interval": args.follow_interval, **result}))
            if args.json:
                Path(args.json).write_text(json.dumps(result, indent=2))
            return 0 if result["errors"] == 0 else 1
        report = run_load(urls, users=args.users, duration=args.duration, max_tokens=args.max_tokens,
                          request_timeout=120.0)
    print(report.summary())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=2))
    return 0 if report.errors == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
