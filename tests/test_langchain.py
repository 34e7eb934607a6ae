"""LangChain integration: memory, history, retriever, models, middleware, handle expansion.

Everything runs on one SmolLM2 engine for the module (see the ``engine`` fixture for why only
one engine is alive at a time).
"""

from __future__ import annotations

import asyncio
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder

from inferscale_engine.errors import ForgedHandleError
from inferscale_engine.handles import HANDLE_PATTERN
from inferscale_integrations import get_engine
from inferscale_integrations.langchain import (
    ChatInferScale,
    HandleExpander,
    InferScaleChatMessageHistory,
    InferScaleLLM,
    InferScaleMemory,
    InferScaleRetriever,
)

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
warnings.filterwarnings("ignore", message=".*was deprecated.*")

TURNS = [
    ("My dog is called Rex.", "Rex is a good name."),
    ("I live in Paris.", "Paris is the capital of France."),
    ("My favourite colour is blue.", "Blue is nice."),
    ("The meeting is on Monday.", "I will remember Monday."),
]


def uid() -> str:
    return f"u-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def engine(smollm2_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    # One engine per module, closed at the end: vLLM keeps the first live engine's KV-connector
    # worker in a process global, so an engine left alive would break any engine built after it.
    eng = get_engine("smollm2", store_path=tmp_path_factory.mktemp("lc-store"), recompute=0)
    yield eng
    eng.close()


def _fill(memory: Any) -> None:
    for human, ai in TURNS:
        memory.save_context({"input": human}, {"output": ai})


def _resolved(engine: Any, text: str, user: str) -> list[str]:
    return [engine.memory.resolve(m.group(0), user).text for m in HANDLE_PATTERN.finditer(text)]


# ------------------------------------------------------------------------------------ memory


def test_memory_returns_relevant_and_recent_turns_as_handles(engine: Any) -> None:
    user = uid()
    memory = InferScaleMemory(engine=engine, user_id=user, k=1, recent_turns=1)
    _fill(memory)
    out = memory.load_memory_variables({"input": "What is my dog called?"})["history"]
    lines = out.split("\n")
    assert [line.split(": ", 1)[0] for line in lines] == ["Human", "AI", "Human", "AI"]
    assert all(HANDLE_PATTERN.fullmatch(line.split(": ", 1)[1]) for line in lines)
    # The dog turn (search hit) and the last turn (recent), whole and in conversation order.
    assert _resolved(engine, out, user) == [*TURNS[0], *TURNS[3]]


def test_memory_text_mode_matches_conversation_buffer_memory(engine: Any) -> None:
    from langchain_classic.memory import ConversationBufferMemory

    user = uid()
    ours = InferScaleMemory(engine=engine, user_id=user, mode="text", k=0, recent_turns=100)
    classic = ConversationBufferMemory()
    for memory in (ours, classic):
        _fill(memory)
    assert ours.load_memory_variables({"input": "hi"}) == classic.load_memory_variables({"input": "hi"})
    handles = InferScaleMemory(engine=engine, user_id=user, k=0, recent_turns=100)
    text = handles.load_memory_variables({"input": "hi"})["history"]
    expanded = HandleExpander(engine=engine, user_id=user).invoke(text)
    assert expanded == classic.load_memory_variables({"input": "hi"})["history"]


def test_memory_messages_and_knobs(engine: Any) -> None:
    user = uid()
    memory = InferScaleMemory(
        engine=engine, user_id=user, return_messages=True, memory_key="chat_history",
        input_key="question", output_key="answer", k=4, recent_turns=4,
    )
    for human, ai in TURNS[:2]:
        memory.save_context({"question": human, "other": "x"}, {"answer": ai, "extra": "y"})
    msgs = memory.load_memory_variables({"question": "where do I live?"})["chat_history"]
    assert [type(m) for m in msgs] == [HumanMessage, AIMessage, HumanMessage, AIMessage]
    assert all(HANDLE_PATTERN.fullmatch(m.content) for m in msgs)
    assert memory.memory_variables == ["chat_history"]
    memory.clear()
    assert memory.load_memory_variables({"question": "x"})["chat_history"] == []


def test_memory_handles_are_user_scoped(engine: Any) -> None:
    alice, bob = uid(), uid()
    memory = InferScaleMemory(engine=engine, user_id=alice)
    _fill(memory)
    handle = HANDLE_PATTERN.search(memory.load_memory_variables({"input": "dog"})["history"]).group(0)
    llm = ChatInferScale(engine=engine, user_id=bob, max_tokens=4)
    with pytest.raises(ForgedHandleError):
        llm.invoke(f"Remember: {handle}")
    with pytest.raises(ForgedHandleError):
        HandleExpander(engine=engine, user_id=bob).invoke(handle)


# ------------------------------------------------------------------------------------ history


