"""A bounded, self-stopping load generator for ``inferscale serve``.

Each simulated user is one asyncio task with its own ``user_id`` that, until the deadline,
alternates between

* **add**: ``POST /v1/memories/`` with a new fact about the user ("My <thing> is <value>."),
* **ask**: a chat completion that references the user's memories, either with their handles in
  the system message (KV injection; the answer must report ``injected_tokens > 0``, or the cost
  model's choice to prefill cold memories in ``usage.memory_mix``) or with the
  server-side ``memory_k`` recall; every third ask streams (SSE, checked to end in ``[DONE]``),
* **search** (every fourth op): ``POST /v1/memories/search/``; every hit must be the user's own
  (an isolation check under load).

Anything else — a non-2xx status, a timeout, a broken stream, a hit of another user, an ask with
handles that injected nothing — counts as an error. The run stops by itself: no new operation
starts after ``duration`` seconds, requests time out after ``request_timeout``, and whatever is
still running ``grace`` seconds after the deadline is cancelled (and counted as an error).

Command line (against a running server)::

    inferscale serve --port 8000 &
    python -m inferscale_apps.bench.load --url http://127.0.0.1:8000 --users 100 --duration 60

Against replicas sharing one store, give ``--url`` once per replica: each user's operations
go to the replicas in turn, so a fact added through one is asked about through another.

Library::

    from inferscale_apps.bench.load import run_load, serve_app
    with serve_app(create_app(engine)) as url:        # uvicorn in a thread, loopback port
        report = run_load(url, users=20, duration=15)
    assert report.errors == 0; print(report.summary())
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import socket
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

__all__ = ["LoadReport", "arun_load", "main", "percentile", "run_load", "serve_app"]

#: One user's operations, repeated: every other one is a question about its memories.
CYCLE = ("add", "ask", "search", "ask")
THINGS = ["dog", "cat", "city", "colour", "team", "car", "book", "song", "dish", "sport", "tree", "river"]


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100) of ``values``; ``None`` when empty."""
    if not values:
        return None
    s = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(s)))
    return s[min(rank, len(s)) - 1]


@dataclass
class LoadReport:
    """What a run did. Latencies are in seconds, per operation kind and overall."""

    url: str
    users: int
    duration_s: float
    wall_s: float = 0.0
    requests: int = 0
    errors: int = 0
    by_op: dict[str, int] = field(default_factory=dict)
    errors_by_kind: dict[str, int] = field(default_factory=dict)
    error_examples: list[str] = field(default_factory=list)
    latency: dict[str, dict[str, float | None]] = field(default_factory=dict)
    ttft_stream: dict[str, float | None] = field(default_factory=dict)
    facts_added: int = 0
    injected_tokens: int = 0
    #: Asks that injected nothing because the cost model prefilled their cold memories.
    asks_recomputed: int = 0
    cancelled: int = 0

    @property
    def throughput_rps(self) -> float:
        return self.requests / self.wall_s if self.wall_s else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"throughput_rps": round(self.throughput_rps, 2)}

    def summary(self) -> str:
        lines = [
            f"load: {self.users} users x {self.duration_s:g}s against {self.url} (wall {self.wall_s:.1f}s)",
            (f"requests {self.requests} ({self.throughput_rps:.1f}/s), errors {self.errors}, facts added "
             f"{self.facts_added}, injected tokens {self.injected_tokens}, asks whose cold memories were "
             f"prefilled {self.asks_recomputed}"),
        ]
        for op, stats in sorted(self.latency.items()):
            lines.append(
                f"  {op:<7} n={int(stats['n'] or 0):<6} p50={_ms(stats['p50'])} p95={_ms(stats['p95'])} "
                f"p99={_ms(stats['p99'])} max={_ms(stats['max'])}"
            )
        if self.ttft_stream.get("n"):
            lines.append(f"  stream TTFT p50={_ms(self.ttft_stream['p50'])} p95={_ms(self.ttft_stream['p95'])}")
        if self.errors:
            lines.append(f"  errors by kind: {self.errors_by_kind}")
            lines.extend(f"    e.g. {e}" for e in self.error_examples[:5])
        return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "     -" if v is None else f"{v * 1000:6.0f}ms"


