"""``inferscale serve`` end to end: a real server process, the real ``openai`` client and
LangChain's ``ChatOpenAI`` against it, streaming, memory endpoints, scoping and errors.

One server for the module (tiny random Llama: the text is gibberish, the protocol is not).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

API_KEY = "test-key-123"
MODEL = "tiny-llama"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, tmp: Path, *extra: str, name: str | None = None, timeout: float = 300) -> tuple[subprocess.Popen, str, Path]:
    """Run ``python -m inferscale_apps.cli serve`` on a free port; wait for /health."""
    port = _free_port()
    log = tmp / "server.log"
    env = {**os.environ, "INFERSCALE_HOME": str(tmp / "home")}
    cmd = [sys.executable, "-m", "inferscale_apps.cli", "serve", "--model", model, "--port", str(port),
           "--store", str(tmp / "store"), "--log-level", "warning", *extra]
    if name:
        cmd += ["--served-model-name", name]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base, log
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server did not come up in {timeout}s:\n{log.read_text()[-4000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    proc, base, log = start_server(tiny_llama, tmp, "--max-model-len", "1024", "--api-key", API_KEY, "--recompute", "0",
                                   name=MODEL)
    yield base
    stop_server(proc)
    text = log.read_text()
    assert "Traceback" not in text, text[-4000:]  # no request may crash the server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


def chat(client, content, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


# ---------------------------------------------------------------------- OpenAI protocol


def test_health_and_models(server, client):
    assert httpx.get(server + "/health").json()["status"] == "ok"
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_completion_and_usage(client):
    r = chat(client, "Hello there")
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    assert u.completion_tokens >= 1 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0
    assert u.model_extra["injected_tokens"] == 0


def test_streaming_matches_non_streaming(client):
    full = chat(client, "Tell me about the weather", max_tokens=12, seed=1)
    stream = chat(client, "Tell me about the weather", max_tokens=12, seed=1, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_stream_without_usage_has_no_usage_chunk(client):
    chunks = list(chat(client, "Hi", stream=True))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_completions_endpoint(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text and r.usage.completion_tokens <= 6
    parts = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == r.choices[0].text


def test_sampling_params_and_max_completion_tokens(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_completion_tokens=3, temperature=0.7, top_p=0.9, seed=7, stop=["\n\n"], presence_penalty=0.1,
    )
    assert r.usage.completion_tokens <= 3
    again = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_completion_tokens=3, temperature=0.7, top_p=0.9, seed=7, stop=["\n\n"], presence_penalty=0.1,
    )
    assert again.choices[0].message.content == r.choices[0].message.content  # seeded


def test_langchain_chat_openai(server):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(model=MODEL, base_url=server + "/v1", api_key=API_KEY, temperature=0, max_tokens=8, max_retries=0)
    msg = llm.invoke("Hello")
    assert isinstance(msg.content, str) and msg.usage_metadata["output_tokens"] >= 1
    streamed = list(lc.ChatOpenAI(model=MODEL, base_url=server + "/v1", api_key=API_KEY, temperature=0, max_tokens=8,
                                  max_retries=0, stream_usage=True).stream("Hello"))
    assert "".join(c.content for c in streamed) == msg.content
    assert sum((c.usage_metadata or {}).get("output_tokens", 0) for c in streamed) == msg.usage_metadata["output_tokens"]


def test_concurrent_requests(client):
    results, errors = [], []

    def one(i):
        try:
            results.append(chat(client, f"Question number {i}", max_tokens=6).choices[0].message.content)
        except Exception as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 6


def test_client_disconnect_mid_stream_frees_the_engine(server, client):
    with httpx.stream("POST", server + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "Go on"}], "max_tokens": 900,
                            "stream": True, "temperature": 0}, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break
    time.sleep(0.5)
    t0 = time.monotonic()
    assert chat(client, "Still there?").choices[0].message.content is not None
    assert time.monotonic() - t0 < 30
    m = httpx.get(server + "/metrics").text
    assert "inferscale_generations_in_flight 0.0" in m


# ---------------------------------------------------------------------- errors


def test_missing_or_wrong_api_key_is_401(server):
    with pytest.raises(openai.AuthenticationError) as exc:
        openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).models.list()
    assert exc.value.status_code == 401
    r = httpx.post(server + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server + "/health").status_code == 200  # health stays open


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{not json", None),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}), "temperature"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": 5}]}), "messages.0.content"),
        (json.dumps({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}), "messages.0.role"),
        (json.dumps({"model": MODEL, "messages": []}), "messages"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}), "max_tokens"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": "yes"}), "stream"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}]}), "model"),
        (json.dumps([1, 2]), None),
    ],
)
def test_bad_bodies_are_400_json(http, body, param):
    r = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param:
        assert err["param"] == param


def test_unsupported_options_are_400(client):
    with pytest.raises(openai.BadRequestError, match="n=1"):
        chat(client, "x", n=2)
    with pytest.raises(openai.BadRequestError, match="legacy 'functions'"):  # tools are served (test_server_tools.py)
        chat(client, "x", functions=[{"name": "f", "parameters": {"type": "object"}}])
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        chat(client, "x", logprobs=True)
    with pytest.raises(openai.BadRequestError, match="one prompt"):
        client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2, stream=True)


def test_completions_with_a_list_of_prompts(client):
    """What vLLM does, and what ``langchain_openai.OpenAI(...).batch`` sends: one choice per prompt."""
    one = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0)
    two = client.completions.create(model=MODEL, prompt="Water is", max_tokens=4, temperature=0)
    both = client.completions.create(model=MODEL, prompt=["The sky is", "Water is"], max_tokens=4, temperature=0)
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == [one.choices[0].text, two.choices[0].text]
    assert both.usage.completion_tokens == one.usage.completion_tokens + two.usage.completion_tokens
    lc = pytest.importorskip("langchain_openai")
    llm = lc.OpenAI(model=MODEL, base_url=str(client.base_url), api_key=API_KEY, temperature=0, max_tokens=4, max_retries=0)
    assert llm.batch(["The sky is", "Water is"]) == [one.choices[0].text, two.choices[0].text]


def test_max_tokens_too_big(client):
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, "x", max_tokens=5000)
    assert exc.value.body["code"] == "context_length_exceeded"
    # OpenAI's and vLLM's wording, which litellm & co. map to their context-window errors
    assert exc.value.body["message"].startswith("This model's maximum context length is 1024 tokens. However, you requested")
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, "word " * 200, max_tokens=1000)  # fits alone, not with the prompt
    assert exc.value.body["code"] == "context_length_exceeded"
    assert "This model's maximum context length is 1024 tokens. However, you requested" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, "word " * 600)  # the prompt alone is too long
    assert "However, your messages resulted in" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        chat(client, "x", max_tokens=0)


def test_unknown_model_and_route_are_404(client, http):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"
    r = http.delete("/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_litellm_context_window_error_and_user(server, http):
    """litellm maps the overflow to ContextWindowExceededError by its wording; it drops ``user``
    for OpenAI-compatible providers, so the user goes in extra_body or the X-User-Id header."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list at import
    litellm = pytest.importorskip("litellm")
    kw = dict(model=f"openai/{MODEL}", api_base=server + "/v1", api_key=API_KEY, max_tokens=4, temperature=0)
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(messages=[{"role": "user", "content": "word " * 200}], **{**kw, "max_tokens": 1000})
    r = http.post("/v1/memories/", json={"messages": "My cat is called Tom.", "user_id": "lite"})
    msgs = [{"role": "system", "content": "Memory: " + r.json()["results"][0]["handle"]}, {"role": "user", "content": "cat?"}]
    for extra in ({"extra_body": {"user": "lite"}}, {"extra_headers": {"X-User-Id": "lite"}}):
        assert litellm.completion(messages=msgs, **kw, **extra).usage.model_extra["injected_tokens"] > 0
    with pytest.raises(litellm.BadRequestError, match="names no user"):
        litellm.completion(messages=msgs, user="lite", **kw)  # dropped by litellm: refused, not served as "default"
    http.delete("/v1/memories/", params={"user_id": "lite"})


