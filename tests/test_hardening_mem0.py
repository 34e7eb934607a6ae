"""Issue 39 (hardening, second round): the Mem0 memory API, attacks and bad input replayed
against a real engine through HTTP and the unmodified ``mem0ai`` client.

One tiny-Llama engine and one server (with an API key, as the client needs) for the module.
Every test works on users of its own, since the store is shared.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import httpx
import pytest

os.environ["MEM0_TELEMETRY"] = "False"  # read when mem0 is imported, so before it
import mem0  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

API_KEY = "hardening-mem0-key"


def uid(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def engine(tiny_llama, tmp_path_factory):
    from inferscale_engine import InferScaleEngine

    eng = InferScaleEngine(model=tiny_llama, store_path=tmp_path_factory.mktemp("hard-mem0-store"),
                           device="cpu", dtype="float32", max_model_len=1024, recompute=0)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    from inferscale_apps.bench.load import serve_app
    from inferscale_apps.server import create_app

    os.environ.setdefault("MEM0_DIR", str(tmp_path_factory.mktemp("mem0-home")))  # the client writes its config there
    with serve_app(create_app(engine, served_model_name="tiny", api_key=API_KEY)) as url:
        yield url


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server, headers={"Authorization": f"Token {API_KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture
def client(server):
    return mem0.MemoryClient(api_key=API_KEY, host=server)


def add(http: httpx.Client, text: str, **ids: str) -> dict[str, Any]:
    r = http.post("/v3/memories/add/", json={"messages": [{"role": "user", "content": text}], "infer": False, **ids})
    assert r.status_code == 200, r.text
    [item] = r.json()["results"]
    return item


def listed(http: httpx.Client, filters: dict[str, Any]) -> list[dict[str, Any]]:
    r = http.post("/v3/memories/", json={"filters": filters})
    assert r.status_code == 200, r.text
    return r.json()["results"]


# ------------------------------------------------------------------------------ 1: "*" is an id


def test_star_is_a_user_named_star_not_a_wildcard(http, client):
    """``"*"`` used to select every user's memories: list, search and delete all of them."""
    from mem0.exceptions import MemoryNotFoundError

    client.delete_all(user_id="*")  # start clean: other tests may use "*" too
    alice, bob, bot = uid("alice"), uid("bob"), uid("bot")
    a = client.add("Alice keeps her diary in the blue drawer.", user_id=alice, infer=False)["results"][0]
    b = client.add("Bob's locker code is 7731.", user_id=bob, agent_id=bot, infer=False)["results"][0]
    star = client.add("Star's own note.", user_id="*", infer=False)["results"][0]
    assert star["user_id"] == "*"

    for filters in ({"user_id": "*"}, {"user_id": {"in": ["*"]}}, {"AND": [{"user_id": "*"}]}):
        assert [m["id"] for m in client.get_all(filters=filters)["results"]] == [star["id"]], filters
        assert [m["id"] for m in client.search("diary locker code note", filters=filters, top_k=50)["results"]] == [star["id"]]
    assert client.get_all(filters={"agent_id": "*"})["results"] == []  # no agent is named "*"
    assert client.get_all(filters={"AND": [{"agent_id": bot}, {"user_id": "*"}]})["results"] == []
    r = http.get("/v1/memories/", params={"user_id": "*"})
    assert [m["id"] for m in r.json()["results"]] == [star["id"]]
    # the per-id calls: a caller named "*" owns only its own memories
    assert http.get(f"/v1/memories/{a['id']}/", params={"user_id": "*"}).status_code == 404
    assert http.get(f"/v1/memories/{a['id']}/", headers={"X-User-Id": "*"}).status_code == 404

    with pytest.raises(MemoryNotFoundError):  # agent "*" has no memories: nothing to forget
        client.delete_users(agent_id="*")
    client.delete_all(user_id="*")
    assert [m["id"] for m in client.get_all(filters={"user_id": alice})["results"]] == [a["id"]]
    assert [m["id"] for m in client.get_all(filters={"user_id": bob})["results"]] == [b["id"]]
    assert client.get_all(filters={"user_id": "*"})["results"] == []

    star = client.add("Star again.", user_id="*", infer=False)["results"][0]
    client.delete_users(user_id="*")  # DELETE /v2/entities/user/*/
    assert [m["id"] for m in client.get_all(filters={"user_id": alice})["results"]] == [a["id"]]
    assert [m["id"] for m in client.get_all(filters={"user_id": bob})["results"]] == [b["id"]]
    with pytest.raises(MemoryNotFoundError):
        client.get(star["id"])


