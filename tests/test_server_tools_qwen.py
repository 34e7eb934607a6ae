"""A LangChain ``create_agent`` agent on ``ChatOpenAI`` over ``inferscale serve``'s HTTP API,
with Qwen2.5-Coder-0.5B-Instruct, whose chat template renders tools: the model calls the tool
on its own (``tool_choice`` auto), the agent runs it and sends the result back, and the model
answers. About 40 s on a 2-core CPU, most of it the engine's start.

After the tool has answered, a middleware sends ``tool_choice="none"``, as
examples/langchain_agent.py constrains its agent: a 0.5B model otherwise calls the tool again
with the result as the argument, round after round.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("langchain_openai")

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from inferscale_apps.bench.load import serve_app
    from inferscale_apps.server import create_app
    from inferscale_engine import InferScaleEngine

    # Closed at the module's end: vLLM keeps the first live engine's KV-connector worker in a
    # process global, so an engine left alive would break any engine built after it.
    with InferScaleEngine(model="qwen2.5-coder-0.5b", store_path=tmp_path_factory.mktemp("qwen-tools"),
                          device="cpu", recompute=0) as engine, \
            serve_app(create_app(engine, served_model_name="qwen", preload_memory=False)) as url:
        yield url


def test_create_agent_calls_a_tool_over_http(base: str) -> None:
    from langchain.agents import create_agent
    from langchain.agents.middleware import AgentMiddleware
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression such as '12 * 7' or '(3 + 4) / 2'."""
        def value(node: ast.AST) -> float:
            if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
                return node.value
            if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
                return _OPS[type(node.op)](value(node.left), value(node.right))
            raise ValueError("only numbers and + - * /")
        return f"{expression} = {value(ast.parse(expression, mode='eval').body):g}"

    class AnswerAfterTools(AgentMiddleware):
        def wrap_model_call(self, request: Any, handler: Any) -> Any:
            if isinstance(request.messages[-1], ToolMessage):
                request = request.override(tool_choice="none")
            return handler(request)

    llm = ChatOpenAI(model="qwen", base_url=base + "/v1", api_key="none", temperature=0, max_tokens=64, max_retries=0)
    agent = create_agent(llm, tools=[calculator], middleware=[AnswerAfterTools()],
                         system_prompt="You are a helpful assistant. Use the calculator for arithmetic.")
    messages = agent.invoke({"messages": [("user", "What is 1234 times 5678?")]})["messages"]

    call, result, answer = messages[1:]
    assert isinstance(call, AIMessage) and [c["name"] for c in call.tool_calls] == ["calculator"]
    assert call.response_metadata["finish_reason"] == "tool_calls"
    assert isinstance(result, ToolMessage) and result.tool_call_id == call.tool_calls[0]["id"]
    assert result.status == "success", result.content  # the model's arguments were a valid expression
    # The call and its result went back in OpenAI's format (how they are rendered is checked
    # token for token in test_server_tools.py); "none": nothing in the answer is read as a call.
    assert isinstance(answer, AIMessage) and not answer.tool_calls and answer.content
    assert answer.response_metadata["finish_reason"] in ("stop", "length")
