"""The terminal chatbot with long-term memory: the logic behind ``inferscale chat``.

One turn of :class:`ChatSession`::

    user text ──store.search(top-k)──▶ memories of this user
      system message  "…Things you remember about the user:\\n<<mem:…>>\\n<<mem:…>>"
      + the last few turns as plain messages + the user text
    ──engine.stream──▶ reply (each handle's KV is injected: no prefill for the memories)
    ──store.add──▶ the user's turn (optionally the reply) becomes a memory for later turns

Memories live in the store on disk, so they survive restarts; the recent-turn history does
not (it is this process's short-term context). :func:`run_repl` drives a session from a
terminal or from a script (one line per turn; EOF ends the session).

This module has no vLLM import of its own: it is usable with any object that offers the
engine's ``stream`` method and a Mem0-style ``memory`` store (tests pass fakes).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from inferscale_engine.errors import ContextOverflowError, HandleError
from inferscale_engine.memory.text.splitting import split_facts
from inferscale_engine.prompting import (
    DEFAULT_SYSTEM_PROMPT,
    memory_context,
    memory_system_message,
)
from inferscale_engine.types import DEFAULT_USER

logger = logging.getLogger(__name__)

HELP_TEXT = """\
Type a message and press Enter to chat. Everything you say is remembered across sessions.
Commands:
  /memories            list what I remember about you (id, date, text)
  /remember TEXT       store TEXT as a memory without chatting
  /forget ID           forget one memory (id as shown by /memories; a unique prefix is enough)
  /forget all          forget everything about you
  /why                 what the last reply was given: the recalled memories (with their
                       search scores) and the recent turns kept
  /clear               clear the recent-turn history (memories stay)
  /help                this help
  /quit                leave (Ctrl-D works too)"""


@dataclass
class TurnResult:
    """What one chat turn did."""

    user_text: str
    reply: str
    result: Any  # GenerationResult
    recalled: list[Any] = field(default_factory=list)  # MemoryItems put into the prompt
    stored: list[Any] = field(default_factory=list)  # MemoryItems added after the turn
    messages: list[dict[str, str]] = field(default_factory=list)  # what was sent to the model

    def usage_line(self) -> str:
        r = self.result
        u = r.usage
        gen_s = max(r.latency_s - r.ttft_s, 1e-9)
        rate = (u.completion_tokens - 1) / gen_s if u.completion_tokens > 1 else 0.0
        return (
            f"[ttft {r.ttft_s * 1000:.0f} ms | {len(self.recalled)} memories, {u.injected_tokens} injected tokens"
            f" | prompt {u.prompt_tokens} tok, cached {u.cached_tokens} | {u.completion_tokens} tok in"
            f" {r.latency_s:.2f} s ({rate:.1f} tok/s)]"
        )


class ChatSession:
    """A chat with one user's long-term memory.

    Args:
        engine: an :class:`~inferscale_engine.engine.InferScaleEngine` (or anything with its
            ``stream`` method and ``memory`` store).
        user_id: whose memories are searched and written.
        k: memories recalled per turn (0 turns recall off).
        history_turns: previous user/assistant exchanges sent as plain messages.
        max_tokens, temperature, sampling: generation settings (``stop``, ``top_p``, ``seed``...).
        system_prompt: text before the memories in the system message.
        remember: store each user turn as a memory after replying.
        remember_replies: store the assistant's replies too.
        remember_questions: also store messages that are questions (end with "?"). Off by
            default: "What is my dog's name?" says nothing about the user, and once stored it
            is recalled for every later question on the topic, crowding out the facts.
        min_score: recall only memories whose search score (cosine) is at least this;
            ``None`` (default) keeps all ``k``: scores do not separate a user's true facts from
            unrelated ones (measured in docs/cli.md), so a cutoff drops facts it should keep.
        split: store each independent fact of a message as its own memory
            (:func:`~inferscale_engine.memory.text.splitting.split_facts`): "My dog is Rex and I
            live in Lisbon." becomes two, each found by its own topic. ``False``: one memory per
            message, as typed.

    Recalled memories go into the system message best-last (nearest the question: small
    models attend to it most). New memories are encoded after the very text that precedes
    them when recalled (the rendered system head), so a single recalled memory is injected
    exactly as if it had been prefilled.
    """

    def __init__(
        self,
        engine: Any,
        *,
        user_id: str = DEFAULT_USER,
        k: int = 5,
        history_turns: int = 2,
        max_tokens: int = 256,
        temperature: float = 0.0,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        remember: bool = True,
        remember_replies: bool = False,
        remember_questions: bool = False,
        min_score: float | None = None,
        split: bool = True,
        **sampling: Any,
    ) -> None:
        if k < 0 or history_turns < 0:
            raise ValueError("k and history_turns must be >= 0")
        self.engine = engine
        self.user_id = user_id
        self.k = k
        self.history_turns = history_turns
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.system_prompt = system_prompt
        self.remember = remember
        self.remember_replies = remember_replies
        self.remember_questions = remember_questions
        self.min_score = min_score
        self.split = split
        self.sampling = sampling
        self.history: list[tuple[str, str]] = []  # (user, assistant) of this process
        self.last: TurnResult | None = None
        self._context: list[str] | None | bool = False  # False: not computed yet

    @property
    def store(self) -> Any:
        return self.engine.memory

    # ------------------------------------------------------------------ prompt

    def recall(self, text: str) -> list[Any]:
        """The user's memories most relevant to ``text`` (at most ``k``)."""
        if self.k == 0:
            return []
        items = list(self.store.search(text, user_id=self.user_id, k=self.k))
        if self.min_score is not None:
            items = [m for m in items if m.score is None or m.score >= self.min_score]
        return items[::-1]  # best last

    def memory_context(self) -> list[str] | None:
        """The text new memories are encoded after (see :func:`memory_context`)."""
        if self._context is False:
            self._context = memory_context(self.engine, self.system_prompt)
        return self._context  # type: ignore[return-value]

    def build_messages(
        self, text: str, recalled: Sequence[Any], *, history_turns: int | None = None
    ) -> list[dict[str, str]]:
        """System message with the memories' handles, recent turns, then ``text``."""
        n = self.history_turns if history_turns is None else history_turns
        messages = [{"role": "system", "content": memory_system_message([m.handle for m in recalled], self.system_prompt)}]
        if not messages[0]["content"]:
            messages = []
        for user, assistant in self.history[-n:] if n else []:
            messages.append({"role": "user", "content": user})
            messages.append({"role": "assistant", "content": assistant})
        messages.append({"role": "user", "content": text})
        return messages

    # ------------------------------------------------------------------ turns

    def stream(self, text: str) -> Iterator[str]:
        """Run one turn, yielding the reply as it is generated; :attr:`last` holds the outcome.

        The turn is stored (and added to the history) only if the generation finished: a
        consumer that stops early (Ctrl-C) leaves no trace.
        """
        text = text.strip()
        if not text:
            raise ValueError("empty message")
        recalled = self.recall(text)
        result = None
        attempts = self._attempts(text, recalled)
        for i, (messages, used) in enumerate(attempts):
            try:
                pieces = self.engine.stream(
                    messages,
                    user_id=self.user_id,
                    max_tokens=self.max_tokens,
                    temperature=self.temperature,
                    **self.sampling,
                )
                first = next(pieces)  # errors in handle resolution / layout surface here
            except (ContextOverflowError, HandleError) as exc:
                if i == len(attempts) - 1:
                    raise
                logger.warning("turn did not fit or a memory was unusable (%s); retrying with less context", exc)
                continue
            for delta in _chain(first, pieces):
                if delta.text:
                    yield delta.text
                if delta.result is not None:
                    result = delta.result
            recalled = used
            break
        assert result is not None
        if keep_in_history(text, result.text, [reply for _, reply in self.history[-self.history_turns:]]):
            self.history.append((text, result.text.strip()))
        self.last = TurnResult(text, result.text, result, list(recalled), [], messages)
        self.last.stored = self._store_turn(text, result.text)

    def send(self, text: str) -> TurnResult:
        """Run one turn and return its :class:`TurnResult`."""
        for _ in self.stream(text):
            pass
        assert self.last is not None
        return self.last

    def _attempts(self, text: str, recalled: list[Any]) -> list[tuple[list[dict[str, str]], list[Any]]]:
        """Prompts to try in order: full, then without history, then fewer / no memories."""
        attempts = [(self.build_messages(text, recalled), recalled)]
        if self.history_turns and self.history:
            attempts.append((self.build_messages(text, recalled, history_turns=0), recalled))
        if recalled:
            half = recalled[len(recalled) - len(recalled) // 2 :]  # the better half (best last)
            if half:
                attempts.append((self.build_messages(text, half, history_turns=0), half))
            attempts.append((self.build_messages(text, [], history_turns=0), []))
        return attempts

    def _store_turn(self, text: str, reply: str) -> list[Any]:
        """The user's words as they were typed (first person), the reply as ``"Assistant: ..."``.

        Plain first-person facts worked best with SmolLM2 (4/5 recalled over a five-fact
        conversation, against 1/5 with the store's ``"User: ..."`` form, which the model
        starts echoing); see docs/cli.md.
        """
        if not self.remember:
            return []
        meta = {"source": "chat"}
        ctx = self.memory_context()
        facts = self.split_facts(text)
        # A question says nothing about the user; the statements around it still do.
        items: list[Any] = self._add([f for f in facts if self.remember_questions or not f.endswith("?")])
        if self.remember_replies and reply.strip():
            items += self.store.add([{"role": "assistant", "content": reply.strip()}], user_id=self.user_id, metadata=meta, context=ctx)
        return items

    def why(self) -> list[str]:
        """What the last turn's reply was given, for ``/why``."""
        if self.last is None:
            return ["(no turn yet)"]
        lines = [f"{len(self.last.recalled)} memor{'y' if len(self.last.recalled) == 1 else 'ies'} recalled "
                 f"(best last; cutoff {self.min_score if self.min_score is not None else 'none'}):"]
        lines += [f"  {m.score:.3f}  {m.memory}" if m.score is not None else f"  {m.memory}" for m in self.last.recalled]
        turns = sum(m["role"] == "assistant" for m in self.last.messages)
        lines.append(f"{turns} recent turn{'' if turns == 1 else 's'} sent as messages")
        return lines

    # ------------------------------------------------------------------ memory commands

    def split_facts(self, text: str) -> list[str]:
        """The memories ``text`` is stored as: its independent facts, or the text itself."""
        text = text.strip()
        return split_facts(text) if self.split else [text] if text else []

    def remember_text(self, text: str) -> list[Any]:
        """Store ``text`` (one memory per independent fact) without chatting."""
        return self._add(self.split_facts(text))

    def _add(self, facts: list[str]) -> list[Any]:
        if not facts:
            return []
        # One transaction: a crash keeps all of a message's facts or none.
        return list(self.store.add_texts(facts, user_id=self.user_id, metadata=[{"source": "chat"}] * len(facts),
                                         context=self.memory_context()))

    def memories(self) -> list[Any]:
        return list(self.store.get_all(user_id=self.user_id))

    def forget(self, target: str) -> int:
        """Forget one memory (by id or unique id prefix) or ``"all"``; returns how many went."""
        target = target.strip()
        if target == "all":
            return int(self.store.delete_all(user_id=self.user_id))
        if not target:
            raise ValueError("say which memory: /forget ID or /forget all")
        matches = [m for m in self.memories() if m.id == target] or [
            m for m in self.memories() if m.id.startswith(target)
        ]
        if not matches:
            raise LookupError(f"no memory with id {target!r} (see /memories)")
        if len(matches) > 1:
            raise LookupError(f"{len(matches)} memories start with {target!r}; give more of the id")
        self.store.delete(matches[0].id, user_id=self.user_id)
        return 1

    def close(self) -> None:
        """Let pending memory encodings finish (they are what the next session injects)."""
        wait = getattr(self.store, "wait_for_encoding", None)
        if wait is not None:
            wait()


#: Replies that, once in the recent-turn window, the next turns copy instead of the memories.
_DERAILED = ("i'm sorry", "i am sorry", "as a helpful assistant", "as an ai", "i don't have personal",
             "i do not have personal", "not equipped", "i cannot", "i can't")
#: Common English words: a reply with none of them, to a message with some, is in another language.
_ENGLISH = frozenset("the is are you your i my me to of and in it that this for what with have be".split())


def keep_in_history(user_text: str, reply: str, window: Sequence[str] = ()) -> bool:
    """Whether an exchange stays in the recent-turn window (the decision, issue 24).

    Small models copy the window: one reply in another language or one refusal, kept, turned
    every later reply the same way, and a reply that copies the opening of one in the window
    starts a loop (SmolLM2 answered five questions in a row "You can take your ..."). So an
    exchange is dropped when its reply is empty, refuses or apologises, opens with the same four
    words as a reply in ``window``, or is in another language than the user's message. Dropped
    exchanges only leave the window; the user's statement is still stored as a memory.
    """
    words = reply.lower().split()
    if not words:
        return False
    if len(words) >= 4 and any(prev.lower().split()[:4] == words[:4] for prev in window):
        return False
    low = reply.lower()
    if any(p in low for p in _DERAILED):
        return False
    user_words = {w.strip(".,!?'\"") for w in user_text.lower().split()}
    reply_words = {w.strip(".,!?'\"") for w in words}
    return not (len(words) >= 4 and user_words & _ENGLISH and not reply_words & _ENGLISH)


def _chain(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest


# ---------------------------------------------------------------------- terminal loop


class _Style:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, text: str, code: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.enabled else text


def run_repl(
    session: ChatSession,
    *,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    stream: bool = True,
    show_usage: bool = False,
    show_memories: bool = False,
    interactive: bool | None = None,
    banner: str | None = None,
) -> int:
    """Chat on a terminal (or a script on stdin) until ``/quit`` or EOF; returns an exit code.

    Interactive (stdin is a TTY): prompts, colours, Ctrl-C stops a reply, Ctrl-C at the prompt
    or Ctrl-D leaves. Scripted: one input line per turn and one reply per turn on stdout, no
    prompts; EOF ends the session cleanly.
    """
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    if interactive is None:
        interactive = _isatty(stdin) and _isatty(stdout)
    style = _Style(interactive and _isatty(stdout))

    def say(text: str = "", end: str = "\n") -> None:
        stdout.write(text + end)
        stdout.flush()

    if interactive and banner:
        say(style(banner, "2"))
    read = _reader(stdin, interactive, prompt=style("you> ", "1;32"))
    try:
        while True:
            try:
                line = read()
            except KeyboardInterrupt:
                say()
                break
            if line is None:  # EOF
                if interactive:
                    say()
                break
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                if _command(session, line, say, style) == "quit":
                    break
                continue
            try:
                if show_memories:
                    # Recall is repeated inside the turn; this copy is only for display.
                    for m in session.recall(line):
                        say(style(f"  (recalled {m.id[:8]}: {m.memory})", "2"))
                if interactive:
                    stdout.write(style("bot> ", "1;34"))
                if stream:
                    for piece in session.stream(line):
                        stdout.write(piece)
                        stdout.flush()
                    say()
                else:
                    say(session.send(line).reply.strip())
            except KeyboardInterrupt:
                say(style(" [interrupted]", "2"))
                continue
            except (ValueError, LookupError, PermissionError) as exc:  # bad input, handle errors
                say(style(f"error: {exc}", "31"))
                continue
            if show_usage and session.last is not None:
                say(style(session.last.usage_line(), "2"))
    finally:
        session.close()
    return 0


def _command(session: ChatSession, line: str, say: Any, style: _Style) -> str | None:
    cmd, _, arg = line.partition(" ")
    cmd = cmd.lower()
    try:
        if cmd in ("/quit", "/exit", "/q"):
            return "quit"
        if cmd in ("/help", "/?"):
            say(HELP_TEXT)
        elif cmd in ("/memories", "/mem", "/list"):
            items = session.memories()
            if not items:
                say("(no memories yet)")
            for m in items:
                say(f"{m.id}  {_date(m.created_at)}  {m.memory}")
        elif cmd == "/forget":
            n = session.forget(arg)
            say(f"forgot {n} memor{'y' if n == 1 else 'ies'}")
        elif cmd == "/remember":
            if not arg.strip():
                raise ValueError("usage: /remember TEXT")
            for m in session.remember_text(arg.strip()):
                say(f"remembered {m.id}: {m.memory}")
        elif cmd == "/why":
            for line in session.why():
                say(line)
        elif cmd == "/clear":
            session.history.clear()
            say("history cleared (memories kept)")
        else:
            say(f"unknown command {cmd!r}; /help lists them")
    except (ValueError, LookupError, PermissionError) as exc:
        say(style(f"error: {exc}", "31"))
    return None


def _date(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, float)):
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(value))
    return str(value)[:16].replace("T", " ")


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _reader(stdin: TextIO, interactive: bool, prompt: str) -> Any:
    if interactive and stdin is sys.stdin:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass

        def read_tty() -> str | None:
            try:
                return input(prompt)
            except EOFError:
                return None

        return read_tty

    def read_stream() -> str | None:
        line = stdin.readline()
        return line if line else None

    return read_stream
