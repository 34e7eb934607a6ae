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
from langchain_standard_base import ASYNC, MARKS, InjectedChatModelTests, module_engine
from langchain_tests.integration_tests import RetrieversIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from inferscale_integrations.langchain import ChatInferScale, InferScaleRetriever

pytestmark = MARKS

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
    yield from module_engine("smollm2", tmp_path_factory.mktemp("lc-std-store"), USER, FACTS, _STATE)


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
class TestChatInferScaleIntegration(InjectedChatModelTests):
    state = _STATE
    user = USER

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
