"""``InferScaleChatMessageHistory``: chat history kept as InferScale memory facts.

For ``RunnableWithMessageHistory`` (and anything else that takes a ``BaseChatMessageHistory``).
Each message added becomes one fact of ``user_id`` (its text is the message content exactly;
role, turn and session go in metadata), encoded in the background with the conversation
before it. ``messages`` returns the session's messages with each content replaced by the fact's
handle (``mode="handles"``, for InferScale models: the history costs no prefill) or by its text
(``mode="text"``, for any other model).

**Across sessions (decision).** A history is one session's transcript, as LangChain's contract
has it (``messages``, ``clear``), so by default a new ``session_id`` starts empty.
``earlier_turns=N`` puts the user's last ``N`` conversation turns from their other sessions
(stored by any InferScale history, memory or agent middleware, in this process or an earlier
one) before the session's messages, as handles too: a new session remembers the last ones.
There is no query here (``RunnableWithMessageHistory`` asks for the messages before it adds
the input), so the choice is by recency; ``InferScaleMemory`` recalls by relevance instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
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
    SESSION_KEY,
    TURN_KEY,
    EncodeStyle,
    EngineRef,
    OnEngine,
    RecallMode,
    _turn_of,
    all_items,
    check_mode,
    checks_arguments,
    content_of,
    new_turn_id,
    role_of,
    save_messages,
    user_of,
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


def last_turns(items: list[MemoryItem], count: int | None) -> list[MemoryItem]:
    """The facts of the last ``count`` turns of ``items`` (all of them for None), in order."""
    if count is None:
        return items
    turns: list[str] = []
    for item in items:
        t = _turn_of(item)
        if t not in turns:
            turns.append(t)
    keep = set(turns[-count:]) if count > 0 else set()
    return [i for i in items if _turn_of(i) in keep]


def checked_messages(messages: Any) -> list[BaseMessage]:
    """``messages`` as a list, or ``TypeError`` when it is not a list of LangChain messages
    (a plain string used to be skipped without a word, as an unsupported message is)."""
    if isinstance(messages, (str, bytes, BaseMessage, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(f"add_messages takes a list of LangChain messages, got {type(messages).__name__}")
    for message in messages:
        if not isinstance(message, BaseMessage):
            raise TypeError(
                f"InferScaleChatMessageHistory stores LangChain messages (HumanMessage, AIMessage, SystemMessage), "
                f"got {type(message).__name__} {message!r:.60}: use add_user_message(text) / add_ai_message(text) "
                "or wrap it, e.g. HumanMessage(content=text)"
            )
    return list(messages)


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
        recent_turns: return only the last N turns of the session (None: all).
        earlier_turns: also return the user's last N turns from their other sessions, first
            (default 0: the session alone; None: all of them). Needs a ``session_id``.
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

    @checks_arguments
    def __init__(
        self,
        user_id: str | None = None,
        session_id: str | None = None,
        *,
        engine: InferScaleEngine | None = None,
        model: str | None = None,
        mode: RecallMode = "handles",
        recent_turns: int | None = None,
        earlier_turns: int | None = 0,
        engine_options: dict[str, Any] | None = None,
        encode_style: EncodeStyle = "chat",
        prefixes: tuple[str, str] = ("Human", "AI"),
    ) -> None:
        self.user_id = user_of(type(self), user_id)
        self.encode_style: EncodeStyle = encode_style
        self.prefixes = prefixes
        self.session_id = session_id
        self.mode = check_mode(mode)
        self.recent_turns = recent_turns
        if earlier_turns is not None and (isinstance(earlier_turns, bool) or not isinstance(earlier_turns, int)
                                          or earlier_turns < 0):
            raise ValueError(f"earlier_turns must be None or an integer >= 0, got {earlier_turns!r}")
        self.earlier_turns = earlier_turns
        self._engine = EngineRef(engine, model, engine_options)
        self._turn_id: str | None = None

    def items(self) -> list[MemoryItem]:
        """The facts ``messages`` stands for, oldest first: the earlier sessions' last
        ``earlier_turns`` turns, then the session's (last ``recent_turns``) turns."""
        items = last_turns(all_items(self.store, user_id=self.user_id, session_id=self.session_id), self.recent_turns)
        if self.session_id is not None and self.earlier_turns != 0:
            items = self.earlier_items() + items
        return items

    def earlier_items(self) -> list[MemoryItem]:
        """The facts of the user's last ``earlier_turns`` conversation turns in other sessions
        (facts stored as turns, so not LangGraph store items or bare ``store.add`` facts)."""
        others = [
            i for i in all_items(self.store, user_id=self.user_id)
            if TURN_KEY in (i.metadata or {}) and (i.metadata or {}).get(SESSION_KEY) != self.session_id
        ]
        return last_turns(others, self.earlier_turns)

    @property
    def messages(self) -> list[BaseMessage]:  # type: ignore[override]
        return [message_for(item, self.mode) for item in self.items()]

    async def aget_messages(self) -> list[BaseMessage]:
        return await asyncio.to_thread(lambda: self.messages)

    def add_messages(self, messages: Sequence[BaseMessage]) -> None:
        """Store each message as a fact; a human message starts a new turn. Tool messages and
        messages without text are not stored; anything but a message raises ``TypeError``
        (before any is stored)."""
        turn: list[tuple[str, str]] = []
        for message in checked_messages(messages):
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
        return (f"InferScaleChatMessageHistory(user_id={self.user_id!r}, session_id={self.session_id!r}, "
                f"mode={self.mode!r}, earlier_turns={self.earlier_turns!r})")
