"""Issue 39 (hardening, second round): the OpenAI-compatible routes, replayed against a real engine.

Each test is an attack or a mistake that used to get a 500, a silent success or minutes of work,
sent through the public API. One tiny-Llama engine (context 256, the default ``recompute``) for
the module; HTTP through FastAPI's ``TestClient``, which re-raises any unhandled server error.
"""

from __future__ import annotations

import inspect
import uuid

import pytest

from inferscale_engine.errors import ContextOverflowError
from inferscale_engine.testing import memory_swapped_out

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning")]

CTX = 256
MSGS = [{"role": "user", "content": "hi"}]


def uid(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def engine(tiny_llama, tmp_path_factory):
    from inferscale_engine import InferScaleEngine

    eng = InferScaleEngine(model=tiny_llama, store_path=tmp_path_factory.mktemp("openai-store"),
                           device="cpu", dtype="float32", max_model_len=CTX)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def client(engine):
    from fastapi.testclient import TestClient

    from inferscale_apps.server import create_app

    return TestClient(create_app(engine, served_model_name="tiny"))  # re-raises any unhandled error


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "max_tokens": 2, **body})


def error_of(r) -> dict:
    return r.json()["error"]


# ------------------------------------------------------------------------------ errors: every class mapped


def test_every_engine_error_class_has_its_response():
    """Each error class of inferscale_engine.errors is answered on purpose: a store that does
    not open (damaged secret...) is a 503 memory_unavailable, not an unmapped 500; the server's
    own ValueErrors (settings, KV) are 500s, not the client's 400s."""
    from inferscale_apps.server import api_error
    from inferscale_engine import errors

    expected = {
        "InferScaleError": (500, "internal_error"),
        "HandleError": (400, "invalid_handle"),
        "MalformedHandleError": (400, "malformed_handle"),
        "ForgedHandleError": (403, "forged_handle"),
        "FactNotFoundError": (404, "memory_not_found"),
        "StaleKVError": (409, "stale_kv"),
        "ContextOverflowError": (400, "context_length_exceeded"),
        "InvalidSchemaError": (400, "invalid_json_schema"),
        "InvalidOptionError": (400, "invalid_value"),
        "EngineSettingsError": (500, "internal_error"),
        "EngineClosedError": (503, "engine_closed"),
        "KVNotReadyError": (503, "kv_not_ready"),
        "KVMissingError": (503, "kv_not_ready"),
        "ModelNotFoundError": (500, "internal_error"),
        "ModelPreparationError": (500, "internal_error"),
        "NonFiniteKVError": (500, "internal_error"),
        "MissingUserError": (400, "user_required"),
        "SchemaVersionError": (503, "memory_unavailable"),
        "SecretError": (503, "memory_unavailable"),
        "StoreDamagedError": (503, "memory_unavailable"),
        "TooLargeError": (413, "too_large"),
        "StorageFullError": (507, "insufficient_storage"),
        "StorageUnavailableError": (503, "storage_unavailable"),
        "ReplicaMismatchError": (503, "memory_unavailable"),
        "DatabaseUnavailableError": (503, "database_unavailable"),
        "ConnectorError": (500, "internal_error"),
        # The LlamaIndex LLM's, raised in place of the engine's own: answered as those would be.
        "HandleOwnerError": (403, "forged_handle"),
        "RefusedRequestError": (400, "invalid_request"),
    }
    classes = {name: cls for name, cls in inspect.getmembers(errors, inspect.isclass)
               if cls.__module__ == errors.__name__ and not issubclass(cls, Warning)}  # warnings are not raised
    assert set(classes) == set(expected), "a new error class needs its response in app._ERRORS and here"
    got = {name: (api_error(cls("what went wrong")).status, api_error(cls("what went wrong")).code)
           for name, cls in classes.items()}
    assert got == expected


# ------------------------------------------------------------------------------ response_format

BAD_SCHEMAS = {
    "schema not an object": {"name": "x", "schema": "str"},
    "unknown type": {"name": "x", "schema": {"type": "nonsense"}},
    "$ref to nowhere": {"name": "x", "schema": {"$ref": "#/$defs/nope"}},
    "remote $ref": {"name": "x", "schema": {"$ref": "http://example.com/s.json"}},
    "schema missing": {"name": "x"},
    "name missing": {"schema": {"type": "object"}},
    "properties not an object": {"name": "x", "schema": {"type": "object", "properties": [1, 2]}},
    "recursive garbage": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#"}, "b": {"type": 5}}}},
    "required not a list": {"name": "x", "schema": {"type": "object", "required": "a"}},
    "minimum not a number": {"name": "x", "schema": {"type": "integer", "minimum": "a"}},
    "bad pattern": {"name": "x", "schema": {"type": "string", "pattern": "(["}},
    "items not a schema": {"name": "x", "schema": {"type": "array", "items": 5}},
    "json_schema not an object": "x",
}