def test_chat_message_history_sessions_and_runnable(engine: Any) -> None:
    from langchain_core.runnables.history import RunnableWithMessageHistory

    user = uid()
    hist = InferScaleChatMessageHistory(user, "s1", engine=engine)
    hist.add_messages([HumanMessage("My dog is called Rex."), AIMessage("Nice.")])
    other = InferScaleChatMessageHistory(user, "s2", engine=engine)
    other.add_user_message("I live in Paris.")
    assert [m.type for m in hist.messages] == ["human", "ai"]
    assert all(HANDLE_PATTERN.fullmatch(m.content) for m in hist.messages)
    assert [m.content for m in InferScaleChatMessageHistory(user, "s1", engine=engine, mode="text").messages] == [
        "My dog is called Rex.",
        "Nice.",
    ]
    assert len(other.messages) == 1

    prompt = ChatPromptTemplate.from_messages([MessagesPlaceholder("history"), ("human", "{q}")])
    llm = ChatInferScale(engine=engine, user_id=user, max_tokens=4, model_kwargs={"min_tokens": 1})
    chain = RunnableWithMessageHistory(
        prompt | llm,
        lambda sid: InferScaleChatMessageHistory(user, sid, engine=engine),
        input_messages_key="q",
        history_messages_key="history",
    )
    reply = chain.invoke({"q": "What is my dog called?"}, config={"configurable": {"session_id": "s1"}})
    assert reply.usage_metadata["input_token_details"]["injected"] > 0
    assert len(hist.messages) == 4  # the new turn was stored
    other.clear()
    assert other.messages == [] and len(hist.messages) == 4


# ------------------------------------------------------------------------------------ retriever


def test_retriever_documents_are_handles_with_text_free_metadata(engine: Any) -> None:
    user = uid()
    memory = InferScaleMemory(engine=engine, user_id=user)
    _fill(memory)
    docs = InferScaleRetriever(engine=engine, user_id=user, k=2).invoke("dog")
    assert len(docs) == 2 and all(isinstance(d, Document) for d in docs)
    texts = {t for turn in TURNS for t in turn}
    for d in docs:
        assert HANDLE_PATTERN.fullmatch(d.page_content)
        assert isinstance(d.metadata["score"], float) and d.metadata["fact_id"] == d.id
        assert not any(isinstance(v, str) and v in texts for v in d.metadata.values())
    text_docs = InferScaleRetriever(engine=engine, user_id=user, k=2, mode="text").invoke("dog")
    assert [d.page_content for d in text_docs] == [engine.memory.get(d.id).memory for d in docs]
    assert len(asyncio.run(InferScaleRetriever(engine=engine, user_id=user).ainvoke("dog", k=1))) == 1


# ------------------------------------------------------------------------------------ models


def test_chat_model_injects_handles_and_prompt_mode_matches(engine: Any) -> None:
    user = uid()
    (item,) = engine.memory.add("My dog is called Rex.", user_id=user)
    msgs = [SystemMessage(f"Memory:\n{item.handle}"), HumanMessage("What is my dog called?")]
    kw = {"engine": engine, "user_id": user, "max_tokens": 8, "model_kwargs": {"ignore_eos": True}}
    injected = ChatInferScale(**kw).invoke(msgs)
    baseline = ChatInferScale(**kw, mode="prompt").invoke(msgs)
    assert injected.usage_metadata["input_token_details"]["injected"] > 0
    assert baseline.usage_metadata["input_token_details"]["injected"] == 0
    assert injected.usage_metadata["input_tokens"] == baseline.usage_metadata["input_tokens"]
    assert injected.response_metadata["model_provider"] == "inferscale"
    # Per-call user: the handle is alice's only.
    with pytest.raises(ForgedHandleError):
        ChatInferScale(**kw).invoke(msgs, user_id=uid())


def test_chat_model_async_stream_batch_stop(engine: Any) -> None:
    llm = ChatInferScale(engine=engine, max_tokens=6, model_kwargs={"min_tokens": 1})
    chunks = list(llm.stream("Hello"))
    assert chunks[-1].chunk_position == "last" and chunks[-1].usage_metadata["output_tokens"] >= 1
    assert len(llm.batch(["a", "b", "c"])) == 3
    assert isinstance(asyncio.run(llm.ainvoke("Hello")), AIMessage)

    async def collect() -> list[Any]:
        return [c async for c in llm.astream("Hello")]

    assert asyncio.run(collect())[-1].chunk_position == "last"
    free = ChatInferScale(engine=engine, max_tokens=12, model_kwargs={"ignore_eos": True}).invoke("Hello").text
    stop = free[2:5] if len(free) > 5 else None
    if stop and stop.strip():
        cut = ChatInferScale(engine=engine, max_tokens=12, model_kwargs={"ignore_eos": True}).invoke("Hello", stop=[stop])
        assert stop not in cut.text and cut.response_metadata["finish_reason"] == "stop"


def test_completion_llm(engine: Any) -> None:
    user = uid()
    (item,) = engine.memory.add("My dog is called Rex.", user_id=user)
    llm = InferScaleLLM(engine=engine, user_id=user, max_tokens=5, model_kwargs={"min_tokens": 1})
    result = llm.generate([f"Memory: {item.handle}\nQuestion: dog?", "Hello"])
    assert len(result.generations) == 2
    assert result.generations[0][0].generation_info["injected_tokens"] > 0
    assert result.llm_output["token_usage"]["memories_injected"] == 1
    assert result.llm_output["token_usage"]["injected_tokens"] > 0
    assert "".join(llm.stream("Hello")) == llm.invoke("Hello")
    assert isinstance(asyncio.run(llm.ainvoke("Hello")), str)
    assert len(asyncio.run(llm.abatch(["a", "b"]))) == 2