def test_retrieve_model(client):
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_forged_and_malformed_handles(client):
    forged = "<<mem:0123456789abcdef:0123456789abcdef>>"
    with pytest.raises(openai.PermissionDeniedError) as exc:
        chat(client, f"Remember {forged}", user="alice")
    assert exc.value.status_code == 403 and exc.value.body["code"] == "forged_handle"
    with pytest.raises(openai.PermissionDeniedError):  # streaming: the error comes before any chunk
        list(chat(client, f"Remember {forged}", user="alice", stream=True))
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, "Remember <<mem:xyz>>")
    assert exc.value.body["code"] == "malformed_handle"


# ---------------------------------------------------------------------- memories


def test_memory_lifecycle_and_scoping(http, client):
    r = http.post("/v1/memories/", json={"messages": [{"role": "user", "content": "My dog is called Rex."},
                                                       {"role": "user", "content": "I live in Lyon."}],
                                          "user_id": "alice", "metadata": {"source": "test"}})
    assert r.status_code == 200, r.text
    added = r.json()["results"]
    assert [a["memory"] for a in added] == ["My dog is called Rex.", "I live in Lyon."]
    assert all(a["event"] == "ADD" and a["user_id"] == "alice" and a["handle"].startswith("<<mem:") for a in added)
    dog = added[0]

    listed = http.get("/v1/memories/", params={"user_id": "alice"}).json()["results"]
    assert {m["id"] for m in listed} == {a["id"] for a in added}
    assert http.get("/v1/memories/", params={"user_id": "bob"}).json()["results"] == []

    found = http.post("/v1/memories/search/", json={"query": "what is my dog called?", "user_id": "alice", "limit": 1}).json()["results"]
    assert [f["id"] for f in found] == [dog["id"]] and "score" in found[0]
    assert http.post("/v1/memories/search/", json={"query": "dog", "user_id": "bob"}).json()["results"] == []

    got = http.get(f"/v1/memories/{dog['id']}/", params={"user_id": "alice"})
    assert got.status_code == 200 and got.json()["memory"] == "My dog is called Rex."
    assert http.get(f"/v1/memories/{dog['id']}", params={"user_id": "alice"}).status_code == 200  # no slash too

    # another user's id: 404, whatever the verb
    assert http.get(f"/v1/memories/{dog['id']}/", params={"user_id": "bob"}).status_code == 404
    assert http.put(f"/v1/memories/{dog['id']}/", params={"user_id": "bob"}, json={"text": "hacked"}).status_code == 404
    assert http.delete(f"/v1/memories/{dog['id']}/", params={"user_id": "bob"}).status_code == 404
    assert http.get(f"/v1/memories/{dog['id']}/history/", params={"user_id": "bob"}).status_code == 404
    assert http.get("/v1/memories/ffffffffffffffff/", params={"user_id": "alice"}).status_code == 404
    # without a user the API key is the scope (Mem0's per-id calls send none); naming one checks it
    assert http.get(f"/v1/memories/{dog['id']}/").json()["memory"] == "My dog is called Rex."
    assert http.get(f"/v1/memories/{dog['id']}/", headers={"X-User-Id": "bob"}).status_code == 404
    assert http.post("/v1/memories/", json={"messages": "x"}).status_code == 400

    # the handle works in chat for alice (its KV is injected) and is refused for bob
    sys_msg = {"role": "system", "content": f"Things you remember about the user:\n{dog['handle']}"}
    r = client.chat.completions.create(model=MODEL, user="alice", max_tokens=4, temperature=0,
                                       messages=[sys_msg, {"role": "user", "content": "What is my dog's name?"}])
    assert r.usage.model_extra["injected_tokens"] > 0
    s = list(client.chat.completions.create(model=MODEL, user="alice", max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[sys_msg, {"role": "user", "content": "What is my dog's name?"}]))
    assert "".join(c.choices[0].delta.content or "" for c in s if c.choices) == r.choices[0].message.content
    assert s[-1].usage.model_extra["injected_tokens"] == r.usage.model_extra["injected_tokens"]
    # the quality knob per request: the one memory prefilled, nothing injected; a bad value is a 400
    knob = client.chat.completions.create(model=MODEL, user="alice", max_tokens=4, temperature=0,
                                          extra_body={"recompute": 1},
                                          messages=[sys_msg, {"role": "user", "content": "What is my dog's name?"}])
    assert knob.usage.model_extra["injected_tokens"] == 0
    assert knob.usage.prompt_tokens == r.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, user="alice", max_tokens=4, extra_body={"recompute": -1},
                                       messages=[sys_msg, {"role": "user", "content": "What is my dog's name?"}])
    with pytest.raises(openai.PermissionDeniedError):
        client.chat.completions.create(model=MODEL, user="bob", max_tokens=4,
                                       messages=[sys_msg, {"role": "user", "content": "What is my dog's name?"}])
    # memory_k extension: the server recalls and injects by itself
    r = client.chat.completions.create(model=MODEL, user="alice", max_tokens=4, temperature=0, extra_body={"memory_k": 2},
                                       messages=[{"role": "user", "content": "What is my dog's name?"}])
    assert r.usage.model_extra["injected_tokens"] > 0
    # the user may come from OpenAI's safety_identifier or an X-User-Id header (litellm drops `user`)
    for kw in ({"extra_body": {"memory_k": 2, "safety_identifier": "alice"}},
               {"extra_body": {"memory_k": 2}, "extra_headers": {"X-User-Id": "alice"}}):
        r = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, **kw,
                                           messages=[{"role": "user", "content": "What is my dog's name?"}])
        assert r.usage.model_extra["injected_tokens"] > 0
    # memories without a user are refused, never served as some default user's
    for kw in ({"extra_body": {"memory_k": 2}}, {}):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model=MODEL, max_tokens=4, **kw,
                                           messages=[sys_msg, {"role": "user", "content": "What is my dog's name?"}])
        assert exc.value.body["code"] == "user_required"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, user="alice", max_tokens=4, extra_headers={"X-User-Id": "bob"},
                                       messages=[sys_msg, {"role": "user", "content": "What is my dog's name?"}])
    assert exc.value.body["code"] == "conflicting_user"
    assert chat(client, "No memories here").choices[0].message.content is not None  # no user needed

    # update + history
    r = http.put(f"/v1/memories/{dog['id']}/", params={"user_id": "alice"}, json={"text": "My dog is called Max."})
    assert r.status_code == 200 and r.json()["memory"] == "My dog is called Max."
    hist = http.get(f"/v1/memories/{dog['id']}/history/", params={"user_id": "alice"}).json()
    assert [h["event"] for h in hist][-1] == "UPDATE" and hist[-1]["new_memory"] == "My dog is called Max."

    # delete one, then all
    assert http.delete(f"/v1/memories/{dog['id']}/", params={"user_id": "alice"}).status_code == 200
    assert http.get(f"/v1/memories/{dog['id']}/", params={"user_id": "alice"}).status_code == 404
    with pytest.raises(openai.NotFoundError):  # a deleted fact's handle
        client.chat.completions.create(model=MODEL, user="alice", max_tokens=4,
                                       messages=[sys_msg, {"role": "user", "content": "What is my dog's name?"}])
    r = http.delete("/v1/memories/", params={"user_id": "alice"})
    assert r.status_code == 200 and r.json()["deleted"] == 1
    assert http.get("/v1/memories/", params={"user_id": "alice"}).json()["results"] == []


def test_metrics(server, client):
    chat(client, "count me")
    text = httpx.get(server + "/metrics").text
    assert 'inferscale_requests_total{method="POST",route="/v1/chat/completions",status="200"}' in text
    assert "inferscale_ttft_seconds_count" in text and "inferscale_injected_tokens_total" in text
    assert 'inferscale_requests_total{method="POST",route="unauthorized",status="401"}' in text
