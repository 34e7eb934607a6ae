"""``InferScaleChatMessageHistory`` across sessions and processes, on SmolLM2.

Session A of a user talks and the process exits; a fresh process opens session B of the same
user with ``earlier_turns`` and gets A's turns as handles, which ``RunnableWithMessageHistory``
sends to ``ChatInferScale`` and the engine injects. The default (the session alone) and another
user see none of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent

SESSION_A = """
import sys
from langchain_core.messages import AIMessage, HumanMessage
from inferscale_integrations import get_engine
from inferscale_integrations.langchain import InferScaleChatMessageHistory

engine = get_engine("smollm2", store_path=sys.argv[1], recompute=0)
history = InferScaleChatMessageHistory("alice", "session-a", engine=engine)
history.add_messages([HumanMessage("My dog is called Rex."), AIMessage("Rex is a lovely name.")])
history.add_messages([HumanMessage("I live in Lisbon."), AIMessage("Lisbon is sunny.")])
engine.memory.wait_for_encoding()
"""

SESSION_B = """
import json, sys
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.runnables.history import RunnableWithMessageHistory
from inferscale_integrations import expand_handles, get_engine
from inferscale_integrations.langchain import ChatInferScale, InferScaleChatMessageHistory

engine = get_engine("smollm2", store_path=sys.argv[1], recompute=0)
texts = lambda history, user: [expand_handles(m.content, store=engine.memory, user_id=user) for m in history.messages]
out = {
    "b": texts(InferScaleChatMessageHistory("alice", "session-b", engine=engine, earlier_turns=4), "alice"),
    "b_types": [m.type for m in InferScaleChatMessageHistory("alice", "session-b", engine=engine, earlier_turns=4).messages],
    "b_last": texts(InferScaleChatMessageHistory("alice", "session-b", engine=engine, earlier_turns=1), "alice"),
    "default": texts(InferScaleChatMessageHistory("alice", "session-c", engine=engine), "alice"),
    "bob": texts(InferScaleChatMessageHistory("bob", "session-b", engine=engine, earlier_turns=4), "bob"),
}
prompt = ChatPromptTemplate.from_messages([("system", "Answer briefly."), MessagesPlaceholder("history"), ("human", "{q}")])
chain = RunnableWithMessageHistory(
    prompt | ChatInferScale(engine=engine, user_id="alice", max_tokens=8),
    lambda session_id: InferScaleChatMessageHistory("alice", session_id, engine=engine, earlier_turns=4),
    input_messages_key="q",
    history_messages_key="history",
)
reply = chain.invoke({"q": "What is my dog called?"}, config={"configurable": {"session_id": "session-b"}})
out["injected"] = reply.usage_metadata["input_token_details"]["injected"]
out["b_after"] = len(InferScaleChatMessageHistory("alice", "session-b", engine=engine).messages)
print("RESULT " + json.dumps(out))
"""


def _run(code: str, path: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_new_session_recalls_earlier_sessions_after_a_restart(tmp_path: Path, smollm2_path: str) -> None:
    store = tmp_path / "store"
    _run(SESSION_A, store)  # the process exits: only the store on disk carries the turns over
    (line,) = [x for x in _run(SESSION_B, store).splitlines() if x.startswith("RESULT ")]
    out = json.loads(line.removeprefix("RESULT "))
    turns = ["My dog is called Rex.", "Rex is a lovely name.", "I live in Lisbon.", "Lisbon is sunny."]
    assert out["b"] == turns  # session A's turns, as handles that expand to their text
    assert out["b_types"] == ["human", "ai", "human", "ai"]
    assert out["b_last"] == turns[2:]
    assert out["default"] == []  # the default: a session is its own transcript
    assert out["bob"] == []  # another user never sees them
    assert out["injected"] > 0  # the earlier session's turns reached the model as injected KV
    assert out["b_after"] == 2  # the new turn was stored in session B