def test_the_quality_knob_reaches_the_engine(engine: Any) -> None:
    """``recompute`` on the class and per call: at 1 the prompt's only memory is prefilled."""
    user = uid()
    (item,) = engine.memory.add("My dog is called Rex.", user_id=user)
    prompt = [HumanMessage(f"Memory: {item.handle}\nQuestion: dog?")]
    injected = ChatInferScale(engine=engine, user_id=user, max_tokens=2)
    recomputed = ChatInferScale(engine=engine, user_id=user, max_tokens=2, recompute=1)
    assert injected.invoke(prompt).usage_metadata["input_token_details"]["injected"] > 0
    assert recomputed.invoke(prompt).usage_metadata["input_token_details"]["injected"] == 0
    assert injected.invoke(prompt, recompute=1).usage_metadata["input_token_details"]["injected"] == 0
    completion = InferScaleLLM(engine=engine, user_id=user, max_tokens=2, recompute=1).generate([prompt[0].content])
    usage = completion.generations[0][0].generation_info["token_usage"]
    assert (usage["injected_tokens"], usage["memories_injected"], usage["memories_recomputed"]) == (0, 0, 1)
    with pytest.raises(ValueError):
        ChatInferScale(engine=engine, recompute=-1)


def test_engine_is_shared_per_model(engine: Any, smollm2_path: str) -> None:
    assert ChatInferScale(model="smollm2").get_engine() is engine
    assert InferScaleMemory(model="SmolLM2").get_engine() is engine
    assert InferScaleRetriever(model=smollm2_path).get_engine() is engine


def test_create_agent_middleware_injects_memory(engine: Any) -> None:
    pytest.importorskip("langchain.agents")
    from langchain.agents import create_agent

    from inferscale_integrations.langchain import InferScaleMemoryMiddleware

    user = uid()
    seen: list[Any] = []

    class Spy(ChatInferScale):
        def _generate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kwargs: Any) -> Any:
            seen.append(messages)
            return super()._generate(messages, stop=stop, run_manager=run_manager, **kwargs)

    llm = Spy(engine=engine, user_id=user, max_tokens=4, model_kwargs={"min_tokens": 1})
    agent = create_agent(llm, tools=[], middleware=[InferScaleMemoryMiddleware(engine=engine, user_id=user)])
    agent.invoke({"messages": [{"role": "user", "content": "My dog is called Rex."}]})
    state = agent.invoke({"messages": [{"role": "user", "content": "What is my dog called?"}]})
    assert HANDLE_PATTERN.fullmatch(seen[-1][0].content)  # earlier turn recalled as a handle
    assert state["messages"][-1].usage_metadata["input_token_details"]["injected"] > 0
    assert len(engine.memory.get_all(user_id=user)) == 4


# ------------------------------------------------------------------------------------ equivalence


def test_handles_and_text_pipelines_give_the_same_answer(engine: Any) -> None:
    """Retriever → prompt → chat model, with handles and with pasted text: the same answer when
    the fact was encoded after exactly the text that precedes it in the prompt."""
    smol = engine
    prompt = ChatPromptTemplate.from_messages(
        [("system", "You are a helpful assistant. What you know about the user:\n{context}\nAnswer briefly."),
         ("human", "{question}")]
    )

    def chain(mode: str, llm_mode: str, user: str) -> Any:
        retriever = InferScaleRetriever(engine=smol, user_id=user, k=1, mode=mode)
        llm = ChatInferScale(engine=smol, user_id=user, max_tokens=24, mode=llm_mode)
        return {"context": lambda x: "\n".join(d.page_content for d in retriever.invoke(x["question"])),
                "question": lambda x: x["question"]} | prompt | llm

    # The text before the handle in the rendered prompt is the context to encode the fact after.
    scratch = uid()
    (probe,) = smol.memory.add("probe", user_id=scratch)
    text, _ = smol.render(
        [{"role": m.type.replace("human", "user"), "content": m.content}
         for m in prompt.format_messages(context=probe.handle, question="q")]
    )
    head = text[: text.index(probe.handle)]
    assert head.endswith("\n")
    user = uid()
    smol.memory.add("My dog's name is Rex.", user_id=user, context=[head[:-1]])
    smol.memory.wait_for_encoding()
    question = {"question": "What is my dog's name?"}
    with_handles = chain("handles", "inject", user).invoke(question)
    with_text = chain("text", "inject", user).invoke(question)
    prefilled = chain("handles", "prompt", user).invoke(question)
    assert with_handles.usage_metadata["input_token_details"]["injected"] > 0
    assert with_text.usage_metadata["input_token_details"]["injected"] == 0
    assert with_handles.text == with_text.text == prefilled.text
    assert "rex" in with_handles.text.lower()
