"""``InferScaleMemory``: LlamaIndex chat memory kept as InferScale memory facts.

A ``BaseMemory`` for ``SimpleChatEngine``, ``CondensePlusContextChatEngine``,
``ContextChatEngine`` (anything that takes ``memory=``), in place of ``ChatMemoryBuffer``.

* ``put``: a user message waits until its answer arrives; then the turn (user message and
  answer) is stored as two facts of ``user_id``, encoded in the background with the turns before.
* ``get(input=...)``: the turns holding the ``k`` facts most relevant to ``input`` (or to the
  pending user message) plus the ``recent_turns`` last turns of this session, whole, in
  conversation order, each message's content being the fact's handle (``mode="handles"``) or
  text (``mode="text"``), followed by the pending user message as plain text.
* ``get_all``: every stored turn of the session, then the pending messages.
* ``reset``: deletes the session's facts (all of the user's when ``session_id`` is None).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.memory.memory import BaseMemoryBlock
from llama_index.core.memory.types import BaseMemory

from inferscale_engine.types import DEFAULT_USER
from inferscale_integrations._common import (
    OnEngine,
    RecallMode,
    all_items,
    check_mode,
    content_of,
    recall,
    recall_for,
    role_of,
    save_messages,
)
from inferscale_integrations.llamaindex._base import InferScaleComponent
from inferscale_integrations.llamaindex.retrievers import remember_issued

if TYPE_CHECKING:
    from inferscale_engine.memory import MemoryItem

SOURCE = "llamaindex"
_ROLES = {"user": MessageRole.USER, "assistant": MessageRole.ASSISTANT, "system": MessageRole.SYSTEM}


def checked_message(message: Any) -> ChatMessage:
    """``message``, or ``TypeError`` when it is not a ``ChatMessage`` (a string or a dict used to
    fail later, on a missing ``.role``)."""
    if not isinstance(message, ChatMessage):
        raise TypeError(
            f"InferScale memory stores llama-index ChatMessages, got {type(message).__name__} {message!r:.60}: "
            "wrap it, e.g. ChatMessage(role='user', content=text)"
        )
    return message


def chat_message_for(item: MemoryItem, mode: str) -> ChatMessage:
    role = _ROLES.get(role_of(item), MessageRole.USER)
    return ChatMessage(role=role, content=content_of(item, mode), additional_kwargs={"fact_id": item.id})


class _MemoryBase(OnEngine, InferScaleComponent):
    """The store and the checked ``mode`` of both memory classes (before their LlamaIndex base)."""

    if TYPE_CHECKING:
        mode: RecallMode

    def _check_fields(self) -> None:
        check_mode(self.mode)


class InferScaleMemory(_MemoryBase, BaseMemory):
    """Chat-engine memory whose recalled turns reach the LLM as injected KV.

    Example:
        ```python
        from llama_index.core.chat_engine import SimpleChatEngine
        from inferscale_integrations.llamaindex import InferScaleLLM, InferScaleMemory

        llm = InferScaleLLM(model="smollm2", user_id="alice")
        memory = InferScaleMemory.from_defaults(model="smollm2", user_id="alice")
        chat = SimpleChatEngine.from_defaults(llm=llm, memory=memory)
        chat.chat("My dog is called Rex.")
        ```
    """

    user_id: str = Field(default=DEFAULT_USER)
    session_id: str | None = Field(default=None, description="Conversation id (recent turns, reset).")
    model_name: str | None = Field(default=None, description="Model alias/folder of the shared engine.")
    mode: RecallMode = Field(default="handles")
    k: int = Field(default=4, description="Facts recalled by semantic search on the input.")
    recent_turns: int = Field(default=2, description="Most recent turns always included.")
    min_score: float | None = Field(default=None)

    _pending: list[ChatMessage] = PrivateAttr(default_factory=list)

    __init__ = InferScaleComponent.__init__  # so that type checkers know engine=, model=

    @classmethod
    def class_name(cls) -> str:
        return "InferScaleMemory"

    @classmethod
    def from_defaults(cls, **kwargs: Any) -> InferScaleMemory:
        kwargs.pop("llm", None)
        kwargs.pop("chat_history", None)
        kwargs.pop("token_limit", None)
        return cls(**kwargs)


    # ------------------------------------------------------------------ BaseMemory API

    def get(self, input: str | None = None, **kwargs: Any) -> list[ChatMessage]:
        query = input
        if query is None:
            users = [m for m in self._pending if m.role == MessageRole.USER]
            query = users[-1].content if users else None
        return self._messages([r.item for r in recall_for(self, query)]) + list(self._pending)

    def get_all(self) -> list[ChatMessage]:
        items = all_items(self.store, user_id=self.user_id, session_id=self.session_id)
        return self._messages(items) + list(self._pending)

    def _messages(self, items: list[MemoryItem]) -> list[ChatMessage]:
        if self.mode == "handles":  # so an InferScaleLLM without user_id can serve them
            remember_issued(self.store, {i.handle: self.user_id for i in items})
        return [chat_message_for(i, self.mode) for i in items]

    def put(self, message: ChatMessage) -> None:
        """Hold a user message until its answer; store the turn when the answer comes (tool
        messages are not stored; anything but a ``ChatMessage`` raises ``TypeError``)."""
        role = checked_message(message).role
        if role == MessageRole.USER:
            if any(m.role == MessageRole.USER for m in self._pending):
                self._flush()  # an unanswered question: keep it as a turn of its own
            self._pending.append(message)
        elif role == MessageRole.ASSISTANT:
            self._pending.append(message)
            self._flush()
        elif role == MessageRole.SYSTEM:
            self._pending.append(message)
        # tool/function messages are not conversation memory

    def set(self, messages: list[ChatMessage]) -> None:
        """Replace the session's memory with ``messages`` (checked first: a bad one deletes nothing)."""
        messages = [checked_message(m) for m in messages]
        self.reset()
        for m in messages:
            self.put(m)
        self._flush()

    def reset(self) -> None:
        self._pending = []
        if self.session_id is None:
            self.store.delete_all(user_id=self.user_id)
        else:
            for item in all_items(self.store, user_id=self.user_id, session_id=self.session_id):
                self.store.delete(item.id)

    def _flush(self) -> None:
        turn = [(m.role.value, m.content or "") for m in self._pending if m.role in _ROLES.values()]
        self._pending = []
        save_messages(self.store, turn, user_id=self.user_id, session_id=self.session_id, source=SOURCE)

    def wait(self) -> None:
        """Block until every stored fact is encoded."""
        self.store.wait_for_encoding()


