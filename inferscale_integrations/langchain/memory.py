"""``InferScaleMemory``: a drop-in for langchain-classic's ``ConversationBufferMemory``.

Same knobs (``memory_key``, ``input_key``, ``output_key``, ``return_messages``, ``human_prefix``,
``ai_prefix``), same ``save_context`` / ``load_memory_variables`` / ``clear`` contract, so chains
and ``AgentExecutor`` take it unchanged. The difference is what ``load_memory_variables`` puts
in the prompt:

* ``ConversationBufferMemory``: the whole conversation, pasted as text, prefilled every turn.
* ``InferScaleMemory``: the relevant part of it, as fact handles whose KV the InferScale
  engine injects (no prefill). What is returned: the turns holding the ``k`` facts most
  relevant to the new input (semantic search over everything this user said, any session)
  plus the ``recent_turns`` last turns of this session, each turn whole, in conversation order.
  As a string it reads exactly like ``ConversationBufferMemory``'s buffer
  (``"Human: <<mem:…>>\\nAI: <<mem:…>>"``) and as messages each content is a handle.

``save_context`` stores the turn (input and output) as two facts, encoded in the background
with the turns before them (the store's context window).

``mode="text"`` returns the facts' text instead of handles: use it with an LLM that is not
InferScale (a handle means nothing to another model and cannot be intercepted on its way there).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from langchain_classic.memory.chat_memory import BaseChatMemory
from langchain_classic.memory.utils import get_prompt_input_key
from langchain_core.messages import BaseMessage, get_buffer_string
from pydantic import Field

from inferscale_integrations._common import (
    OnEngine,
    RecallMode,
    check_mode,
    recall_for,
)
from inferscale_integrations.langchain._base import InferScaleModelBase
from inferscale_integrations.langchain.chat_history import (
    InferScaleChatMessageHistory,
    message_for,
)

if TYPE_CHECKING:
    from inferscale_engine import InferScaleEngine


class InferScaleMemory(OnEngine, InferScaleModelBase, BaseChatMemory):
    """Conversation memory whose recalled turns reach the model as injected KV.

    Example (the only change from a ``ConversationBufferMemory`` chain is the memory class):
        ```python
        from langchain_classic.chains import ConversationChain
        from inferscale_integrations.langchain import ChatInferScale, InferScaleMemory

        llm = ChatInferScale(model="smollm2", user_id="alice")
        memory = InferScaleMemory(model="smollm2", user_id="alice")  # was ConversationBufferMemory()
        chain = ConversationChain(llm=llm, memory=memory)
        chain.invoke({"input": "My dog is called Rex."})
        ```
    """

    human_prefix: str = "Human"
    ai_prefix: str = "AI"
    memory_key: str = "history"
    chat_memory: Any = Field(default=None, exclude=True)
    """An :class:`InferScaleChatMessageHistory` of ``user_id``/``session_id`` (built when omitted)."""

    model: str | None = None
    """Model alias or local folder whose shared engine's store keeps the facts."""
    session_id: str | None = None
    """Conversation id: ``recent_turns`` and ``clear`` are scoped to it (None: all of the user's)."""
    mode: RecallMode = "handles"
    k: int = 4
    """Facts to recall by semantic search on the new input (their whole turns come along)."""
    recent_turns: int = 2
    """Most recent turns of the session always included (the running conversation)."""
    min_score: float | None = None
    """Drop search hits scoring below this."""

    def __init__(self, *, engine: InferScaleEngine | None = None, **kwargs: Any) -> None:
        """``engine``: the ``InferScaleEngine`` whose store keeps the facts (else the shared one of ``model``)."""
        super().__init__(engine=engine, **kwargs)
        check_mode(self.mode)
        if not isinstance(self.chat_memory, InferScaleChatMessageHistory):
            self.chat_memory = InferScaleChatMessageHistory(
                user_id=self.user_id,
                session_id=self.session_id,
                engine=engine,
                model=self.model,
                mode=self.mode,
                engine_options=self.engine_options,
                encode_style="chat" if self.return_messages else "buffer",
                prefixes=(self.human_prefix, self.ai_prefix),
            )

    # ------------------------------------------------------------------ store

    # ------------------------------------------------------------------ ConversationBufferMemory API

    @property
    def memory_variables(self) -> list[str]:
        return [self.memory_key]

    @property
    def buffer(self) -> Any:
        """The whole conversation (handles or text), as ``ConversationBufferMemory.buffer``."""
        return self.buffer_as_messages if self.return_messages else self.buffer_as_str

    @property
    def buffer_as_messages(self) -> list[BaseMessage]:
        return self.chat_memory.messages

    @property
    def buffer_as_str(self) -> str:
        return get_buffer_string(self.buffer_as_messages, human_prefix=self.human_prefix, ai_prefix=self.ai_prefix)

    def recall_messages(self, query: str | None) -> list[BaseMessage]:
        """Messages for ``query``: relevant turns plus the recent ones, in conversation order."""
        return [message_for(r.item, self.mode) for r in recall_for(self, query)]

    def _query(self, inputs: dict[str, Any]) -> str | None:
        if not inputs:
            return None
        key = self.input_key
        if key is None:
            try:
                key = get_prompt_input_key(inputs, self.memory_variables)
            except ValueError:
                return None
        value = inputs.get(key)
        return value if isinstance(value, str) else None

    def load_memory_variables(self, inputs: dict[str, Any]) -> dict[str, Any]:
        messages = self.recall_messages(self._query(inputs))
        if self.return_messages:
            return {self.memory_key: messages}
        return {self.memory_key: get_buffer_string(messages, human_prefix=self.human_prefix, ai_prefix=self.ai_prefix)}

    async def aload_memory_variables(self, inputs: dict[str, Any]) -> dict[str, Any]:
        return await asyncio.to_thread(self.load_memory_variables, inputs)

    def wait(self) -> None:
        """Block until every stored fact is encoded (handles resolve without waiting after this)."""
        self.store.wait_for_encoding()
