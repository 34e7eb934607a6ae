"""Generation options are checked in one place (``GenerationOptions``), once per request and
before any work: Python, LangChain, LlamaIndex and HTTP refuse a bad option with the same words.

The prompt carries a handle to a memory that does not exist: a request that got as far as
resolving it would fail with ``FactNotFoundError`` instead, so each refusal below also shows
that no memory was looked up, and a spy on the engine loop shows that nothing reached vLLM.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from probes import mint_handle

from inferscale_engine.errors import InvalidOptionError, RefusedRequestError
from inferscale_engine.request import GenerationOptions

USER = "alice"

#: option, bad value, the one message every entry point refuses it with.
BAD = [
    ("recompute", -1, "recompute must be an integer >= 0 (memories prefilled as text), got -1"),
    ("seed", 2**70, f"seed must be an integer in [-2**63, 2**64), got {2**70}"),
]


@pytest.fixture(scope="module")
def engine(tiny_llama, tmp_path_factory):
    from inferscale_engine import InferScaleEngine

    eng = InferScaleEngine(model=tiny_llama, store_path=tmp_path_factory.mktemp("options-store"),
                           device="cpu", dtype="float32", max_model_len=256)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompt(engine) -> str:
    return f"Memory: {mint_handle(engine.memory, USER, '0123456789abcdef')}\nQ:"


@pytest.fixture
def no_vllm(engine):
    """Fails the test if any request reaches vLLM."""
    submitted: list[Any] = []
    submit = engine.loop.submit
    engine.loop.submit = lambda *a, **k: (submitted.append(a), submit(*a, **k))[1]
    yield
    del engine.loop.submit
    assert not submitted, "a refused request reached vLLM"


@pytest.mark.parametrize("option, value, message", BAD)
def test_a_bad_option_is_refused_alike_from_python_langchain_llamaindex_and_http(engine, prompt, no_vllm,
                                                                                 option, value, message):
    from fastapi.testclient import TestClient
    from langchain_core.messages import HumanMessage

    from inferscale_apps.server import create_app
    from inferscale_integrations.langchain import ChatInferScale
    from inferscale_integrations.llamaindex import InferScaleLLM

    with pytest.raises(InvalidOptionError) as py:
        engine.generate(prompt, user_id=USER, max_tokens=2, **{option: value})
    assert str(py.value) == message and py.value.option == option

    chat = ChatInferScale(engine=engine, user_id=USER, max_tokens=2)
    with pytest.raises(InvalidOptionError) as lc:
        chat.invoke([HumanMessage(content=prompt)], **{option: value})
    assert str(lc.value) == message

    # LlamaIndex answers "Empty Response" for a ValueError: the refusal comes as RefusedRequestError.
    with pytest.raises(RefusedRequestError) as li:
        InferScaleLLM(engine=engine, user_id=USER, max_tokens=2).complete(prompt, **{option: value})
    assert isinstance(li.value.__cause__, InvalidOptionError) and str(li.value.__cause__) == message

    client = TestClient(create_app(engine, served_model_name="tiny"))
    r = client.post("/v1/chat/completions", json={"model": "tiny", "user": USER, "max_tokens": 2, option: value,
                                                  "messages": [{"role": "user", "content": prompt}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"] | {"message": message} == r.json()["error"], r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (option, "invalid_value")


def test_an_integration_refuses_a_bad_default_when_built_in_the_same_words(engine):
    from pydantic import ValidationError

    from inferscale_integrations.langchain import ChatInferScale
    from inferscale_integrations.llamaindex import InferScaleLLM

    for cls in (ChatInferScale, InferScaleLLM):
        with pytest.raises(ValidationError, match=r"recompute must be an integer >= 0 \(memories prefilled as text\), "
                                                  r"got -1"):
            cls(engine=engine, user_id=USER, recompute=-1)


def test_a_misspelled_option_names_the_closest_one_before_any_work(engine, prompt, no_vllm):
    from langchain_core.messages import HumanMessage

    from inferscale_integrations.langchain import ChatInferScale

    expected = r"unknown generation option 'temprature' \(did you mean 'temperature'\?\)"
    with pytest.raises(InvalidOptionError, match=expected):
        engine.generate(prompt, user_id=USER, max_tokens=2, temprature=0.5)
    with pytest.raises(InvalidOptionError, match=expected):
        ChatInferScale(engine=engine, user_id=USER, max_tokens=2).invoke([HumanMessage(content=prompt)], temprature=0.5)
    with pytest.raises(InvalidOptionError, match=r"logprobs is not a generation option: use first_logprobs=N"):
        engine.generate(prompt, user_id=USER, max_tokens=2, logprobs=3)


def test_one_options_object_serves_many_requests_and_cannot_change(engine):
    options = GenerationOptions.from_kwargs(max_tokens=3, top_p=0.9, seed=7, temperature=1.0)
    segments = engine.resolve("Name a colour:", user_id=USER)
    first = engine.generate_segments(segments, user_id=USER, options=options)
    again = engine.generate_segments(segments, user_id=USER, options=options)
    assert first.token_ids == again.token_ids and len(first.token_ids) == 3  # seeded: the same sample
    with pytest.raises(TypeError):
        options.sampling["seed"] = 8  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.max_tokens = 4  # type: ignore[misc]
    with pytest.raises(TypeError, match="not both"):
        engine.generate_segments(segments, user_id=USER, options=options, max_tokens=4)
