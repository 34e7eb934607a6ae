"""A LangGraph agent with long-term memory in a store, its memories injected as KV.

This is LangGraph's stock long-term-memory recipe: a ``StateGraph`` compiled with
``store=``, whose model node searches the user's namespace for memories relevant to the new
message, puts them in the system prompt, and saves what the user asks it to remember. Two
lines change (marked ★): the store (``InMemoryStore`` → ``InferScaleStore``) and the model
(→ ``ChatInferScale``). The agent's code is the same: it pastes ``memory.value["text"]`` into
the prompt; with ``InferScaleStore`` that field reads back as the fact's handle, and the
engine injects the fact's precomputed KV in its place (no prefill).

Each turn is a new thread (no checkpointer): what the agent knows of the user comes from the
store alone, across threads and runs.

Run:
    python examples/langgraph_store.py --demo    # remember a few facts, then ask about them
    python examples/langgraph_store.py           # chat; "remember ..." lines are stored
"""

from __future__ import annotations

import argparse
import uuid
from dataclasses import dataclass
from typing import Any

from langgraph.graph import START, MessagesState, StateGraph
from langgraph.runtime import Runtime

from inferscale_integrations.langchain import ChatInferScale
from inferscale_integrations.langgraph import InferScaleStore

MODEL = "smollm2"
DEMO = [
    "Remember: my dog's name is Rex.",
    "Remember: I live in Lisbon.",
    "Remember: I work as a nurse at the city hospital.",
    "Remember: my favourite food is grilled sardines.",
    "What is my dog's name?",
    "Which city do I live in?",
]


@dataclass
class Context:
    user_id: str


def build(engine: Any = None) -> Any:
    """The agent graph, compiled with its store."""
    # store = InMemoryStore(index={"embed": embeddings, "dims": 1536})  # the stock recipe
    store = InferScaleStore(engine=engine, model=MODEL)  # ★ the store

    def call_model(state: MessagesState, runtime: Runtime[Context]) -> dict[str, Any]:
        user_id = runtime.context.user_id
        namespace = (user_id, "memories")
        last = state["messages"][-1].text
        if last.lower().startswith("remember"):
            fact = last.split(":", 1)[-1].strip()
            runtime.store.put(namespace, uuid.uuid4().hex, {"text": fact})
            return {"messages": [{"role": "assistant", "content": "Noted."}]}
        memories = runtime.store.search(namespace, query=last, limit=2)
        info = "\n".join(m.value["text"] for m in memories)
        system = f"You are a helpful assistant. What you know about the user:\n{info}\nAnswer in a few words."
        llm = ChatInferScale(engine=engine, model=MODEL, user_id=user_id, max_tokens=32)  # ★ the model
        reply = llm.invoke([{"role": "system", "content": system}, *state["messages"]])
        return {"messages": [reply]}

    builder = StateGraph(MessagesState, context_schema=Context)
    builder.add_node("call_model", call_model)
    builder.add_edge(START, "call_model")
    return builder.compile(store=store)


def main(engine: Any = None, scripted: list[str] | None = None) -> list[str]:
    """Talk to the agent; returns its answers to questions (lines not starting with 'remember')."""
    graph = build(engine)
    context = Context(user_id=f"user-{uuid.uuid4().hex[:8]}")
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
        state = graph.invoke({"messages": [{"role": "user", "content": text}]}, context=context)
        reply = state["messages"][-1]
        injected = (reply.usage_metadata or {}).get("input_token_details", {}).get("injected", 0)
        if text.lower().startswith("remember"):
            print(f"agent> {reply.text.strip()}")
            continue
        answers.append(reply.text.strip())
        print(f"agent> {reply.text.strip()}   [memory tokens injected: {injected}]")
    return answers


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", action="store_true", help="run a scripted session")
    args = parser.parse_args()
    main(scripted=DEMO if args.demo else None)
