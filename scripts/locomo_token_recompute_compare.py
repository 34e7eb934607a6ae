"""Token-level recompute rows against plain injection and the prompt, from a ``bench locomo
--answers`` file that holds both (runs of one workdir with and without ``--engine-option
recompute_tokens=...`` share it; the last run's answers file has every row).

Per row: F1, its ratio to the prompt's and to plain injection's (paired bootstrap, 95%),
agreement with the prompt's answers, and the share of answers that state a date.

Run: ``python scripts/locomo_token_recompute_compare.py ANSWERS.jsonl --k 5 --w 20`` (``--recompute 4``:
the rows served with the knob's R=4, against R=4 alone). The prompt is the one in conversation
order: the bench's own table scores each row against its same-order prompt.
"""

from __future__ import annotations

import argparse
import json
import lzma
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from locomo_dates_analysis import STATES_A_DATE  # noqa: E402

from inferscale_apps.bench.locomo import agreement, ratio_ci95, score  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("answers", help="a bench locomo --answers file (.jsonl or .jsonl.xz)")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--w", type=int, default=20)
    parser.add_argument("--recompute", type=int, default=0,
                        help="the knob's R of the rows compared (their plain row: R alone)")
    parser.add_argument("--tokens", help="only these recompute_tokens rows, comma-separated (default: every one "
                        "in the file; questions lacking one are left out)")
    args = parser.parse_args()
    opener = lzma.open if args.answers.endswith(".xz") else open
    with opener(args.answers, "rt") as f:
        records = [json.loads(line) for line in f if line.strip()]
    prompt, inject = f"prompt k={args.k}", f"inject k={args.k} w={args.w}" + (f" r{args.recompute}" if args.recompute else "")
    labels = sorted({label for r in records for label in r["answers"] if label.startswith(inject + " tokens:")})
    if args.tokens:
        labels = [f"{inject} tokens:{t}" for t in args.tokens.split(",")]
    kept = [r for r in records if all(label in r["answers"] for label in (prompt, inject, *labels))]
    scores = {label: [score(r["answers"][label], r["gold"], r["category"]) for r in kept]
              for label in (prompt, inject, *labels)}
    out: dict[str, object] = {"questions": len(kept)}
    for label, values in scores.items():
        row: dict[str, object] = {"f1": round(sum(values) / len(values), 4),
                                  "states_a_date": round(sum(bool(STATES_A_DATE.search(r["answers"][label]))
                                                             for r in kept) / len(kept), 3)}
        if label != prompt:
            row["over_prompt_ci95"] = ratio_ci95(list(zip(values, scores[prompt])))
            row["agreement"] = agreement([r["answers"][label] for r in kept], [r["answers"][prompt] for r in kept])
        if label not in (prompt, inject):
            row["over_inject"] = sum(values) / max(sum(scores[inject]), 1e-12)
            row["over_inject_ci95"] = ratio_ci95(list(zip(values, scores[inject])))
        out[label] = row
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