# ------------------------------------------------------------------------------ 2: filters must pin an entity


@pytest.mark.parametrize("filters", [
    {"metadata": {}},
    {"metadata": {"src": "x"}},
    {"NOT": [{"user_id": "nobody"}]},
    {"AND": [{"metadata": {}}]},
    {"OR": [{"user_id": "PLACEHOLDER"}, {"metadata": {}}]},
    {"OR": [{"user_id": "PLACEHOLDER"}, {"NOT": [{"user_id": "PLACEHOLDER"}]}]},
    {"user_id": {"ne": "nobody"}},
    {"user_id": {"nin": ["nobody"]}},
    {"agent_id": {"ne": "nobody"}},
    {"user_id": {"in": []}},
    {"AND": [{"NOT": [{"user_id": "nobody"}]}, {"run_id": {"nin": []}}]},
])
def test_a_selection_that_pins_no_entity_id_is_refused(http, filters):
    """Filters with no entity id by equality used to list, search and delete every user's memories."""
    user = uid("pin")
    mine = add(http, "Pinned fact.", user_id=user)
    filters = _replace(filters, "PLACEHOLDER", user)
    for path, body in (("/v3/memories/", {"filters": filters}), ("/v2/memories/", {"filters": filters}),
                       ("/v3/memories/search/", {"query": "fact", "filters": filters}),
                       ("/v1/memories/search/", {"query": "fact", "filters": filters})):
        r = http.post(path, json=body)
        assert r.status_code == 400, (path, filters, r.text)
        err = r.json()["error"]
        assert err["code"] == "entity_id_required" and err["param"] == "filters", err
        assert "user_id" in err["message"]
    assert [m["id"] for m in listed(http, {"user_id": user})] == [mine["id"]]


@pytest.mark.parametrize("filters", [
    {"AND": [{"user_id": "PLACEHOLDER"}, {"metadata": {}}]},
    {"OR": [{"user_id": "PLACEHOLDER"}, {"agent_id": "nobody"}]},
    {"user_id": {"in": ["PLACEHOLDER", "nobody"]}},
    {"user_id": {"eq": "PLACEHOLDER"}},
    {"AND": [{"user_id": "PLACEHOLDER"}, {"NOT": [{"run_id": "r"}]}, {"agent_id": {"ne": "x"}}]},
    {"user_id": "PLACEHOLDER", "metadata": {"role": "user"}},
])
def test_a_selection_that_pins_an_entity_in_every_branch_is_served(http, filters):
    user = uid("pinned")
    mine = add(http, "Pinned fact.", user_id=user)
    assert [m["id"] for m in listed(http, _replace(filters, "PLACEHOLDER", user))] == [mine["id"]]


def _replace(obj: Any, old: str, new: str) -> Any:
    if isinstance(obj, dict):
        return {k: _replace(v, old, new) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_replace(v, old, new) for v in obj]
    return new if obj == old else obj


# ------------------------------------------------------------------------------ 3: user ids starting with "@"


def test_a_user_id_starting_with_at_round_trips(http, client):
    """``@handle``-style user ids used to be stored with ``user_id: null`` and vanish from
    list, search, delete_all and entities."""
    user = "@" + uid("erin")
    item = add(http, "Erin's cat is called Miso.", user_id=user)
    assert item["user_id"] == user
    assert http.get(f"/v1/memories/{item['id']}/", params={"user_id": user}).json()["user_id"] == user
    assert [m["id"] for m in client.get_all(filters={"user_id": user})["results"]] == [item["id"]]
    assert [m["id"] for m in http.get("/v1/memories/", params={"user_id": user}).json()["results"]] == [item["id"]]
    assert [m["id"] for m in client.search("cat", filters={"user_id": user}, top_k=5)["results"]] == [item["id"]]
    assert ("user", user) in {(e["type"], e["name"]) for e in client.users()["results"]}
    assert {h["user_id"] for h in client.history(item["id"])} == {user}
    assert client.delete_all(user_id=user)["deleted"] == 1
    events = client.history(item["id"])  # deleted: the events still say whose it was
    assert [e["event"] for e in events] == ["ADD", "DELETE"] and {e["user_id"] for e in events} == {user}
    assert http.get(f"/v1/memories/{item['id']}/history/", params={"user_id": user}).status_code == 200
    assert http.get(f"/v1/memories/{item['id']}/history/", params={"user_id": "@someone-else"}).status_code == 404
    # the store keys of agent, run and app memories stay out of reach of user ids
    r = http.post("/v3/memories/add/", json={"messages": "x", "user_id": "@agent:bot", "infer": False})
    assert r.status_code == 400 and r.json()["error"]["code"], r.text
    bot = uid("bot")
    agent_only = add(http, "Agent-only fact.", agent_id=bot)
    assert agent_only["user_id"] is None and agent_only["agent_id"] == bot
    assert {h["user_id"] for h in client.history(agent_only["id"])} == {None}


