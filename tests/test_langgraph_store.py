"""``InferScaleStore`` against LangGraph's ``InMemoryStore``, then in a LangGraph agent on SmolLM2.

LangGraph ships no store conformance suite (``langgraph-checkpoint-conformance`` covers
checkpointers only), so the same scripts run on an ``InMemoryStore`` and on an
``InferScaleStore`` (``mode="text"``, same embedding model) and must give the same results:
items, values, order, scores. The store tests need no engine (a retrieval-only memory store);
the agent tests run SmolLM2.
"""

from __future__ import annotations

import ast
import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from langgraph.store.base import GetOp, InvalidNamespaceError, Item, PutOp, SearchItem, SearchOp
from langgraph.store.memory import InMemoryStore

from inferscale_engine.errors import ForgedHandleError
from inferscale_engine.handles import HANDLE_PATTERN
from inferscale_engine.memory import MemoryStore
from inferscale_engine.memory.text.embedder import Embedder
from inferscale_integrations.langgraph import InferScaleStore

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder()


@pytest.fixture
def memory(tmp_path: Path, embedder: Embedder) -> Iterator[MemoryStore]:
    store = MemoryStore(None, tmp_path / "store", embedder=embedder)  # retrieval only: no engine
    yield store
    store.close()


def reference(embedder: Embedder, fields: list[str] | None = None) -> InMemoryStore:
    return InMemoryStore(index={"dims": embedder.dim, "embed": lambda texts: embedder.embed(list(texts)).tolist(),
                                "fields": fields or ["text"]})


def norm(result: Any) -> Any:
    """A result in a comparable form (timestamps left out: InMemoryStore renews created_at on update)."""
    if isinstance(result, SearchItem):
        return (result.namespace, result.key, result.value, None if result.score is None else round(result.score, 3))
    if isinstance(result, Item):
        return (result.namespace, result.key, result.value)
    if isinstance(result, list):
        return [norm(r) for r in result]
    return result


A, B = ("alice", "memories"), ("bob", "memories")
PREFS = ("alice", "prefs")
SCRIPT: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("put", (A, "dog", {"text": "My dog is called Rex.", "kind": "pet", "n": 1}), {}),
    ("put", (A, "city", {"text": "I live in Lisbon.", "kind": "place", "n": 2}), {}),
    ("put", (A, "food", {"text": "I love grilled sardines.", "kind": "food", "n": 3, "tags": ["fish"],
                         "meta": {"src": "chat", "turn": 4}}), {}),
    ("put", (PREFS, "theme", {"theme": "dark", "font": {"size": 12}}), {}),
    ("put", (B, "pet", {"text": "Bob has a cat named Tom.", "kind": "pet", "n": 4}), {}),
    ("put", (A, "quiet", {"text": "I sleep late on Sundays.", "kind": "habit", "n": 5}), {"index": False}),
    ("get", (A, "dog"), {}),
    ("get", (A, "missing"), {}),
    ("get", (B, "dog"), {}),
    ("get", (PREFS, "theme"), {}),
    ("search", (("alice",),), {}),
    ("search", (("alice",),), {"limit": 2}),
    ("search", (("alice",),), {"offset": 1, "limit": 2}),
    ("search", ((),), {"filter": {"kind": "pet"}}),
    ("search", (A,), {"filter": {"n": {"$gte": 2}, "kind": {"$ne": "food"}}}),
    ("search", ((),), {"filter": {"meta": {"src": "chat"}}}),
    ("search", (("alice",),), {"query": "which animal do I own?"}),
    ("search", (("alice",),), {"query": "where do I live?", "limit": 2, "offset": 1}),
    ("search", (A,), {"query": "pets", "filter": {"kind": "pet"}}),
    ("search", ((),), {"query": "cat"}),
    ("list_namespaces", (), {}),
    ("list_namespaces", (), {"prefix": ("alice",)}),
    ("list_namespaces", (), {"suffix": ("memories",)}),
    ("list_namespaces", (), {"prefix": ("*", "memories")}),
    ("list_namespaces", (), {"max_depth": 1}),
    ("list_namespaces", (), {"limit": 1, "offset": 1}),
    ("put", (A, "dog", {"text": "My dog is called Max.", "kind": "pet", "n": 1}), {}),  # new text
    ("put", (A, "city", {"text": "I live in Lisbon.", "kind": "place", "n": 20, "extra": [1, 2]}), {}),  # new rest
    ("get", (A, "dog"), {}),
    ("get", (A, "city"), {}),
    ("search", (A,), {"query": "what is my dog's name?", "limit": 1}),
    ("delete", (A, "food"), {}),
    ("get", (A, "food"), {}),
    ("search", (("alice",),), {}),
    ("search", ((),), {"query": "fish", "filter": {"kind": "food"}}),
]


