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
