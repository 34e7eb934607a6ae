"""A LangChain chatbot that remembers, with its memory injected as KV instead of prefilled.

This is the classic langchain-classic bot, ``ConversationChain`` + ``ConversationBufferMemory``,
with one change: the memory class (the line marked ★). ``ConversationBufferMemory`` pastes the
whole conversation into every prompt; ``InferScaleMemory`` stores each turn as memory facts
and puts the handles of the relevant and recent turns in the prompt, and the InferScale engine
injects their precomputed KV.

The LCEL flavour (``--lcel``) is ``RunnableWithMessageHistory`` where, likewise, the only change
is the history class (``InMemoryChatMessageHistory`` → ``InferScaleChatMessageHistory``).

Run:
    python examples/langchain_chatbot.py            # chat on the terminal (Qwen2.5-Coder-0.5B on the CPU)
    python examples/langchain_chatbot.py --demo     # a scripted conversation
    python examples/langchain_chatbot.py --lcel --demo
"""

from __future__ import annotations

import argparse
import uuid
import warnings
from typing import Any

from langchain_classic.chains import ConversationChain
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.runnables.history import RunnableWithMessageHistory

from inferscale_integrations.langchain import (
    ChatInferScale,
    InferScaleChatMessageHistory,
    InferScaleMemory,
)

warnings.filterwarnings("ignore", message=".*was deprecated.*")  # ConversationChain is a classic API

MODEL = "qwen2.5-coder-0.5b"
SYSTEM = (
    "You are a friendly assistant with a good memory. The earlier conversation with the user "
    "comes first; use it to answer the user's questions about themselves in a few words."
)
PROMPT = ChatPromptTemplate.from_messages(
    [("system", SYSTEM), MessagesPlaceholder("history"), ("human", "{input}")]
)
DEMO = [
    "Hi! My dog's name is Rex.",
    "I live in Lisbon and work as a nurse.",
    "My favourite colour is green.",
    "Yesterday I went for a long walk by the river.",
    "I am learning to play the guitar.",
    "What is my dog's name?",
]


def build_chain(engine: Any = None, user_id: str = "demo-user") -> ConversationChain:
    llm = ChatInferScale(engine=engine, model=MODEL, user_id=user_id, max_tokens=40)
    # memory = ConversationBufferMemory(return_messages=True)              # the classic bot
    memory = InferScaleMemory(engine=engine, model=MODEL, user_id=user_id, return_messages=True)  # ★
    return ConversationChain(llm=llm, memory=memory, prompt=PROMPT)


def build_lcel(engine: Any = None, user_id: str = "demo-user") -> RunnableWithMessageHistory:
    llm = ChatInferScale(engine=engine, model=MODEL, user_id=user_id, max_tokens=40)

    def history(session_id: str) -> InferScaleChatMessageHistory:
        # return InMemoryChatMessageHistory()                              # the classic bot
        return InferScaleChatMessageHistory(user_id, session_id, engine=engine, model=MODEL, recent_turns=6)  # ★

    return RunnableWithMessageHistory(
        PROMPT | llm, history, input_messages_key="input", history_messages_key="history"
    )


def main(engine: Any = None, scripted: list[str] | None = None, *, lcel: bool = False) -> list[str]:
    """Chat (on the terminal, or through ``scripted`` lines); returns the bot's answers."""
    user_id = f"user-{uuid.uuid4().hex[:8]}"  # a fresh user: earlier runs' memories stay out
    answers: list[str] = []
    if lcel:
        bot = build_lcel(engine, user_id)

        def reply(text: str) -> str:
            config = {"configurable": {"session_id": "chat"}}
            return bot.invoke({"input": text}, config=config).text
    else:
        chain = build_chain(engine, user_id)

        def reply(text: str) -> str:
            return chain.invoke({"input": text})["response"]

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
        answer = reply(text).strip()
        answers.append(answer)
        print(f"bot> {answer}")
    return answers


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", action="store_true", help="run a scripted conversation")
    parser.add_argument("--lcel", action="store_true", help="RunnableWithMessageHistory instead of ConversationChain")
    args = parser.parse_args()
    main(scripted=DEMO if args.demo else None, lcel=args.lcel)
