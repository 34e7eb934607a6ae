"""Every ``MemoryClient`` / ``AsyncMemoryClient`` method of the installed ``mem0ai``, unmodified,
against a running ``inferscale serve``.

Imported by tests/test_mem0_client.py for the ``mem0ai`` in the venv, and run as a script
(``python tests/mem0_checks.py BASE_URL API_KEY``) with another major release first on
``PYTHONPATH``. Only the client's public API is used: what a Mem0 user's code calls.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
import uuid
from typing import Any

os.environ.setdefault("MEM0_TELEMETRY", "False")


async def _aw(x: Any) -> Any:
    return await x if inspect.isawaitable(x) else x


def _fails(exc_type: type, status: int):
    """A context manager asserting the client raised ``exc_type`` for an HTTP ``status``.

    1.x's async client has no error mapping and lets httpx's ``HTTPStatusError`` through.
    """
    import httpx

    class _Ctx:
        def __enter__(self) -> None:
            return None

        def __exit__(self, et, ev, tb) -> bool:
            assert et is not None, f"expected {exc_type.__name__} (HTTP {status}), nothing was raised"
            if issubclass(et, httpx.HTTPStatusError):
                assert ev.response.status_code == status, ev
                return True
            assert issubclass(et, exc_type), f"expected {exc_type.__name__}, got {et.__name__}: {ev}"
            assert (getattr(ev, "debug_info", None) or {}).get("status_code") == status, ev
            return True

    return _Ctx()


async def flow(client: Any, major: int) -> None:
    """Add, search, list, get, update, history, delete, delete_all, users, delete_users, with
    user, agent and run scoping; ``major`` picks the call styles that release documents."""
    from mem0.exceptions import MemoryNotFoundError, ValidationError

    u = "u-" + uuid.uuid4().hex[:8]  # this run's own user: the server is shared with other checks
    agent, run = "agent-" + u, "run-" + u

    # add: infer=false stores each message's content as it is (no role prefix)
    r = await _aw(client.add("I moved to Austin last year.", user_id=u, infer=False, metadata={"src": "check"}))
    [austin] = r["results"]
    assert austin["memory"] == "I moved to Austin last year." and austin["event"] == "ADD", r
    assert austin["user_id"] == u and austin["metadata"] == {"src": "check", "role": "user"}, austin
    r = await _aw(client.add([{"role": "system", "content": "You are kind."},
                              {"role": "user", "content": "My sister is called Ana."},
                              {"role": "assistant", "content": "Ana is a lovely name."}],
                             user_id=u, agent_id=agent, run_id=run, infer=False))
    assert [m["memory"] for m in r["results"]] == ["My sister is called Ana.", "Ana is a lovely name."], r
    assert all(m["agent_id"] == agent and m["run_id"] == run and m["user_id"] == u for m in r["results"]), r
    sister = r["results"][0]
    r = await _aw(client.add("Prefers short answers.", agent_id=agent, infer=False))
    [agent_only] = r["results"]
    assert agent_only["user_id"] is None and agent_only["agent_id"] == agent, agent_only

    # infer=true runs extraction on the served model; a reply it cannot use is a clear 4xx,
    # never an empty success (the test model is random: its reply is never the JSON asked for)
    with _fails(ValidationError, 422):
        await _aw(client.add("I love hiking in the Alps.", user_id=u))

    # search: filters (both majors), top_k, AND of entities
    r = await _aw(client.search("Where does the user live?", filters={"user_id": u}, top_k=1))
    assert [m["id"] for m in r["results"]] == [austin["id"]] and "score" in r["results"][0], r
    r = await _aw(client.search("sister", filters={"AND": [{"user_id": u}, {"run_id": run}]}, top_k=10))
    assert len(r["results"]) == 2 and all(m["run_id"] == run for m in r["results"]), r
    assert r["results"][0]["id"] == sister["id"], r
    r = await _aw(client.search("answers", filters={"agent_id": agent}, top_k=10))
    assert len(r["results"]) == 3 and agent_only["id"] in {m["id"] for m in r["results"]}, r
    if major < 2:  # 1.x also takes the entity at top level
        r = await _aw(client.search("Where does the user live?", user_id=u, top_k=1))
        assert [m["id"] for m in r["results"]] == [austin["id"]], r

    # get_all: filters, AND, pagination
    r = await _aw(client.get_all(filters={"user_id": u}))
    assert len(r["results"]) == 3, r
    r = await _aw(client.get_all(filters={"AND": [{"agent_id": agent}, {"user_id": u}]}))
    assert len(r["results"]) == 2, r
    r = await _aw(client.get_all(filters={"user_id": u}, page=2, page_size=2))
    assert r["count"] == 3 and len(r["results"]) == 1 and r["next"] is None and r["previous"], r
    if major < 2:
        r = await _aw(client.get_all(user_id=u))
        assert len(r["results"]) == 3, r

    # get / update (text, then metadata alone) / history
    got = await _aw(client.get(austin["id"]))
    assert got["memory"] == austin["memory"] and got["user_id"] == u, got
    r = await _aw(client.update(austin["id"], text="I moved to Denver last year."))
    assert r["memory"] == "I moved to Denver last year.", r
    r = await _aw(client.update(austin["id"], metadata={"src": "edited"}))
    assert r["metadata"] == {"src": "edited"} and r["memory"] == "I moved to Denver last year.", r
    got = await _aw(client.get(austin["id"]))
    assert got["metadata"] == {"src": "edited"} and got["memory"] == "I moved to Denver last year.", got
    hist = await _aw(client.history(austin["id"]))
    assert [h["event"] for h in hist] == ["ADD", "UPDATE"], hist
    assert hist[1]["old_memory"] == "I moved to Austin last year." and hist[1]["new_memory"] == "I moved to Denver last year."
    assert all(h["user_id"] == u and h["memory_id"] == austin["id"] and "updated_at" in h for h in hist), hist

    # delete: gone, and its history says so
    r = await _aw(client.delete(austin["id"]))
    assert "deleted" in r["message"].lower(), r
    with _fails(MemoryNotFoundError, 404):
        await _aw(client.get(austin["id"]))
    hist = await _aw(client.history(austin["id"]))
    assert [h["event"] for h in hist] == ["ADD", "UPDATE", "DELETE"], hist

    # users / entities
    ents = await _aw(client.users())
    mine = {(e["type"], e["name"]): e["total_memories"] for e in ents["results"] if e["name"] in (u, agent, run)}
    assert mine == {("user", u): 2, ("agent", agent): 3, ("run", run): 2}, ents

    # delete_all by run, then delete_users by agent
    r = await _aw(client.delete_all(user_id=u, run_id=run))
    assert "deleted" in r["message"].lower(), r
    assert (await _aw(client.get_all(filters={"user_id": u})))["results"] == []
    assert len((await _aw(client.get_all(filters={"agent_id": agent})))["results"]) == 1
    await _aw(client.delete_users(agent_id=agent))
    assert (await _aw(client.get_all(filters={"agent_id": agent})))["results"] == []

    # delete_users() with no argument deletes every entity of the store
    await _aw(client.add("Likes tea.", user_id=u, infer=False))
    await _aw(client.delete_users())
    assert (await _aw(client.users()))["results"] == []


def check_all(base: str, api_key: str) -> str:
    """Run :func:`flow` with the sync and the async client; returns the mem0ai version."""
    import mem0
    from mem0 import AsyncMemoryClient, MemoryClient

    major = int(mem0.__version__.split(".")[0])
    try:
        MemoryClient(api_key="wrong-key", host=base)
    except ValueError as exc:  # the client reports a failed ping as ValueError
        assert "API key" in str(exc), exc
    else:
        raise AssertionError("a wrong API key was accepted")
    asyncio.run(flow(MemoryClient(api_key=api_key, host=base), major))

    async def run_async() -> None:
        await flow(AsyncMemoryClient(api_key=api_key, host=base), major)

    asyncio.run(run_async())
    return mem0.__version__


if __name__ == "__main__":
    print("mem0ai", check_all(sys.argv[1], sys.argv[2]), "OK")