def test_invalid_json_schemas_are_400_before_any_work(client, engine, monkeypatch):
    resolved = []
    real = engine.resolve
    monkeypatch.setattr(engine, "resolve", lambda *a, **k: resolved.append(1) or real(*a, **k))
    for name, spec in BAD_SCHEMAS.items():
        r = chat(client, response_format={"type": "json_schema", "json_schema": spec})
        assert r.status_code == 400, (name, r.text)
        assert error_of(r)["code"] == "invalid_json_schema" and error_of(r)["param"] == "response_format", (name, r.text)
    assert resolved == []  # refused before the prompt was even rendered
    good = {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}, "$defs": {"n": {"type": "integer"}}}}
    r = chat(client, response_format={"type": "json_schema", "json_schema": good})
    assert r.status_code == 200, r.text


def test_a_schema_only_vllm_refuses_is_a_400(client):
    """Valid under its metaschema, but no grammar compiler takes it: vLLM's refusal is the
    client's error, mapped, not a 500."""
    r = chat(client, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": []}}})
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_json_schema", r.text
    r = chat(client, stream=True, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": []}}})
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_json_schema", r.text


# ------------------------------------------------------------------------------ a store that does not open


def test_a_chat_with_a_handle_while_the_store_cannot_open_is_503(engine, tmp_path, monkeypatch):
    """secret.key replaced after handles were given out: the store refuses to open (SecretError),
    and a chat that needs it gets a 503 that says so."""
    from fastapi.testclient import TestClient

    from inferscale_apps.server import create_app

    monkeypatch.setattr(engine.config, "store_path", tmp_path / "store")
    user = uid("secret")
    with memory_swapped_out(engine):
        store = engine.memory  # a store of its own in tmp_path
        handle = store.add("The locker code is 2231.", user_id=user)[0].handle
        store.wait_for_encoding(60)
        store.close()
    (tmp_path / "store" / "secret.key").write_bytes(b"\x01" * 32)
    with memory_swapped_out(engine):  # the next use opens the store again
        client = TestClient(create_app(engine, served_model_name="tiny"))
        r = client.post("/v1/chat/completions", json={"model": "tiny", "user": user, "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": f"Memory: {handle}. Code?"}]})
    assert r.status_code == 503 and error_of(r)["code"] == "memory_unavailable", r.text
    assert "secret" in error_of(r)["message"]


# ------------------------------------------------------------------------------ non-finite numbers


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("field, value", [
    ("temperature", "Infinity"), ("temperature", "NaN"), ("top_p", "NaN"), ("presence_penalty", "NaN"),
    ("frequency_penalty", "-Infinity"), ("temperature", "1e309"), ("max_tokens", "1e309"), ("seed", "NaN"),
    ("recompute", "Infinity"), ("logit_bias", '{"1": NaN}'),
])
def test_non_finite_numbers_are_400(client, endpoint, field, value):
    """Python's JSON reads NaN, Infinity and 1e309; each is a 400 naming the field, never a 500."""
    head = '"messages": [{"role": "user", "content": "hi"}]' if "chat" in endpoint else '"prompt": "hi"'
    r = client.post(endpoint, content=f'{{"model": "tiny", {head}, "{field}": {value}}}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == field or error_of(r)["param"].startswith(field + "."), r.text
    if field not in ("max_tokens", "seed", "recompute"):  # integers: "a valid integer"
        assert "finite" in error_of(r)["message"], r.text


def test_non_finite_numbers_in_a_response_format_are_400(client):
    schema = '{"type": "number", "maximum": NaN}'
    body = ('{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "response_format": '
            f'{{"type": "json_schema", "json_schema": {{"name": "x", "schema": {schema}}}}}}}')
    r = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_json_schema", r.text
    assert "finite" in error_of(r)["message"]


# ------------------------------------------------------------------------------ codes and abandoned requests


def test_every_4xx_has_a_code(client):
    raw = '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x \\ud800 y"}]}'
    responses = [
        client.post("/v1/completions", json={"model": "tiny", "prompt": ""}),
        client.post("/v1/completions", json={"model": "tiny", "prompt": ["hi", ""]}),
        client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"}),  # lone surrogate
        client.post("/v1/completions", content=raw.replace('"messages": [{"role": "user", "content": "x \\ud800 y"}]',
                                                           '"prompt": "x \\ud800 y"'), headers={"content-type": "application/json"}),
    ]
    for r in responses:
        assert r.status_code == 400, r.text
        assert isinstance(error_of(r)["code"], str) and error_of(r)["code"], r.text


def _counts(metrics: str, prefix: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(prefix)}


def test_an_abandoned_request_is_a_499_not_a_500(engine):
    """A client that hangs up mid-generation is counted as 499 (client closed request), with no
    error: before, the request counter said 500 and the server logged a traceback."""
    import time

    import httpx

    from inferscale_apps.bench.load import serve_app
    from inferscale_apps.server import create_app

    with serve_app(create_app(engine, served_model_name="tiny")) as url:
        body = {"model": "tiny", "messages": MSGS, "max_tokens": 200, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):  # the tiny model takes seconds for 200 tokens
            httpx.post(url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=0.2))
        deadline = time.monotonic() + 30
        while True:
            metrics = httpx.get(url + "/metrics").text
            requests = _counts(metrics, 'inferscale_requests_total{method="POST"')
            if requests or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert requests == {'inferscale_requests_total{method="POST",route="/v1/chat/completions",status="499"}': 1.0}
        assert _counts(metrics, "inferscale_errors_total{") == {}
        assert _counts(metrics, "inferscale_generations_in_flight") == {"inferscale_generations_in_flight": 0.0}


