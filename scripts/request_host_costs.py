"""CPU micro-benchmark of a served request's host costs before the engine runs: the handles'
MAC checks, the device tier's gather, the store's ``resolve_many`` and ``engine.resolve`` as a
whole, at k memories per request (issue 37).

    python scripts/request_host_costs.py [--ks 50,200] [--repeats 200]

Builds the 4-layer test model (``tests/tiny_models.py``), stores ``--facts`` memories of one user
through a CPU engine, waits for their KV, then times, per k, the same k handles again and again
(medians of ``--repeats``, warm, after one untimed call; the facts all sit in the device tier):

* ``verify``: each of the k handles (parsed, as ``engine.resolve`` hands them on) checked against
  the store's secret (``testing.verify_handle``);
* ``get_many``: ``KVTiers.get_many`` of the k facts' keys; ``gather``: of it, the device tier's
  read (one copy of the facts' pages into a new block, handed out as rows);
* ``resolve_many``: the store's ``FactSource`` call (MAC checks, snapshot, tiers); ``snapshot``:
  of it, the copies of the k facts' rows a request reads outside the store's lock;
* ``engine.resolve``: render, split on handles, tokenize the pieces, ``resolve_many``;
  ``split``: of it, ``split_on_handles`` of the prompt (finding and parsing the k handles);
  ``spans``: of it, the k spans of the rows ``get_many`` handed out, made as the store
  makes them (``Span.stored``, unchecked, where the build has it; else the checked ``Span()``);
* ``cat rows``: the connector's CPU path concatenating every span's K and V (``_inject_torch``'s
  first copy) from the rows ``get_many`` handed out. What injecting straight from the slab would
  do instead, one copy in all: ``cat pages`` (the same concatenation of per-page views of the
  slab, made per request), ``cat kept pages`` (the same, its views made beforehand, as a tier
  could keep them per fact), ``index pages`` (one indexing kernel per K and V over the slab with
  a row index per token, the index made per request).

Prints one JSON line per k (µs). Absolute figures move with the box's load: compare figures of
one run, or of two builds run one after the other (``PYTHONPATH=<worktree>``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _median_us(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(1e6 * statistics.median(times), 1)


def _measure(engine: Any, items: list[Any], handles: list[str], k: int, rng: random.Random,
             repeats: int) -> dict[str, Any]:
    """The figures of one k (see the module docstring), µs."""
    from inferscale_engine.handles import find_handles, split_on_handles
    from inferscale_engine.testing import verify_handle
    from inferscale_engine.types import Span

    store = engine.memory
    tiers, fingerprint = store.tiers, store.fingerprint
    slab, pt = tiers.device_tier.slab, tiers.page_tokens
    assert slab is not None and fingerprint is not None  # [pages, layers, 2, page_tokens, heads, dim]
    chosen = rng.sample(range(len(items)), k)
    hs = [handles[i] for i in chosen]
    parsed = [find_handles(h)[0] for h in hs]
    keys = [(items[i].id, store.table.by_id[items[i].id].kv_version) for i in chosen]
    assert all(tiers.where(key) == "device" for key in keys), "facts not all in the device tier"
    prompt = "Facts:\n" + "\n".join(hs) + "\nWhat do you know?"
    entries = [tiers.device_tier.entries[key] for key in keys]
    rows = tiers.get_many(keys, fingerprint)

    facts = [store.table.by_id[items[i].id] for i in chosen]
    made = [(f"fact:{f.id}:{f.kv_version}", f.token_ids or (), kv, f.text) for f, kv in zip(facts, rows)]
    stored = getattr(Span, "stored", None)  # builds before Span.stored check every span

    def spans() -> None:
        if stored is None:
            [Span(key=key, token_ids=tuple(ids), kv=kv, text=text) for key, ids, kv, text in made]
        else:
            [stored(key, tuple(ids), kv, text) for key, ids, kv, text in made]

    def cat_rows() -> None:
        torch.cat([kv.k for kv in rows], dim=1)
        torch.cat([kv.v for kv in rows], dim=1)

    def page_views() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        ks, vs = [], []
        for e in entries:
            for j, page in enumerate(e.pages):
                n = min(pt, e.num_tokens - j * pt)
                ks.append(slab[page, :, 0, :n])
                vs.append(slab[page, :, 1, :n])
        return ks, vs

    def cat_pages() -> None:
        ks, vs = page_views()
        torch.cat(ks, dim=1)
        torch.cat(vs, dim=1)

    kept = page_views()

    def cat_kept_pages() -> None:
        torch.cat(kept[0], dim=1)
        torch.cat(kept[1], dim=1)

    def index_pages() -> tuple[torch.Tensor, torch.Tensor]:
        page, row = [], []
        for e in entries:
            for t in range(e.num_tokens):
                page.append(e.pages[t // pt])
                row.append(t % pt)
        p, r = torch.tensor(page), torch.tensor(row)
        by_layer = slab.permute(2, 1, 0, 3, 4, 5)  # [2, layers, pages, page_tokens, heads, dim]
        return by_layer[0][:, p, r], by_layer[1][:, p, r]

    # The pages hold exactly the rows the gather hands out.
    ks, _ = page_views()
    assert torch.equal(torch.cat(ks, dim=1), torch.cat([kv.k for kv in rows], dim=1))
    assert torch.equal(index_pages()[1], torch.cat([kv.v for kv in rows], dim=1))
    return {
        "tokens": sum(kv.num_tokens for kv in rows),
        "gathered_mb": round(sum(len(e.pages) for e in entries) * tiers.layout.page_bytes / 2**20, 2),
        "verify": _median_us(lambda: [verify_handle(store, h, "u") for h in parsed], repeats),
        "get_many": _median_us(lambda: tiers.get_many(keys, fingerprint), repeats),
        "gather": _median_us(lambda: tiers.device_tier.read(entries), repeats),
        "resolve_many": _median_us(lambda: store.resolve_many(hs, "u"), repeats),
        "snapshot": _median_us(lambda: store.table.snapshot([f.id for f in facts], "u"), repeats),
        "engine.resolve": _median_us(lambda: engine.resolve(prompt, user_id="u"), repeats),
        "split": _median_us(lambda: split_on_handles(prompt), repeats),
        "spans": _median_us(spans, repeats),
        "cat rows": _median_us(cat_rows, repeats),
        "cat pages": _median_us(cat_pages, repeats),
        "cat kept pages": _median_us(cat_kept_pages, repeats),
        "index pages": _median_us(index_pages, repeats),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ks", default="50,200")
    parser.add_argument("--facts", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--build", help="label of the build measured (default: the checkout's git hash)")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "tests"))
    from tiny_models import VLLM_CPU_TEST_ENV, build_tiny_model

    for key, value in VLLM_CPU_TEST_ENV.items():
        os.environ.setdefault(key, value)
    from inferscale_engine import InferScaleEngine

    build = args.build or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="inferscale-hostcosts-") as tmp:
        model = build_tiny_model(Path(tmp) / "tiny-llama", "llama")
        with InferScaleEngine(model=model, device="cpu", max_model_len=2048, recompute=0,
                              store_path=Path(tmp) / "store") as engine:
            store = engine.memory
            words = ["garden", "river", "blue", "train", "music", "winter", "coffee", "paper", "stone", "light"]
            texts = [f"fact {i}: " + " ".join(rng.choice(words) for _ in range(12)) for i in range(args.facts)]
            items = store.add_texts(texts, user_id="u")
            store.wait_for_encoding()
            handles = [store.handle(it.id, user_id="u") for it in items]
            for k in ks:
                print(json.dumps({"k": k, "build": build, **_measure(engine, items, handles, k, rng, args.repeats)}),
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