def run(store: Any, script: list[tuple[str, tuple[Any, ...], dict[str, Any]]], *, aio: bool) -> list[Any]:
    async def arun() -> list[Any]:
        return [norm(await getattr(store, f"a{name}")(*args, **kwargs)) for name, args, kwargs in script]

    if aio:
        return asyncio.run(arun())
    return [norm(getattr(store, name)(*args, **kwargs)) for name, args, kwargs in script]


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "async"])
def test_same_results_as_in_memory_store(memory: MemoryStore, embedder: Embedder, aio: bool) -> None:
    expected = run(reference(embedder), SCRIPT, aio=aio)
    got = run(InferScaleStore(memory_store=memory, mode="text", index={"fields": ["text"]}), SCRIPT, aio=aio)
    for step, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert have == want, f"step {step}: {SCRIPT[step][0]}{SCRIPT[step][1:]}"
    # The query steps did rank by meaning (not just insertion order): the dog first, with a score.
    dog_search = got[16]
    assert dog_search[0][1] == "dog" and dog_search[0][3] > dog_search[1][3]


def test_batch_reads_the_state_before_its_puts(memory: MemoryStore, embedder: Embedder) -> None:
    ns = ("carol", "notes")
    ops = [
        PutOp(ns, "k", {"text": "first"}),
        GetOp(ns, "k"),
        SearchOp(ns),
        PutOp(ns, "k", {"text": "second"}),
        PutOp(ns, "j", {"text": "other"}),
        PutOp(ns, "j", None),
    ]
    ours, ref = InferScaleStore(memory_store=memory, mode="text"), reference(embedder)
    assert norm(ours.batch(ops)) == norm(ref.batch(ops)) == [None, None, [], None, None, None]
    assert norm(ours.get(ns, "k")) == norm(ref.get(ns, "k")) == (ns, "k", {"text": "second"})
    assert ours.get(ns, "j") is None
    assert norm(asyncio.run(ours.abatch([GetOp(ns, "k")]))) == [(ns, "k", {"text": "second"})]


def test_values_read_back_as_handles_and_round_trip(memory: MemoryStore) -> None:
    store = InferScaleStore(memory_store=memory)  # mode="handles"
    value = {"content": "My dog is called Rex.", "tags": ["pet"], "nested": {"a": 1}}
    store.put(A, "dog", value)
    store.put(A, "prefs", {"theme": "dark"})
    item = store.get(A, "dog")
    assert item is not None and HANDLE_PATTERN.fullmatch(item.value["content"])
    assert {k: v for k, v in item.value.items() if k != "content"} == {"tags": ["pet"], "nested": {"a": 1}}
    # The handle is the fact's, for the namespace's user.
    (fact,) = [f for f in memory.get_all(user_id="alice") if f.handle == item.value["content"]]
    assert fact.memory == "My dog is called Rex."
    # A value without a text field is stored as its JSON, and its handle is added.
    hit = store.search(A, query="theme")[0]
    assert hit.key == "prefs" and hit.value["theme"] == "dark" and HANDLE_PATTERN.fullmatch(hit.value["handle"])
    # Read-modify-write: the handle written back is stored as the text it stands for, not as a handle.
    item.value["tags"].append("dog")
    store.put(A, "dog", item.value)
    text_view = InferScaleStore(memory_store=memory, mode="text")
    assert text_view.get(A, "dog").value == {**value, "tags": ["pet", "dog"]}
    assert len(memory.get_all(user_id="alice")) == 2  # updated in place, not duplicated
    assert store.get(A, "dog").value["content"] == item.value["content"]  # same fact, same handle


def test_namespaces_are_users_and_handles_do_not_cross(memory: MemoryStore) -> None:
    store = InferScaleStore(memory_store=memory)
    store.put(("alice", "memories"), "dog", {"text": "My dog is called Rex."})
    store.put(("alice", "work"), "dog", {"text": "The office dog is Bolt."})  # same key, other namespace
    handle = store.get(("alice", "memories"), "dog").value["text"]
    assert {f.memory for f in memory.get_all(user_id="alice")} == {"My dog is called Rex.", "The office dog is Bolt."}
    assert memory.get_all(user_id="bob") == []
    with pytest.raises(ForgedHandleError):  # bob cannot write (and so read) alice's handle
        store.put(("bob", "memories"), "stolen", {"text": handle})
    tail = InferScaleStore(memory_store=memory, user_index=-1)
    tail.put(("memories", "dave"), "city", {"text": "I live in Porto."})
    assert [f.memory for f in memory.get_all(user_id="dave")] == ["I live in Porto."]
    assert tail.search(("memories",), query="city")[0].namespace == ("memories", "dave")
    with pytest.raises(InvalidNamespaceError, match="user_index"):
        InferScaleStore(memory_store=memory, user_index=2).put(("x", "y"), "k", {"text": "t"})
    with pytest.raises(NotImplementedError):
        store.put(A, "k", {"text": "t"}, ttl=5)