class _Run:
    def __init__(self, url: str, *, users: int, duration: float, model: str | None, api_key: str | None,
                 max_tokens: int, request_timeout: float, think_time: float, seed: int, prefix: str) -> None:
        self.url = url.rstrip("/")
        self.users, self.duration = users, duration
        self.model, self.api_key = model, api_key
        self.max_tokens, self.request_timeout, self.think_time = max_tokens, request_timeout, think_time
        self.rng = random.Random(seed)
        self.prefix = prefix
        self.lat: dict[str, list[float]] = defaultdict(list)
        self.ttft: list[float] = []
        self.ops: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.examples: list[str] = []
        self.facts = 0
        self.injected = 0
        self.recomputed = 0
        self.user_ids = [f"{prefix}-{i:04d}" for i in range(users)]

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        if len(self.examples) < 20:
            self.examples.append(f"{kind}: {detail[:300]}")

    async def user(self, clients: list[httpx.AsyncClient], index: int, deadline: float) -> None:
        uid = self.user_ids[index]
        rng = random.Random(self.rng.random())
        facts: list[dict[str, str]] = []
        step = asks = 0
        while time.monotonic() < deadline:
            kind = CYCLE[step % len(CYCLE)] if facts else "add"
            client = clients[(index + step) % len(clients)]  # replicas in turn
            step += 1
            t0 = time.perf_counter()
            ok = False
            try:
                if kind == "add":
                    ok = await self.add(client, uid, rng, facts, step)
                elif kind == "ask":
                    asks += 1
                    ok = await self.ask(client, uid, rng, facts, stream=asks % 3 == 0, recall=asks % 4 == 2)
                else:
                    ok = await self.search(client, uid, rng, facts)
            except httpx.TimeoutException as exc:
                self.error("timeout", f"{kind}: {exc!r}")
            except httpx.HTTPError as exc:
                self.error("transport", f"{kind}: {exc!r}")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a malformed answer: count it, keep going
                self.error("invalid_response", f"{kind}: {exc!r}")
            self.ops[kind] += 1
            if ok:
                self.lat[kind].append(time.perf_counter() - t0)
            if self.think_time:
                await asyncio.sleep(rng.uniform(0, 2 * self.think_time))

    def _status(self, kind: str, r: httpx.Response) -> bool:
        if 200 <= r.status_code < 300:
            return True
        self.error(f"http_{r.status_code}", f"{kind}: {r.text}")
        return False

    async def add(self, client: httpx.AsyncClient, uid: str, rng: random.Random, facts: list[dict[str, str]], step: int) -> bool:
        thing = rng.choice(THINGS)
        value = f"{rng.choice(['red', 'blue', 'Rex', 'Lyon', 'Oslo', 'jazz', 'oak', 'Nile'])}{step}"
        r = await client.post("/v1/memories/", json={
            "messages": [{"role": "user", "content": f"My {thing} is {value}."}],
            "user_id": uid, "metadata": {"source": "inferscale-load", "run": self.prefix},
        })
        if not self._status("add", r):
            return False
        results = r.json()["results"]
        if len(results) != 1 or results[0]["user_id"] != uid or not results[0]["handle"].startswith("<<mem:"):
            self.error("invalid_response", f"add: {r.text}")
            return False
        facts.append({"id": results[0]["id"], "handle": results[0]["handle"], "thing": thing})
        self.facts += 1
        return True

    def _chat_body(self, uid: str, rng: random.Random, facts: list[dict[str, str]], *, stream: bool, recall: bool) -> dict[str, Any]:
        chosen = rng.sample(facts, min(len(facts), rng.randint(1, 3)))
        question = f"What is my {chosen[-1]['thing']}?"
        body: dict[str, Any] = {"model": self.model, "user": uid, "max_tokens": self.max_tokens, "temperature": 0}
        if recall:  # the server recalls and injects the user's memories itself
            body["messages"] = [{"role": "user", "content": question}]
            body["memory_k"] = 2
        else:
            memory = "\n".join(f["handle"] for f in chosen)
            body["messages"] = [{"role": "system", "content": f"Things you remember about the user:\n{memory}"},
                                {"role": "user", "content": question}]
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    async def ask(self, client: httpx.AsyncClient, uid: str, rng: random.Random, facts: list[dict[str, str]], *, stream: bool, recall: bool) -> bool:
        body = self._chat_body(uid, rng, facts, stream=stream, recall=recall)
        if not stream:
            r = await client.post("/v1/chat/completions", json=body)
            if not self._status("ask", r):
                return False
            data = r.json()
            content = data["choices"][0]["message"]["content"]
            usage = data["usage"]
            if not isinstance(content, str) or usage["completion_tokens"] < 1:
                self.error("invalid_response", f"ask: {r.text}")
                return False
        else:
            t0 = time.perf_counter()
            first, done, usage = None, False, None
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if not 200 <= r.status_code < 300:
                    await r.aread()
                    return self._status("stream", r)
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[6:]
                    if payload == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        self.error("stream_error", json.dumps(chunk["error"]))
                        return False
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                        first = time.perf_counter() - t0
            if not done or usage is None:
                self.error("invalid_response", f"stream ended without [DONE] or usage (done={done})")
                return False
            if first is not None:
                self.ttft.append(first)
        injected = int(usage.get("injected_tokens", 0))
        if injected <= 0:
            # The user has memories: handles (or memory_k recall) must inject them, unless the
            # cost model chose to prefill memories whose KV was only in cold disk files.
            if not (usage.get("memory_mix") or {}).get("recomputed"):
                self.error("not_injected", f"ask injected nothing: {json.dumps(body)[:200]}")
                return False
            self.recomputed += 1
        self.injected += injected
        return True

    async def search(self, client: httpx.AsyncClient, uid: str, rng: random.Random, facts: list[dict[str, str]]) -> bool:
        thing = rng.choice(facts)["thing"] if facts else rng.choice(THINGS)
        r = await client.post("/v1/memories/search/", json={"query": f"my {thing}", "user_id": uid, "limit": 3})
        if not self._status("search", r):
            return False
        hits = r.json()["results"]
        own = {f["id"] for f in facts}
        foreign = [h for h in hits if h.get("user_id") != uid]
        if foreign:
            self.error("isolation", f"search of {uid} returned memories of {sorted({h.get('user_id') for h in foreign})}")
            return False
        if facts and not any(h["id"] in own for h in hits):
            self.error("invalid_response", f"search of {uid} found none of its {len(own)} memories")
            return False
        return True

    async def cleanup(self, client: httpx.AsyncClient) -> None:
        sem = asyncio.Semaphore(16)

        async def one(uid: str) -> None:
            async with sem:
                with contextlib.suppress(httpx.HTTPError):
                    await client.delete("/v1/memories/", params={"user_id": uid})

        await asyncio.gather(*(one(u) for u in self.user_ids))

    def report(self, wall: float, cancelled: int) -> LoadReport:
        everything = [x for v in self.lat.values() for x in v]
        latency = {k: _stats(v) for k, v in sorted(self.lat.items())}
        latency["all"] = _stats(everything)
        errors = sum(self.errors.values())
        return LoadReport(
            url=self.url, users=self.users, duration_s=self.duration, wall_s=round(wall, 3),
            requests=sum(self.ops.values()), errors=errors, by_op=dict(self.ops), errors_by_kind=dict(self.errors),
            error_examples=self.examples, latency=latency, ttft_stream=_stats(self.ttft), facts_added=self.facts,
            injected_tokens=self.injected, asks_recomputed=self.recomputed, cancelled=cancelled,
        )


