"""Where a LoCoMo run's inject rows lose, by where each question's evidence was served: the
evidence turns retrieved all lie among the R memories prefilled as text (``text``), some were
injected (``injected``), or none was retrieved (``none``); ``-partial`` where some evidence was
not retrieved. Each group's inject F1 over its same-order prompt's, paired, per category. Reads
a `bench locomo --answers` file (R=0 and R=R rows; prompt rows in conversation order and in
``relevance-last-R`` order) and ranks every turn again with the bench's own embedder (MiniLM on
the CPU, exact cosine: the bench's search).

    python -m inferscale_apps.bench locomo --model qwen2.5-coder-0.5b --score-only --k 5,10,30 --w 20 \\
        --recompute 0,4 --no-full --resume-answers \\
        docs/results/h100/locomo-qwen2.5-coder-0.5b-goal-af1d389-answers-cache.jsonl.xz --answers goal-answers.jsonl
    python scripts/locomo_evidence_analysis.py goal-answers.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json
import lzma

import numpy as np

from inferscale_apps.bench.locomo import LocomoBench, ratio_ci95, relevance_last, score
from inferscale_apps.bench.locomo_data import CATEGORIES, default_data_path, load_locomo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("answers", help="a bench locomo --answers file (.jsonl or .jsonl.xz)")
    parser.add_argument("--data", default=str(default_data_path()))
    parser.add_argument("--k", default="5,10,30")
    parser.add_argument("--w", type=int, default=20)
    parser.add_argument("--recompute", type=int, default=4)
    args = parser.parse_args()
    from inferscale_engine.memory.text.embedder import Embedder

    convs = {c.sample_id: c for c in load_locomo(args.data)}
    embedder = Embedder(device="cpu")
    opener = lzma.open if args.answers.endswith(".xz") else open
    with opener(args.answers, "rt") as f:
        rows = list(map(json.loads, f))
    asked_ids = {(r["sample_id"], r["qa_index"]) for r in rows}
    ranking, evidence_of = {}, {}
    for sample_id, conv in convs.items():
        turns = embedder.embed([t.memory for t in conv.turns])
        asked = [q for q in conv.questions if (sample_id, q.index) in asked_ids]
        if not asked:
            continue
        queries = embedder.embed([q.question for q in asked])
        at = {t.dia_id: t.index for t in conv.turns}
        for q, similarity in zip(asked, queries @ turns.T):
            order = np.argsort(-similarity, kind="stable")
            ranking[sample_id, q.index] = [(int(i), conv.turns[i].speaker) for i in order]
            evidence_of[sample_id, q.index] = {at[e] for e in q.evidence if e in at}

    r = args.recompute
    pairs: dict[tuple, list[tuple[float, float]]] = collections.defaultdict(list)
    ranks: dict[tuple[int, str], list[int]] = collections.defaultdict(list)
    for row in rows:
        conv, key = convs[row["sample_id"]], (row["sample_id"], row["qa_index"])
        if key not in ranking:
            continue
        evidence, answers, category = evidence_of[key], row["answers"], CATEGORIES[row["category"]]
        ranked = [i for i, _ in ranking[key]]
        order_of = {i: n for n, i in enumerate(ranked)}
        for k in map(int, args.k.split(",")):
            served = LocomoBench.pick(ranking[key], conv.speakers, k)
            as_text = set(relevance_last(served, ranked, r)[-r:])
            found = evidence & set(served)
            where = "none" if not found else "text" if found <= as_text else "injected"
            where += "" if found == evidence else "-partial"
            if where.startswith("injected"):  # the served rank (1: most relevant) of its best injected evidence
                rank = {i: n for n, i in enumerate(sorted(served, key=order_of.__getitem__), 1)}
                ranks[k, category].append(min(rank[i] for i in found - as_text))
            for tag, inject, prompt in ((f"R={r}", f"inject k={k} w={args.w} r{r}", f"prompt k={k} relevance-last-{r}"),
                                        ("R=0", f"inject k={k} w={args.w}", f"prompt k={k}")):
                if inject in answers and prompt in answers:
                    gold, c = row["gold"], row["category"]
                    pair = (score(answers[inject], gold, c), score(answers[prompt], gold, c))
                    pairs[tag, k, category, where].append(pair)
                    pairs[tag, k, "all", where].append(pair)
    print("row  k  category     evidence          n    inject  prompt  ratio (95% CI)")
    for (tag, k, category, where), got in sorted(pairs.items()):
        inject, prompt = (sum(x) / len(got) for x in zip(*got))
        ci = ratio_ci95(got)
        ratio = f"{inject / prompt:.2f}" + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else "") if prompt else "-"
        print(f"{tag:4} {k:2} {category:12} {where:16} {len(got):4}  {inject:.3f}   {prompt:.3f}   {ratio}")
    _rank_shares(ranks, r)


def _rank_shares(ranks: dict[tuple[int, str], list[int]], recompute: int) -> None:
    print(f"\nquestions with injected evidence: its best served rank (R={recompute} prefilled as text)")
    for (k, category), got in sorted(ranks.items()):
        bins = [(recompute + 1, 2 * recompute), (2 * recompute + 1, 4 * recompute), (4 * recompute + 1, 10**6)]
        shares = [sum(lo <= r <= hi for r in got) / len(got) for lo, hi in bins]
        print(f"k={k:2} {category:12} n={len(got):4}  ranks {bins[0][0]}-{bins[0][1]}: {shares[0]:.2f}  "
              f"{bins[1][0]}-{bins[1][1]}: {shares[1]:.2f}  {bins[2][0]}+: {shares[2]:.2f}")


if __name__ == "__main__":
    main()
