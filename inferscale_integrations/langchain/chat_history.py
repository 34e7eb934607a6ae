"""``InferScaleChatMessageHistory``: chat history kept as InferScale memory facts.

For ``RunnableWithMessageHistory`` (and anything else that takes a ``BaseChatMessageHistory``).
Each message added becomes one fact of ``user_id`` (its text is the message content exactly;
role, turn and session go in metadata), encoded in the background with the conversation
before it. ``messages`` returns the session's messages with each content replaced by the fact's
handle (``mode="handles"``, for InferScale models: the history costs no prefill) or by its text
(``mode="text"``, for any other model).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from langchain_core.chat_history import BaseChatMessageHistory
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
)

from inferscale_integrations._common import (
    DEFAULT_USER,
    EncodeStyle,
    EngineRef,
    OnEngine,
    RecallMode,
    all_items,
    check_mode,
    content_of,
    new_turn_id,
    role_of,
    save_messages,
    warn_if_shared_user,
)
from inferscale_integrations.langchain._messages import message_role

if TYPE_CHECKING:
    from inferscale_engine import InferScaleEngine
    from inferscale_engine.memory import MemoryItem

SOURCE = "langchain"


def message_for(item: MemoryItem, mode: str) -> BaseMessage:
    """A LangChain message standing for ``item`` (content: its handle or its text)."""
    content = content_of(item, mode)
    role = role_of(item)
    meta = {"fact_id": item.id}
    if role == "user":
        return HumanMessage(content=content, id=item.id, response_metadata=meta)
    if role == "assistant":
        return AIMessage(content=content, id=item.id, response_metadata=meta)
    if role == "system":
        return SystemMessage(content=content, id=item.id, response_metadata=meta)
    return ChatMessage(role=role, content=content, id=item.id, response_metadata=meta)


def role_for(message: BaseMessage) -> str | None:
    """Role to store ``message`` under, or None for messages history does not keep."""
    try:
        role = message_role(message)
    except ValueError:
        return None
    return role if role in ("user", "assistant", "system") else None  # tool traffic is not conversation memory


class InferScaleChatMessageHistory(OnEngine, BaseChatMessageHistory):
    """Chat message history stored as InferScale memory facts of one user (and session).

    Args:
        user_id: owner of the facts; handles are minted for, and only resolve for, this user.
        session_id: conversation id; ``messages`` and ``clear`` are scoped to it. None: all of
            the user's facts.
        engine / model: the engine (or model alias) whose memory store keeps the facts.
        mode: ``"handles"`` (default) or ``"text"``.
        recent_turns: return only the last N turns (None: all).
        encode_style / prefixes: how facts will sit in prompts, so they are encoded in that
            layout: ``"chat"`` (message contents) or ``"buffer"`` (``"Human: ..."`` lines).

    Example:
        ```python
        from langchain_core.runnables.history import RunnableWithMessageHistory

        chain_with_history = RunnableWithMessageHistory(
            prompt | ChatInferScale(model="smollm2", user_id="alice"),
            lambda session_id: InferScaleChatMessageHistory(
                user_id="alice", session_id=session_id, model="smollm2"
            ),
            input_messages_key="question",
            history_messages_key="history",
        )
        ```
    """

    def __init__(
        self,
        user_id: str | None = None,
        session_id: str | None = None,
        *,
        engine: InferScaleEngine | None = None,
        model: str | None = None,
        mode: RecallMode = "handles",
        recent_turns: int | None = None,
        engine_options: dict[str, Any] | None = None,
        encode_style: EncodeStyle = "chat",
        prefixes: tuple[str, str] = ("Human", "AI"),
    ) -> None:
        warn_if_shared_user(type(self), user_id)
        self.user_id = user_id if user_id is not None else DEFAULT_USER
        self.encode_style: EncodeStyle = encode_style
        self.prefixes = prefixes
        self.session_id = session_id
        self.mode = check_mode(mode)
        self.recent_turns = recent_turns
        self._engine = EngineRef(engine, model, engine_options)
        self._turn_id: str | None = None

    def items(self) -> list[MemoryItem]:
        """The session's facts, oldest first."""
        items = all_items(self.store, user_id=self.user_id, session_id=self.session_id)
        if self.recent_turns is not None:
            from inferscale_integrations._common import _turn_of

            turns: list[str] = []
            for item in items:
                t = _turn_of(item)
                if t not in turns:
                    turns.append(t)
            keep = set(turns[-self.recent_turns :]) if self.recent_turns > 0 else set()
            items = [i for i in items if _turn_of(i) in keep]
        return items

    @property
    def messages(self) -> list[BaseMessage]:  # type: ignore[override]
        return [message_for(item, self.mode) for item in self.items()]

    async def aget_messages(self) -> list[BaseMessage]:
        return await asyncio.to_thread(lambda: self.messages)

    def add_messages(self, messages: Sequence[BaseMessage]) -> None:
        """Store each message as a fact; a human message starts a new turn."""
        turn: list[tuple[str, str]] = []
        for message in messages:
            role = role_for(message)
            if role is None:
                continue
            if role == "user" and turn:
                self._flush(turn)
                turn = []
            if role == "user" or self._turn_id is None:
                self._turn_id = new_turn_id()
            turn.append((role, message.text if hasattr(message, "text") else str(message.content)))
        if turn:
            self._flush(turn)

    def _flush(self, turn: list[tuple[str, str]]) -> None:
        save_messages(
            self.store,
            turn,
            user_id=self.user_id,
            session_id=self.session_id,
            source=SOURCE,
            turn_id=self._turn_id,
            style=self.encode_style,
            prefixes=self.prefixes,
        )

    async def aadd_messages(self, messages: Sequence[BaseMessage]) -> None:
        await asyncio.to_thread(self.add_messages, messages)

    def clear(self) -> None:
        """Delete this session's facts (all of the user's facts when no ``session_id``)."""
        if self.session_id is None:
            self.store.delete_all(user_id=self.user_id)
        else:
            for item in all_items(self.store, user_id=self.user_id, session_id=self.session_id):
                self.store.delete(item.id)
        self._turn_id = None

    async def aclear(self) -> None:
        await asyncio.to_thread(self.clear)

    def __repr__(self) -> str:
        return f"InferScaleChatMessageHistory(user_id={self.user_id!r}, session_id={self.session_id!r}, mode={self.mode!r})"
