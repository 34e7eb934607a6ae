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
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests

from inferscale_integrations import get_engine
from inferscale_integrations.langchain import ChatInferScale

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:The test <Function .* is marked with '@pytest.mark.asyncio':pytest.PytestWarning"),
]

ASYNC = pytest.mark.asyncio(loop_scope="class")  # see tests/test_langchain_standard.py

MODEL = "qwen2.5-coder-0.5b"
USER = "standard-suite-qwen"
FACTS = ["My dog is called Rex.", "I live in Paris, the capital of France.", "My favourite colour is blue."]
_STATE: dict[str, Any] = {}


@pytest.fixture(scope="module", autouse=True)
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    # One engine per module, closed at the end (vLLM keeps the KV connector process-global).
    eng = get_engine(MODEL, store_path=tmp_path_factory.mktemp("lc-std-qwen"), recompute=0)
    for fact in FACTS:
        eng.memory.add(fact, user_id=USER)
    eng.memory.wait_for_encoding()
    _STATE["engine"] = eng
    yield eng
    _STATE.clear()
    eng.close()


@ASYNC
class TestChatInferScaleQwenIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatInferScale]:
        return ChatInferScale

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # max_tokens: room for a structured joke (~45 tokens); chat answers end well before it.
        return {"engine": _STATE["engine"], "user_id": USER, "max_tokens": 80, "model_kwargs": {"min_tokens": 2}}

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

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_model_override(self) -> bool:
        return False  # see module docstring

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[str]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """A prompt carrying memory handles: their KV is injected, so it is read, not prefilled."""
        eng = _STATE["engine"]
        handles = [item.handle for item in eng.memory.get_all(user_id=USER)]
        llm = ChatInferScale(**self.chat_model_params)
        messages = [SystemMessage("Memory:\n" + "\n".join(handles)), HumanMessage("What is my dog called?")]
        if stream:
            full = None
            for chunk in llm.stream(messages):
                full = chunk if full is None else full + chunk
            assert full is not None
            message: AIMessage = full  # type: ignore[assignment]
        else:
            message = llm.invoke(messages)
        details = (message.usage_metadata or {}).get("input_token_details", {})
        assert details.get("injected", 0) > 0
        return message
