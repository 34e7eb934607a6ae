"""LangChain's own standard test suites, run against ChatInferScale / InferScaleRetriever on a
real InferScale engine: SmolLM2-135M on the CPU (one engine for the module, closed at its end).

Capabilities switched off, and why:

* tool calling / structured output / JSON mode (integration suite): SmolLM2's chat template has
  no tools and the 135M model has next to no skill with them; the whole suite, those included,
  runs on Qwen2.5-Coder-0.5B in tests/test_langchain_standard_qwen.py.
* image / audio / PDF / video inputs: text-only models.
* model override: ``invoke(model=...)`` works (it picks another shared engine) but would load a
  second vLLM engine just for that check; skipped to keep CI short.
* VCR / serialisation / init-from-env: no HTTP to record, no secrets, not serialisable (an
  engine is live process state).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_tests.integration_tests import (
    ChatModelIntegrationTests,
    RetrieversIntegrationTests,
)
from langchain_tests.unit_tests import ChatModelUnitTests

from inferscale_integrations import get_engine
from inferscale_integrations.langchain import ChatInferScale, InferScaleRetriever

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:The test <Function .* is marked with '@pytest.mark.asyncio':pytest.PytestWarning"),
]


# The suites' async tests need pytest-asyncio's mark (this repo runs it in strict mode); the
# suites forbid overriding their tests, so the mark goes on the classes. pytest-asyncio ignores it
# on the synchronous tests.
ASYNC = pytest.mark.asyncio(loop_scope="class")

_STATE: dict[str, Any] = {}
USER = "standard-suite-user"
FACTS = [
    "My dog is called Rex.",
    "I live in Paris, the capital of France.",
    "My favourite colour is blue.",
    "The meeting is on Monday at ten o'clock.",
    "I have two children, Tom and Emma.",
]


@pytest.fixture(scope="module", autouse=True)
def engine(smollm2_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    # One engine per module, closed at the end: vLLM keeps the first live engine's KV-connector
    # worker in a process global, so an engine left alive would break any engine built after it.
    eng = get_engine("smollm2", store_path=tmp_path_factory.mktemp("lc-std-store"), recompute=0)
    for fact in FACTS:
        eng.memory.add(fact, user_id=USER)
    eng.memory.wait_for_encoding()
    _STATE["engine"] = eng
    yield eng
    _STATE.clear()
    eng.close()


def _params() -> dict[str, Any]:
    # min_tokens: a model may emit EOS first; the suites want non-empty content.
    return {"engine": _STATE["engine"], "max_tokens": 12, "model_kwargs": {"min_tokens": 2}}


class TestChatInferScaleUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatInferScale]:
        return ChatInferScale

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "smollm2", "user_id": USER}  # construction only: no engine is built

    @property
    def has_tool_calling(self) -> bool:
        return True  # bind_tools (prompt-based) must accept every tool format

    @property
    def has_structured_output(self) -> bool:
        return True  # with_structured_output goes through bind_tools

    @property
    def supports_model_override(self) -> bool:
        return True


@ASYNC
class TestChatInferScaleIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatInferScale]:
        return ChatInferScale

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {**_params(), "user_id": USER}

    @property
    def has_tool_calling(self) -> bool:
        return False  # see module docstring: covered on Qwen

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def supports_json_mode(self) -> bool:
        return False

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
        handles = [item.handle for item in eng.memory.get_all(user_id=USER)[:3]]
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


@ASYNC
class TestInferScaleRetrieverIntegration(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[InferScaleRetriever]:
        return InferScaleRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {"engine": _STATE["engine"], "user_id": USER}

    @property
    def retriever_query_example(self) -> str:
        return "What is my dog's name?"
