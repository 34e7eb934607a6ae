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

Prints one JSON line per k (µs).

``--sections retrieval`` (also in the default ``resolve,retrieval``): one search's host costs, as
``bench ttft`` times it (``SyntheticRetriever``: the store's query encoder, ``.cpu().numpy()``,
``ExactIndex.search`` over ``--index-facts`` vectors, top ``--ks``'s largest), on the CPU, where
the encoder runs eagerly (no CUDA graph):

* ``idle_wakes_per_s``: per thread of the engine (its memory store built, as a server's is) and
  sitting idle, how often the OS woke it (context switches over 2 s, from ``/proc``): a thread
  that polls wakes on its timer, takes the GIL and can hold a search's thread waiting for it;
* per encoder (``minilm``: bench ttft's 6-layer 384-wide BERT; ``tiny``: a 1-layer 32-wide one,
  so that the host's share shows), the whole call ``alone`` (half before the engine starts, half
  after it closes: phases, so the box's load drifting between them shows here; only ``idle`` and
  ``after request`` interleave call by call), with the engine alive and ``idle``, each 20 ms after the last
  call (a pause slows the next call by itself: compare these two), and ``after request``: right
  after a request returns, where ``bench ttft`` calls it;
* ``tiny`` alone, split: ``encode`` (the encoder's call: inputs built, forward, pooled) and
  ``forward``, a yardstick beside it (transformers' own forward of the model on inputs built
  beforehand, unpooled, with its mask helpers, which the encoder skips: runs before 2026-12-06
  06:15 timed the encoder's private forward instead, a part of ``encode``); ``search`` (``ExactIndex``)
  and of it ``matmul+topk`` (the same two ops on the query as a tensor, results left on the
  device).

Absolute figures move with the box's load: compare figures of one run, or of two builds run one
after the other (``PYTHONPATH=<worktree>``).
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


def _thread_wakes(seconds: float = 2.0) -> dict[str, float]:
    """Context switches per second of each named thread of this process (Linux ``/proc``)."""
    import threading

    def switches() -> dict[int, int]:
        out = {}
        for t in threading.enumerate():
            if t.native_id is None:
                continue
            try:
                with open(f"/proc/self/task/{t.native_id}/status") as f:
                    out[t.native_id] = sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
            except FileNotFoundError:
                pass
        return out

    names = {t.native_id: t.name for t in threading.enumerate()
             if t is not threading.current_thread() and t.native_id is not None}
    before = switches()
    time.sleep(seconds)
    after = switches()
    wakes: dict[str, float] = {}
    for tid, name in names.items():
        if tid in before and tid in after:
            wakes[name] = wakes.get(name, 0.0) + (after[tid] - before[tid]) / seconds
    return dict(sorted(wakes.items()))


def _retrievers(k: int, facts: int) -> dict[str, Any]:
    """bench ttft's retriever, and one with a 1-layer 32-wide encoder over the same index size."""
    from transformers import BertConfig, BertModel

    from inferscale_apps.bench.common import SyntheticRetriever

    minilm = SyntheticRetriever("cpu", facts=facts, k=k)
    tiny = SyntheticRetriever("cpu", facts=facts, k=k)
    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    tiny.encoder = type(minilm.encoder)(BertModel(cfg).eval())
    tiny.index = type(minilm.index)(32)
    vecs = torch.nn.functional.normalize(torch.randn(facts, 32), dim=-1).numpy()
    tiny.index.add(list(range(facts)), vecs)
    return {"minilm": minilm, "tiny": tiny, "tiny_vecs": vecs}


def _retrieval_split(tiny: Any, vecs: Any, question: list[int], k: int, repeats: int) -> dict[str, float]:
    from inferscale_engine.memory.text import query_graph

    n = len(question)
    bucket = next(b for b in query_graph.BUCKETS if b >= n)
    io = torch.zeros(2, bucket, dtype=torch.long)
    io[0, :n] = torch.tensor(question)
    io[1, :n] = 1
    query = tiny.encoder(question).cpu().numpy()
    mat, q = torch.from_numpy(vecs), torch.from_numpy(query)

    def forward() -> None:
        with torch.inference_mode():
            tiny.encoder.model(input_ids=io[0:1], attention_mask=io[1:2])

    return {
        "encode": _median_us(lambda: tiny.encoder(question), repeats),
        "forward": _median_us(forward, repeats),
        "search": _median_us(lambda: tiny.index.search(query, k), repeats),
        "matmul+topk": _median_us(lambda: torch.topk(mat @ q, k), repeats),
    }


def _retrieval(args: argparse.Namespace, build: str, model: Path, store_path: Path) -> None:
    """The ``retrieval`` section (see the module docstring)."""
    from inferscale_engine import InferScaleEngine

    k = max(int(x) for x in args.ks.split(","))
    rng = random.Random(1)
    made = _retrievers(k, args.index_facts)
    names = ("minilm", "tiny")
    times: dict[str, dict[str, list[float]]] = {n: {"alone": [], "idle": [], "after request": []} for n in names}
    question = lambda: [rng.randint(1000, 29999) for _ in range(24)]  # noqa: E731  (bench ttft's 24 tokens)

    def alone(count: int) -> None:
        for _ in range(count):
            for n in names:
                time.sleep(0.02)  # as before an idle engine's call: a pause cools caches and threads alike
                times[n]["alone"].append(made[n](question()))

    for n in names:  # warm
        made[n](question())
    split = _retrieval_split(made["tiny"], made["tiny_vecs"], question(), k, args.repeats)
    alone(args.repeats // 2)
    with InferScaleEngine(model=str(model), device="cpu", max_model_len=2048, recompute=0,
                          store_path=store_path) as engine:
        store = engine.memory  # its threads alive, as a server's are
        store.add_texts([f"fact {i}: the garden by the river" for i in range(8)], user_id="u")
        store.wait_for_encoding()
        prompt = [[rng.randint(10, 250) for _ in range(64)]]
        engine.generate_segments(prompt, max_tokens=1, mode="prompt")
        time.sleep(0.5)
        wakes = _thread_wakes()
        for _ in range(args.repeats):
            for n in names:
                time.sleep(0.02)
                times[n]["idle"].append(made[n](question()))
                engine.generate_segments(prompt, max_tokens=1, mode="prompt")
                times[n]["after request"].append(made[n](question()))
    alone(args.repeats - args.repeats // 2)
    figures = {f"{n} {state}": round(1e6 * statistics.median(ts), 1) for n in names for state, ts in times[n].items()}
    print(json.dumps({"section": "retrieval", "k": k, "facts": args.index_facts, "build": build,
                      "idle_wakes_per_s": wakes, **figures, **{f"tiny {p}": v for p, v in split.items()}}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ks", default="50,200")
    parser.add_argument("--facts", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--sections", default="resolve,retrieval", help="resolve, retrieval or both")
    parser.add_argument("--index-facts", type=int, default=10_000, help="vectors a search searches (retrieval)")
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
    sections = args.sections.split(",")
    with tempfile.TemporaryDirectory(prefix="inferscale-hostcosts-") as tmp:
        model = build_tiny_model(Path(tmp) / "tiny-llama", "llama")
        if "retrieval" in sections:
            _retrieval(args, build, model, Path(tmp) / "store-retrieval")
        if "resolve" not in sections:
            return 0
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