def _stats(values: list[float]) -> dict[str, float | None]:
    def r(v: float | None) -> float | None:
        return None if v is None else round(v, 4)

    return {"n": len(values), "p50": r(percentile(values, 50)), "p95": r(percentile(values, 95)),
            "p99": r(percentile(values, 99)), "max": r(max(values) if values else None)}


async def arun_load(
    url: str | list[str],
    *,
    users: int = 100,
    duration: float = 60.0,
    model: str | None = None,
    api_key: str | None = None,
    max_tokens: int = 16,
    request_timeout: float = 120.0,
    grace: float | None = None,
    think_time: float = 0.0,
    seed: int = 0,
    cleanup: bool = True,
    prefix: str | None = None,
) -> LoadReport:
    """Run the load against ``url`` (async; a list: replicas, taken in turn); see :func:`run_load`."""
    urls = [url] if isinstance(url, str) else list(url)
    if users < 1 or duration <= 0 or max_tokens < 1 or request_timeout <= 0:
        raise ValueError("users, duration, max_tokens and request_timeout must be positive")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=users + 8, max_keepalive_connections=users + 8)
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(httpx.AsyncClient(
            base_url=u.rstrip("/"), headers=headers, timeout=request_timeout, limits=limits)) for u in urls]
        client = clients[0]
        if model is None:
            r = await client.get("/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        run = _Run(" ".join(urls), users=users, duration=duration, model=model, api_key=api_key, max_tokens=max_tokens,
                   request_timeout=request_timeout, think_time=think_time, seed=seed,
                   prefix=prefix or f"load-{uuid.uuid4().hex[:8]}")
        t0 = time.monotonic()
        deadline = t0 + duration
        tasks = [asyncio.create_task(run.user(clients, i, deadline)) for i in range(users)]
        grace = request_timeout if grace is None else grace
        _, pending = await asyncio.wait(tasks, timeout=duration + grace)
        for t in pending:  # self-stopping: nothing outlives deadline + grace
            t.cancel()
            run.error("cancelled", "still running at the deadline + grace")
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                run.error("crashed", repr(t.exception()))
        wall = time.monotonic() - t0
        if cleanup:
            await run.cleanup(client)
        return run.report(wall, len(pending))


