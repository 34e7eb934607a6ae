"""LangChain agents with local tools whose conversation memory is injected as KV.

Two agents, each the stock recipe with one swap (the lines marked ★):

* ``classic``: langchain-classic's tool-calling ``AgentExecutor`` with ``memory=``. The classic
  recipe uses ``ConversationBufferMemory(memory_key="chat_history", return_messages=True)``; here
  it is ``InferScaleMemory`` with the same arguments, so ``chat_history`` holds handles, not text.
* ``graph``: LangChain v1 ``create_agent`` (a LangGraph graph). Memory is middleware there;
  adding ``InferScaleMemoryMiddleware`` stores each finished turn and gives the model the
  recalled turns as handles. The chat model is ``ChatInferScale`` (handles need an InferScale
  model), with native tool calling: Qwen2.5's chat template renders the tools and the model's
  ``<tool_call>`` answers become ``tool_calls``.

The model is Qwen2.5-Coder-0.5B-Instruct (SmolLM2-135M cannot drive tools). A 0.5B model needs
help to finish: each tool answers in a sentence that restates the question ("12 * 7 = 84"),
not a bare value, which it would otherwise take for a new call's arguments; the classic agent
returns that sentence as its answer (``return_direct``), and guided decoding keeps the
create_agent agent to one tool round per turn and an answer in words after it. The
``injected`` count printed after each answer shows the memory reached the model as KV.

Run:
    python examples/langchain_agent.py --demo              # both agents, scripted
    python examples/langchain_agent.py --agent graph       # chat with the create_agent agent
"""

from __future__ import annotations

import argparse
import ast
import datetime as _dt
import operator
import uuid
import warnings
from typing import Any

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.tools import tool

from inferscale_integrations.langchain import ChatInferScale, InferScaleMemory

warnings.filterwarnings("ignore", message=".*was deprecated.*")  # AgentExecutor is a classic API

MODEL = "qwen2.5-coder-0.5b"
DEMO = [
    "My dog's name is Rex.",
    "What is 1234 times 5678?",
    "I live in Lisbon.",
    "What is my dog's name?",
]


