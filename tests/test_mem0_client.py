"""The real ``mem0ai`` client, unmodified, against ``inferscale serve`` (tiny random Llama; the
memory endpoints do not depend on what the model says, except ``infer=true``, which must then
refuse clearly).

The current major release is the one in the ``test`` extra and runs in this process. The
previous major cannot share the venv with it, so it is installed (``--no-deps``: both majors
need the same packages) into a temporary folder put first on ``PYTHONPATH`` of a subprocess;
that test is skipped when pip cannot fetch it (offline CI without a cache).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_server import start_server, stop_server

os.environ["MEM0_TELEMETRY"] = "False"  # read when mem0 is imported, so before it
import mem0  # noqa: E402  (the test extra installs it: a missing one must fail, not skip)
import mem0_checks  # noqa: E402

API_KEY = "mem0-test-key"
PREVIOUS_MAJOR = "mem0ai>=1.0,<2"


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server-mem0")
    os.environ.setdefault("MEM0_DIR", str(tmp / "mem0-home"))  # the client writes a config file there
    proc, base, log = start_server(tiny_llama, tmp, "--max-model-len", "1024", "--api-key", API_KEY)
    yield base
    stop_server(proc)
    text = log.read_text()
    assert "Traceback" not in text, text[-4000:]


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server, headers={"Authorization": f"Token {API_KEY}"}, timeout=120) as c:
        yield c


def test_current_release_every_method_sync_and_async(server):
    assert int(mem0.__version__.split(".")[0]) >= 2, mem0.__version__
    mem0_checks.check_all(server, API_KEY)


def test_previous_major_release_every_method_sync_and_async(server, tmp_path):
    target = tmp_path / "mem0-previous"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), PREVIOUS_MAJOR],
                         check=False, capture_output=True, text=True, timeout=300)
    if pip.returncode != 0:
        pytest.skip(f"cannot install {PREVIOUS_MAJOR} here: {pip.stderr.strip()[-300:]}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]),
           "MEM0_TELEMETRY": "False", "MEM0_DIR": str(tmp_path / "mem0-home")}
    script = Path(__file__).with_name("mem0_checks.py")
    r = subprocess.run([sys.executable, str(script), server, API_KEY], check=False, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-6000:]
    assert r.stdout.startswith("mem0ai 1."), r.stdout


def test_another_users_memory_is_404_to_a_caller_that_names_itself(http):
    r = http.post("/v3/memories/add/", json={"messages": [{"role": "user", "content": "I play the cello."}],
                                              "user_id": "carol", "infer": False})
    assert r.status_code == 200, r.text
    mid = r.json()["results"][0]["id"]
    for method, path, kw in [("GET", f"/v1/memories/{mid}/", {}), ("PUT", f"/v1/memories/{mid}/", {"json": {"text": "x"}}),
                             ("DELETE", f"/v1/memories/{mid}/", {}), ("GET", f"/v1/memories/{mid}/history/", {})]:
        for who in ({"params": {"user_id": "dave"}}, {"headers": {"X-User-Id": "dave"}}, {"params": {"agent_id": "bot"}}):
            r = http.request(method, path, **kw, **who)
            assert r.status_code == 404, (method, path, who, r.text)
            assert r.json()["detail"]  # what the mem0 client shows
    assert http.get(f"/v1/memories/{mid}/", params={"user_id": "carol"}).json()["memory"] == "I play the cello."
    # search and list never cross users
    r = http.post("/v3/memories/search/", json={"query": "cello", "filters": {"user_id": "dave"}})
    assert r.json()["results"] == []
    assert http.delete("/v1/memories/", params={"user_id": "carol"}).json()["deleted"] == 1
    # once deleted, its history still answers only its owner (or a caller that names no one)
    assert http.get(f"/v1/memories/{mid}/history/", params={"user_id": "dave"}).status_code == 404
    assert http.get(f"/v1/memories/{mid}/history/", headers={"X-User-Id": "dave"}).status_code == 404
    events = http.get(f"/v1/memories/{mid}/history/", params={"user_id": "carol"}).json()
    assert [e["event"] for e in events] == ["ADD", "DELETE"] and events[0]["user_id"] == "carol"


def test_requests_without_entity_or_with_unknown_filters_are_400(http):
    r = http.post("/v3/memories/", json={})
    assert r.status_code == 400 and "user_id" in r.json()["detail"]
    r = http.post("/v3/memories/search/", json={"query": "x", "filters": {"user_id": "a", "created_at": {"gte": "2024"}}})
    assert r.status_code == 400 and "created_at" in r.json()["detail"]
    assert http.delete("/v1/memories/").status_code == 400  # never "everything" by omission
    r = http.post("/v3/memories/add/", json={"messages": "x", "user_id": "@agent:bot"})
    assert r.status_code == 400


def test_bearer_and_token_auth_on_every_version(server):
    assert httpx.get(server + "/v1/ping/", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    for method, path in [("GET", "/v1/ping/"), ("POST", "/v2/memories/"), ("POST", "/v3/memories/search/"),
                         ("POST", "/v3/memories/add/"), ("DELETE", "/v2/entities/user/carol/"), ("GET", "/v1/entities/")]:
        for headers in ({"Authorization": "Token nope"}, {}):
            r = httpx.request(method, server + path, headers=headers, json={"query": "x", "filters": {"user_id": "a"}})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (method, path, r.text)
