"""``inferscale serve`` with SmolLM2, where answers matter: a memory added over REST is
recalled through its handle (openai client) and through ``memory_k`` (LangChain, streaming);
``inferscale memory ...`` works through the running server that holds the store.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
from test_server import start_server, stop_server

from inferscale_engine.prompting import memory_system_message

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(smollm2_path, tmp_path_factory):
    """The server's URL, its store folder and its process."""
    tmp = tmp_path_factory.mktemp("server-smollm2")
    proc, base, log = start_server("smollm2", tmp, "--recompute", "0")
    yield base, tmp / "store", proc
    stop_server(proc)
    assert "Traceback" not in log.read_text()


@pytest.fixture(scope="module")
def server(served):
    return served[0]


def test_recall_through_handles_and_memory_k(server):
    http = httpx.Client(base_url=server, timeout=120)
    r = http.post("/v1/memories/", json={"messages": "My dog is called Rex.", "user_id": "erin"})
    assert r.status_code == 200, r.text
    fact = r.json()["results"][0]

    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)
    # The layout the server encodes REST-added facts for (and that memory_k / inferscale chat use).
    system = memory_system_message([fact["handle"]])
    for _ in range(30):  # a memory still being encoded is served as text (serve_as_text_after)
        r = client.chat.completions.create(
            model="smollm2", user="erin", temperature=0, max_tokens=24,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": "What is my dog's name?"}],
        )
        if not r.usage.model_extra["memories_as_text"]:
            break
        time.sleep(1)
    assert "Rex" in r.choices[0].message.content
    injected = r.usage.model_extra["injected_tokens"]
    assert injected > 0 and r.usage.prompt_tokens_details.cached_tokens >= injected

    # Injection must not change the answer: the same prompt with the fact pasted as text.
    pasted = client.chat.completions.create(
        model="smollm2", user="erin", temperature=0, max_tokens=24,
        messages=[{"role": "system", "content": system.replace(fact["handle"], fact["memory"])},
                  {"role": "user", "content": "What is my dog's name?"}],
    )
    assert pasted.choices[0].message.content == r.choices[0].message.content
    assert pasted.usage.model_extra["injected_tokens"] == 0

    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(model="smollm2", base_url=server + "/v1", api_key="none", temperature=0, max_tokens=24,
                        max_retries=0, extra_body={"memory_k": 3, "user": "erin"}, stream_usage=True)
    chunks = list(llm.stream("What is my dog's name?"))
    assert "Rex" in "".join(c.content for c in chunks)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``inferscale ...`` in a fresh process, as a user runs it; reports whether vLLM was imported."""
    code = textwrap.dedent("""
        import sys
        from inferscale_apps.cli import main
        rc = main(sys.argv[1:])
        print("vllm imported:", "vllm" in sys.modules, file=sys.stderr)
        sys.exit(rc)
    """)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})}, check=False)


def ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, r.stderr[-3000:]
    assert "vllm imported: False" in r.stderr  # store-only: the server's model does the encoding
    return r.stdout


def test_memory_commands_through_the_running_server(served, tmp_path):
    base, store, proc = served
    at = ["--store", str(store)]  # the server's own store: its lock names the server's URL
    r = cli("memory", "add", "--user", "dana", "--json", "My dog is called Rex and I live in Lisbon.", *at)
    added = json.loads(ok(r))
    assert f"held by `inferscale serve` (process {proc.pid}); using its API at {base}" in " ".join(r.stderr.split())
    # Two topics, two memories, each stored by the server.
    assert [a["memory"] for a in added] == ["My dog is called Rex.", "I live in Lisbon."]
    dog, home = added
    assert [m["id"] for m in httpx.get(base + "/v1/memories/", params={"user_id": "dana"}).json()["results"]] == \
        [dog["id"], home["id"]]

    # A search for either topic finds its part first.
    out = ok(cli("memory", "search", "--user", "dana", "where do I live?", "--k", "2", *at))
    assert re.match(rf"{home['id']}  0\.\d{{3}}  I live in Lisbon\.\n{dog['id']}  ", out), out
    out = ok(cli("memory", "search", "--user", "dana", "What is my dog's name?", "--k", "1", *at))
    assert out.startswith(f"{dog['id']}  ") and out.rstrip().endswith("My dog is called Rex."), out

    # Output is that of the local path: a copy of the store (not locked) read without the server.
    copy = tmp_path / "copy"
    shutil.copytree(store, copy, ignore=shutil.ignore_patterns("kv"))
    for args in (["list", "--json"], ["list"], ["search", "where do I live?", "--json"], ["search", "my pets"]):
        via_server = ok(cli("memory", args[0], "--user", "dana", *args[1:], env={"INFERSCALE_SERVER": base}))
        local = ok(cli("memory", args[0], "--user", "dana", *args[1:], "--store", str(copy)))
        assert via_server == local, args

    # delete: another user's id is refused and deletes nothing; then one, then --all.
    r = cli("memory", "delete", "--user", "eve", dog["id"], "--server", base)
    assert r.returncode == 1 and f"no memory '{dog['id']}' for user 'eve'" in r.stderr
    assert ok(cli("memory", "delete", "--user", "dana", dog["id"], "--server", base)) == "deleted 1 memory\n"
    assert [m["memory"] for m in json.loads(ok(cli("memory", "list", "--user", "dana", "--json", *at)))] == \
        ["I live in Lisbon."]
    assert ok(cli("memory", "delete", "--user", "dana", "--all", *at)) == "deleted 1 memory\n"
    assert ok(cli("memory", "list", "--user", "dana", *at)) == ""


def test_commands_the_server_cannot_run_name_it_in_one_line(served, tmp_path):
    base, store, proc = served
    locomo = tmp_path / "locomo.json"
    locomo.write_text("[]")
    for args in (["import-locomo", str(locomo)], ["rotate-secret"]):
        r = cli("memory", *args, "--store", str(store))
        assert r.returncode == 1
        err = " ".join(r.stderr.split())
        assert f"already open by process {proc.pid}" in err and f"--server {base}" in err, err
        assert "Traceback" not in r.stderr
    # A server that is not there: one line saying so.
    r = cli("memory", "list", "--user", "dana", "--server", "http://127.0.0.1:9")
    assert r.returncode == 1 and "no InferScale server answers at http://127.0.0.1:9" in r.stderr
    r = cli("memory", "list", "--user", "dana", "--server", base, "--store", str(store))
    assert r.returncode == 1 and "give one of them" in r.stderr