# ------------------------------------------------------------------------------ misspelled fields


@pytest.mark.parametrize("field, meant", [
    ("memory_K", "memory_k"), ("Memory_k", "memory_k"), ("memoryk", "memory_k"), ("recompte", "recompute"),
    ("Recompute", "recompute"), ("temprature", "temperature"), ("max_token", "max_tokens"), ("top-p", "top_p"),
])
def test_a_misspelled_field_is_400_naming_the_field_meant(client, field, meant):
    for endpoint, head in (("/v1/chat/completions", {"messages": MSGS}), ("/v1/completions", {"prompt": "hi"})):
        if meant == "memory_k" and "chat" not in endpoint:
            continue
        r = client.post(endpoint, json={"model": "tiny", "max_tokens": 2, **head, field: 1})
        assert r.status_code == 400, r.text
        assert error_of(r)["code"] == "unknown_parameter" and error_of(r)["param"] == field, r.text
        assert f"did you mean '{meant}'?" in error_of(r)["message"]


def test_other_unknown_fields_stay_tolerated(client):
    """What OpenAI's and vLLM's clients send beside our fields (some a letter from ours)."""
    extras = {"top_k": 5, "min_tokens": 1, "min_p": 0.1, "ignore_eos": False, "metadata": {"a": "b"}, "store": False,
              "service_tier": "auto", "repetition_penalty": 1.0, "chat_template_kwargs": {}, "x-trace": "1"}
    assert chat(client, **extras).status_code == 200
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, **extras})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------------------ usage: memories injected and recomputed


@pytest.fixture(scope="module")
def two_memories(engine):
    user = uid("usage")
    items = engine.memory.add_texts(["My dog is called Rex.", "My cat is called Tom."], user_id=user)
    engine.memory.wait_for_encoding(60)
    return user, items


def test_usage_says_how_many_memories_were_injected_and_recomputed(client, engine, two_memories):
    """With the default quality knob (the last 4 memories prefilled as text) two memories give
    injected_tokens 0, which the docs' example read as "the memories' tokens": usage now says
    how many memories were injected and how many recomputed."""
    user, _ = two_memories
    ask = [{"role": "user", "content": "What are my pets called?"}]
    counts = {}
    for recompute in (None, 1, 0):
        extra = {} if recompute is None else {"recompute": recompute}
        r = chat(client, messages=ask, user=user, memory_k=2, **extra)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        counts[recompute] = (usage["memories_injected"], usage["memories_recomputed"], usage["injected_tokens"] > 0)
    assert counts == {None: (0, 2, False), 1: (1, 1, True), 0: (2, 0, True)}
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": ask, "user": user, "memory_k": 2,
                                                  "max_tokens": 2, "recompute": 0, "stream": True,
                                                  "stream_options": {"include_usage": True}})
    usage = [c for c in r.text.split("data: ") if '"usage": {' in c][-1]
    assert '"memories_injected": 2' in usage and '"memories_recomputed": 0' in usage
    handles = "\n".join(i.handle for i in two_memories[1])
    plain = engine.generate(f"Memory:\n{handles}\nQ: pets? A:", user_id=user, max_tokens=2, mode="prompt")
    assert (plain.usage.memories_injected, plain.usage.memories_recomputed) == (0, 2)


