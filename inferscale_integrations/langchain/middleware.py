"""``InferScaleMemoryMiddleware``: long-term memory for LangChain v1 ``create_agent`` agents.

``create_agent`` keeps a thread's messages in its state (with a checkpointer) and sends them
all to the model on every step. With this middleware each finished turn (the user's message and
the agent's final answer) is stored as facts of ``user_id``, and every model call gets, in
place of the earlier conversation, the recalled turns (relevant to the new question plus the
most recent ones) as messages whose content is a handle: an InferScale chat model injects their
KV instead of prefilling them. The current turn (the last user message and the tool calls and
results after it) is sent as it is.

Requires the ``langchain`` package (``pip install 'inferscale[langchain]'``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from langchain.agents.middleware import (
    AgentMiddleware,
    AgentState,
    ModelRequest,
    ModelResponse,
)
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage

from inferscale_integrations._common import (
    EngineRef,
    OnEngine,
    RecallMode,
    check_mode,
    checks_arguments,
    recall_for,
    save_messages,
    user_of,
)
from inferscale_integrations.langchain.chat_history import message_for

if TYPE_CHECKING:
    from inferscale_engine import InferScaleEngine

SOURCE = "langchain-agent"


def _last_human_index(messages: Sequence[BaseMessage]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if isinstance(messages[i], HumanMessage):
            return i
    return -1


class InferScaleMemoryMiddleware(OnEngine, AgentMiddleware):
    """Store each turn as memory facts; give the model recalled turns as handles.

    Example:
        ```python
        from langchain.agents import create_agent
        from inferscale_integrations.langchain import ChatInferScale, InferScaleMemoryMiddleware

        agent = create_agent(
            ChatInferScale(model="smollm2", user_id="alice"),
            tools=[...],
            middleware=[InferScaleMemoryMiddleware(model="smollm2", user_id="alice")],
        )
        agent.invoke({"messages": [{"role": "user", "content": "My dog is called Rex."}]})
        ```

    Args:
        user_id / session_id / engine / model / mode / k / recent_turns: as for
            :class:`~inferscale_integrations.langchain.InferScaleMemory`.
        replace_history: drop the earlier messages of the thread from the model request (they
            are in memory); False keeps them and adds the recalled turns before them.
    """

    @checks_arguments
    def __init__(
        self,
        *,
        user_id: str | None = None,
        session_id: str | None = None,
        engine: InferScaleEngine | None = None,
        model: str | None = None,
        mode: RecallMode = "handles",
        k: int = 4,
        recent_turns: int = 2,
        replace_history: bool = True,
        engine_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.user_id = user_of(type(self), user_id)
        self.session_id = session_id
        self.mode = check_mode(mode)
        self.k = k
        self.recent_turns = recent_turns
        self.replace_history = replace_history
        self._engine = EngineRef(engine, model, engine_options)

    def _recalled(self, query: str | None) -> list[BaseMessage]:
        return [message_for(r.item, self.mode) for r in recall_for(self, query)]

    def _rewrite(self, request: ModelRequest) -> ModelRequest:
        messages: list[BaseMessage] = list(request.messages)
        i = _last_human_index(messages)
        current = messages[i:] if i >= 0 else messages
        earlier = messages[:i] if i > 0 else []
        query = current[0].text if current and isinstance(current[0], HumanMessage) else None
        recalled = self._recalled(query)
        history = recalled if self.replace_history else recalled + earlier
        # message_for makes Human/AI messages, members of ModelRequest's AnyMessage union, but is
        # typed BaseMessage (the chat history's API).
        return request.override(messages=history + current)  # type: ignore[arg-type]

    def wrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]) -> ModelResponse:
        return handler(self._rewrite(request))

    async def awrap_model_call(
        self, request: ModelRequest, handler: Callable[[ModelRequest], Awaitable[ModelResponse]]
    ) -> ModelResponse:
        import asyncio

        return await handler(await asyncio.to_thread(self._rewrite, request))

    def after_agent(self, state: AgentState, runtime: Any) -> dict[str, Any] | None:
        messages = list(state.get("messages", []))
        i = _last_human_index(messages)
        if i < 0:
            return None
        answer = next(
            (m for m in reversed(messages[i + 1 :]) if isinstance(m, AIMessage) and not m.tool_calls and m.text),
            None,
        )
        turn = [("user", messages[i].text)]
        if answer is not None:
            turn.append(("assistant", answer.text))
        save_messages(self.store, turn, user_id=self.user_id, session_id=self.session_id, source=SOURCE)
        return None

    async def aafter_agent(self, state: AgentState, runtime: Any) -> dict[str, Any] | None:
        import asyncio

        return await asyncio.to_thread(self.after_agent, state, runtime)
