"""Where the host time of many concurrent KV-injected requests goes (diagnostic, not a benchmark).

usage: py-spy record --threads --format raw -o OUT.raw -- \
           python scripts/profile_throughput.py MODEL_DIR [cuda|cpu] [USERS] [ENGINE OPTION=VALUE...]
       python scripts/profile_throughput.py --summarize OUT.raw   (inclusive and self samples per function)
Runs waves of USERS concurrent requests (k=50 injected facts, 32 output tokens) on an
in-process engine, as ``bench throughput`` does, and prints each wave's request rate;
``--dummy-weights`` models (config.json alone) load with load_format=dummy.
"""

import ast
import asyncio
import collections
import re
import sys
import time
from collections.abc import Iterator

from inferscale_apps.bench.common import SyntheticWorkload
from inferscale_engine.engine import InferScaleEngine


def _value(text: str) -> object:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _stacks(path: str) -> Iterator[tuple[list[str], int]]:
    """Each sample's frames and count from a ``py-spy --format raw`` file. With ``--subprocesses``
    a stack starts with ``process PID:"COMMAND LINE"`` frames, whose command line may span lines
    (``python -c`` scripts such as ``vllm serve`` started from tests): joined, and cut short."""
    pending = ""
    with open(path) as f:
        for line in f:
            pending += line.rstrip("\n")
            stack, _, count = pending.rpartition(" ")
            if not count.isdigit():
                pending += " "  # a command line's newline
                continue
            pending = ""
            stack = re.sub(r'process (\d+):"(.*?)"(?=;|$)',
                           lambda m: f"process {m.group(1)} {' '.join(m.group(2).split())[:60]}", stack, flags=re.S)
            yield [re.sub(r":\d+\)", ")", frame) for frame in stack.split(";")], int(count)


def summarize(path: str, top: int = 150) -> None:
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    total = 0
    for frames, n in _stacks(path):
        total += n
        # Processes and thread: everything up to the first frame that is neither.
        where = next((i for i, f in enumerate(frames) if not f.startswith(("process ", "thread "))), len(frames))
        threads[";".join(frames[: max(where, 1)])] += n
        for frame in set(frames):
            inclusive[frame] += n
        own[frames[-1]] += n
    print("samples", total)
    for name, counts in (("threads", threads), ("inclusive", inclusive), ("self", own)):
        print("---", name)
        for frame, n in counts.most_common(top if name == "inclusive" else 40):
            print(n, frame[:170])


def main() -> None:
    if sys.argv[1] == "--summarize":
        summarize(sys.argv[2])
        return
    model = sys.argv[1]
    device = sys.argv[2] if len(sys.argv) > 2 else "cuda"
    users = int(sys.argv[3]) if len(sys.argv) > 3 else 100
    options = {key: _value(value) for key, value in (a.split("=", 1) for a in sys.argv[4:])}
    with InferScaleEngine(model=model, device=device, dtype="bfloat16", skip_tokenizer_init=True, recompute=0,
                          **options) as engine:  # type: ignore[arg-type]
        work = SyntheticWorkload.build(engine, pool=200, fact_tokens=28)

        async def wave(n: int) -> float:
            requests = []
            for i in range(n):
                picks, question = work.sample(50), work.question()
                requests.append(engine.agenerate_segments(work.inject_segments(picks, question), user_id=f"u{i}",
                                                          max_tokens=32, ignore_eos=True))
            start = time.perf_counter()
            await asyncio.gather(*requests)
            return n / (time.perf_counter() - start)

        async def waves() -> None:
            await wave(4)
            for _ in range(5):
                print("inject", users, "users", round(await wave(users), 1), "req/s", flush=True)

        asyncio.run(waves())


if __name__ == "__main__":
    main()
