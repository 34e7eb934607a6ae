"""LlamaIndex integration: LLM, retriever, memory, and LlamaIndex's own engines used unchanged
(``RetrieverQueryEngine``, ``SimpleChatEngine``, ``CondensePlusContextChatEngine``).

Everything runs on one SmolLM2 engine for the module (see the ``engine`` fixture for why only
one engine is alive at a time).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.chat_engine import CondensePlusContextChatEngine, SimpleChatEngine
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers import SimpleSummarize
from llama_index.core.schema import MetadataMode, NodeWithScore
from probes import Recorder, check_margin

from inferscale_engine.errors import FactNotFoundError, RefusedRequestError
from inferscale_engine.handles import HANDLE_PATTERN
from inferscale_integrations import get_engine
from inferscale_integrations.llamaindex import (
    HandleOwnerError,
    InferScaleLLM,
    InferScaleMemory,
    InferScaleMemoryBlock,
    InferScaleRetriever,
)

pytestmark = pytest.mark.slow

FACTS = ["My dog is called Rex.", "I live in Paris.", "My favourite colour is blue.", "The meeting is on Monday."]


def uid() -> str:
    return f"li-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def engine(smollm2_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    # One engine per module, closed at the end: vLLM keeps the first live engine's KV-connector
    # worker in a process global, so an engine left alive would break any engine built after it.
    eng = get_engine("smollm2", store_path=tmp_path_factory.mktemp("li-store"), recompute=0)
    yield eng
    eng.close()


def _user_with_facts(engine: Any) -> str:
    user = uid()
    for fact in FACTS:
        engine.memory.add(fact, user_id=user)
    return user


def test_llm_metadata_and_calls(engine: Any) -> None:
    llm = InferScaleLLM(engine=engine, max_tokens=5, sampling_kwargs={"min_tokens": 1})
    meta = llm.metadata
    assert meta.is_chat_model and meta.num_output == 5 and meta.context_window == engine.max_model_len
    assert meta.model_name == engine.config.model
    assert llm.complete("Hello").text
    assert llm.chat([ChatMessage(role="user", content="Hello")]).message.role == MessageRole.ASSISTANT
    streamed = list(llm.stream_complete("Hello"))
    assert streamed[-1].text == "".join(r.delta for r in streamed)
    assert list(llm.stream_chat([ChatMessage(role="user", content="Hi")]))[-1].message.content

    async def run() -> None:
        assert (await llm.acomplete("Hello")).text
        assert (await llm.achat([ChatMessage(role="user", content="Hi")])).message.content
        gen = await llm.astream_complete("Hello")
        assert [r async for r in gen][-1].text
        gen = await llm.astream_chat([ChatMessage(role="user", content="Hi")])
        assert [r async for r in gen][-1].message.content

    asyncio.run(run())
    free = InferScaleLLM(engine=engine, max_tokens=10, sampling_kwargs={"ignore_eos": True}).complete("Hello").text
    if len(free) > 5 and free[2:5].strip():
        cut = InferScaleLLM(engine=engine, max_tokens=10, stop=[free[2:5]], sampling_kwargs={"ignore_eos": True})
        assert free[2:5] not in cut.complete("Hello").text


def test_retriever_nodes_are_handles(engine: Any) -> None:
    user = _user_with_facts(engine)
    nodes = InferScaleRetriever(engine=engine, user_id=user, similarity_top_k=2).retrieve("dog")
    assert len(nodes) == 2 and all(isinstance(n, NodeWithScore) for n in nodes)
    for n in nodes:
        assert HANDLE_PATTERN.fullmatch(n.node.get_content(metadata_mode=MetadataMode.LLM))
        assert n.score is not None and n.node.node_id == n.node.metadata["fact_id"]
        assert not any(v in FACTS for v in n.node.metadata.values())
    text = InferScaleRetriever(engine=engine, user_id=user, similarity_top_k=2, mode="text").retrieve("dog")
    assert [n.node.get_content() for n in text] == [engine.memory.get(n.node.node_id).memory for n in nodes]
    assert len(asyncio.run(InferScaleRetriever(engine=engine, user_id=user, similarity_top_k=1).aretrieve("dog"))) == 1


def test_retriever_query_engine_unchanged(engine: Any) -> None:
    user = _user_with_facts(engine)
    retriever = InferScaleRetriever(engine=engine, user_id=user, similarity_top_k=2)
    llm = InferScaleLLM(engine=engine, user_id=user, max_tokens=4, sampling_kwargs={"min_tokens": 1})
    with Recorder(engine) as spy:
        response = RetrieverQueryEngine.from_args(retriever, llm=llm).query("What is my dog called?")
        streaming = RetrieverQueryEngine.from_args(retriever, llm=llm, streaming=True).query("dog?")
        assert "".join(streaming.response_gen) is not None
    assert len(response.source_nodes) == 2 and str(response)
    assert HANDLE_PATTERN.search(spy.prompts[0]) and spy.results[0].usage.injected_tokens > 0
    # The quality knob: with every retrieved memory recomputed, nothing is injected.
    knob = InferScaleLLM(engine=engine, user_id=user, max_tokens=4, recompute=2, sampling_kwargs={"min_tokens": 1})
    with Recorder(engine) as spy:
        RetrieverQueryEngine.from_args(retriever, llm=knob).query("What is my dog called?")
    assert HANDLE_PATTERN.search(spy.prompts[0]) and spy.results[0].usage.injected_tokens == 0


def test_llm_of_another_user_than_the_retriever_raises_instead_of_empty_response(engine: Any) -> None:
    """The LLM's user_id differs from the retriever's: a clear error, never "Empty Response"
    (LlamaIndex's synthesizers swallow ValueErrors, and a refused handle was one)."""
    alice, bob = _user_with_facts(engine), uid()
    retriever = InferScaleRetriever(engine=engine, user_id=alice, similarity_top_k=2)
    llm = InferScaleLLM(engine=engine, user_id=bob, max_tokens=4)
    with Recorder(engine) as spy:
        for streaming in (False, True):
            query_engine = RetrieverQueryEngine.from_args(retriever, llm=llm, streaming=streaming)
            with pytest.raises(HandleOwnerError, match=rf"user_id='{bob}'.*recalled for user_id '{alice}'"):
                response = query_engine.query("What is my dog called?")
                "".join(response.response_gen)  # a stream raises when read
        # A handle no retriever of this process recalled (pasted, kept from an earlier run): the
        # engine refuses it, and that reaches the user too.
        (fact,) = engine.memory.add("Alice keeps bees.", user_id=alice)
        with pytest.raises(HandleOwnerError, match="was not issued to user_id") as err:
            SimpleSummarize(llm=llm).get_response("Who keeps bees?", [fact.handle])
        assert isinstance(err.value, PermissionError) and not isinstance(err.value, ValueError)
    assert spy.results == []  # nothing generated with another user's memories
    # The engine's other refusals are ValueErrors too: a prompt over the context, a deleted
    # memory's handle. They reach the user, not "Empty Response".
    engine.memory.delete(fact.id)
    alices = InferScaleLLM(engine=engine, user_id=alice, max_tokens=4)
    with pytest.raises(RefusedRequestError, match="FactNotFoundError") as err:
        SimpleSummarize(llm=alices).get_response("Who keeps bees?", [fact.handle])
    assert isinstance(err.value.__cause__, FactNotFoundError)
    # LlamaIndex counts a handle's ~25 tokens, the engine the fact's own (~10 a sentence here).
    (essay,) = engine.memory.add(" ".join(["Alice's garden has roses, tulips and old apple trees."] * 16), user_id=alice)
    tight = InferScaleLLM(engine=engine, user_id=alice, max_tokens=engine.max_model_len - 150)
    with pytest.raises(RefusedRequestError, match="ContextOverflowError"):
        SimpleSummarize(llm=tight).get_response("What grows in the garden?", [essay.handle])
    # The same engine given the retriever's user answers.
    same = InferScaleLLM(engine=engine, user_id=alice, max_tokens=4, sampling_kwargs={"min_tokens": 1})
    assert str(RetrieverQueryEngine.from_args(retriever, llm=same).query("What is my dog called?")) != "Empty Response"


def test_memory_with_simple_chat_engine(engine: Any) -> None:
    user = uid()
    llm = InferScaleLLM(engine=engine, user_id=user, max_tokens=4, sampling_kwargs={"min_tokens": 1})
    memory = InferScaleMemory.from_defaults(engine=engine, user_id=user, k=2, recent_turns=1)
    chat = SimpleChatEngine.from_defaults(llm=llm, memory=memory, system_prompt="You are helpful.")
    with Recorder(engine) as spy:
        for fact in FACTS:
            chat.chat(fact)
        chat.chat("What is my dog called?")
    assert spy.results[0].usage.injected_tokens == 0  # nothing to remember yet
    last = spy.prompts[-1]
    assert last.endswith("What is my dog called?")  # the new message goes as plain text
    recalled = [engine.memory.resolve(m.group(0), user).text for m in HANDLE_PATTERN.finditer(last)]
    assert recalled[0] == FACTS[0] and FACTS[-1] in recalled  # the dog turn (search) + the last turn
    assert spy.results[-1].usage.injected_tokens > 0
    history = memory.get_all()
    assert [m.role for m in history[:2]] == [MessageRole.USER, MessageRole.ASSISTANT] and len(history) == 10
    assert all(HANDLE_PATTERN.fullmatch(m.content) for m in history)
    text_memory = InferScaleMemory(engine=engine, user_id=user, mode="text")
    assert text_memory.get_all()[0].content == FACTS[0]
    memory.reset()
    assert memory.get_all() == []


def test_memory_with_condense_plus_context_chat_engine(engine: Any) -> None:
    user = _user_with_facts(engine)
    llm = InferScaleLLM(engine=engine, user_id=user, max_tokens=4, sampling_kwargs={"min_tokens": 1})
    memory = InferScaleMemory.from_defaults(engine=engine, user_id=user, session_id="s")
    chat = CondensePlusContextChatEngine.from_defaults(
        InferScaleRetriever(engine=engine, user_id=user, similarity_top_k=2), llm=llm, memory=memory
    )
    with Recorder(engine) as spy:
        chat.chat("Hello there.")
        chat.chat("What is my dog called?")  # condenses the history (handles) with complete()
        asyncio.run(chat.achat("And my colour?"))
    assert all(HANDLE_PATTERN.search(p) for p in spy.prompts)
    assert all(r.usage.injected_tokens > 0 for r in spy.results)
    assert len(memory.get_all()) == 6


def test_memory_block_in_llamaindex_memory(engine: Any) -> None:
    """llama-index's own ``Memory``: messages flushed out of its short-term buffer become facts,
    and later calls get the relevant ones back as handle messages."""
    from llama_index.core.memory import Memory

    user = uid()
    block = InferScaleMemoryBlock(engine=engine, user_id=user, k=1)
    memory = Memory.from_defaults(session_id=user, token_limit=24, token_flush_size=12, memory_blocks=[block])
    llm = InferScaleLLM(engine=engine, user_id=user, max_tokens=4, sampling_kwargs={"min_tokens": 1})
    chat = SimpleChatEngine.from_defaults(llm=llm, memory=memory)
    with Recorder(engine) as spy:
        for fact in FACTS:
            chat.chat(fact)
        chat.chat("What is my dog called?")
    stored = engine.memory.get_all(user_id=user)
    assert stored and stored[0].memory == FACTS[0]  # flushed from short-term memory into the store
    recalled = [engine.memory.resolve(m.group(0), user).text for m in HANDLE_PATTERN.finditer(spy.prompts[-1])]
    assert recalled[:1] == [FACTS[0]] and spy.results[-1].usage.injected_tokens > 0


def test_handles_and_text_query_engines_give_the_same_answer(engine: Any) -> None:
    """RetrieverQueryEngine with handle nodes vs text nodes: same answer when the fact was
    encoded after exactly the prompt text that precedes it."""
    smol = engine
    llm_kw = {"engine": smol, "max_tokens": 24}
    # The rendered prompt's text before the context is what the fact must be encoded after.
    scratch = uid()
    (probe,) = smol.memory.add("probe", user_id=scratch)
    with Recorder(smol) as spy:
        RetrieverQueryEngine.from_args(
            InferScaleRetriever(engine=smol, user_id=scratch, similarity_top_k=1),
            llm=InferScaleLLM(user_id=scratch, **llm_kw),
        ).query("What is my dog's name?")
    text, _ = smol.render(spy.calls[0][0])
    head = text[: text.index(probe.handle)]
    assert head.endswith("\n")
    user = uid()
    smol.memory.add("My dog's name is Rex.", user_id=user, context=[head[:-1]])
    smol.memory.wait_for_encoding()

    def ask(mode: str, llm_mode: str) -> Any:
        engine = RetrieverQueryEngine.from_args(
            InferScaleRetriever(engine=smol, user_id=user, similarity_top_k=1, mode=mode),
            llm=InferScaleLLM(user_id=user, mode=llm_mode, **llm_kw),
        )
        with Recorder(smol) as s:
            answer = str(engine.query("What is my dog's name?"))
        return answer, s.results[-1], s

    (a, ra, recorded), (b, rb, _), (c, rc, _) = ask("handles", "inject"), ask("text", "inject"), ask("handles", "prompt")
    assert ra.usage.injected_tokens > 0 and rb.usage.injected_tokens == 0
    assert ra.prompt_token_ids == rb.prompt_token_ids == rc.prompt_token_ids
    assert a == b == c
    assert "rex" in a.lower()
    check_margin(smol, recorded, "Rex")
