"""Host time of a request whose memories are all cold on disk, against prompt injection of the
same memories (issue 25: a cold request must cost no more than pasting its facts):

    python scripts/profile_cold_plan.py [--k 50,200] [--repeats 30] [--profile] [--check]

A store of SmolLM2-135M (real weights, bf16) holds ``max(k)`` memories of one user; every
memory's KV is only in its disk file, outside the page cache (memory tiers dropped,
``posix_fadvise(DONTNEED)`` per file), and the disk is capped at 2 MB/s
(``MemoryConfig.disk_read_bps``, what the start-up calibration measures), so the cost model
prefills them all (mix 0/0/k). Per request the clock runs over what the host does before vLLM
gets the request:

* ``cold``: ``engine.resolve`` of the prompt with ``k`` handles (render, tokenize, the store's
  ``resolve_many``) + the engine's preparation (cost model, layout, sampling params);
* ``prompt``: the same prompt with the memories' texts pasted in place of the handles,
  ``engine.resolve`` + preparation with ``mode="prompt"``.

Medians of ``--repeats`` (the two alternate); ``resolve_many`` and ``planner.plan`` are timed
apart inside ``cold``. ``--profile`` prints cProfile's top functions of the cold path;
``--check`` runs one real request each way (``max_tokens=4``) and checks the mix and that both
give the same tokens (a prefill of thousands of tokens: seconds on a CPU).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import shutil
import statistics
import tempfile
import time

from inferscale_engine import InferScaleEngine, planner
from inferscale_engine.config import MemoryConfig
from inferscale_engine.runtime import build_memory
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", default="50,200", help="memories per request, comma separated")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--profile", action="store_true", help="cProfile the cold path")
    p.add_argument("--check", action="store_true", help="run one real request each way and compare")
    args = p.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    root = tempfile.mkdtemp(prefix="profile-cold-")
    try:
        with InferScaleEngine(model="smollm2", device="cpu", dtype="bfloat16", max_model_len=8192,
                              recompute=0, store_path=root) as engine:
            engine.memory = build_memory(engine, MemoryConfig.for_engine(engine.config, disk_read_bps=SLOW_DISK))
            texts = _facts(max(ks))
            items = engine.memory.add_texts(texts, user_id=USER)
            engine.memory.wait_for_encoding()
            rates = engine.calibrate()
            assert rates is not None, "the cost model's calibration failed"
            print(f"disk {rates.disk_bytes_per_s / 1e6:.2f} MB/s + {1e3 * rates.disk_latency_s:.1f} ms, "
                  f"prefill {[(n, round(1e3 * t, 1)) for n, t in rates.prefill]} ms")
            for k in ks:
                cold_prompt = HEAD + "".join(item.handle for item in items[:k]) + QUESTION
                text_prompt = HEAD + "".join(texts[:k]) + QUESTION
                _run(engine, k, cold_prompt, text_prompt, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(engine: InferScaleEngine, k: int, cold_prompt: str, text_prompt: str, args: argparse.Namespace) -> None:
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
        prepared, _ = engine._prepare(segments, USER, max_tokens=1)
        elapsed = time.perf_counter() - t0
        engine._unstage(prepared.staged)
        return elapsed, prepared.memory_mix

    def prompt() -> float:
        t0 = time.perf_counter()
        segments = engine.resolve(text_prompt, user_id=USER)
        prepared, _ = engine._prepare(segments, USER, max_tokens=1, mode="prompt")
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


if __name__ == "__main__":
    main()
