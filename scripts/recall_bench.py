"""Does `inferscale chat` remember across a restart? Tell facts, restart, ask about them.

    python scripts/recall_bench.py --model smollm2 [--model qwen2.5-coder-0.5b] [--json out.json]

Each model runs in two fresh processes on a fresh store, as a user would meet it:

1. **tell**: every remember line is stored the way a chat turn stores it (``ChatSession``:
   statements are kept as typed, encoded after the chat's system head). No reply is generated:
   replies stay in the process's recent-turn window and never cross the restart.
2. **ask** (a new process: nothing but the store on disk): every question is one chat turn
   with ``inferscale chat``'s defaults; a reply counts as recalled when it contains one of the
   expected words (case-insensitive).

Reported per model: start-up (engine start + store and embedder warm-up, ask process), mean
TTFT, decode tokens/s, recall %, and how often search put the fact in the top k at all (so a
miss can be told apart: retrieval or the model). Numbers for this repository are in docs/cli.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

#: (what the user says, what they ask after a restart, words a right answer contains).
#: Phrased the ways people tell a chatbot things: plain statements, "please remember", facts
#: inside chatter, two facts in one line (the last five pairs; the question asks for either topic).
PAIRS: list[tuple[str, str, tuple[str, ...]]] = [
    ("My dog is called Rex.", "What is my dog's name?", ("rex",)),
    ("Please remember: my bicycle is painted bright orange.", "What colour is my bicycle?", ("orange",)),
    ("My office is in Lisbon.", "Which city is my office in?", ("lisbon",)),
    ("My sister's name is Maria.", "What is my sister called?", ("maria",)),
    ("Remember that my favourite food is sushi.", "What is my favourite food?", ("sushi",)),
    ("I work as a nurse at the city hospital.", "What is my job?", ("nurse",)),
    ("Ugh, long day. My car, a blue Toyota, broke down again on the way home.", "What car do I drive?", ("toyota",)),
    ("Please remember that my birthday is on the 12th of March.", "When is my birthday?", ("march", "12")),
    ("I'm allergic to peanuts, so no peanut snacks for me.", "What am I allergic to?", ("peanut",)),
    ("My cat is called Whiskers.", "What is my cat's name?", ("whiskers",)),
    ("Note this: my wifi password is sunflower42.", "What is my wifi password?", ("sunflower42",)),
    ("I play the violin in a small orchestra.", "Which instrument do I play?", ("violin",)),
    ("Haha yes, and by the way my son Leo just turned seven.", "How old is my son?", ("seven", "7")),
    ("My favourite colour is green.", "What is my favourite colour?", ("green",)),
    ("Keep in mind that I am vegetarian.", "Do I eat meat?", ("vegetarian", "no", "don't", "do not")),
    ("I was born in Toronto.", "Where was I born?", ("toronto",)),
    ("My best friend is called Sam.", "Who is my best friend?", ("sam",)),
    ("I drink my coffee black, no sugar.", "How do I like my coffee?", ("black",)),
    ("Please remember my dentist appointment is on Friday.", "When is my dentist appointment?", ("friday",)),
    ("Fun fact about me: I speak Japanese.", "Which foreign language do I speak?", ("japanese",)),
    # Two topics in one line: the search score of "where do I live?" is lower (issue 24: 0.236).
    ("My parrot is called Kiwi and I live in Porto.", "Where do I live?", ("porto",)),
    ("I support the football club Benfica.", "Which football club do I support?", ("benfica",)),
    ("My husband is a pilot and I own a small sailing boat.", "What is my husband's job?", ("pilot",)),
    ("I collect old stamps, but my brother Tom lives in Madrid.", "Where does my brother live?", ("madrid",)),
    ("My mother is called Ines; I grow tomatoes on my balcony.", "What do I grow on my balcony?", ("tomato",)),
    ("I have a dentist fear and my favourite band is Queen.", "What is my favourite band?", ("queen",)),
]


def _split(said: str) -> list[str]:
    from inferscale_engine.memory.text.splitting import split_facts

    return split_facts(said)


def _session(args: argparse.Namespace, store: str) -> tuple[Any, Any, float]:
    from inferscale_apps.chat import ChatSession
    from inferscale_engine.engine import InferScaleEngine
    from inferscale_engine.runtime import warm_up

    start = time.perf_counter()
    engine = InferScaleEngine(model=args.model, store_path=store, max_model_len=2048)
    warm_up(engine.memory)
    startup = time.perf_counter() - start
    kwargs = {} if args.min_score is None else {"min_score": None if args.min_score < -0.99 else args.min_score}
    session = ChatSession(engine, user_id="bench", max_tokens=args.max_tokens, split=not args.no_split, k=args.k, **kwargs)
    return engine, session, startup


def tell(args: argparse.Namespace, store: str) -> dict:
    engine, session, startup = _session(args, store)
    with engine:
        for said, _, _ in PAIRS:
            session.remember_text(said)
        session.close()
    return {"startup_s": startup}


def ask(args: argparse.Namespace, store: str) -> dict:
    engine, session, startup = _session(args, store)
    rows = []
    with engine:
        for said, question, expect in PAIRS:
            # The memory that answers: the line as said, or its part that holds the answer.
            fact = next((f for f in session.split_facts(said) if any(w in f.lower() for w in expect)), said)
            hits = engine.memory.search(question, user_id="bench", k=session.k)
            rank = next((i for i, h in enumerate(hits) if h.memory == fact), None)
            turn = session.send(question)
            r = turn.result
            gen_s = r.latency_s - r.ttft_s
            rows.append({
                "question": question, "mixed": len(_split(said)) > 1, "reply": turn.reply.strip(), "recalled": any(w in turn.reply.lower() for w in expect),
                "fact_rank": rank, "fact_score": hits[rank].score if rank is not None else None,
                "in_prompt": any(m.memory == fact for m in turn.recalled), "memories": len(turn.recalled), "ttft_s": r.ttft_s,
                "tok_s": (r.usage.completion_tokens - 1) / gen_s if r.usage.completion_tokens > 1 and gen_s > 0 else None,
            })
    return {"startup_s": startup, "turns": rows}


def run_model(args: argparse.Namespace, model: str) -> dict:
    store = tempfile.mkdtemp(prefix="recall-bench-")
    out = {}
    for phase in ("tell", "ask"):
        cmd = [sys.executable, __file__, "--phase", phase, "--store", store, "--model", model,
               "--max-tokens", str(args.max_tokens), "--k", str(args.k)] + (["--no-split"] if args.no_split else [])
        if args.min_score is not None:
            cmd += ["--min-score", str(args.min_score)]
        t = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if p.returncode:
            sys.exit(f"{model} {phase} failed:\n{p.stderr[-3000:]}")
        out[phase] = json.loads(p.stdout.strip().splitlines()[-1])
        out[phase]["process_s"] = time.perf_counter() - t
    turns = out["ask"]["turns"]
    rates = [t["tok_s"] for t in turns if t["tok_s"]]
    return {
        "model": model,
        "startup_s": round(out["ask"]["startup_s"], 1),
        "ttft_ms": round(1000 * statistics.median(t["ttft_s"] for t in turns)),
        "decode_tok_s": round(statistics.median(rates), 1) if rates else None,
        "recall_pct": round(100 * sum(t["recalled"] for t in turns) / len(turns)),
        "mixed_recall": f"{sum(t['recalled'] for t in turns if t['mixed'])}/{sum(t['mixed'] for t in turns)}",
        "retrieved_pct": round(100 * sum(t["fact_rank"] is not None for t in turns) / len(turns)),
        "first_pct": round(100 * sum(t["fact_rank"] == 0 for t in turns) / len(turns)),
        "in_prompt_pct": round(100 * sum(t["in_prompt"] for t in turns) / len(turns)),
        "min_fact_score": round(min(t["fact_score"] for t in turns if t["fact_score"] is not None), 3),
        "turns": turns,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", help="alias or folder (repeatable; default smollm2)")
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--min-score", type=float, default=None, help="chat's recall cutoff (default: chat's; -1 = none)")
    p.add_argument("--k", type=int, default=5, help="memories recalled per question (default 5, chat's)")
    p.add_argument("--no-split", action="store_true", help="store each line as one memory (chat's --no-split)")
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--phase", choices=["tell", "ask"], help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase:
        args.model = args.model[0]
        print(json.dumps((tell if args.phase == "tell" else ask)(args, args.store)))
        return
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    results = [run_model(args, m) for m in args.model or ["smollm2"]]
    for r in results:
        missed = [f"{t['question']} -> {t['reply'][:70]!r} (fact rank {t['fact_rank']})" for t in r["turns"] if not t["recalled"]]
        print(f"{r['model']}: start-up {r['startup_s']} s, TTFT {r['ttft_ms']} ms, {r['decode_tok_s']} tok/s, "
              f"recall {r['recall_pct']}% ({len(r['turns'])} questions; two-topic lines {r['mixed_recall']}), "
              f"fact in top-k {r['retrieved_pct']}%, ranked first {r['first_pct']}%, "
              f"in the prompt {r['in_prompt_pct']}%, "
              f"lowest fact score {r['min_fact_score']}")
        for m in missed:
            print("   missed:", m)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
