"""Hardening of the framework integrations, as users meet them: the framework imported first,
the public classes built and called wrongly. Nothing here needs an engine (classes build theirs
on first use, and every check below comes before that), so the module runs in seconds."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langchain_core.messages import HumanMessage
from llama_index.core.base.llms.types import ChatMessage

from inferscale_integrations.langchain import InferScaleChatMessageHistory
from inferscale_integrations.llamaindex import InferScaleMemory, InferScaleMemoryBlock


def test_chat_history_refuses_what_is_not_a_message() -> None:
    """add_message("text") used to store nothing without a word (a str has no role)."""
    history = InferScaleChatMessageHistory("alice", "chat-1", model="smollm2")
    calls: list[Any] = [
        lambda: history.add_message("My dog is Rex."),  # type: ignore[arg-type]
        lambda: history.add_messages(["My dog is Rex."]),  # type: ignore[list-item]
        lambda: history.add_messages([HumanMessage("Hi"), {"role": "user", "content": "Rex"}]),  # type: ignore[list-item]
        lambda: asyncio.run(history.aadd_messages(["My dog is Rex."])),  # type: ignore[list-item]
    ]
    for call in calls:
        with pytest.raises(TypeError, match=r"stores LangChain messages .* got (str|dict) .*HumanMessage\(content=text\)"):
            call()
    for not_a_list in ("My dog is Rex.", HumanMessage("My dog is Rex.")):
        with pytest.raises(TypeError, match=r"add_messages takes a list of LangChain messages, got (str|HumanMessage)"):
            history.add_messages(not_a_list)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="valid string"):  # LangChain's own check, as for any history
        history.add_user_message(5)  # type: ignore[arg-type]


def test_llamaindex_memory_refuses_what_is_not_a_chat_message() -> None:
    memory = InferScaleMemory(model="smollm2", user_id="alice")
    for bad in ("My dog is Rex.", {"role": "user", "content": "My dog is Rex."}):
        for call in (memory.put, lambda m: memory.put_messages([m]), lambda m: memory.set([ChatMessage(content="x"), m])):
            with pytest.raises(TypeError, match=r"stores llama-index ChatMessages, got (str|dict) .*ChatMessage\(role="):
                call(bad)
    block = InferScaleMemoryBlock(model="smollm2", user_id="alice")
    with pytest.raises(TypeError, match="stores llama-index ChatMessages, got str"):
        asyncio.run(block.aput(["My dog is Rex."]))  # type: ignore[list-item]


def test_misspelled_arguments_of_every_class_name_the_closest_match() -> None:
    """The retrievers (and the other classes with a plain ``__init__``) raised Python's bare
    TypeError, or no suggestion for a name another framework uses (``search_kwargs``)."""
    from langchain_core.retrievers import BaseRetriever as LangChainRetriever
    from llama_index.core.base.base_retriever import BaseRetriever as LlamaIndexRetriever

    from inferscale_integrations.langchain import InferScaleMemoryMiddleware
    from inferscale_integrations.langchain import InferScaleRetriever as LangChainInferScaleRetriever
    from inferscale_integrations.langgraph import InferScaleStore
    from inferscale_integrations.llamaindex import InferScaleRetriever as LlamaIndexInferScaleRetriever

    assert issubclass(LangChainInferScaleRetriever, LangChainRetriever)
    assert issubclass(LlamaIndexInferScaleRetriever, LlamaIndexRetriever)
    cases: list[tuple[Any, dict[str, Any], str, str]] = [
        (LangChainInferScaleRetriever, {"user_id": "a", "kk": 5}, "kk", "k"),
        (LangChainInferScaleRetriever, {"user_id": "a", "serch_kwargs": {"k": 5}}, "serch_kwargs", "k"),
        (LangChainInferScaleRetriever, {"user_id": "a", "search_kwargs": {"k": 5}}, "search_kwargs", "k"),
        (LlamaIndexInferScaleRetriever, {"user_id": "a", "kk": 5}, "kk", "similarity_top_k"),
        (LlamaIndexInferScaleRetriever, {"user_id": "a", "similarity_topk": 5}, "similarity_topk", "similarity_top_k"),
        (LlamaIndexInferScaleRetriever, {"user_id": "a", "serch_kwargs": {}}, "serch_kwargs", "similarity_top_k"),
        (InferScaleChatMessageHistory, {"user_id": "a", "sesion_id": "s"}, "sesion_id", "session_id"),
        (InferScaleMemoryMiddleware, {"user_id": "a", "recent_turn": 2}, "recent_turn", "recent_turns"),
        (InferScaleStore, {"user_idx": -1}, "user_idx", "user_index"),
    ]
    for cls, kwargs, wrong, right in cases:
        with pytest.raises(ValueError, match=rf"{cls.__name__} got unknown argument '{wrong}' \(did you mean '{right}'\?\)"):
            cls(model="smollm2", **kwargs)


BAD_USER_IDS: list[tuple[Any, str]] = [
    ("", r"user_id must be a non-empty string"),
    ("   ", r"user_id must be a non-empty string"),
    (5, r"user_id must be a non-empty string"),
    ("@agent:helper", r"user_id '@agent:helper' is reserved"),
    ("@run:r1", r"user_id '@run:r1' is reserved"),
    ("@app:shop", r"user_id '@app:shop' is reserved"),
]


def test_empty_non_string_and_reserved_user_ids_are_refused_by_every_class() -> None:
    """``ChatInferScale(user_id="")`` was accepted (and an empty user is no user at all); the
    server's keys for agent-, run- and app-only memories (``@agent:<id>``) would reach those."""
    from inferscale_integrations.langchain import (
        ChatInferScale,
        HandleExpander,
        InferScaleMemoryMiddleware,
        InferScaleRetriever,
    )
    from inferscale_integrations.langchain import InferScaleLLM as LangChainLLM
    from inferscale_integrations.langchain import InferScaleMemory as LangChainMemory
    from inferscale_integrations.langgraph import InferScaleStore
    from inferscale_integrations.llamaindex import InferScaleLLM as LlamaIndexLLM
    from inferscale_integrations.llamaindex import InferScaleRetriever as LlamaIndexRetriever
    from inferscale_integrations.llamaindex import InferScaleVectorStore

    store = InferScaleStore(model="smollm2", user_index=0)
    builders: list[Any] = [
        lambda u: ChatInferScale(model="smollm2", user_id=u),
        lambda u: LangChainLLM(model="smollm2", user_id=u),
        lambda u: LangChainMemory(model="smollm2", user_id=u),
        lambda u: InferScaleRetriever(model="smollm2", user_id=u),
        lambda u: InferScaleChatMessageHistory(u, "chat-1", model="smollm2"),
        lambda u: InferScaleMemoryMiddleware(model="smollm2", user_id=u),
        lambda u: HandleExpander(model="smollm2", user_id=u),
        lambda u: LlamaIndexLLM(model="smollm2", user_id=u),
        lambda u: InferScaleMemory(model="smollm2", user_id=u),
        lambda u: InferScaleMemoryBlock(model="smollm2", user_id=u),
        lambda u: LlamaIndexRetriever(model="smollm2", user_id=u),
        lambda u: InferScaleVectorStore(model="smollm2", user_id=u),
        # Per call, where a class takes one: the same rule.
        lambda u: InferScaleRetriever(model="smollm2", user_id="alice").invoke("dog", user_id=u),
        lambda u: ChatInferScale(model="smollm2", user_id="alice").invoke("Hi", user_id=u),
        # (context_window given: LlamaIndex's callbacks read the LLM's metadata, which asks the
        # engine for its context length otherwise, and no engine is built in this module.)
        lambda u: LlamaIndexLLM(model="smollm2", user_id="alice", context_window=2048).complete("Hi", user_id=u),
    ]
    for bad, message in BAD_USER_IDS:
        for build in builders:
            with pytest.raises(ValueError, match=message):
                build(bad)
    # LangGraph's store takes its users from the namespaces (LangGraph itself refuses labels that
    # are empty or not strings).
    for bad, message in BAD_USER_IDS[1:2] + BAD_USER_IDS[3:]:
        for call in (lambda u: store.get((u, "memories"), "dog"), lambda u: store.search((u, "memories"), query="dog")):
            with pytest.raises(ValueError, match=message):
                call(bad)