# ------------------------------------------------------------------------------ 4: infer=true checks the model's actions


@pytest.fixture
def scripted(engine, monkeypatch):
    """A server whose extraction model answers with the replies the test queues: the route, the
    store and the engine are the real ones; only the words of the model are chosen (the tiny
    random-weight model's own words are noise)."""
    from fastapi.testclient import TestClient

    from inferscale_apps.server import create_app, mem0_api

    replies: list[str] = []
    monkeypatch.setattr(mem0_api, "engine_generate", lambda engine, max_tokens: lambda messages, user_id: replies.pop(0))
    yield TestClient(create_app(engine, served_model_name="tiny")), replies  # re-raises any unhandled error


FACTS = '{"facts": ["Lives in Rome"]}'


@pytest.mark.parametrize("decision", [
    '{"memory": [{"id": "0", "text": "...", "event": "UPDATE"}]}',  # the prompt's own example, copied
    '{"memory": [{"id": "0", "text": "\\u2026", "event": "UPDATE"}]}',
    '{"memory": [{"id": "0", "text": "  ", "event": "UPDATE"}]}',
    '{"memory": [{"id": "0", "text": "-- !", "event": "UPDATE"}]}',
    '{"memory": [{"id": "7", "text": "Lives in Rome", "event": "UPDATE"}]}',  # not an id it was shown
    '{"memory": [{"id": "ID", "text": "Lives in Rome", "event": "UPDATE"}]}',  # the real id, never shown
    '{"memory": [{"id": "7", "event": "DELETE"}]}',
    '{"memory": [{"id": "new", "text": "...", "event": "ADD"}]}',
])
def test_infer_never_applies_a_placeholder_or_an_unshown_id(scripted, decision):
    """A model that copied the prompt's ``"text": "..."`` used to overwrite a real memory with
    ``...`` and answer 200."""
    client, replies = scripted
    user = uid("rome")
    r = client.post("/v3/memories/add/", json={"messages": "I live in Paris.", "user_id": user, "infer": False})
    old = r.json()["results"][0]
    replies[:] = [FACTS, decision.replace('"ID"', f'"{old["id"]}"')]
    r = client.post("/v3/memories/add/", json={"messages": "I moved to Rome.", "user_id": user, "infer": True})
    assert r.status_code == 422 and r.json()["error"]["code"] == "extraction_failed", r.text
    assert not replies  # both model calls were made
    after = client.get("/v1/memories/", params={"user_id": user}).json()["results"]
    assert [(m["id"], m["memory"]) for m in after] == [(old["id"], "I live in Paris.")]


def test_infer_applies_the_valid_actions_and_answers_none_with_an_empty_result(scripted):
    client, replies = scripted
    user = uid("rome")
    old = client.post("/v3/memories/add/", json={"messages": "I live in Paris.", "user_id": user, "infer": False}).json()["results"][0]
    replies[:] = [FACTS, '{"memory": [{"id": "0", "event": "NONE"}]}']
    r = client.post("/v3/memories/add/", json={"messages": "I live in Paris.", "user_id": user, "infer": True})
    assert r.status_code == 200 and r.json()["results"] == [], r.text
    replies[:] = [FACTS, '{"memory": [{"id": "0", "text": "...", "event": "UPDATE"}, '
                         '{"id": "0", "text": "Lives in Rome", "event": "UPDATE"}, {"id": "3", "event": "DELETE"}]}']
    r = client.post("/v3/memories/add/", json={"messages": "I moved to Rome.", "user_id": user, "infer": True})
    assert r.status_code == 200, r.text
    [(event, text, previous)] = [(m["event"], m["memory"], m.get("previous_memory")) for m in r.json()["results"]]
    assert (event, text, previous) == ("UPDATE", "Lives in Rome", "I live in Paris.")
    after = client.get(f"/v1/memories/{old['id']}/").json()
    assert after["memory"] == "Lives in Rome"