_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _arith(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _arith(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arith(node.left), _arith(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arith(node.operand))
    raise ValueError("only numbers and + - * / ( ) are allowed")


#: Every tool call of this process, as ``"name(argument) -> result"`` (the tests read it).
TOOL_LOG: list[str] = []


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as '12 * 7' or '(3 + 4) / 2'."""
    try:
        value = _arith(ast.parse(expression, mode="eval"))
        result = f"{expression} = {int(value) if float(value).is_integer() else value}"
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:  # reported to the agent, not raised
        result = f"error: {exc}"
    TOOL_LOG.append(f"calculator({expression!r}) -> {result}")
    return result


@tool
def today() -> str:
    """Today's date, as YYYY-MM-DD."""
    result = f"Today is {_dt.date.today().isoformat()}."
    TOOL_LOG.append(f"today() -> {result}")
    return result


TOOLS = [calculator, today]


class InjectionCounter(BaseCallbackHandler):
    """Adds up the memory tokens the engine injected in this agent's model calls."""

    def __init__(self) -> None:
        self.injected = 0

    def on_llm_end(self, response: Any, **kwargs: Any) -> None:
        for gens in response.generations:
            for gen in gens:
                meta = getattr(getattr(gen, "message", None), "response_metadata", None) or {}
                self.injected += int(meta.get("injected_tokens", 0) or 0)


# ------------------------------------------------------------------------------ classic agent

SYSTEM = (
    "You are a friendly assistant with a good memory. Reply in one short sentence. Call a tool only "
    "when the user asks for arithmetic or for today's date. Once a tool has answered, reply to the "
    "user with its result."
)


def build_classic(engine: Any = None, user_id: str = "demo-user") -> Any:
    from langchain_classic.agents import AgentExecutor, create_tool_calling_agent
    from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder

    prompt = ChatPromptTemplate.from_messages([
        ("system", SYSTEM),
        MessagesPlaceholder("chat_history"),
        ("human", "{input}"),
        MessagesPlaceholder("agent_scratchpad"),
    ])
    llm = ChatInferScale(engine=engine, model=MODEL, user_id=user_id, max_tokens=64)
    agent = create_tool_calling_agent(llm, TOOLS, prompt)
    # memory = ConversationBufferMemory(memory_key="chat_history", return_messages=True)  # classic
    memory = InferScaleMemory(engine=engine, model=MODEL, user_id=user_id,  # ★
                              memory_key="chat_history", return_messages=True)
    # return_direct: each tool's sentence is the turn's answer. Left to read it back, a 0.5B model
    # calls the tool again with the result as the argument until the iteration limit.
    tools = [t.model_copy(update={"return_direct": True}) for t in TOOLS]
    return AgentExecutor(agent=agent, tools=tools, memory=memory, max_iterations=3)


# ------------------------------------------------------------------------------ create_agent

#: The reply after tools (guided decoding): one line of words that starts by giving the answer,
#: so neither another call nor a bare "Yes".
IN_WORDS = {"regex": r"The answer is [^{}<>\n]+"}


def answer_after_tools() -> Any:
    """Middleware: once the tools have answered, the next model call replies in words: its answer
    is constrained to a line of text (guided decoding), so no further call. One round of tools
    per turn, which is what a 0.5B model can do: left alone, it calls the tool again with the
    result as the argument, or writes the call out as text."""
    from langchain.agents.middleware import AgentMiddleware
    from langchain_core.messages import ToolMessage

    class AnswerAfterTools(AgentMiddleware):
        def wrap_model_call(self, request: Any, handler: Any) -> Any:
            if request.messages and isinstance(request.messages[-1], ToolMessage):
                settings = {**request.model_settings, "structured": IN_WORDS}
                request = request.override(model_settings=settings)
            return handler(request)

    return AnswerAfterTools()


def build_graph(engine: Any = None, user_id: str = "demo-user") -> Any:
    from langchain.agents import create_agent

    from inferscale_integrations.langchain import InferScaleMemoryMiddleware

    llm = ChatInferScale(engine=engine, model=MODEL, user_id=user_id, max_tokens=64)  # ★ the model
    return create_agent(
        llm,
        tools=TOOLS,
        system_prompt=SYSTEM,
        middleware=[
            InferScaleMemoryMiddleware(engine=engine, model=MODEL, user_id=user_id),  # ★ memory
            answer_after_tools(),
        ],
    )


def main(engine: Any = None, scripted: list[str] | None = None, *, agent: str = "both") -> list[str]:
    """Talk to the agent(s); returns the answers (both agents' answers interleaved for 'both')."""
    kinds = ["classic", "graph"] if agent == "both" else [agent]
    bots = {}
    for kind in kinds:
        user_id = f"{kind}-{uuid.uuid4().hex[:8]}"
        bots[kind] = build_classic(engine, user_id) if kind == "classic" else build_graph(engine, user_id)
    answers: list[str] = []
    lines = iter(scripted) if scripted is not None else None
    while True:
        if lines is not None:
            text = next(lines, None)
            if text is None:
                break
            print(f"you> {text}")
        else:
            try:
                text = input("you> ").strip()
            except EOFError:
                break
            if text in ("", "quit", "exit"):
                break
        for kind, bot in bots.items():
            counter = InjectionCounter()
            config = {"callbacks": [counter], "recursion_limit": 8}
            if kind == "classic":
                answer = bot.invoke({"input": text}, config=config)["output"]
            else:
                from langgraph.errors import GraphRecursionError

                try:
                    state = bot.invoke({"messages": [{"role": "user", "content": text}]}, config=config)
                    answer = state["messages"][-1].text
                except GraphRecursionError:  # a small model can call tools in circles
                    answer = "(agent stopped: too many steps)"
            answer = answer.strip()
            answers.append(answer)
            print(f"{kind}> {answer}   [memory tokens injected: {counter.injected}]")
    return answers


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", action="store_true", help="run a scripted conversation")
    parser.add_argument("--agent", choices=["classic", "graph", "both"], default="both")
    args = parser.parse_args()
    main(scripted=DEMO if args.demo else None, agent=args.agent)
