"""A LlamaIndex chat engine whose memory is injected as KV: ``SimpleChatEngine``, unchanged.

The stock recipe is ``SimpleChatEngine.from_defaults(llm=..., memory=ChatMemoryBuffer...)``;
here the memory is ``InferScaleMemory`` (the line marked ★): every turn is stored as memory
facts, and each new message gets the relevant and recent turns as handles whose KV the engine
injects. ``--condense`` runs ``CondensePlusContextChatEngine`` instead, with
``InferScaleRetriever`` as its retriever: memory both as chat history and as retrieved context.

Run:
    python examples/llamaindex_chat.py --demo
    python examples/llamaindex_chat.py              # chat on the terminal
"""

from __future__ import annotations

import argparse
import uuid
from typing import Any

from llama_index.core.chat_engine import CondensePlusContextChatEngine, SimpleChatEngine

from inferscale_integrations import get_engine
from inferscale_integrations.llamaindex import (
    InferScaleLLM,
    InferScaleMemory,
    InferScaleRetriever,
)

MODEL = "qwen2.5-coder-0.5b"
SYSTEM = (
    "You are a friendly assistant with a good memory. The earlier conversation with the user "
    "comes first; use it to answer the user's questions about themselves in a few words."
)
DEMO = [
    "Hi! My dog's name is Rex.",
    "I live in Lisbon and work as a nurse.",
    "My favourite colour is green.",
    "Yesterday I went for a long walk by the river.",
    "I am learning to play the guitar.",
    "What is my dog's name?",
]


def build(engine: Any, user_id: str, *, condense: bool = False) -> Any:
    llm = InferScaleLLM(engine=engine, user_id=user_id, max_tokens=40)
    # memory = ChatMemoryBuffer.from_defaults(token_limit=3000)                # the classic bot
    memory = InferScaleMemory.from_defaults(engine=engine, user_id=user_id)  # ★
    if condense:
        retriever = InferScaleRetriever(engine=engine, user_id=user_id, similarity_top_k=2)
        return CondensePlusContextChatEngine.from_defaults(
            retriever, llm=llm, memory=memory, system_prompt=SYSTEM, skip_condense=True
        )
    return SimpleChatEngine.from_defaults(llm=llm, memory=memory, system_prompt=SYSTEM)


def main(engine: Any = None, scripted: list[str] | None = None, *, condense: bool = False) -> list[str]:
    """Chat (on the terminal, or through ``scripted`` lines); returns the bot's answers."""
    engine = engine or get_engine(MODEL)
    chat = build(engine, f"user-{uuid.uuid4().hex[:8]}", condense=condense)
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
        answer = str(chat.chat(text)).strip()
        answers.append(answer)
        print(f"bot> {answer}")
    return answers


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", action="store_true", help="run a scripted conversation")
    parser.add_argument("--condense", action="store_true", help="CondensePlusContextChatEngine + retriever")
    args = parser.parse_args()
    main(scripted=DEMO if args.demo else None, condense=args.condense)
