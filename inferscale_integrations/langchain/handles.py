"""``HandleExpander``: paste fact text in place of handles, for a model that is not InferScale.

A handle means nothing to another model, and nothing can intercept it inside that model's
client. When a chain built for InferScale must also run against another model, put this
runnable between the prompt and that model::

    chain = prompt | HandleExpander(model="smollm2", user_id="alice") | ChatOpenAI()

It takes a string, a prompt value or a list of messages and returns the same kind with every
handle replaced by its fact's text (each handle checked for ``user_id``, as the engine does).
Simpler still: build the memory/retriever with ``mode="text"``.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import BaseMessage
from langchain_core.prompt_values import ChatPromptValue, PromptValue, StringPromptValue
from langchain_core.runnables import RunnableConfig, RunnableSerializable
from langchain_core.tracers.context import register_configure_hook
from pydantic import ConfigDict, PrivateAttr, field_validator, model_validator

from inferscale_engine.types import DEFAULT_USER
from inferscale_integrations._common import (
    EngineRef,
    check_arguments,
    check_user_id,
    expand_handles,
    pydantic_fields,
    warn_foreign_handles,
)

if TYPE_CHECKING:
    from inferscale_engine import InferScaleEngine


class HandleExpander(RunnableSerializable[Any, Any]):
    """Replace memory handles with their facts' text (str, PromptValue or messages in, same out)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model: str | None = None
    user_id: str = DEFAULT_USER

    @model_validator(mode="before")
    @classmethod
    def _check_arguments(cls, data: Any) -> Any:
        check_arguments(cls, data, pydantic_fields(cls), user=False)
        return data

    @field_validator("user_id", mode="before")
    @classmethod
    def _check_user(cls, value: Any) -> str:
        return check_user_id(value)

    _engine: EngineRef = PrivateAttr()

    def __init__(self, *, engine: InferScaleEngine | None = None, **kwargs: Any) -> None:
        """``engine``: the ``InferScaleEngine`` whose store holds the facts (else the shared one of ``model``)."""
        super().__init__(**kwargs)
        self._engine = EngineRef(engine, self.model)

    def get_engine(self) -> InferScaleEngine:
        """The engine whose memory store keeps the facts (built or shared on first use)."""
        return self._engine.get()

    def expand(self, text: str) -> str:
        return expand_handles(text, store=self.get_engine().memory, user_id=self.user_id)

    def _message(self, message: BaseMessage) -> BaseMessage:
        if isinstance(message.content, str):
            return message.model_copy(update={"content": self.expand(message.content)})
        blocks = [
            {**b, "text": self.expand(b["text"])} if isinstance(b, dict) and isinstance(b.get("text"), str) else b
            for b in message.content
        ]
        return message.model_copy(update={"content": blocks})

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        if isinstance(input, str):
            return self.expand(input)
        if isinstance(input, StringPromptValue):
            return StringPromptValue(text=self.expand(input.text))
        if isinstance(input, ChatPromptValue):
            return ChatPromptValue(messages=[self._message(m) for m in input.messages])
        if isinstance(input, PromptValue):
            return ChatPromptValue(messages=[self._message(m) for m in input.to_messages()])
        if isinstance(input, list):
            return [self._message(m) if isinstance(m, BaseMessage) else m for m in input]
        raise TypeError(f"HandleExpander takes a string, a prompt value or messages, not {type(input).__name__}")


class HandleGuard(BaseCallbackHandler):
    """Warns when memory handles reach a model that is not InferScale (once per model class).

    Registered for every LangChain run in the process (a configure hook, as LangChain's own
    tracers are), because such a model receives the raw ``<<mem:…>>`` strings without a word.
    """

    raise_error = False
    _INFERSCALE = frozenset({"ChatInferScale", "InferScaleLLM"})

    def on_llm_start(self, serialized: dict[str, Any], prompts: list[str], **kwargs: Any) -> None:
        self._check(serialized, prompts)

    def on_chat_model_start(self, serialized: dict[str, Any], messages: list[list[BaseMessage]], **kwargs: Any) -> None:
        self._check(serialized, [str(m.content) for batch in messages for m in batch])

    def _check(self, serialized: dict[str, Any] | None, texts: list[str]) -> None:
        ids = (serialized or {}).get("id") or [(serialized or {}).get("name") or "an LLM"]
        if str(ids[-1]) not in self._INFERSCALE:
            warn_foreign_handles(str(ids[-1]), texts, "Put HandleExpander(engine=..., user_id=...) before it")


# A default, not .set(): the one guard then serves every thread and task, which .set() would not reach.
_guard: ContextVar[HandleGuard | None] = ContextVar("inferscale_handle_guard", default=HandleGuard())  # noqa: B039
register_configure_hook(_guard, inheritable=True)
