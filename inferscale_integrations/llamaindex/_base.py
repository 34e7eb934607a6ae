"""What every LlamaIndex InferScale class built by pydantic shares: where its engine comes from,
and the check that rejects a misspelled argument with the closest known name.

A pydantic model (pydantic collects validators only from ``BaseModel`` bases), put before the
LlamaIndex base: ``class InferScaleLLM(InferScaleComponent, CustomLLM)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from llama_index.core.bridge.pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator

from inferscale_integrations._common import (
    EngineConstructors,
    EngineRef,
    check_arguments,
    check_user_id,
    model_name_of,
    pydantic_fields,
)

if TYPE_CHECKING:
    from inferscale_engine import InferScaleEngine


class InferScaleComponent(EngineConstructors, BaseModel):
    """``engine=``, or ``model=`` (kept in ``model_name``) for the shared engine of a model;
    ``engine_options``; checked arguments; ``from_engine`` / ``from_model``, as
    llama-index-memory-mem0 has ``from_client`` / ``from_config``."""

    #: Whether a missing ``user_id`` is warned about (not by a class without one, nor by one
    #: with a rule of its own for it).
    _WARN_NO_USER: ClassVar[bool] = True
    #: Whether ``engine=`` without ``model=`` puts the engine's model in ``model_name``.
    _NAME_FROM_ENGINE: ClassVar[bool] = False

    if TYPE_CHECKING:
        model_name: str | None  # a field of each class: its default differs

    engine_options: dict[str, Any] = Field(default_factory=dict)
    """Options for building the engine (``max_model_len``, ``window``...) when this class builds it."""

    _engine: EngineRef = PrivateAttr()

    @model_validator(mode="before")
    @classmethod
    def _check_arguments(cls, data: Any) -> Any:
        check_arguments(cls, data, pydantic_fields(cls), user=cls._WARN_NO_USER)
        return data

    @field_validator("user_id", mode="before", check_fields=False)  # the classes that have one
    @classmethod
    def _check_user(cls, value: Any) -> str | None:
        return None if value is None else check_user_id(value)

    def __init__(self, *, engine: InferScaleEngine | None = None, model: str | None = None, **kwargs: Any) -> None:
        """``engine``: an ``InferScaleEngine`` to use instead of the shared engine of ``model``."""
        if model is not None:
            kwargs["model_name"] = model
        elif engine is not None and self._NAME_FROM_ENGINE and "model_name" not in kwargs:
            kwargs["model_name"] = model_name_of(engine, None)
        super().__init__(**kwargs)
        self._check_fields()
        self._engine = EngineRef(engine, self.model_name, self.engine_options)

    def _check_fields(self) -> None:
        """Raise ``ValueError`` on fields that do not go together (before the engine is taken)."""
