"""LangChain's standard integration suite for ``ChatInferScale`` on Qwen2.5-Coder-0.5B-Instruct,
whose chat template renders tools: every capability on, tool calling, tool choice, structured
output and JSON mode included (one engine for the module, closed at its end).

How the capabilities are met (docs/langchain.md, "Tools and structured output"): tools go
through the model's chat template, ``<tool_call>`` blocks (or a bare JSON call) in the answer
become ``tool_calls``, and a forced ``tool_choice`` or a ``with_structured_output`` schema is
enforced by guided decoding (vLLM structured outputs, xgrammar on the CPU).

Switched off, and why: image / audio / PDF / video inputs (a text-only model); model override
(it would load a second vLLM engine just for that check; ``invoke(model=...)`` is covered by the
SmolLM2 module's unit suite).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from langchain_standard_base import ASYNC, MARKS, InjectedChatModelTests, module_engine

pytestmark = MARKS

MODEL = "qwen2.5-coder-0.5b"
USER = "standard-suite-qwen"
FACTS = ["My dog is called Rex.", "I live in Paris, the capital of France.", "My favourite colour is blue."]
_STATE: dict[str, Any] = {}


@pytest.fixture(scope="module", autouse=True)
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    yield from module_engine(MODEL, tmp_path_factory.mktemp("lc-std-qwen"), USER, FACTS, _STATE)


@ASYNC
class TestChatInferScaleQwenIntegration(InjectedChatModelTests):
    state = _STATE
    user = USER

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # max_tokens: room for a structured joke (~45 tokens); chat answers end well before it.
        # repetition_penalty: greedy decoding of a 0.5B model can loop inside a JSON string until
        # max_tokens ("A cat is like a superhero, but..." on some CPUs and not others: the kernels'
        # rounding differs by instruction set), and a truncated joke fails the schema. A mild
        # penalty, of the kind Qwen's instruct models ship in their generation configs, breaks it.
        return {"engine": _STATE["engine"], "user_id": USER, "max_tokens": 80,
                "model_kwargs": {"min_tokens": 2, "repetition_penalty": 1.05}}

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True
