"""Adversarial isolation: user B must never get anything of user A's memory.

Through the library (engine + store), the LangChain and LlamaIndex classes, and the HTTP server
(real uvicorn on a loopback port), B tries A's handles, altered and forged handles, A's fact ids
on every memory endpoint, and searches for A's secret. Every prompt the engine builds is
recorded (``PromptSpy``): no prompt of B may contain A's fact token ids, while A's own prompts
do (the positive control that shows the check can fail). The prefix cache is checked too:
injected KV of one user never serves another user's or a plain request.

One tiny-Llama engine for the module (one engine per process), closed at the end.
"""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, Self

import httpx
import pytest

from inferscale_engine.errors import (
    FactNotFoundError,
    ForgedHandleError,
    MalformedHandleError,
)
from inferscale_engine.handles import HandleCodec
from inferscale_engine.testing import prepared, watching_prepare

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

API_KEY = "isolation-key"
SECRET = "Alice's vault code is 7419 and her passphrase is purple giraffe lantern."
LONG_TEXT = "You are a careful assistant who answers briefly. " * 40  # > 1 prefix-cache block


def uid(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def engine(tiny_llama, tmp_path_factory):
    from inferscale_engine import InferScaleEngine

    eng = InferScaleEngine(model=tiny_llama, store_path=tmp_path_factory.mktemp("iso-store"),
                           device="cpu", dtype="float32", max_model_len=1024, recompute=0)
    yield eng
    from inferscale_integrations.testing import forget_engines

    forget_engines()
    eng.close()


@pytest.fixture(scope="module")
def people(engine):
    """A with a secret, B with facts of its own (some about the same topics)."""
    store = engine.memory
    a, b = uid("alice"), uid("bob")
    a_items = store.add(SECRET, user_id=a) + store.add("Alice's dog is called Rex.", user_id=a)
    b_items = store.add("Bob's vault has no code.", user_id=b) + store.add("Bob's dog is called Bruno.", user_id=b)
    store.wait_for_encoding(60)
    secret_ids = list(store.resolve(a_items[0].handle, a).token_ids)
    return {"a": a, "b": b, "a_items": a_items, "b_items": b_items, "secret_ids": secret_ids}


@pytest.fixture(scope="module")
def server(engine, people):
    from inferscale_apps.bench.load import serve_app
    from inferscale_apps.server import create_app

    app = create_app(engine, served_model_name="tiny", api_key=API_KEY)
    with serve_app(app) as url:
        yield url


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


class PromptSpy:
    """Records ``(user_id, prompt token ids)`` of every request the engine prepares, and counts
    what is submitted to vLLM (a refused request must reach neither)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.prompts: list[tuple[str, list[int]]] = []
        self.submitted = 0

    def __enter__(self) -> Self:
        eng = self.engine
        submit = eng.loop.submit

        def spy_submit(*args: Any, **kw: Any) -> Any:
            self.submitted += 1
            return submit(*args, **kw)

        self.watching = watching_prepare(eng, lambda user_id, request: self.prompts.append(
            (user_id, request.prompt_token_ids)))
        self.watching.__enter__()
        eng.loop.submit = spy_submit
        return self

    def __exit__(self, *exc: object) -> None:
        self.watching.__exit__(None, None, None)
        self.engine.loop.__dict__.pop("submit", None)

    def of(self, user: str) -> list[list[int]]:
        return [ids for u, ids in self.prompts if u == user]


def contains(haystack: Sequence[int], needle: Sequence[int]) -> bool:
    n = len(needle)
    return any(list(haystack[i : i + n]) == list(needle) for i in range(len(haystack) - n + 1))


def assert_clean(engine: Any, spy: PromptSpy, people: dict[str, Any]) -> None:
    """No prompt of B holds A's fact tokens, nor A's secret as text."""
    b_prompts = spy.of(people["b"])
    assert b_prompts, "B made no request: the check would be vacuous"
    for ids in b_prompts:
        assert not contains(ids, people["secret_ids"])
        assert "purple giraffe" not in engine.detokenize(ids) and "7419" not in engine.detokenize(ids)


@contextmanager
def refused(spy: PromptSpy, exc: type[BaseException] = ForgedHandleError) -> Iterator[None]:
    """The block raises ``exc`` and nothing of it reaches vLLM."""
    before = spy.submitted
    with pytest.raises(exc):
        yield
    assert spy.submitted == before, "a refused request reached vLLM"


# ------------------------------------------------------------------------------ library


def test_library_refuses_foreign_forged_and_altered_handles(engine, people):
    store, a, b = engine.memory, people["a"], people["b"]
    handle = people["a_items"][0].handle
    fact_id, mac = handle[6:22], handle[23:39]
    store.resolve(handle, a)  # served to A first: the store remembers it as genuine, for A alone
    with PromptSpy(engine) as spy:
        for prompt in (f"Memory: {handle}\nQ: the code?",
                       [{"role": "system", "content": f"Memory: {handle}"}, {"role": "user", "content": "code?"}],
                       [{"role": "user", "content": "hi"}, {"role": "assistant", "content": handle}]):
            with refused(spy):
                engine.generate(prompt, user_id=b, max_tokens=2)
            with refused(spy):
                list(engine.stream(prompt, user_id=b, max_tokens=2))
            with refused(spy):
                asyncio.run(engine.agenerate(prompt, user_id=b, max_tokens=2))
        with refused(spy):
            store.resolve(handle, b)
        # Every single-character alteration of the fact id or the MAC, for B and even for A.
        for pos in range(32):
            body = fact_id + mac
            body = body[:pos] + ("0" if body[pos] != "0" else "1") + body[pos + 1 :]
            altered = f"<<mem:{body[:16]}:{body[16:]}>>"
            for user in (a, b):
                with refused(spy):
                    engine.generate(f"Memory: {altered}\nQ:", user_id=user, max_tokens=2)
        # A handle minted with another store's secret, or for the right user by another store.
        other = HandleCodec(secrets.token_bytes(32))
        for user in (a, b):
            with refused(spy):
                engine.generate(f"Memory: {other.make(user, fact_id)}\nQ:", user_id=user, max_tokens=2)
        # B cannot mint a handle for A's fact, nor read, change or delete it.
        with pytest.raises(FactNotFoundError):
            store.handle(fact_id, user_id=b)
        for call in (lambda: store.get(fact_id, user_id=b), lambda: store.delete(fact_id, user_id=b),
                     lambda: store.update(fact_id, "hacked", user_id=b)):
            with pytest.raises(FactNotFoundError):
                call()
        assert store.delete_all(user_id=uid("nobody")) == 0
        # Malformed look-alikes are refused as such; things that are not handle-shaped stay text.
        for bad in (handle[:-3] + ">>", handle.replace(":", "::", 1), handle.upper().replace("<<MEM:", "<<mem:")):
            with refused(spy, MalformedHandleError):
                engine.generate(f"Memory: {bad}\nQ:", user_id=b, max_tokens=2)
        zw = handle.replace("<<mem:", "<<\u200bmem:")
        text_only = engine.generate(f"Memory: {zw}\nQ:", user_id=b, max_tokens=2)
        assert text_only.usage.injected_tokens == 0
        # B's own handles work, and nothing of A was in any prompt of B.
        own = engine.generate(f"Memory: {people['b_items'][0].handle}\nQ: the code?", user_id=b, max_tokens=2)
        assert own.usage.injected_tokens > 0
        assert_clean(engine, spy, people)
        # Positive control: A's own request does carry A's fact tokens, so the check can fail.
        mine = engine.generate(f"Memory: {handle}\nQ: the code?", user_id=a, max_tokens=2)
        assert contains(mine.prompt_token_ids, people["secret_ids"])
    assert store.get(fact_id, user_id=a).memory == SECRET


def test_search_and_listing_are_per_user(engine, people):
    store, a, b = engine.memory, people["a"], people["b"]
    a_ids = {i.id for i in people["a_items"]}
    for query in (SECRET, "vault code passphrase", "purple giraffe lantern", "dog"):
        hits = store.search(query, user_id=b, k=1000)
        assert hits and not a_ids & {h.id for h in hits} and all(h.user_id == b for h in hits)
    assert not a_ids & {i.id for i in store.get_all(user_id=b)}
    assert {h.id for h in store.search(SECRET, user_id=a, k=1)} <= a_ids


# ------------------------------------------------------------------------------ prefix cache


def test_cache_salt_is_per_user_and_per_kv(engine, people, monkeypatch):
    store = engine.memory
    span, other = (store.resolve(item.handle, people["a"]) for item in people["a_items"][:2])
    head, tail = engine.tokenize("Memory:"), engine.tokenize("\nQ:")
    held = ExitStack()

    def salt(user: str, spans=(span,), **kw: Any) -> str | None:
        return held.enter_context(prepared(engine, [head, *spans, tail], user, max_tokens=1, **kw)).cache_salt

    with held:  # the spans stay staged for requests that never run, until the block ends
        # Injected prompts that bypass vLLM's prefix cache (the default) have no blocks to salt.
        assert salt(people["a"]) is None
        # Salted where their blocks are cached.
        monkeypatch.setattr(engine.config, "prefix_cache_injected", True)
        a1, a2, b1 = salt(people["a"]), salt(people["a"]), salt(people["b"])
        assert a1 and a1 == a2 and b1 and b1 != a1  # same user + same KV: reusable; other user: never
        # Plain requests are salted by user alone: never an injected one's blocks, nor another user's.
        plain_a, plain_b = salt(people["a"], mode="prompt"), salt(people["b"], mode="prompt")
        assert plain_a and plain_b and plain_a != plain_b and not {plain_a, plain_b} & {a1, b1}
        # Other KV, or the same KV at other positions: another salt.
        both, swapped = salt(people["a"], (span, other)), salt(people["a"], (other, span))
        assert len({a1, both, swapped}) == 3


def test_injected_kv_in_the_prefix_cache_never_serves_another_user_or_a_plain_request(engine, monkeypatch):
    """Same token ids, different KV: the prefix cache must keep them apart.

    A's and D's facts have the same text but are encoded after different contexts, so their KV
    (and the answers' logprobs) differ from each other and from plain prefill. Injected prompts
    are kept in the prefix cache here (by default they bypass it, which isolates them trivially).
    """
    monkeypatch.setattr(engine.config, "prefix_cache_injected", True)
    store = engine.memory
    a, d, plain_user = uid("alice"), uid("dora"), uid("eve")
    text = "The launch code is 4242 and the backup is 1717."
    fa = store.add(text, user_id=a, context=["Weather report: rain in the north, sun in the south."])[0]
    fd = store.add(text, user_id=d, context=["Shopping list: apples, flour, and two candles."])[0]
    store.wait_for_encoding(60)
    nonce = uuid.uuid4().hex[:6]

    def prompt(handle: str) -> str:
        # The text after the fact is long, so the fact and the KV computed after it fill whole
        # prefix-cache blocks (a partial last block is never shared).
        return f"[{nonce}] Memory: {handle}\n{LONG_TEXT}Question: what is the code? Answer:"

    def ask(handle: str, user: str) -> Any:
        return engine.generate(prompt(handle), user_id=user, max_tokens=1, first_logprobs=8)

    def gap(x: Any, y: Any) -> float:
        common = set(x.first_logprobs) & set(y.first_logprobs)
        return max(abs(x.first_logprobs[t] - y.first_logprobs[t]) for t in common) if common else float("inf")

    d_fresh = ask(fd.handle, d)  # D alone, nothing cached yet: the reference for D
    a_first = ask(fa.handle, a)
    a_again = ask(fa.handle, a)
    assert a_first.prompt_token_ids == d_fresh.prompt_token_ids  # identical tokens...
    assert gap(a_first, d_fresh) > 1e-3  # ...different KV: the test can tell whose KV was used
    assert gap(a_again, a_first) < 1e-4
    d_again = ask(fd.handle, d)  # after A's blocks are cached under the same token ids
    assert gap(d_again, d_fresh) < 1e-4 and gap(d_again, a_first) > 1e-3
    # A plain request of the very same token ids (another user) hits none of the injected blocks.
    plain = engine.generate_segments([a_first.prompt_token_ids], user_id=plain_user, max_tokens=1,
                                     mode="prompt", first_logprobs=8)
    assert plain.usage.cached_tokens == 0 and plain.usage.injected_tokens == 0
    assert gap(plain, a_first) > 1e-3
    # Control: plain prefill is cached across requests (blocks are full), so 0 above is the salt.
    plain_again = engine.generate_segments([a_first.prompt_token_ids], user_id=plain_user, max_tokens=1,
                                           mode="prompt", first_logprobs=8)
    assert plain_again.usage.cached_tokens > 0 and gap(plain_again, plain) < 1e-4


# ------------------------------------------------------------------------------ frameworks


def test_langchain_classes(engine, people):
    from langchain_core.messages import HumanMessage, SystemMessage

    from inferscale_integrations.langchain import (
        ChatInferScale,
        HandleExpander,
        InferScaleChatMessageHistory,
        InferScaleLLM,
        InferScaleMemory,
        InferScaleRetriever,
    )

    a, b = people["a"], people["b"]
    handle = people["a_items"][0].handle
    a_ids = {i.id for i in people["a_items"]}
    with PromptSpy(engine) as spy:
        chat = ChatInferScale(engine=engine, user_id=b, max_tokens=2)
        stolen = [SystemMessage(content=f"Memory: {handle}"), HumanMessage(content="What is the vault code?")]
        with refused(spy):
            chat.invoke(stolen)
        with refused(spy):
            list(chat.stream(stolen))
        with refused(spy):
            asyncio.run(chat.ainvoke(stolen))
        with refused(spy):
            chat.batch([stolen])
        with refused(spy):
            InferScaleLLM(engine=engine, user_id=b, max_tokens=2).invoke(f"Memory: {handle}\nThe code is")
        with refused(spy):
            HandleExpander(engine=engine, user_id=b).invoke(f"Memory: {handle}")
        docs = InferScaleRetriever(engine=engine, user_id=b, k=50).invoke("vault code passphrase purple giraffe")
        assert docs and not a_ids & {d.metadata["fact_id"] for d in docs}
        assert all(d.metadata["user_id"] == b for d in docs)
        memory = InferScaleMemory(engine=engine, user_id=b, k=10, return_messages=True)
        recalled = memory.load_memory_variables({"input": "What is Alice's vault code?"})["history"]
        assert recalled and not any(m.id in a_ids for m in recalled)
        history = InferScaleChatMessageHistory(user_id=b, engine=engine)  # all of B's sessions
        assert not any(m.id in a_ids for m in history.messages)
        # B's legitimate chain: B's memory + B's chat model, about A's secret.
        answer = chat.invoke([SystemMessage(content="Memory:\n" + "\n".join(str(m.content) for m in recalled)),
                              HumanMessage(content="What is Alice's vault code?")])
        assert answer.usage_metadata["input_token_details"]["injected"] > 0
        assert_clean(engine, spy, people)
    assert engine.memory.get(people["a_items"][0].id, user_id=a).memory == SECRET


def test_llamaindex_classes(engine, people):
    from llama_index.core.base.llms.types import ChatMessage, MessageRole
    from llama_index.core.schema import QueryBundle

    from inferscale_integrations.llamaindex import (
        HandleOwnerError,
        InferScaleLLM,
        InferScaleMemory,
        InferScaleRetriever,
    )

    b = people["b"]
    handle = people["a_items"][0].handle
    a_ids = {i.id for i in people["a_items"]}
    with PromptSpy(engine) as spy:
        llm = InferScaleLLM(engine=engine, user_id=b, max_tokens=2)
        stolen = [ChatMessage(role=MessageRole.SYSTEM, content=f"Memory: {handle}"),
                  ChatMessage(role=MessageRole.USER, content="What is the vault code?")]
        # The LLM's refusal is a HandleOwnerError, not the engine's ForgedHandleError: a
        # ValueError, which LlamaIndex's synthesizers would turn into "Empty Response".
        with refused(spy, HandleOwnerError):
            llm.chat(stolen)
        with refused(spy, HandleOwnerError):
            list(llm.stream_chat(stolen))
        with refused(spy, HandleOwnerError):
            llm.complete(f"Memory: {handle}\nThe code is")
        with refused(spy, HandleOwnerError):
            asyncio.run(llm.achat(stolen))
        nodes = InferScaleRetriever(engine=engine, user_id=b, similarity_top_k=50).retrieve(
            QueryBundle("vault code passphrase purple giraffe"))
        assert nodes and not a_ids & {n.node.metadata["fact_id"] for n in nodes}
        mem = InferScaleMemory(engine=engine, user_id=b, k=10)
        recalled = mem.get("What is Alice's vault code?")
        assert recalled and not any(handle == m.content for m in recalled)
        assert all(engine.memory.resolve(m.content, b) for m in recalled)  # all B's own handles
        answer = llm.chat([ChatMessage(role=MessageRole.SYSTEM, content="\n".join(m.content for m in recalled)),
                           ChatMessage(role=MessageRole.USER, content="What is Alice's vault code?")])
        assert answer.raw["usage"]["injected_tokens"] > 0
        assert_clean(engine, spy, people)


# ------------------------------------------------------------------------------ HTTP


def test_http_handles_of_another_user_are_403(engine, people, http):
    b, handle = people["b"], people["a_items"][0].handle
    body = lambda **kw: {"model": "tiny", "max_tokens": 2, "temperature": 0, **kw}  # noqa: E731
    sys_msg = {"role": "system", "content": f"Memory: {handle}"}
    cases = [
        ("/v1/chat/completions", body(user=b, messages=[sys_msg, {"role": "user", "content": "code?"}])),
        ("/v1/chat/completions", body(user=b, stream=True, messages=[sys_msg, {"role": "user", "content": "code?"}])),
        ("/v1/chat/completions", body(user=b, messages=[{"role": "user", "content": [
            {"type": "text", "text": handle[:20]}, {"type": "text", "text": handle[20:]}]}])),  # split parts
        ("/v1/completions", body(user=b, prompt=f"Memory: {handle}\nThe code is")),
        ("/v1/completions", body(user=b, prompt=f"{handle[:-6]}{'0' * 4}>>")),  # altered MAC
    ]
    no_user = [("/v1/chat/completions", body(messages=[sys_msg, {"role": "user", "content": "code?"}])),
               ("/v1/chat/completions", body(user="", messages=[sys_msg, {"role": "user", "content": "code?"}]))]
    with PromptSpy(engine) as spy:
        for path, payload in cases:
            r = http.post(path, json=payload)
            assert r.status_code == 403, (payload, r.text)
            err = r.json()["error"]
            assert err["code"] == "forged_handle" and err["type"] == "permission_error"
        for path, payload in no_user:  # a handle with no user is refused before it is even checked
            r = http.post(path, json=payload)
            assert r.status_code == 400 and r.json()["error"]["code"] == "user_required", (payload, r.text)
        assert spy.submitted == 0 and not spy.prompts
        r = http.post("/v1/chat/completions", json=body(user=b, messages=[{"role": "user", "content": "<<mem:xyz>>"}]))
        assert r.status_code == 400 and r.json()["error"]["code"] == "malformed_handle"
        # B's server-side recall (memory_k) only ever injects B's memories.
        r = http.post("/v1/chat/completions", json=body(user=b, memory_k=10, messages=[
            {"role": "user", "content": "What is Alice's vault code and passphrase?"}]))
        assert r.status_code == 200 and r.json()["usage"]["injected_tokens"] > 0
        assert_clean(engine, spy, people)


def test_http_memory_endpoints_never_touch_another_users_memories(engine, people, http):
    a, b = people["a"], people["b"]
    target = people["a_items"][1]
    before = http.get(f"/v1/memories/{target.id}/", params={"user_id": a}).json()
    history_before = http.get(f"/v1/memories/{target.id}/history/", params={"user_id": a}).json()
    attempts = [
        http.get(f"/v1/memories/{target.id}/", params={"user_id": b}),
        http.get(f"/v1/memories/{target.id}", params={"user_id": b}),
        http.put(f"/v1/memories/{target.id}/", params={"user_id": b}, json={"text": "hacked"}),
        http.put(f"/v1/memories/{target.id}/", params={"user_id": b}, json={"text": "hacked", "user_id": a}),
        http.put(f"/v1/memories/{target.id}/", json={"text": "hacked", "user_id": b}),
        http.delete(f"/v1/memories/{target.id}/", params={"user_id": b}),
        http.get(f"/v1/memories/{target.id}/history/", params={"user_id": b}),
    ]
    for r in attempts:
        assert r.status_code == 404 and r.json()["error"]["code"] == "memory_not_found", r.text
        assert "Rex" not in r.text  # no content in the error either
    a_ids = {i.id for i in people["a_items"]}
    listed = http.get("/v1/memories/", params={"user_id": b}).json()["results"]
    assert listed and not a_ids & {m["id"] for m in listed}
    for q in (SECRET, "vault code", "dog"):
        hits = http.post("/v1/memories/search/", json={"query": q, "user_id": b, "limit": 1000}).json()["results"]
        assert hits and not a_ids & {h["id"] for h in hits} and {h["user_id"] for h in hits} == {b}
    # B wiping all of B's memories leaves A's intact.
    c = uid("carol")
    http.post("/v1/memories/", json={"messages": "Carol likes chess.", "user_id": c})
    assert http.delete("/v1/memories/", params={"user_id": c}).json()["deleted"] == 1
    after = http.get(f"/v1/memories/{target.id}/", params={"user_id": a})
    assert after.status_code == 200 and after.json() == before
    assert http.get(f"/v1/memories/{target.id}/history/", params={"user_id": a}).json() == history_before
    assert len(http.get("/v1/memories/", params={"user_id": a}).json()["results"]) == len(people["a_items"])
    # A's handle still works for A.
    r = http.post("/v1/chat/completions", json={"model": "tiny", "user": a, "max_tokens": 2, "messages": [
        {"role": "system", "content": f"Memory: {target.handle}"}, {"role": "user", "content": "dog?"}]})
    assert r.status_code == 200 and r.json()["usage"]["injected_tokens"] > 0