def run_load(url: str | list[str], **kwargs: Any) -> LoadReport:
    """Run ``users`` simulated users against ``url`` for ``duration`` seconds and report.

    Keyword arguments: ``users``, ``duration``, ``model`` (default: the served one), ``api_key``,
    ``max_tokens``, ``request_timeout``, ``grace`` (default ``request_timeout``), ``think_time``
    (mean seconds between a user's operations; 0 = closed loop), ``seed``, ``cleanup`` (delete
    the users' memories afterwards), ``prefix`` (user id prefix).
    """
    return asyncio.run(arun_load(url, **kwargs))


@contextlib.contextmanager
def serve_app(app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> Iterator[str]:
    """Serve an ASGI app with uvicorn in a background thread; yields its base URL.

    ``port=0`` picks a free port (the socket is bound here, so there is no race). The server
    stops when the block exits.
    """
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5, access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="inferscale-test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m inferscale_apps.bench.load", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", action="append", default=None,
                   help="server base URL (default http://127.0.0.1:8000); repeat for replicas sharing one store")
    p.add_argument("--users", type=int, default=100, help="concurrent simulated users (default %(default)s)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds to generate load (default %(default)s)")
    p.add_argument("--model", default=None, help="model id to send (default: the one /v1/models lists)")
    p.add_argument("--api-key", default=None, help="Bearer key, when the server has one")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (default %(default)s)")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request (default %(default)s)")
    p.add_argument("--grace", type=float, default=None, help="seconds after the deadline before in-flight work is cancelled")
    p.add_argument("--think-time", type=float, default=0.0, help="mean pause between a user's operations (default 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the simulated users' memories (default: delete them)")
    p.add_argument("--json", default=None, help="write the report here as JSON ('-' = stdout)")
    args = p.parse_args(argv)
    report = run_load(
        args.url or ["http://127.0.0.1:8000"], users=args.users, duration=args.duration, model=args.model, api_key=args.api_key,
        max_tokens=args.max_tokens, request_timeout=args.request_timeout, grace=args.grace,
        think_time=args.think_time, seed=args.seed, cleanup=not args.keep,
    )
    print(report.summary(), file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json == "-":
        print(json.dumps(report.to_dict(), indent=2))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=2)
    return 0 if report.errors == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
