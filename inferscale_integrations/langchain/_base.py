"""What every LangChain InferScale class shares: where its engine comes from, whose memories it
may use, and the check that rejects a misspelled argument with the closest known name.

A pydantic model (pydantic collects validators only from ``BaseModel`` bases), put first among
a class's bases: ``class ChatInferScale(InferScaleModelBase, BaseChatModel)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from inferscale_engine.types import DEFAULT_USER
from inferscale_integrations._common import EngineRef, check_arguments, check_user_id, pydantic_fields

if TYPE_CHECKING:
    from inferscale_engine import InferScaleEngine


class InferScaleModelBase(BaseModel):
    """``engine=`` or the shared engine of a model, ``engine_options``, ``user_id``, checked arguments."""

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    #: The field naming the model: ``model_name`` (alias ``model``) on the chat model and LLM, as
    #: ``ChatOpenAI`` has it; ``model`` on the memory and the retriever.
    _MODEL_FIELD: ClassVar[str] = "model"

    engine_options: dict[str, Any] = Field(default_factory=dict)
    """Options for building the engine (``max_model_len``, ``window``...) when this class builds it."""
    user_id: str = DEFAULT_USER
    """Whose memories this object reads and writes (one per end user)."""

    _engine: EngineRef = PrivateAttr()

    @model_validator(mode="before")
    @classmethod
    def _check_arguments(cls, data: Any) -> Any:
        check_arguments(cls, data, pydantic_fields(cls))
        return data

    @field_validator("user_id", mode="before")
    @classmethod
    def _check_user(cls, value: Any) -> str:
        return check_user_id(value)

    def __init__(self, *, engine: InferScaleEngine | None = None, **kwargs: Any) -> None:
        """``engine``: an ``InferScaleEngine`` to use instead of the shared engine of ``model``."""
        super().__init__(**kwargs)
        self._engine = EngineRef(engine, getattr(self, self._MODEL_FIELD), self.engine_options)
