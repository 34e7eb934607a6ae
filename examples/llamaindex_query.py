"""Ask questions about a user's memories with LlamaIndex's ``RetrieverQueryEngine``, unchanged.

``InferScaleRetriever`` returns the user's most relevant memories as nodes whose text is the
fact's handle; ``RetrieverQueryEngine`` builds its usual prompt around them and
``InferScaleLLM`` injects the facts' KV in place of the handles (no prefill for the context).

Run:
    python examples/llamaindex_query.py --demo   # remember a few facts, then ask about them
    python examples/llamaindex_query.py          # type facts to remember; a line ending in '?' is a question
"""

from __future__ import annotations

import argparse
import uuid
from typing import Any

from llama_index.core.query_engine import RetrieverQueryEngine

from inferscale_integrations import get_engine
from inferscale_integrations.llamaindex import InferScaleLLM, InferScaleRetriever

MODEL = "qwen2.5-coder-0.5b"
DEMO = [
    "My dog's name is Rex.",
    "I live in Lisbon.",
    "I work as a nurse at the city hospital.",
    "My favourite food is grilled sardines.",
    "My sister Ana lives in Porto.",
    "I play the guitar on Sundays.",
    "What is my dog's name?",
    "Which city do I live in?",
]


def build(engine: Any, user_id: str) -> RetrieverQueryEngine:
    retriever = InferScaleRetriever(engine=engine, user_id=user_id, similarity_top_k=2)
    llm = InferScaleLLM(engine=engine, user_id=user_id, max_tokens=32)
    return RetrieverQueryEngine.from_args(retriever, llm=llm)


def main(engine: Any = None, scripted: list[str] | None = None) -> list[str]:
    """Lines ending in '?' are questions (answered); others are remembered. Returns the answers."""
    engine = engine or get_engine(MODEL)
    user_id = f"user-{uuid.uuid4().hex[:8]}"
    query_engine = build(engine, user_id)
    answers: list[str] = []
    lines = iter(scripted) if scripted is not None else None
    while True:
        if lines is not None:
            text = next(lines, None)
            if text is None:
                break
        else:
            try:
                text = input("fact or question> ").strip()
            except EOFError:
                break
            if text in ("", "quit", "exit"):
                break
        if text.endswith("?"):
            answer = str(query_engine.query(text)).strip()
            answers.append(answer)
            print(f"Q: {text}\nA: {answer}")
        else:
            engine.memory.add(text, user_id=user_id)
            print(f"remembered: {text}")
    return answers


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", action="store_true", help="run a scripted session")
    args = parser.parse_args()
    main(scripted=DEMO if args.demo else None)
