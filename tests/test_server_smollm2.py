"""``inferscale serve`` with SmolLM2, where answers matter: a memory added over REST is
recalled through its handle (openai client) and through ``memory_k`` (LangChain, streaming).
"""

from __future__ import annotations

import httpx
import pytest
from test_server import start_server, stop_server

from inferscale_engine.prompting import memory_system_message

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server-smollm2")
    proc, base, log = start_server("smollm2", tmp, "--recompute", "0")
    yield base
    stop_server(proc)
    assert "Traceback" not in log.read_text()


def test_recall_through_handles_and_memory_k(server):
    http = httpx.Client(base_url=server, timeout=120)
    r = http.post("/v1/memories/", json={"messages": "My dog is called Rex.", "user_id": "erin"})
    assert r.status_code == 200, r.text
    fact = r.json()["results"][0]

    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)
    # The layout the server encodes REST-added facts for (and that memory_k / inferscale chat use).
    system = memory_system_message([fact["handle"]])
    r = client.chat.completions.create(
        model="smollm2", user="erin", temperature=0, max_tokens=24,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "What is my dog's name?"}],
    )
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
