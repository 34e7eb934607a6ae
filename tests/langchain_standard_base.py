"""What the two runs of LangChain's standard chat-model suite share (SmolLM2 in
test_langchain_standard.py, Qwen2.5-Coder-0.5B in test_langchain_standard_qwen.py): one engine
per module with a user's facts stored, and the capabilities both models have."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests

from inferscale_integrations import get_engine
from inferscale_integrations.langchain import ChatInferScale

# The suites' async tests need pytest-asyncio's mark (this repo runs it in strict mode); the
# suites forbid overriding their tests, so the mark goes on the classes. pytest-asyncio ignores it
# on the synchronous tests.
ASYNC = pytest.mark.asyncio(loop_scope="class")

MARKS = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:The test <Function .* is marked with '@pytest.mark.asyncio':pytest.PytestWarning"),
]


def module_engine(model: str, store: Path, user: str, facts: list[str], state: dict[str, Any]) -> Iterator[Any]:
    """The body of a module-scoped fixture: one engine with ``facts`` stored for ``user``, closed
    at the module's end (vLLM keeps the first live engine's KV-connector worker in a process
    global, so an engine left alive would break any engine built after it)."""
    eng = get_engine(model, store_path=store, recompute=0)
    for fact in facts:
        eng.memory.add(fact, user_id=user)
    eng.memory.wait_for_encoding()
    state["engine"] = eng
    yield eng
    state.clear()
    eng.close()


class InjectedChatModelTests(ChatModelIntegrationTests):
    """The integration suite on a live engine: text only, one engine (no model override), usage
    reported, and prompts carrying memory handles read their KV instead of prefilling it."""

    state: ClassVar[dict[str, Any]]
    user: ClassVar[str]

    @property
    def chat_model_class(self) -> type[ChatInferScale]:
        return ChatInferScale

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_model_override(self) -> bool:
        return False  # it would load a second vLLM engine just for that check

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[str]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """A prompt carrying memory handles: their KV is injected, so it is read, not prefilled."""
        handles = [item.handle for item in self.state["engine"].memory.get_all(user_id=self.user)[:3]]
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
