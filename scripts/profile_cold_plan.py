"""Host time of a request whose memories are all cold on disk, against prompt injection of the
same memories (issue 25: a cold request must cost no more than pasting its facts):

    python scripts/profile_cold_plan.py [--k 50,200] [--repeats 30] [--profile] [--check] [--ttft]
        [--model DIR --device cuda --dummy-weights --disk-bps 0 --max-model-len N --no-prefix-cache]

A store of SmolLM2-135M (real weights, bf16; or ``--model``) holds ``max(k)`` memories of one
user; every memory's KV is only in its disk file, outside the page cache (memory tiers dropped,
``posix_fadvise(DONTNEED)`` per file), and the disk is capped at 2 MB/s
(``MemoryConfig.disk_read_bps``, what the start-up calibration measures; ``--disk-bps 0``: the
disk as it is), so the cost model prefills them all (mix 0/0/k). Per request the clock runs over
what the host does before vLLM gets the request:

* ``cold``: ``engine.resolve`` of the prompt with ``k`` handles (render, tokenize, the store's
  ``resolve_many``) + the engine's preparation (cost model, layout, sampling params);
* ``prompt``: the same prompt with the memories' texts pasted in place of the handles,
  ``engine.resolve`` + preparation with ``mode="prompt"``.

Medians of ``--repeats`` (the two alternate); ``resolve_many`` and ``planner.plan`` are timed
apart inside ``cold``. ``--profile`` prints cProfile's top functions of the cold path;
``--check`` runs one real request each way (``max_tokens=4``) and checks the mix and that both
give the same tokens (a prefill of thousands of tokens: seconds on a CPU). ``--ttft`` times whole
requests as a user sees them, from the call to ``engine.generate`` (``max_tokens=1``) to its
answer: the cold handles against the pasted texts, each after an untimed short request, the two
in alternating order, the cold memories' background promotions done before the next repeat;
medians and the median of the paired ratios. On the H200 (no model weights there): a
Llama-3.1-8B-shaped model with random weights and SmolLM2's tokenizer (``scripts/make_configs.py
OUT --tokenizer DIR``, ``STEPS=coldtext bash scripts/h200_core.sh``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import shutil
import statistics
import tempfile
import time
import zlib

import numpy as np

from inferscale_engine import InferScaleEngine, planner
from inferscale_engine.config import MemoryConfig
from inferscale_engine.memory import MemoryStore
from inferscale_engine.memory.text.embedder import Embedder
from inferscale_engine.testing import prepared
from inferscale_engine.types import MemoryMix

USER = "cold-user"
SLOW_DISK = 2e6  # bytes a second: every cold read loses to prefilling the memory
HEAD = "Notes about the user:\n"
QUESTION = "Question: where are the keys kept?\nAnswer:"
WORDS = ("blue red green folder drawer desk kitchen garden bicycle piano cello marathon Lisbon nurse cat "
         "Monday March sister brother risotto coffee window").split()


def _facts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"Note {i}: the {rng.choice(WORDS)} {rng.choice(WORDS)} is next to the {rng.choice(WORDS)} "
            f"{rng.choice(WORDS)}.\n" for i in range(n)]


def _make_cold(engine: InferScaleEngine) -> None:
    tiers = engine.memory.tiers
    tiers.drop_memory()
    for item in engine.memory.get_all(user_id=USER):
        fd = os.open(tiers.path((item.id, 1)), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class _HashEmbedder:
    """Deterministic word-hash vectors: handles are resolved by id, so search quality plays no
    part here, and no embedding model need be on the machine."""

    inferscale_name = "profile-cold-plan-hash"

    def encode(self, texts: list[str], **_: object) -> np.ndarray:
        out = np.zeros((len(texts), 64), dtype=np.float32)
        for i, text in enumerate(texts):
            for word in text.split():
                out[i, zlib.crc32(word.encode()) % 64] += 1.0
        return out + 1e-3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", default="50,200", help="memories per request, comma separated")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--profile", action="store_true", help="cProfile the cold path")
    p.add_argument("--check", action="store_true", help="run one real request each way and compare")
    p.add_argument("--ttft", action="store_true", help="time whole requests, call to answer, both ways")
    p.add_argument("--model", default="smollm2", help="alias or model folder (with a tokenizer)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="vLLM's prefix cache off: every repeat sends the same prompts, whose pasted texts and "
                        "recomputed memories it would otherwise serve, where the cost model prices a prefill")
    p.add_argument("--dummy-weights", action="store_true", help="random weights (load_format=dummy)")
    p.add_argument("--disk-bps", type=float, default=SLOW_DISK,
                   help="cap on disk reads, bytes a second (0: the disk as it is)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    root = tempfile.mkdtemp(prefix="profile-cold-")
    results: list[dict] = []
    try:
        with InferScaleEngine(model=args.model, device=args.device, dtype="bfloat16", max_model_len=args.max_model_len,
                              recompute=0, store_path=root,
                              **({"load_format": "dummy"} if args.dummy_weights else {}),
                              **({"enable_prefix_caching": False} if args.no_prefix_cache else {})) as engine:
            engine.memory = MemoryStore.for_engine(engine, MemoryConfig.for_engine(
                engine.config, disk_read_bps=args.disk_bps or None, embedder=Embedder(_HashEmbedder())))
            texts = _facts(max(ks))
            items = engine.memory.add_texts(texts, user_id=USER)
            engine.memory.wait_for_encoding()
            rates = engine.calibrate()
            assert rates is not None, "the cost model's calibration failed"
            print(f"disk {rates.disk_bytes_per_s / 1e6:.2f} MB/s + {1e3 * rates.disk_latency_s:.1f} ms, "
                  f"prefill {[(n, round(1e3 * t, 1)) for n, t in rates.prefill]} ms", flush=True)
            for k in ks:
                cold_prompt = HEAD + "".join(item.handle for item in items[:k]) + QUESTION
                text_prompt = HEAD + "".join(texts[:k]) + QUESTION
                row = _run(engine, k, cold_prompt, text_prompt, args)
                if args.ttft:
                    row.update(_ttft(engine, k, cold_prompt, text_prompt, [(item.id, 1) for item in items[:k]],
                                     args.repeats))
                results.append(row)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"script": "profile_cold_plan", "model": args.model, "device": args.device,
                               "dummy_weights": args.dummy_weights, "disk_read_bps": args.disk_bps or None,
                               "prefix_cache": not args.no_prefix_cache,
                               "rates": rates.as_dict(), "rows": results}, f, indent=1)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _ttft(engine: InferScaleEngine, k: int, cold_prompt: str, text_prompt: str, keys: list[tuple[str, int]],
          repeats: int) -> dict:
    """Call-to-answer time of one-token requests: the cold handles against the pasted texts."""
    tiers = engine.memory.tiers
    times: dict[str, list[float]] = {"cold": [], "prompt": []}
    mixes = set()

    def short() -> None:  # the GPU awake, no long prefill just behind: for both alike
        engine.generate(QUESTION, user_id=USER, max_tokens=1, mode="prompt")

    for rep in range(3 + repeats):
        _make_cold(engine)
        for name in ("cold", "prompt") if rep % 2 == 0 else ("prompt", "cold"):
            short()
            t0 = time.perf_counter()
            if name == "cold":
                result = engine.generate(cold_prompt, user_id=USER, max_tokens=1)
            else:
                result = engine.generate(text_prompt, user_id=USER, max_tokens=1, mode="prompt")
            elapsed = time.perf_counter() - t0
            if rep >= 3:
                times[name].append(elapsed)
            if name == "cold":
                if rep >= 3:  # a warm-up's memories may still be on their way up from the check
                    mixes.add(str(result.usage.memory_mix))
                # The prefilled memories' promotions (reads into the host tier) end before the
                # next request.
                deadline = time.monotonic() + 60
                while any(where == "disk" for where in tiers.where_many(keys)):
                    if time.monotonic() > deadline:
                        raise RuntimeError("the cold memories were not promoted within 60 s")
                    time.sleep(0.001)
    ratios = [c / p for c, p in zip(times["cold"], times["prompt"])]
    row = {"ttft_cold_ms_p50": 1e3 * statistics.median(times["cold"]),
           "ttft_prompt_ms_p50": 1e3 * statistics.median(times["prompt"]),
           "cold_over_prompt_p50": statistics.median(ratios), "ttft_mixes": sorted(mixes)}
    print(f"k={k} call to answer: cold {row['ttft_cold_ms_p50']:.2f} ms, prompt {row['ttft_prompt_ms_p50']:.2f} ms, "
          f"cold / prompt (paired) {row['cold_over_prompt_p50']:.3f}, mixes {row['ttft_mixes']}", flush=True)
    return row


def _run(engine: InferScaleEngine, k: int, cold_prompt: str, text_prompt: str, args: argparse.Namespace) -> dict:
    store = engine.memory
    inner: dict[str, list[float]] = {"resolve_many": [], "plan": []}
    resolve_many, plan = store.resolve_many, planner.plan

    def timed(name, fn):  # type: ignore[no-untyped-def]
        def wrapper(*a, **kw):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                inner[name].append(time.perf_counter() - t0)
        return wrapper

    def cold() -> tuple[float, MemoryMix | None]:
        t0 = time.perf_counter()
        segments = engine.resolve(cold_prompt, user_id=USER)
        with prepared(engine, segments, USER, max_tokens=1) as request:
            elapsed = time.perf_counter() - t0
        return elapsed, request.memory_mix

    def prompt() -> float:
        t0 = time.perf_counter()
        segments = engine.resolve(text_prompt, user_id=USER)
        with prepared(engine, segments, USER, max_tokens=1, mode="prompt"):
            return time.perf_counter() - t0

    times: dict[str, list[float]] = {"cold": [], "prompt": []}
    mixes = set()
    store.resolve_many = timed("resolve_many", resolve_many)  # type: ignore[method-assign]
    planner.plan = timed("plan", plan)  # type: ignore[assignment]
    try:
        for rep in range(3 + args.repeats):
            _make_cold(engine)
            c, mix = cold()
            pr = prompt()
            if rep >= 3:
                times["cold"].append(c)
                times["prompt"].append(pr)
                mixes.add(mix)
    finally:
        del store.resolve_many
        planner.plan = plan
    med = {name: 1e3 * statistics.median(v) for name, v in times.items()}
    inner_med = {name: 1e3 * statistics.median(v[-args.repeats:]) for name, v in inner.items()}
    row = {"k": k, "host_cold_ms_p50": med["cold"], "host_prompt_ms_p50": med["prompt"],
           "resolve_many_ms_p50": inner_med["resolve_many"], "plan_ms_p50": inner_med["plan"], "mixes": sorted(map(str, mixes))}
    print(f"k={k}: cold {med['cold']:.2f} ms (resolve_many {inner_med['resolve_many']:.2f}, "
          f"plan {inner_med['plan']:.2f}), prompt {med['prompt']:.2f} ms, "
          f"cold - prompt {med['cold'] - med['prompt']:+.2f} ms, mixes {sorted(map(str, mixes))}")
    if args.profile:
        prof = cProfile.Profile()
        for _ in range(args.repeats):
            _make_cold(engine)
            prof.enable()
            cold()
            prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
        print(out.getvalue())
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
        print(out.getvalue())
    if args.check:
        _make_cold(engine)
        got = engine.generate(cold_prompt, user_id=USER, max_tokens=4)
        want = engine.generate(text_prompt, user_id=USER, max_tokens=4, mode="prompt")
        print(f"k={k} check: mix {got.usage.memory_mix}, same tokens as prompt injection: "
              f"{got.token_ids == want.token_ids}, same prompt: {got.prompt_token_ids == want.prompt_token_ids}")
        row.update(check_mix=str(got.usage.memory_mix), check_same_tokens=got.token_ids == want.token_ids,
                   check_same_prompt=got.prompt_token_ids == want.prompt_token_ids)
    return row


if __name__ == "__main__":
    main()
