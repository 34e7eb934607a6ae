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


def _integration_calls(model: str, option: str, value: Any) -> dict[str, Any]:
    """Each generating entry point of the integrations, called with ``{option: value}`` (as a
    per-call keyword, or as the class's extra ``SamplingParams``), on ``model``."""
    import asyncio

    from langchain_core.messages import HumanMessage
    from llama_index.core.base.llms.types import ChatMessage

    from inferscale_integrations.langchain import ChatInferScale
    from inferscale_integrations.langchain import InferScaleLLM as LangChainLLM
    from inferscale_integrations.llamaindex import InferScaleLLM

    bad = {option: value}
    chat, llm = ChatInferScale(model=model, user_id=USER), LangChainLLM(model=model, user_id=USER)
    # context_window given: LlamaIndex's callbacks read the LLM's metadata, else the engine's window.
    index = InferScaleLLM(model=model, user_id=USER, context_window=256)
    hi, messages = [HumanMessage(content="Hi")], [ChatMessage(role="user", content="Hi")]

    async def drain(stream: Any) -> None:
        async for _ in await stream if asyncio.iscoroutine(stream) else stream:
            pass

    return {
        "langchain chat invoke": lambda: chat.invoke(hi, **bad),
        "langchain chat stream": lambda: list(chat.stream(hi, **bad)),
        "langchain chat ainvoke": lambda: asyncio.run(chat.ainvoke(hi, **bad)),
        "langchain chat model_kwargs": lambda: ChatInferScale(model=model, user_id=USER, model_kwargs=bad).invoke(hi),
        "langchain chat bind": lambda: chat.bind(**bad).invoke(hi),
        "langchain llm invoke": lambda: llm.invoke("Hi", **bad),
        "langchain llm astream": lambda: asyncio.run(drain(llm.astream("Hi", **bad))),
        "llamaindex complete": lambda: index.complete("Hi", **bad),
        "llamaindex chat": lambda: index.chat(messages, **bad),
        "llamaindex stream_complete": lambda: index.stream_complete("Hi", **bad),
        "llamaindex acomplete": lambda: asyncio.run(index.acomplete("Hi", **bad)),
        "llamaindex astream_chat": lambda: asyncio.run(drain(index.astream_chat(messages, **bad))),
        "llamaindex sampling_kwargs": lambda: InferScaleLLM(model=model, user_id=USER, context_window=256,
                                                               sampling_kwargs=bad).complete("Hi"),
    }


@pytest.mark.parametrize("option, value, message",
                         [*BAD, ("temprature", 0.5, "unknown generation option 'temprature' (did you mean 'temperature'?)")])
def test_every_integration_entry_refuses_a_bad_option_before_it_takes_an_engine(tmp_path, option, value, message):
    """The model named does not exist: an entry point that reached for its engine before checking
    the options would fail with ``ModelNotFoundError`` instead of the option's own error."""
    for entry, call in _integration_calls(str(tmp_path / "no-such-model"), option, value).items():
        # LlamaIndex answers "Empty Response" for a ValueError: the refusal comes as RefusedRequestError.
        with pytest.raises((InvalidOptionError, RefusedRequestError)) as refused:
            call()
        error = refused.value.__cause__ if isinstance(refused.value, RefusedRequestError) else refused.value
        assert isinstance(error, InvalidOptionError), f"{entry}: {refused.value!r}"
        assert (str(error).split(";")[0], error.option) == (message, option), entry
