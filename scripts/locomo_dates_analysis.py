"""Where a LoCoMo run's temporal answers lose: questions whose evidence uses relative dates
("yesterday", "last Saturday", "two days ago") against those that do not, and how often the
answers state a date at all. Reads a `bench locomo --answers` file (R=0 and R=4 inject rows,
prompt rows in conversation order) and re-scores it with the bench's scorer.

    python scripts/locomo_dates_analysis.py \\
        docs/results/h200/locomo-qwen2.5-coder-0.5b-w20-recompute-7339dd7-answers.jsonl.xz
"""

from __future__ import annotations

import argparse
import collections
import json
import lzma
import re

from inferscale_apps.bench.locomo import ratio_ci95, score
from inferscale_apps.bench.locomo_data import default_data_path

RELATIVE = re.compile(
    r"\b(yesterday|today|tonight|tomorrow|last (week|weekend|month|year|night|monday|tuesday|wednesday|thursday"
    r"|friday|saturday|sunday|summer|winter|spring|fall)|next (week|weekend|month|year|monday|tuesday|wednesday"
    r"|thursday|friday|saturday|sunday)|this (week|weekend|month|year|morning|past)|(\w+ )?(days?|weeks?|months?"
    r"|years?) ago|recently|the other day|few (days|weeks|months))\b", re.I)
STATES_A_DATE = re.compile(r"\b(january|february|march|april|may|june|july|august|september|october|november"
                           r"|december|20\d\d)\b", re.I)
TEMPORAL = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("answers", help="a bench locomo --answers file (.jsonl or .jsonl.xz)")
    parser.add_argument("--data", default=str(default_data_path()))
    parser.add_argument("--w", type=int, default=20)
    args = parser.parse_args()
    raw = json.load(open(args.data))
    text = {(c["sample_id"], t["dia_id"]): t.get("text", "") for c in raw
            for key, session in c["conversation"].items() if re.fullmatch(r"session_\d+", key) for t in session}
    evidence = {(c["sample_id"], i): qa.get("evidence", []) for c in raw for i, qa in enumerate(c["qa"])}
    opener = lzma.open if args.answers.endswith(".xz") else open
    with opener(args.answers, "rt") as f:
        rows = [r for r in map(json.loads, f) if r["category"] == TEMPORAL]
    pairs: dict[tuple[str, int, str], list[tuple[float, float]]] = collections.defaultdict(list)
    stated: collections.Counter[tuple[str, int]] = collections.Counter()
    for r in rows:
        relative = any(RELATIVE.search(text.get((r["sample_id"], e), "")) for e in evidence[(r["sample_id"], r["qa_index"])])
        kind = "relative" if relative else "absolute"
        for k in (5, 10, 30):
            a = r["answers"]
            prompt = a.get(f"prompt k={k}")
            if prompt is None:
                continue
            stated[("prompt", k)] += bool(STATES_A_DATE.search(prompt))
            for tag, key in (("r0", f"inject k={k} w={args.w}"), ("r4", f"inject k={k} w={args.w} r4")):
                if key in a:
                    pairs[(kind, k, tag)].append((score(a[key], r["gold"], TEMPORAL), score(prompt, r["gold"], TEMPORAL)))
                    stated[(tag, k)] += bool(STATES_A_DATE.search(a[key]))
    print(f"{len(rows)} temporal questions")
    for group in sorted(pairs):
        got = pairs[group]
        inject, prompt = (sum(x) / len(got) for x in zip(*got))
        print(*group, len(got), f"inject {inject:.3f} prompt {prompt:.3f} ratio {inject / prompt:.2f} ci95 {ratio_ci95(got)}")
    print("answers stating a date:", {f"{m} k={k}": round(n / len(rows), 2) for (m, k), n in sorted(stated.items())})


if __name__ == "__main__":
    main()