def test_emptied_namespace_is_not_listed(memory: MemoryStore) -> None:
    """A deliberate difference: InMemoryStore keeps listing a namespace whose items were all
    deleted; this store lists namespaces that hold items, as LangGraph's database stores do."""
    store = InferScaleStore(memory_store=memory)
    store.put(("erin", "a"), "k", {"text": "one"})
    store.put(("erin", "b"), "k", {"text": "two"})
    store.delete(("erin", "a"), "k")
    assert store.list_namespaces(prefix=("erin",)) == [("erin", "b")]


def test_items_persist_across_processes(tmp_path: Path) -> None:
    """A process puts items and exits; a fresh one finds them, by key and by meaning."""
    code = (
        "import sys; from inferscale_engine.memory import MemoryStore; "
        "from inferscale_integrations.langgraph import InferScaleStore; "
        "m = MemoryStore(None, sys.argv[1]); s = InferScaleStore(memory_store=m, mode='text'); "
        "{body}; m.close()"
    )
    path = str(tmp_path / "store")
    put = ("s.put(('fay', 'memories'), 'dog', {'text': 'My dog is called Rex.', 'n': 1}); "
           "s.put(('fay', 'memories'), 'city', {'text': 'I live in Lisbon.', 'n': 2})")
    get = ("print(s.get(('fay', 'memories'), 'dog').value); "
           "print(s.search(('fay',), query='where do I live?', limit=1)[0].key); "
           "s.put(('fay', 'memories'), 'dog', {'text': 'My dog is called Max.'}); "
           "print(len(m.get_all(user_id='fay')))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", code.format(body=put), path], check=True, env=env, timeout=300)
    out = subprocess.run([sys.executable, "-c", code.format(body=get), path], check=True, env=env, timeout=300,
                         capture_output=True, text=True).stdout.splitlines()
    assert [ast.literal_eval(out[0]), *out[1:]] == [{"text": "My dog is called Rex.", "n": 1}, "city", "2"]


# ------------------------------------------------------------------------------------ on SmolLM2


def handles_in(text: str) -> list[str]:
    return [m.group(0) for m in HANDLE_PATTERN.finditer(text)]


@pytest.fixture(scope="module")
def engine(smollm2_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    # One engine per module, closed at the end: vLLM keeps the first live engine's KV-connector
    # worker in a process global, so an engine left alive would break any engine built after it.
    from inferscale_integrations import get_engine

    eng = get_engine("smollm2", store_path=tmp_path_factory.mktemp("lg-store"), recompute=0)
    yield eng
    eng.close()


@pytest.mark.slow
def test_langgraph_agent_gets_injected_memories(engine: Any) -> None:
    """The stock LangGraph memory node, unchanged but for the store and model classes: the
    memories it pastes from ``item.value["text"]`` reach the model as injected KV."""
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.runtime import Runtime

    from inferscale_integrations.langchain import ChatInferScale

    user = f"u-{uuid.uuid4().hex[:8]}"
    store = InferScaleStore(engine=engine)
    llm = ChatInferScale(engine=engine, user_id=user, max_tokens=16)
    for key, text in [("dog", "My dog is called Rex."), ("city", "I live in Lisbon."), ("job", "I am a nurse.")]:
        store.put((user, "memories"), key, {"text": text})
    prompts: list[str] = []

    def call_model(state: MessagesState, runtime: Runtime) -> dict[str, Any]:
        memories = runtime.store.search((user, "memories"), query=state["messages"][-1].text, limit=1)
        system = "What you know about the user:\n" + "\n".join(m.value["text"] for m in memories)
        prompts.append(system)
        return {"messages": [llm.invoke([{"role": "system", "content": system}, *state["messages"]])]}

    graph = StateGraph(MessagesState).add_node("call_model", call_model).add_edge(START, "call_model")
    app = graph.compile(store=store)
    state = app.invoke({"messages": [{"role": "user", "content": "What is my dog's name?"}]})
    (handle,) = handles_in(prompts[-1])
    assert engine.memory.resolve(handle, user).text == "My dog is called Rex."  # retrieval found the dog
    usage = state["messages"][-1].usage_metadata
    assert usage["input_token_details"]["injected"] >= len(engine.tokenize("My dog is called Rex."))
    assert usage["input_token_details"]["injected"] < usage["input_tokens"]


@pytest.mark.slow
def test_example_langgraph_store(engine: Any) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from probes import Recorder
    from test_examples import load

    example = load("langgraph_store")
    with Recorder(engine) as rec:
        answers = example.main(engine, example.DEMO)
    assert len(answers) == 2
    assert rec.handles_seen >= 2 and rec.injected > 0
    # Each question's prompt held the handles of the facts retrieved for it, the right one among them.
    first, second = (handles_in(p) for p in rec.prompts)
    user = next(u for u in engine.memory.user_ids() if u.startswith("user-"))
    assert "my dog's name is rex." in [engine.memory.resolve(h, user).text.lower() for h in first]
    assert "i live in lisbon." in [engine.memory.resolve(h, user).text.lower() for h in second]
