"""``inferscale bench`` (also ``python -m inferscale_apps.bench``): InferScale's benchmarks."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import Any

from inferscale_apps.bench import common
from inferscale_engine.config import engine_option


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _oracles(text: str) -> list[Any]:
    from inferscale_apps.bench.locomo_oracle import parse_oracles

    try:
        return parse_oracles(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="inferscale bench", description=__doc__)
    sub = parser.add_subparsers(dest="bench", required=True)

    def add(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("--model", default="smollm2", help="model folder or alias (default: smollm2)")
        p.add_argument("--device", choices=["cpu", "cuda"], default=None)
        p.add_argument("--dtype", default="auto")
        p.add_argument("--max-model-len", type=int, default=None, help="default: the model's own")
        p.add_argument("--json", help="write {bench, env, results} here")
        p.add_argument("--plot", help="write a PNG plot here")
        p.add_argument("--dummy-weights", action="store_true",
                       help="random weights from config.json alone (timing runs on machines without weights)")
        p.add_argument("--engine-option", type=engine_option, action="append", default=[], metavar="KEY=VALUE",
                       help="an EngineConfig field or vLLM engine argument, e.g. block_size=64 (repeatable)")
        return p

    p = add("ttft", "TTFT vs k: no memory, prompt injection, KV injection, prefix-cache floor")
    p.add_argument("--ks", type=_ints, default=[0, 5, 10, 20, 50, 100, 200], help="facts per request (default: 0,5,10,20,50,100,200)")
    p.add_argument("--fact-tokens", type=int, default=28, help="tokens per synthetic fact (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=20, help="timed requests per mode and k (default: %(default)s)")
    p.add_argument("--no-retrieval", action="store_true", help="leave retrieval time out of TTFT")
    p.add_argument("--recompute", type=_ints, default=[],
                   help="also time KV injection with its last R facts prefilled as text, per R (default: none)")
    p.add_argument("--max-inject-over-floor", type=float, default=None, metavar="RATIO",
                   help="exit 1 when KV injection's engine TTFT exceeds RATIO × the prefix-cache floor at any k "
                        "(the performance gate CI runs)")
    p.add_argument("--max-growth", type=float, default=None, metavar="RATIO",
                   help="exit 1 when KV injection's engine TTFT at the largest k exceeds RATIO × the smallest k's")
    p.add_argument("--serve-pool-first", action="store_true",
                   help="inject every fact of the pool once before timing, as a warm server has (multiprocess: "
                        "they are then staged for vLLM's workers)")

    p = add("throughput", "concurrent users, k facts each: prompt vs KV injection vs the prefix-cache floor")
    p.add_argument("--users", type=_ints, default=[1, 10, 50, 100], help="concurrent users per wave (default: 1,10,50,100)")
    p.add_argument("--k", type=int, default=50, help="facts per user's question (default: %(default)s)")
    p.add_argument("--output-tokens", type=int, default=32, help="tokens each answer generates (default: %(default)s)")

    p = add("exactness", "KV injection vs prompt injection of the same tokens (exact context and w=0)")
    p.add_argument("--k", type=int, default=8, help="facts in the prompt, for models without a tokenizer (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens compared (default: %(default)s)")

    p = add("locomo", "LoCoMo QA F1: the same retrieval answered by KV injection, pasted memories, full text")
    p.add_argument("--k", type=_ints, default=[5, 10, 30], help="memories retrieved per speaker")
    p.add_argument("--w", type=_ints, default=[0, 5, 20], help="context windows (turns) the memories are encoded with")
    p.add_argument("--conversations", type=int, default=None, help="first N conversations (default: all 10)")
    p.add_argument("--questions-per-category", type=int, default=None, help="first N questions of each category")
    p.add_argument("--max-turns", type=int, default=None,
                   help="first N turns of each conversation, and only questions whose evidence is in them")
    p.add_argument("--categories", type=_ints, default=None,
                   help="question categories asked, e.g. 2 (1 multi-hop, 2 temporal, 3 open-domain, 4 single-hop; default all)")
    p.add_argument("--resolve-dates", action="store_true",
                   help="write the absolute date after each relative one in a turn (\"yesterday (7 May 2023)\"), "
                        "resolved against its session date; every mode sees the same text")
    p.add_argument("--encoding", choices=["window", "sliding"], default="window",
                   help="window: one prefill per turn after exactly w turns; sliding: one prefill per w turns")
    p.add_argument("--max-tokens", type=int, default=32, help="answer length (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    p.add_argument("--workdir", help="stores and cached answers (kept: a rerun resumes); default a temp dir")
    p.add_argument("--data", help="locomo10.json (default: $INFERSCALE_LOCOMO or ../shared/data/locomo)")
    p.add_argument("--answers", help="write every question's answers here (JSONL)")
    p.add_argument("--resume-answers", metavar="FILE",
                   help="answers an earlier run of the same model and data cached (its workdir's "
                        "answers-t*.jsonl, or .xz): questions answered there are not asked again")
    p.add_argument("--score-only", action="store_true",
                   help="score the --resume-answers file with the same grid and questions, starting no "
                        "engine (e.g. answers that came back from a device run cut short); a row counts "
                        "the questions the file answers")
    p.add_argument("--no-full", action="store_true", help="skip the full-conversation mode")
    p.add_argument("--after-head", action="store_true",
                   help="encode memories after the served prompt's opening (store context_prefix), not at position 0")
    p.add_argument("--exact-control", action="store_true",
                   help="also answer with every memory encoded after exactly its served prefix (noise floor)")
    p.add_argument("--recompute", type=_ints, default=[0],
                   help="the quality knob: memories prefilled as text after the injected ones, "
                        "one inject row per value (default: 0)")
    p.add_argument("--oracle", type=_oracles, default=[],
                   help="token sets of the injected region that take the prompt's own KV, e.g. "
                        "header,first:4,top:2,deviating:15,separators,all (see bench/locomo_oracle.py)")
    p.add_argument("--order", choices=["relevance", "conversation"], default="relevance",
                   help="which memories are recomputed: the most similar to the question (moved last) "
                        "or the last listed (default: %(default)s)")

    p = add("tiers", "TTFT at k facts whose KV is promoted from the device, host or disk tier")
    p.add_argument("--k", type=_ints, default=[50], help="facts per request (default: 50)")
    p.add_argument("--repeats", type=int, default=10, help="timed requests per tier (default: %(default)s)")
    p.add_argument("--fact-tokens", type=int, default=28, help="tokens per synthetic fact (default: %(default)s)")
    p.add_argument("--warm-disk", action="store_true", help="leave fact files in the OS page cache")
    return parser


def engine_from(args: argparse.Namespace, **extra: Any):
    from inferscale_engine.engine import InferScaleEngine

    # Benchmarks measure injection itself: every memory injected unless a run names the knob
    # (--recompute on ttft and locomo, or --engine-option recompute=N).
    options: dict[str, Any] = {"dtype": args.dtype, "max_model_len": args.max_model_len, "recompute": 0,
                               **dict(args.engine_option), **extra}
    if args.dummy_weights:
        options.update(load_format="dummy", skip_tokenizer_init=True)
    return InferScaleEngine(model=args.model, device=args.device, **options)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the benchmark ``args.bench`` with the options :func:`build_parser` parsed; 1 when a
    bound it was given (``ttft --max-inject-over-floor`` / ``--max-growth``) was broken."""
    broken: list[str] = []
    if args.plot:  # before the run, not after it: a benchmark can take an hour
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("--plot needs matplotlib: pip install 'inferscale[bench]'") from None
    if args.bench == "exactness":
        from inferscale_apps.bench.exactness import random_case, run_case, text_case

        with engine_from(args, max_logprobs=20) as engine:
            case = text_case(engine) if engine.tokenizer is not None else random_case(engine, k=args.k)
            rows = run_case(engine, *case, max_tokens=args.max_tokens)
            env = common.environment(engine)
        common.print_table(rows, ["mode", "arch", "dtype", "greedy_match", "max_logit_diff", "first_divergence"])
        title = f"KV injection vs prompt injection — {rows[0]['arch']}, {rows[0]['dtype']}"
    elif args.bench == "ttft":
        from inferscale_apps.bench.ttft import gate, run_ttft, summarize

        with engine_from(args) as engine:
            retriever = None if args.no_retrieval else common.SyntheticRetriever(engine.config.device, k=max(args.ks))
            rows = run_ttft(engine, args.ks, fact_tokens=args.fact_tokens, repeats=args.repeats, retriever=retriever,
                            recompute=args.recompute, serve_pool_first=args.serve_pool_first)
            env = common.environment(engine)
        common.print_table(rows, ["mode", "k", "prompt_tokens", "ttft_ms_p50", "ttft_ms_p95", "retrieval_ms_p50", "engine_ms_p50"])
        knob = [c for r in sorted(set(args.recompute)) if r > 0
                for c in (f"inject-r{r}_over_inject", f"prompt_over_inject-r{r}")]
        summary = summarize(rows)
        common.print_table(summary, ["k", "prompt_over_inject", "engine_prompt_over_inject", "inject_over_floor",
                                     "inject_minus_floor_ms", *knob])
        title = f"TTFT vs k — {_hardware(env)}, {args.model}"
        broken = gate(summary, rows, max_inject_over_floor=args.max_inject_over_floor, max_growth=args.max_growth)
    elif args.bench == "throughput":
        from inferscale_apps.bench.throughput import run_throughput

        with engine_from(args) as engine:
            rows = run_throughput(engine, args.users, k=args.k, output_tokens=args.output_tokens)
            env = common.environment(engine)
        common.print_table(rows, ["mode", "users", "k", "req_per_s", "tok_per_s", "ttft_ms_p50", "ttft_ms_p95",
                                  "cached_tokens_p50"])
        title = f"Concurrent users, k={args.k} facts each — {_hardware(env)}, {args.model}"
    elif args.bench == "locomo":
        rows, env = _locomo(args)
        title = f"LoCoMo F1 — {args.model}, {env['locomo']['questions']} questions"
    elif args.bench == "tiers":
        from inferscale_apps.bench.tiers import run_tiers

        with engine_from(args) as engine:
            rows = run_tiers(engine, args.k, repeats=args.repeats, fact_tokens=args.fact_tokens,
                             warm_disk=args.warm_disk)
            env = common.environment(engine)
        common.print_table(rows, ["tier", "k", "ttft_ms_p50", "ttft_ms_p95", "promote_ms_p50", "inject_ms_p50",
                                  "over_prompt_p50", "mix", "prefetch_ms_p50"])
        title = f"TTFT by KV tier — {_hardware(env)}, {args.model}"
    else:  # pragma: no cover - argparse enforces the choices
        raise AssertionError(args.bench)
    common.write_json(args.json, args.bench, env, rows)
    if args.plot:
        from inferscale_apps.bench.plots import plot

        plot(args.bench, rows, args.plot, title=title)
    if broken:
        print("performance gate failed:\n  " + "\n  ".join(broken))
        return 1
    return 0