# ------------------------------------------------------------------------------ 5: pages and deep filters


@pytest.mark.parametrize("raw", ["Infinity", "-Infinity", "NaN", "1e400", "-1", "0", "1.5", "1e3", "true", '"1.5"',
                                 '"Infinity"', '"-1"', "99999999999999999999999", '"' + "9" * 5000 + '"'])
@pytest.mark.parametrize("field", ["page", "page_size"])
def test_bad_page_numbers_are_400(http, raw, field):
    user = uid("pages")
    add(http, "A fact to page through.", user_id=user)
    other = "page_size" if field == "page" else "page"
    # JSON as sent by a client that writes non-finite floats (Python's json does)
    body = f'{{"filters": {{"user_id": "{user}"}}, "{field}": {raw}, "{other}": 1}}'
    r = http.post("/v3/memories/", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", (raw, r.text)
    assert r.json()["error"]["param"] == field
    value = raw.strip('"')
    r = http.get("/v1/memories/", params={"user_id": user, field: value, other: "1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, (value, r.text)


def test_good_page_numbers_still_work(http):
    user = uid("pages")
    for i in range(3):
        add(http, f"Fact number {i}.", user_id=user)
    r = http.post("/v3/memories/", json={"filters": {"user_id": user}}, params={"page": "2", "page_size": "2"})
    assert r.status_code == 200 and r.json()["count"] == 3 and len(r.json()["results"]) == 1, r.text
    r = http.post("/v3/memories/", json={"filters": {"user_id": user}, "page": 1, "page_size": 2})
    assert r.status_code == 200 and len(r.json()["results"]) == 2, r.text


@pytest.mark.parametrize("op", ["AND", "OR", "NOT"])
def test_deeply_nested_filters_are_400(http, op):
    user = uid("deep")
    add(http, "Deep fact.", user_id=user)
    filters: dict[str, Any] = {"user_id": user}
    for _ in range(300):
        filters = {op: [filters]}
    for path, body in (("/v3/memories/", {"filters": filters}), ("/v3/memories/search/", {"query": "x", "filters": filters})):
        r = http.post(path, json=body)
        assert r.status_code == 400, (path, r.text[:300])
        assert r.json()["error"]["code"] == "invalid_request" and "deep" in r.json()["error"]["message"]
    filters = {"user_id": user}
    for _ in range(30):  # deep, but within the limit
        filters = {"AND": [filters]}
    assert len(listed(http, filters)) == 1


# ------------------------------------------------------------------------------ 6: pagination links keep the selection


def test_next_and_previous_keep_the_entity_ids(http, client):
    """``next`` used to be ``/v1/memories/?page=2&page_size=2``: following it lost ``user_id``."""
    user, run = uid("pager"), uid("run")
    ids = [add(http, f"Paged fact {i}.", user_id=user, run_id=run)["id"] for i in range(5)]
    add(http, "Same user, other run.", user_id=user, run_id=uid("run"))
    add(http, "Another user's fact.", user_id=uid("stranger"))
    seen: list[str] = []
    url: str | None = f"/v1/memories/?user_id={user}&run_id={run}&page=1&page_size=2"
    pages = 0
    while url:
        r = http.get(url)
        assert r.status_code == 200, (url, r.text)
        body = r.json()
        assert body["count"] == 5, body
        seen += [m["id"] for m in body["results"]]
        if pages:
            back = http.get(body["previous"]).json()
            assert back["count"] == 5 and len(back["results"]) == 2, body["previous"]
        url, pages = body["next"], pages + 1
    assert pages == 3 and sorted(seen) == sorted(ids)
    # the mem0ai client's paginated list (POST, page in the query): the links keep that query
    first = client.get_all(filters={"AND": [{"user_id": user}, {"run_id": run}]}, page=1, page_size=2)
    assert first["count"] == 5 and len(first["results"]) == 2
    assert "page=2" in first["next"] and "page_size=2" in first["next"], first["next"]
    r = http.post("/v3/memories/?page=2&page_size=2&org_id=o1", json={"filters": {"user_id": user, "run_id": run}})
    body = r.json()
    for link in (body["next"], body["previous"]):
        assert "org_id=o1" in link and "page_size=2" in link, link


# ------------------------------------------------------------------------------ 7: X-User-Id is UTF-8


def test_x_user_id_is_decoded_as_utf8(http):
    """A UTF-8 ``X-User-Id`` used to be read as Latin-1: ``jürgen`` became ``jÃ¼rgen``, another user."""
    user = "jürgen-" + uuid.uuid4().hex[:6] + "-日本"
    item = add(http, "Jürgen's bike is green.", user_id=user)
    r = http.get(f"/v1/memories/{item['id']}/", headers={"X-User-Id": user.encode("utf-8")})
    assert r.status_code == 200 and r.json()["user_id"] == user, r.text
    mojibake = user.encode("utf-8").decode("latin-1")  # what the header used to be taken for
    r = http.get(f"/v1/memories/{item['id']}/", headers={"X-User-Id": mojibake.encode("utf-8")})
    assert r.status_code == 404, r.text
    for raw in (b"\xff\xfe", b"j\xfcrgen", b"\xc3"):  # not UTF-8 (the middle one is Latin-1)
        r = http.get(f"/v1/memories/{item['id']}/", headers={"X-User-Id": raw})
        assert r.status_code == 400, (raw, r.text)
        assert r.json()["error"]["code"] == "invalid_header" and r.json()["error"]["param"] == "X-User-Id", r.text


# ------------------------------------------------------------------------------ 8: every 4xx has a code


def test_every_memory_4xx_has_a_code(http):
    user = uid("codes")
    item = add(http, "A fact with an id.", user_id=user)
    mid = item["id"]
    surrogate = '{"query": "\\ud800", "filters": {"user_id": "' + user + '"}}'
    cases: list[tuple[str, str, dict[str, Any]]] = [
        ("POST", "/v3/memories/search/", {"content": surrogate, "headers": {"Content-Type": "application/json"}}),
        ("POST", "/v1/memories/search/", {"content": surrogate, "headers": {"Content-Type": "application/json"}}),
        ("POST", "/v3/memories/add/", {"content": b"{not json", "headers": {"Content-Type": "application/json"}}),
        ("POST", "/v3/memories/add/", {"json": {"messages": "x"}}),
        ("POST", "/v3/memories/add/", {"json": {"messages": "x", "user_id": user, "infer": "yes"}}),
        ("POST", "/v3/memories/add/", {"json": {"messages": [], "user_id": user}}),
        ("POST", "/v3/memories/add/", {"json": {"messages": "x" * 200_000, "user_id": user}}),
        ("POST", "/v3/memories/", {"json": {"filters": {"user_id": user, "created_at": "x"}}}),
        ("POST", "/v3/memories/", {"json": {"filters": {"user_id": {"gt": "a"}}}}),
        ("POST", "/v3/memories/search/", {"json": {"query": "", "user_id": user}}),
        ("POST", "/v3/memories/search/", {"json": {"query": "x", "user_id": user, "top_k": 0}}),
        ("POST", "/v1/memories/prefetch/", {"json": {}}),
        ("GET", "/v1/memories/", {"params": {"user_id": "x" * 500}}),
        ("DELETE", "/v1/memories/", {}),
        ("GET", "/v1/memories/nope/", {}),
        ("GET", f"/v1/memories/{mid}/", {"params": {"user_id": "someone-else"}}),
        ("PUT", f"/v1/memories/{mid}/", {"json": {}}),
        ("PUT", f"/v1/memories/{mid}/", {"json": {"text": "y" * 200_000}}),
        ("PUT", f"/v1/memories/{mid}/", {"content": '{"text": "\\ud800"}', "headers": {"Content-Type": "application/json"}}),
        ("DELETE", "/v1/memories/nope/", {}),
        ("GET", "/v1/memories/nope/history/", {}),
        ("DELETE", "/v2/entities/planet/mars/", {}),
        ("DELETE", f"/v2/entities/user/{uid('nobody')}/", {}),
        ("PATCH", "/v1/memories/", {}),
    ]
    for method, path, kw in cases:
        r = http.request(method, path, **kw)
        assert 400 <= r.status_code < 500, (method, path, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert isinstance(err["code"], str) and err["code"], (method, path, err)
    r = http.post("/v3/memories/search/", content=surrogate, headers={"Content-Type": "application/json"})
    assert r.json()["error"]["param"] == "query", r.text