class InferScaleMemoryBlock(_MemoryBase, BaseMemoryBlock[list[ChatMessage]]):
    """Long-term memory block for llama-index's ``Memory`` (agents, chat engines).

    ``Memory`` keeps recent messages as text in its short-term store and flushes older ones into
    its memory blocks. This block stores what is flushed as facts of ``user_id`` (turn by turn)
    and, on every ``get``, returns the turns holding the ``k`` facts most relevant to the latest
    user message as chat messages whose content is a handle (``mode="handles"``) or the text
    (``mode="text"``); ``Memory`` puts them before the short-term history.

    Example:
        ```python
        from llama_index.core.memory import Memory

        memory = Memory.from_defaults(
            session_id="alice-chat",
            token_limit=2000,
            memory_blocks=[InferScaleMemoryBlock(model="smollm2", user_id="alice")],
        )
        ```
    """

    name: str = Field(default="InferScaleMemory")
    user_id: str = Field(default=DEFAULT_USER)
    session_id: str | None = Field(default=None, description="Tag for stored facts (recall spans all sessions).")
    model_name: str | None = Field(default=None)
    mode: RecallMode = Field(default="handles")
    k: int = Field(default=4)
    min_score: float | None = Field(default=None)

    __init__ = InferScaleComponent.__init__  # so that type checkers know engine=, model=

    def _get(self, messages: list[ChatMessage] | None) -> list[ChatMessage]:
        users = [m for m in messages or [] if m.role == MessageRole.USER and m.content]
        if not users:
            return []
        found = recall(
            self.store, user_id=self.user_id, query=users[-1].content, k=self.k, recent_turns=0, min_score=self.min_score
        )
        if self.mode == "handles":  # so an InferScaleLLM without user_id can serve them
            remember_issued(self.store, {r.item.handle: self.user_id for r in found})
        return [chat_message_for(r.item, self.mode) for r in found]

    async def _aget(self, messages: list[ChatMessage] | None = None, **block_kwargs: Any) -> list[ChatMessage]:
        import asyncio

        return await asyncio.to_thread(self._get, messages)

    def _put(self, messages: list[ChatMessage]) -> None:
        turn: list[tuple[str, str]] = []
        for m in [checked_message(m) for m in messages]:
            if m.role not in (MessageRole.USER, MessageRole.ASSISTANT) or not m.content:
                continue
            if m.role == MessageRole.USER and turn:
                save_messages(self.store, turn, user_id=self.user_id, session_id=self.session_id, source=SOURCE)
                turn = []
            turn.append((m.role.value, m.content))
        if turn:
            save_messages(self.store, turn, user_id=self.user_id, session_id=self.session_id, source=SOURCE)

    async def _aput(self, messages: list[ChatMessage]) -> None:
        import asyncio

        await asyncio.to_thread(self._put, messages)
