"""Cost of the token-level recompute (``recompute_tokens``) against plain injection.

Serves ``k`` LoCoMo-shaped memories (``[time on date] Speaker: text``, each encoded alone) with
everything injected, then with each memory's header recomputed (``header``), with the headers of
the last 5 only (``header:5``: where the knob serves the most relevant memories), with CacheBlend's
selection (``deviating:15``), with every memory row recomputed (``first:1000``), then as a plain
prompt (``prompt``, nothing injected), and prints the median time of each request
(``max_tokens=1``: the first token). The rows ride vLLM's forward pass, or with
``--separate-pass`` run a pass of their own ahead of it. ``--rules`` picks the rules, and
``--recompute 0,4`` serves each with the quality knob's last R memories prefilled as text too
(the two together's cost). Model: a tiny random-weight one from tests/tiny_models.py
(``--arch``), or any local model folder (``--model``; ``--dummy-weights``: random weights of its
shape, as on the H200). Each row also says how far its first token's top-20 logprobs lie from
the prompt's (``max_logprob_diff_to_prompt``, over the tokens both top 20s hold:
``top20_shared_with_prompt``) and whether its greedy token is the prompt's: every memory
row recomputed (``first:1000``) must come within the attention kernels' rounding of the prompt.

Run: ``python scripts/token_recompute_cost.py --k 5,50`` (niced on a shared box); on the H200,
``STEPS=tokenrecompute bash scripts/h200_core.sh`` (the CUDA path: the prefix read back from the
cache by the block table, each recompute replayed as a CUDA graph). ``--profile FILE`` then serves the ``header`` row of the last k
``--repeats`` times more under torch's profiler and writes its op tables there (by self CPU time,
and by device time where there is a device): whether the recompute waits on the host or on the
GPU (on an H100, eagerly, it cost ~1.5 ms per layer whatever the row count). On CUDA each row
also says how far its last request's top logprobs lie from its first's
(``max_logprob_diff_last_to_first``): the graph's replays against its eager first run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", default="5,50", help="memories per request, comma-separated")
    parser.add_argument("--arch", default="llama", help="tiny model architecture (tests/tiny_models.py)")
    parser.add_argument("--model", help="a local model folder instead of a tiny model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dummy-weights", action="store_true", help="random weights (load_format=dummy)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", metavar="FILE", help="also profile the header row of the last k into FILE "
                        "(the separate pass's recomputes: with --separate-pass)")
    parser.add_argument("--cudagraph-mode", help="vLLM's cudagraph_mode (default: as the engine picks it)")
    parser.add_argument("--recompute", default="0",
                        help="the quality knob on the injected rows, comma-separated: each R serves every rule "
                             "with its last R memories prefilled as text (the rules choose among the rest)")
    parser.add_argument("--rules", default="header,header:5,deviating:15,first:1000",
                        help="recompute_tokens rules, comma-separated (each beside plain injection and the prompt)")
    parser.add_argument("--separate-pass", action="store_true",
                        help="recompute in a pass of its own ahead of vLLM's (recompute_in_forward=False)")
    args = parser.parse_args()

    from tiny_models import VLLM_CPU_TEST_ENV, build_tiny_model

    for key, value in VLLM_CPU_TEST_ENV.items():
        os.environ.setdefault(key, value)
    from inferscale_apps.bench.exactness import encode_spans
    from inferscale_engine import InferScaleEngine

    model = args.model or str(build_tiny_model(Path(tempfile.mkdtemp()) / f"tiny-{args.arch}", args.arch))
    ks = [int(k) for k in args.k.split(",")]
    recomputes = [int(r) for r in args.recompute.split(",")]
    rules = args.rules.split(",")
    rows = []
    options: dict = {"load_format": "dummy"} if args.dummy_weights else {}
    if args.cudagraph_mode:
        options["compilation_config"] = {"cudagraph_mode": args.cudagraph_mode}
    with InferScaleEngine(model=model, device=args.device, dtype=args.dtype, max_model_len=2048, recompute=0,
                          recompute_in_forward=not args.separate_pass, **options) as engine:
        head = engine.tokenize("<|im_start|>system\nThings you remember about the user:\n")
        tail = engine.tokenize("<|im_end|>\n<|im_start|>user\nWhen did Caroline adopt her cat?<|im_end|>\n"
                               "<|im_start|>assistant\n")
        for k in ks:
            facts = [engine.tokenize(f"[{1 + i % 12}:{10 + i % 50} pm on {1 + i % 28} May, 2023] "
                                     f"{'Caroline' if i % 2 else 'Melanie'}: memory {i} about "
                                     f"the lake.\n") for i in range(k)]
            spans = encode_spans(engine, head, facts, exact=False, key=f"cost-{k}")
            segments = [head, *spans, tail]
            flat = [*head, *(t for f in facts for t in f), *tail]
            first = {}  # per row: (greedy token, top logprobs) of its first request
            runs = [("prompt", 0)] + [(spec, r) for r in recomputes for spec in (None, *rules)]
            for spec, recompute in runs:
                engine.config.recompute_tokens = None if spec == "prompt" else spec
                times = []
                for i in range(args.repeats + 1):
                    t0 = time.perf_counter()
                    if spec == "prompt":  # a user of its own each time: no prefix-cache hit
                        result = engine.generate_segments([flat], mode="prompt", max_tokens=1, first_logprobs=20,
                                                          user_id=f"cost-{k}-{i}")
                    else:
                        result = engine.generate_segments(segments, max_tokens=1, first_logprobs=20,
                                                          recompute=recompute)
                    times.append(time.perf_counter() - t0)
                    first.setdefault((spec, recompute), (result.token_ids[0], result.first_logprobs or {}))
                token, logprobs = first[spec, recompute]
                last = result.first_logprobs or {}
                prompt_token, prompt_logprobs = first["prompt", 0]
                rows.append({"k": k, "recompute_tokens": spec, "recompute": recompute,
                             "pass": "separate" if args.separate_pass else "forward",
                             "cudagraph_mode": str(engine.vllm_config.compilation_config.cudagraph_mode),
                             "prompt_tokens": len(flat),
                             "median_ms": round(1e3 * statistics.median(times[1:]), 2),
                             "greedy_is_prompts": token == prompt_token,
                             # over the prompt's top 20 that this row's top 20 also holds
                             "top20_shared_with_prompt": len(both := prompt_logprobs.keys() & logprobs.keys()),
                             "max_logprob_diff_to_prompt": max((abs(logprobs[t] - prompt_logprobs[t]) for t in both),
                                                               default=None),
                             # a CUDA graph's replays against the first request (run eagerly, then captured)
                             "max_logprob_diff_last_to_first": max((abs(last[t] - logprobs[t])
                                                                    for t in logprobs.keys() & last.keys()), default=None)})
                print(json.dumps(rows[-1]), flush=True)
        if args.profile and args.separate_pass:
            _profile(engine, segments, args.repeats, Path(args.profile))
        elif args.profile:
            _host_split(engine, segments, args.repeats, Path(args.profile))
        engine.config.recompute_tokens = None


def _profile(engine, segments, repeats: int, out: Path) -> None:
    """The header row's recomputes under torch's profiler, each profiled in the thread that runs it
    (the engine's step, not this one): the time of each alone, and op tables of the last, into
    ``out``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from inferscale_engine.connector import blend

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    seen, took, depth = [], [], [0]

    def profiled(run):
        def wrapper(self, *args, **kwargs):
            if depth[0]:  # a graph's first run calls the eager one: time the outer call only
                return run(self, *args, **kwargs)
            depth[0] += 1
            try:
                with profile(activities=activities) as prof:
                    t0 = time.perf_counter()
                    out = run(self, *args, **kwargs)
                    if cuda:
                        torch.cuda.synchronize()
                    took.append(time.perf_counter() - t0)
            finally:
                depth[0] -= 1
            seen.append(prof)
            return out
        return wrapper

    # Eager recomputes, and CUDA graph replays (where the worker replays one)
    originals = {cls: cls.run for cls in (blend.LayerwiseRecompute, blend.GraphedRecompute)}
    for cls, run in originals.items():
        cls.run = profiled(run)
    engine.config.recompute_tokens = "header"
    try:
        for _ in range(repeats):
            engine.generate_segments(segments, max_tokens=1)
    finally:
        for cls, run in originals.items():
            cls.run = run
    tables = [seen[-1].key_averages().table(sort_by="self_cpu_time_total", row_limit=40)]
    if cuda:
        tables.append(seen[-1].key_averages().table(sort_by="self_cuda_time_total", row_limit=40))
    median_ms = round(1e3 * statistics.median(took), 2)
    out.write_text(f"recompute_tokens=header: {len(took)} recomputes, {median_ms} ms each (median, profiled)\n\n"
                   + "\n\n".join(tables))
    print(json.dumps({"profile": str(out), "recomputes": len(took), "recompute_ms_profiled": median_ms}), flush=True)


def _host_split(engine, segments, repeats: int, out: Path) -> None:
    """Where the rows riding the forward pass spend host time, per request of the ``header:5``
    row of the last k: arming the step (``start``) and the rows' attention after vLLM's, summed
    over the layers (host time as the worker's thread spends it; no device sync is added)."""
    from inferscale_engine.connector.forward_recompute import ForwardRecompute

    spent = {"start": 0.0, "attend": 0.0, "attend_calls": 0}
    originals = {name: getattr(ForwardRecompute, name) for name in ("start", "_attend")}

    def timed(name):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return originals[name](*args, **kwargs)
            finally:
                spent[name.lstrip("_")] += time.perf_counter() - t0
                spent["attend_calls"] += name == "_attend"
        return wrapper

    for name in originals:
        setattr(ForwardRecompute, name, timed(name))
    engine.config.recompute_tokens = "header:5"
    took = []
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.generate_segments(segments, max_tokens=1)
            took.append(time.perf_counter() - t0)
    finally:
        for name, method in originals.items():
            setattr(ForwardRecompute, name, method)
    row = {"host_split": "header:5", "requests": repeats, "request_ms": round(1e3 * statistics.median(took), 2),
           "start_ms_per_request": round(1e3 * spent["start"] / repeats, 3),
           "attend_ms_per_request": round(1e3 * spent["attend"] / repeats, 3),
           "attend_calls_per_request": spent["attend_calls"] / repeats}
    out.write_text(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
