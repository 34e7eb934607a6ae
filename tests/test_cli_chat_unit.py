"""ChatSession, the terminal loop and the CLI parser without a model (fast).

A fake engine records the messages it is asked to generate from and a fake store implements
the Mem0-style API, so these tests check the chat logic itself: where the handles go, what is
stored, what the commands do, how the loop ends.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from inferscale_apps.chat import ChatSession, run_repl
from inferscale_engine.errors import ContextOverflowError
from inferscale_engine.prompting import MEMORY_HEADER, memory_system_message, with_memories


@dataclass
class FakeItem:
    id: str
    memory: str
    user_id: str
    score: float | None = None
    created_at: str = "2026-11-29T10:00:00"
    metadata: dict = field(default_factory=dict)

    @property
    def handle(self) -> str:
        return f"<<mem:{self.id}:{'0' * 16}>>"

    def to_dict(self) -> dict:
        return {"id": self.id, "memory": self.memory, "user_id": self.user_id}


class FakeStore:
    def __init__(self) -> None:
        self.items: list[FakeItem] = []
        self.waited = 0

    def add(self, messages, *, user_id, metadata=None, **_):
        out = []
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        for m in messages:
            item = FakeItem(f"{len(self.items) + 1:016x}", m["content"], user_id, metadata=metadata or {})
            self.items.append(item)
            out.append(item)
        return out

    def add_texts(self, texts, *, user_id, metadata=None, **_):
        return [i for t, m in zip(texts, metadata or [None] * len(texts)) for i in self.add(t, user_id=user_id, metadata=m)]

    def search(self, query, *, user_id, k=5):
        words = set(query.lower().strip("?.!").split())
        hits = [FakeItem(i.id, i.memory, i.user_id, score=len(words & set(i.memory.lower().strip(".").split())))
                for i in self.items if i.user_id == user_id]
        return sorted([h for h in hits if h.score], key=lambda h: -h.score)[:k]

    def get_all(self, *, user_id):
        return [i for i in self.items if i.user_id == user_id]

    def delete(self, fact_id, user_id=None):
        self.items = [i for i in self.items if not (i.id == fact_id and i.user_id == user_id)]

    def delete_all(self, *, user_id):
        n = len(self.get_all(user_id=user_id))
        self.items = [i for i in self.items if i.user_id != user_id]
        return n

    def wait_for_encoding(self):
        self.waited += 1


class FakeEngine:
    def __init__(self, reply: str = "Your dog is Rex.", overflow_over: int | None = None) -> None:
        self.memory = FakeStore()
        self.reply = reply
        self.calls: list[list[dict]] = []
        self.overflow_over = overflow_over

    def stream(self, messages, *, user_id, max_tokens, temperature, **sampling):
        self.calls.append(messages)
        if self.overflow_over is not None and sum(len(m["content"]) for m in messages) > self.overflow_over:
            raise ContextOverflowError("too long")
        words = self.reply.split(" ")
        for w in words[:-1]:
            yield SimpleNamespace(text=w + " ", result=None)
        usage = SimpleNamespace(prompt_tokens=40, completion_tokens=len(words), injected_tokens=12, cached_tokens=0)
        result = SimpleNamespace(text=self.reply, usage=usage, ttft_s=0.05, latency_s=0.2)
        yield SimpleNamespace(text=words[-1], result=result)


def test_memory_system_message_layout():
    text = memory_system_message(["<<mem:a>>", "<<mem:b>>"], "Be brief.")
    assert text == f"Be brief.\n{MEMORY_HEADER}\n<<mem:a>>\n<<mem:b>>"
    assert memory_system_message([], "Be brief.") == "Be brief."
    msgs = with_memories([{"role": "user", "content": "hi"}], ["<<mem:a>>"])
    assert msgs[0]["role"] == "system" and msgs[0]["content"].endswith("<<mem:a>>")
    msgs = with_memories([{"role": "developer", "content": "Sys."}, {"role": "user", "content": "hi"}], ["<<mem:a>>"])
    assert msgs[0] == {"role": "system", "content": f"Sys.\n{MEMORY_HEADER}\n<<mem:a>>"} and len(msgs) == 2


def test_turn_recalls_handles_then_stores_the_user_turn():
    engine = FakeEngine()
    chat = ChatSession(engine, user_id="alice", k=3)
    chat.send("My dog is called Rex.")
    assert [i.memory for i in engine.memory.items] == ["My dog is called Rex."]
    assert engine.memory.items[0].metadata == {"source": "chat"}
    turn = chat.send("What is my dog's name?")
    system = engine.calls[-1][0]
    assert system["role"] == "system" and MEMORY_HEADER in system["content"]
    assert engine.memory.items[0].handle in system["content"]
    # the previous exchange comes as plain messages, the new text last
    assert [m["role"] for m in engine.calls[-1]] == ["system", "user", "assistant", "user"]
    assert engine.calls[-1][-1] == {"role": "user", "content": "What is my dog's name?"}
    assert [m.id for m in turn.recalled] == [engine.memory.items[0].id]
    assert "injected" in turn.usage_line() and "ttft 50 ms" in turn.usage_line()


def test_memories_are_per_user_and_history_is_bounded():
    engine = FakeEngine()
    ChatSession(engine, user_id="bob").send("My dog is called Max.")
    chat = ChatSession(engine, user_id="alice", history_turns=1)
    for i in range(3):
        engine.reply = f"Reply {i} to you."  # distinct: a reply copying one in the window is dropped
        chat.send(f"message {i}")
    chat.send("my dog?")
    sent = engine.calls[-1]
    assert "Max" not in json.dumps(sent) and "<<mem:" not in sent[0]["content"]  # bob's fact never reaches alice
    assert [m["content"] for m in sent if m["role"] == "user"] == ["message 2", "my dog?"]


def test_remember_flags():
    engine = FakeEngine()
    ChatSession(engine, remember=False).send("secret")
    assert engine.memory.items == []
    ChatSession(engine, remember_replies=True).send("hello")
    assert [i.memory for i in engine.memory.items] == ["hello", "Your dog is Rex."]  # fake store: no "Assistant:" prefix
    ChatSession(engine).send("What is my dog's name? ")
    assert len(engine.memory.items) == 2  # questions are not facts
    ChatSession(engine, remember_questions=True).send("What is my dog's name?")
    assert engine.memory.items[-1].memory == "What is my dog's name?"


def test_a_two_topic_message_is_stored_as_two_memories():
    engine = FakeEngine()
    session = ChatSession(engine, user_id="u")
    turn = session.send("My dog is called Rex and I live in Lisbon. Where should I eat?")
    # Each fact on its own; the question between them is not a fact about the user.
    assert [m.memory for m in turn.stored] == ["My dog is called Rex.", "I live in Lisbon."]
    assert [m.memory for m in session.remember_text("I am a nurse; my husband is a pilot.")] == \
        ["I am a nurse.", "My husband is a pilot."]
    whole = ChatSession(FakeEngine(), user_id="u", split=False)
    assert [m.memory for m in whole.send("My dog is called Rex and I live in Lisbon.").stored] == \
        ["My dog is called Rex and I live in Lisbon."]


def test_overflow_retries_with_less_context():
    engine = FakeEngine(overflow_over=120)
    chat = ChatSession(engine, user_id="u", history_turns=5, system_prompt="S" * 20)
    for c in "abc":  # distinct replies: a reply copying one in the window is dropped
        engine.reply = f"Reply {c} to you."
        chat.send(c * 30)  # at "c" history makes the first attempt too long: retried without it
    assert len(engine.calls[-1]) == 2 and chat.last.reply == engine.reply
    with pytest.raises(ContextOverflowError):
        chat.send("d" * 200)  # nothing left to drop
    assert chat.history[-1][0] == "c" * 30  # the failed turn left no trace


def test_forget_by_prefix_and_all():
    engine = FakeEngine()
    chat = ChatSession(engine, user_id="u")
    a = chat.remember_text("fact one")[0]
    chat.remember_text("fact two")
    with pytest.raises(LookupError):
        chat.forget("0000")  # ambiguous prefix
    with pytest.raises(LookupError):
        chat.forget("ffff")
    assert chat.forget(a.id) == 1
    assert [m.memory for m in chat.memories()] == ["fact two"]
    assert chat.forget("all") == 1 and chat.memories() == []


def test_repl_scripted_session():
    engine = FakeEngine()
    chat = ChatSession(engine, user_id="u")
    script = "My dog is called Rex.\n\n/memories\n/bogus\n/remember I like tea.\n/forget\nWhat is my dog's name?\n"
    out = io.StringIO()
    assert run_repl(chat, stdin=io.StringIO(script), stdout=out, show_usage=True) == 0
    text = out.getvalue()
    assert text.count("Your dog is Rex.") == 2
    assert "My dog is called Rex." in text  # /memories listed it
    assert "unknown command '/bogus'" in text
    assert "remembered" in text and "error: say which memory" in text
    assert "[ttft" in text and "\x1b[" not in text  # no colours when not a terminal
    assert "you>" not in text  # no prompts in scripted mode
    assert engine.memory.waited == 1  # pending encodings were waited for at exit


def test_repl_quit_stops_reading_and_no_stream_mode():
    engine = FakeEngine()
    chat = ChatSession(engine)
    out = io.StringIO()
    run_repl(chat, stdin=io.StringIO("hi\n/quit\nnot read\n"), stdout=out, stream=False)
    assert out.getvalue() == "Your dog is Rex.\n"
    assert len(engine.calls) == 1


def test_cli_help_teaches(capsys):
    from inferscale_apps.cli import build_parser, main

    for argv in (["--help"], ["chat", "--help"], ["serve", "--help"], ["memory", "--help"], ["models", "--help"]):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(argv)
        assert exc.value.code == 0
        assert "example" in capsys.readouterr().out
    assert main([]) == 2
    assert "chat" in capsys.readouterr().err


def test_cli_models_list(capsys):
    from inferscale_apps.cli import main

    assert main(["models", "list"]) == 0
    assert "smollm2" in capsys.readouterr().out


def test_cli_bad_model_is_a_clean_error(capsys, tmp_path):
    from inferscale_apps.cli import main

    assert main(["chat", "--model", str(tmp_path / "nope"), "--store", str(tmp_path / "s")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("inferscale: error: Unknown model") and "Traceback" not in err


def test_recent_turn_window_drops_replies_that_would_poison_the_next_turn():
    from inferscale_apps.chat import keep_in_history

    assert keep_in_history("My dog is called Rex.", "Nice! Rex is a great name for a dog.")
    assert not keep_in_history("My dog is called Rex.", "O seu cão chama-se Rex, que nome bonito.")  # Portuguese
    assert not keep_in_history("What colour is my bicycle?", "I'm sorry for your loss, but as a helpful assistant...")
    assert not keep_in_history("hi", "  ")
    assert keep_in_history("Olá, tudo bem?", "Tudo bem, obrigado!")  # the user's own language is kept
    copied = ["You can take your coffee with you wherever you go."]
    assert not keep_in_history("When is my dentist appointment?", "You can take your dentist appointment anytime.", copied)
    assert keep_in_history("What is my cat's name?", "My cat is called Whiskers.", ["My dog is called Rex."])

    engine = FakeEngine(reply="Olá! O seu cão chama-se Rex, que nome bonito.")
    chat = ChatSession(engine, user_id="u", history_turns=2)
    chat.send("My dog is called Rex.")
    assert chat.history == [] and [i.memory for i in engine.memory.items] == ["My dog is called Rex."]
    engine.reply = "Your dog is Rex."
    chat.send("What is my dog's name?")
    chat.send("And what is it again?")
    assert [m["role"] for m in engine.calls[-1]] == ["system", "user", "assistant", "user"]


def test_why_shows_what_the_last_reply_was_given():
    engine = FakeEngine()
    chat = ChatSession(engine, user_id="u")
    out = io.StringIO()
    run_repl(chat, stdin=io.StringIO("/why\nMy dog is called Rex.\nWhat is my dog called?\n/why\n"), stdout=out)
    text = out.getvalue()
    assert "(no turn yet)" in text
    assert "1 memory recalled (best last; cutoff none):" in text and "My dog is called Rex." in text
    assert "1 recent turn sent as messages" in text