def _locomo(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``bench locomo``: answered by an engine, or (``--score-only``) scored from an answer cache."""
    from inferscale_apps.bench.locomo import AnswerCache, run_locomo, score_locomo, summarize, table_rows

    selection = dict(ks=args.k, ws=args.w, data=args.data, conversations=args.conversations,
                     questions_per_category=args.questions_per_category, max_turns=args.max_turns,
                     categories=args.categories, resolve_dates=args.resolve_dates, answers_path=args.answers,
                     recompute=args.recompute, order=args.order, oracles=args.oracle,
                     exact_control=args.exact_control)
    if args.score_only:
        if not args.resume_answers:
            raise SystemExit("bench locomo --score-only needs --resume-answers FILE (the answers to score)")
        try:
            rows, info = score_locomo(args.resume_answers, recompute_tokens=dict(args.engine_option).get("recompute_tokens"),
                                      **selection)
        except (FileNotFoundError, ValueError) as exc:
            raise SystemExit(f"bench locomo --score-only: {exc}") from None
        env = {"locomo": info}
    else:
        if args.dummy_weights:
            raise SystemExit("bench locomo needs real weights and a tokenizer (no --dummy-weights)")
        if args.resume_answers:  # a wrong file refused before the engine loads
            try:
                AnswerCache(None).merge(args.resume_answers)
            except (OSError, ValueError) as exc:
                raise SystemExit(f"bench locomo --resume-answers: {exc}") from None
        with engine_from(args) as engine:
            rows, info = run_locomo(
                engine, encoding=args.encoding, max_tokens=args.max_tokens, concurrency=args.concurrency,
                workdir=args.workdir, full=not args.no_full, after_head=args.after_head,
                resume_answers=args.resume_answers, **selection,
            )
            env = {**common.environment(engine), "locomo": info}
    common.print_table(table_rows(rows), ["mode", "w", "k", "order", "recompute", "n_questions", "f1", "multi-hop",
                                          "temporal", "open-domain", "single-hop", "agree_exact", "agree_f1",
                                          "over_conversation_order", "oracle", "recovered", "ttft_ms"])
    common.print_table(summarize(rows), ["w", "k", "recompute", "order", "inject_over_prompt", "ci95_low",
                                         "ci95_high", "noise_floor_low", "noise_floor_high", "worst_category",
                                         "exact_match", "agreement_f1"])
    if info.get("exact_control"):
        print("exact-context control (memories encoded after exactly their served prefix):")
        common.print_table(
            [{"k": k, "n_questions": v["n_questions"], "f1": v["f1"],
              "agree_exact": (v["agreement"] or {}).get("exact_match"), "agree_f1": (v["agreement"] or {}).get("f1")}
             for k, v in info["exact_control"].items()],
            ["k", "n_questions", "f1", "agree_exact", "agree_f1"])
    return rows, env


def _hardware(env: dict[str, Any]) -> str:
    return env.get("gpu") or "CPU"

