"""Memory-store numbers: encode throughput, search latency, tier promotion, chat under writes.

    python -m inferscale_apps.bench.store --model smollm2

Prints (and with ``--json PATH`` writes) figures for:

* add/encode throughput in facts/s for bulk import with context-window encoding (one
  prefill per fact after its ``window`` predecessors) and sliding-chunk encoding (one
  prefill per ``group`` facts), split into embedding and KV encoding, plus the background
  path (``add()`` one fact at a time, then ``wait_for_encoding``);
* search latency p50 at 1k and 10k facts of one user (exact torch index and faiss), end to
  end (query embedding included) and index only. Those stores are filled with random unit
  vectors (latency does not depend on the values; embedding 10k texts would take minutes);
* tier promotion time per fact (disk→device, host→device, device hit) on real KV;
* time to first token of a short chat request, idle and while the encoder thread works.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from inferscale_apps.bench.locomo_data import default_data_path, load_locomo


def _p50(xs: list[float]) -> float:
    return statistics.median(xs)


def _turns(path: Path, n: int) -> list[tuple[str, str]]:
    turns: list[tuple[str, str]] = []
    if path.exists():
        for conv in load_locomo(path):
            turns += [(t.speaker, t.text) for t in conv.turns]
            if len(turns) >= n:
                break
    i = 0
    while len(turns) < n:  # no LoCoMo here: synthetic chat turns
        turns.append(("User" if i % 2 == 0 else "Assistant", f"Turn {i}: I went to the market and bought {i} apples."))
        i += 1
    return turns[:n]


class _RandomEmbedder:
    """Random unit vectors (fills the search-latency stores without minutes of embedding)."""

    inferscale_name = "bench-random"

    def __init__(self, dim: int = 384) -> None:
        self.dim = dim
        self.rng = np.random.default_rng(0)

    def encode(self, texts: list[str]) -> np.ndarray:
        return self.rng.standard_normal((len(texts), self.dim)).astype(np.float32)


def bench_encode(engine: Any, embedder: Any, turns: list[tuple[str, str]], window: int, group: int, root: Path) -> dict:
    from inferscale_engine.memory import MemoryStore
    from inferscale_engine.types import EncodeWindow

    out: dict[str, Any] = {"facts": len(turns), "window": window, "group": group}
    texts = [f"{s}: {t}" for s, t in turns]
    t0 = time.perf_counter()
    embedder.embed(texts)
    out["embed_facts_per_s"] = len(texts) / (time.perf_counter() - t0)

    ids = [engine.tokenize(t) for t in texts]
    out["tokens_per_fact"] = sum(map(len, ids)) / len(ids)

    # Engine only: the prefills the store issues, without embedding / SQLite / KV files.
    nl = engine.tokenize("\n")
    cw = []
    for i, f in enumerate(ids):
        prev = texts[max(0, i - window) : i]
        cw.append(EncodeWindow.single(f, engine.tokenize("\n".join(prev) + "\n") if prev else ()))
    sw = []
    for first in range(0, len(ids), group):
        prev = texts[max(0, first - window) : first]
        seq = list(engine.tokenize("\n".join(prev) + "\n")) if prev else []
        ranges: list[tuple[int, int]] = []
        for f in ids[first : first + group]:
            if ranges:
                seq += nl
            ranges.append((len(seq), len(f)))
            seq += f
        sw.append(EncodeWindow(tuple(seq), tuple(ranges)))
    for name, windows in (("context_window", cw), ("sliding", sw)):
        engine.encode(windows[:4])  # warm
        t0 = time.perf_counter()
        for i in range(0, len(windows), 32):
            engine.encode(windows[i : i + 32])
        dt = time.perf_counter() - t0
        out[f"{name}_engine_facts_per_s"] = len(ids) / dt
        out[f"{name}_prefill_tokens_per_fact"] = sum(len(w.token_ids) for w in windows) / len(ids)

    # The store's bulk import, end to end (embedding + SQLite + encode + KV files).
    for name, g in (("context_window", None), ("sliding", group)):
        store = MemoryStore(engine, root / f"import-{name}", window=window, embedder=embedder)
        t0 = time.perf_counter()
        store.import_conversation(turns, user_id="bench", sliding_group=g, progress=False)
        out[f"{name}_import_facts_per_s"] = len(turns) / (time.perf_counter() - t0)
        store.close()

    # The background path: add() one fact at a time, encoder thread batches the queue.
    store = MemoryStore(engine, root / "adds", window=window, embedder=embedder)
    lat = []
    t0 = time.perf_counter()
    for s, t in turns:
        a = time.perf_counter()
        store.add(f"{s}: {t}", user_id="bench")
        lat.append(time.perf_counter() - a)
    added = time.perf_counter() - t0
    store.wait_for_encoding()
    total = time.perf_counter() - t0
    out["add_latency_p50_ms"] = _p50(lat) * 1e3
    out["add_then_encode_facts_per_s"] = len(turns) / total
    out["add_only_facts_per_s"] = len(turns) / added
    store.close()
    return out


def bench_tiers(engine: Any, embedder: Any, turns: list[tuple[str, str]], root: Path, n: int = 100) -> dict:
    from inferscale_engine.handles import find_handles
    from inferscale_engine.memory import MemoryStore

    store = MemoryStore(engine, root / "tiers", embedder=embedder)
    items = store.import_conversation(turns[:n], user_id="bench", progress=False)
    keys = [(i.id, 1) for i in items]
    fp = store.fingerprint
    assert fp is not None  # a store with an encoder has one
    tiers = store.tiers
    res: dict[str, Any] = {"facts": len(keys)}
    kvs = [tiers.get(k, fp) for k in keys]
    res["kv_bytes_per_fact"] = sum(kv.nbytes for kv in kvs) / len(kvs)
    res["kv_dtype"] = str(kvs[0].k.dtype)

    def timed(prepare) -> float:
        xs = []
        for k in keys:
            prepare(k)
            t0 = time.perf_counter()
            tiers.get(k, fp)
            xs.append(time.perf_counter() - t0)
        return _p50(xs) * 1e3

    tiers.drop_memory()
    os.sync()  # the files are written; reads may still come from the page cache (warm disk)
    res["disk_to_device_ms_p50"] = timed(lambda k: tiers.evict(k, to="disk"))
    res["host_to_device_ms_p50"] = timed(lambda k: tiers.evict(k, to="host"))
    res["device_hit_ms_p50"] = timed(lambda k: None)
    xs = []
    for it in items:
        h = find_handles(it.handle)[0]
        t0 = time.perf_counter()
        store.resolve(h, "bench")
        xs.append(time.perf_counter() - t0)
    res["resolve_device_hit_ms_p50"] = _p50(xs) * 1e3
    store.close()
    return res


def bench_search(minilm: Any, root: Path, sizes: tuple[int, ...], repeats: int = 50) -> dict:
    from inferscale_engine.memory import MemoryStore
    from inferscale_engine.memory.text.embedder import Embedder

    res: dict[str, Any] = {}
    queries = [f"what did we talk about on day {i}?" for i in range(repeats)]
    t0 = time.perf_counter()
    qv = minilm.embed(queries[:1])
    for q in queries:
        a = time.perf_counter()
        minilm.embed([q])
        res.setdefault("_q", []).append(time.perf_counter() - a)
    res["query_embedding_ms_p50"] = _p50(res.pop("_q")) * 1e3
    del t0, qv
    for kind in ("exact", "faiss"):
        for n in sizes:
            store = MemoryStore(None, root / f"search-{kind}-{n}", embedder=Embedder(_RandomEmbedder()), index=kind)
            store.import_conversation([("", f"fact number {i}") for i in range(n)], user_id="u", progress=False)
            store.embedder = minilm  # queries go through the real model
            index = store.table.index("u")
            assert index is not None  # the import just filled it
            store.search(queries[0], user_id="u", k=10)
            e2e, idx = [], []
            for q in queries:
                a = time.perf_counter()
                store.search(q, user_id="u", k=10)
                e2e.append(time.perf_counter() - a)
            vecs = minilm.embed(queries)
            for v in vecs:
                a = time.perf_counter()
                index.search(v, 10)
                idx.append(time.perf_counter() - a)
            res[f"{kind}_{n}_search_ms_p50"] = _p50(e2e) * 1e3
            res[f"{kind}_{n}_index_ms_p50"] = _p50(idx) * 1e3
            store.close()
    return res


def bench_chat_under_writes(engine: Any, embedder: Any, turns: list[tuple[str, str]], root: Path, window: int,
                            batch_tokens: int) -> dict:
    from inferscale_engine.memory import MemoryStore

    prompt = [{"role": "user", "content": "What is the capital of France?"}]

    def ttfts(n: int) -> list[float]:
        return [engine.generate(prompt, max_tokens=4).ttft_s for _ in range(n)]

    ttfts(2)
    idle = ttfts(8)
    store = MemoryStore(engine, root / f"busy-{batch_tokens}", window=window, embedder=embedder,
                        encode_batch_tokens=batch_tokens)
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            s, t = turns[i % len(turns)]
            store.add(f"{s}: {t}", user_id="bench")
            i += 1

    w = threading.Thread(target=writer, daemon=True)
    w.start()
    time.sleep(1.0)
    t0 = time.perf_counter()
    busy = ttfts(8)
    stop.set()
    w.join()
    encoded_meanwhile = store.stats()["encoded"]
    window_s = time.perf_counter() - t0
    res = {"encode_batch_tokens": batch_tokens, "ttft_idle_ms_p50": _p50(idle) * 1e3,
           "ttft_during_writes_ms_p50": _p50(busy) * 1e3, "ttft_during_writes_ms_max": max(busy) * 1e3,
           "facts_encoded_per_s_meanwhile": encoded_meanwhile / window_s}
    store.close()  # queued facts are left for on-demand encoding; this is a throwaway store
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default=None)
    parser.add_argument("--turns", type=int, default=256, help="conversation turns to encode")
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--group", type=int, default=8, help="turns per sliding-chunk prefill")
    parser.add_argument("--search-sizes", default="1000,10000")
    parser.add_argument("--locomo", type=Path, default=default_data_path())
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--encode-batch-tokens", default="256,4096",
                        help="comma list of background batch budgets to try in the chat section")
    parser.add_argument("--skip", default="", help="comma list of sections to skip: encode,tiers,search,chat")
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))

    from inferscale_engine import InferScaleEngine
    from inferscale_engine.memory.text.embedder import Embedder

    root = Path(tempfile.mkdtemp(prefix="inferscale-memory-bench-"))
    results: dict[str, Any] = {"model": args.model, "cpu_count": os.cpu_count()}
    try:
        embedder = Embedder(device=args.device or "cpu")
        embedder.embed(["warm up"])
        turns = _turns(args.locomo, args.turns)
        results["turns_source"] = "locomo" if args.locomo.exists() else "synthetic"
        if "search" not in skip:
            sizes = tuple(int(x) for x in args.search_sizes.split(","))
            results["search"] = bench_search(embedder, root, sizes)
            _show("search", results["search"])
        if not {"encode", "tiers", "chat"} <= skip:
            t0 = time.perf_counter()
            engine = InferScaleEngine(model=args.model, device=args.device, max_model_len=4096,
                                      store_path=root / "engine-store")
            results["engine_start_s"] = time.perf_counter() - t0
            results["device"] = engine.config.device
            try:
                if "encode" not in skip:
                    results["encode"] = bench_encode(engine, embedder, turns, args.window, args.group, root)
                    _show("encode", results["encode"])
                if "tiers" not in skip:
                    results["tiers"] = bench_tiers(engine, embedder, turns, root)
                    _show("tiers", results["tiers"])
                if "chat" not in skip:
                    for budget in (int(x) for x in args.encode_batch_tokens.split(",")):
                        r = bench_chat_under_writes(engine, embedder, turns, root, args.window, budget)
                        results.setdefault("chat", []).append(r)
                        _show(f"chat (encode_batch_tokens={budget})", r)
            finally:
                engine.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def _show(section: str, values: dict[str, Any]) -> None:
    print(f"\n== {section}", flush=True)
    for k, v in values.items():
        print(f"  {k:40s} {v:10.3f}" if isinstance(v, float) else f"  {k:40s} {v}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