# ------------------------------------------------------------------------------ over-long memory_k


def test_a_memory_k_request_over_the_context_is_refused_before_any_encoding(client, engine):
    """The recalled memories are not encoded yet (the encode queue is held): a request they push
    past the context is refused from the token counts the store knows, and none of them is
    encoded for it (before: the request thread encoded every one, minutes at k=64, then refused)."""
    import time

    store = engine.memory
    user = uid("long")
    facts = [f"Fact {i}: my friend number {i} lives in the city of river bends and likes the colour of old green "
             f"copper roofs, tall pine forests and quiet long evenings by the harbour number {i}." for i in range(8)]
    with store.encoding_paused():
        items = store.add_texts(facts, user_id=user)
        assert not any(store.get(i.id).encoded for i in items)
        t0 = time.perf_counter()
        r = chat(client, user=user, memory_k=8, messages=[{"role": "user", "content": "Where do my friends live?"}])
        took = time.perf_counter() - t0
        assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded", r.text
        assert error_of(r)["message"].startswith(f"This model's maximum context length is {CTX} tokens.")
        assert not any(store.get(i.id).encoded for i in items)  # the refusal encoded nothing
        handles = "\n".join(i.handle for i in items)
        with pytest.raises(ContextOverflowError):  # the library path too
            engine.generate(f"Memory:\n{handles}\nQ: where? A:", user_id=user, max_tokens=2)
        assert not any(store.get(i.id).encoded for i in items)
    assert took < 10, took
    store.wait_for_encoding(120)
    # Once encoded, the same request is refused the same way.
    r = chat(client, user=user, memory_k=8, messages=[{"role": "user", "content": "Where do my friends live?"}])
    assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded", r.text


# ------------------------------------------------------------------------------ whose memories


def test_reserved_user_ids_are_refused_and_agent_memories_stay_unserved(client):
    """Agent-only memories are stored under "@agent:<id>": a chat naming that as its user (in
    any of the three places) must not recall them."""
    agent = uid("bot")
    r = client.post("/v1/memories/", json={"messages": "The launch code is 7781.", "agent_id": agent, "infer": False})
    assert r.status_code == 200, r.text
    ask = [{"role": "user", "content": "What is the launch code?"}]
    for key in ("@agent:", "@run:", "@app:"):
        for where in ("user", "safety_identifier", "X-User-Id"):
            headers = {"X-User-Id": key + agent} if where == "X-User-Id" else {}
            body = {} if where == "X-User-Id" else {where: key + agent}
            r = client.post("/v1/chat/completions", headers=headers,
                            json={"model": "tiny", "messages": ask, "max_tokens": 2, "memory_k": 3, **body})
            assert r.status_code == 400, (key, where, r.text)
            assert error_of(r)["code"] == "reserved_user" and error_of(r)["param"] == where, r.text
    # A user whose id merely starts with "@" is a user.
    assert chat(client, user="@alice").status_code == 200


def test_x_user_id_is_read_as_utf8(engine):
    """A UTF-8 X-User-Id is the user of that name (as the memory routes read it), not its
    Latin-1 mojibake; a header that is not UTF-8 is a 400. Through a real server: the test
    client re-encodes header values."""
    import httpx

    from inferscale_apps.bench.load import serve_app
    from inferscale_apps.server import create_app

    user = "jürgen-" + uuid.uuid4().hex[:6]
    handle = engine.memory.add("My bike is red.", user_id=user)[0].handle
    engine.memory.wait_for_encoding(60)
    msgs = [{"role": "user", "content": f"Memory: {handle}. Bike colour?"}]
    with serve_app(create_app(engine, served_model_name="tiny")) as url, httpx.Client(base_url=url, timeout=60) as http:
        r = http.post("/v1/chat/completions", headers={"X-User-Id": user.encode()},
                      json={"model": "tiny", "messages": msgs, "max_tokens": 2})
        assert r.status_code == 200, r.text  # the handle is this user's: no 403
        r = http.post("/v1/chat/completions", headers={"X-User-Id": user.encode()},
                      json={"model": "tiny", "messages": msgs, "max_tokens": 2, "user": user})
        assert r.status_code == 200, r.text  # the same user, not a conflict
        r = http.post("/v1/chat/completions", headers={"X-User-Id": b"j\xfcrgen"},
                      json={"model": "tiny", "messages": MSGS, "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert error_of(r)["code"] == "invalid_header" and error_of(r)["param"] == "X-User-Id", r.text
