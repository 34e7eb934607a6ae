"""Does a CUDA graph mode change what vLLM computes? (diagnostic, H200)

For each graph mode, in a process of its own (one in-process engine per process), prefill one
window of random tokens, capture the KV of its first rows, and take the first-token logprobs
of a short prompt; then compare every mode with eager execution.

    python3 scripts/h200_graph_check.py MODEL [--dummy-weights]

MODEL is a model folder: a real one, a config-only shape (``scripts/make_configs.py``, with
``--dummy-weights``), or the tests' tiny Llama (``tests/tiny_models.build_tiny_model(DIR,
"llama", "bfloat16")``). The graph modes are passed explicitly, so the engine's own start-up
check (``inferscale_engine/cuda_graphs.py``) does not step in.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

MODES = {
    "eager": {"enforce_eager": True},
    "full": {"compilation_config": {"cudagraph_mode": "FULL"}},
    "full_and_piecewise": {"compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"}},
}


def one(model: str, mode: str, out: str, dummy: bool) -> None:
    import torch

    from inferscale_apps.bench.exactness import random_case
    from inferscale_engine import InferScaleEngine
    from inferscale_engine.types import EncodeWindow

    extra = {"load_format": "dummy", "skip_tokenizer_init": True} if dummy else {}
    with InferScaleEngine(model=model, device="cuda", dtype="bfloat16", max_model_len=2048, max_logprobs=1000, recompute=0,
                          **MODES[mode], **extra) as engine:
        head, facts, tail = random_case(engine, k=2)
        window = head + facts[0] + tail  # 144 tokens: one graphed step
        kv = engine.encode([EncodeWindow(tuple(window), ((0, 64),))])[0][0]
        result = engine.generate_segments([window], mode="prompt", max_tokens=4, first_logprobs=1000)
    torch.save({"k": kv.k.cpu(), "v": kv.v.cpu(), "logprobs": result.first_logprobs, "tokens": result.token_ids}, out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--dummy-weights", action="store_true")
    ap.add_argument("--one", nargs=2, metavar=("MODE", "OUT"))
    args = ap.parse_args()
    if args.one:
        return one(args.model, *args.one, args.dummy_weights)

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        got = {}
        for mode in MODES:
            out = os.path.join(tmp, mode + ".pt")
            cmd = [sys.executable, __file__, args.model, "--one", mode, out] + (["--dummy-weights"] * args.dummy_weights)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                print(f"{mode}: failed\n{proc.stderr[-2000:]}")
                continue
            got[mode] = torch.load(out)
        ref = got.get("eager")
        for mode, g in got.items():
            if ref is None or mode == "eager":
                continue
            scale = ref["k"].float().abs().amax(dim=(1, 2, 3)).clamp(min=1e-12)
            rel = ((g["k"].float() - ref["k"].float()).abs().amax(dim=(1, 2, 3)) / scale).tolist()
            shared = set(ref["logprobs"]) & set(g["logprobs"])
            lp = max(abs(ref["logprobs"][t] - g["logprobs"][t]) for t in shared)
            print(json.dumps({"model": os.path.basename(args.model.rstrip("/")), "mode": mode,
                              "key_rel_err_by_layer": [round(x, 4) for x in rel[:6]],
                              "key_rel_err_max": round(max(rel), 4), "first_logprob_diff": round(lp, 4),
                              "tokens_match": g["tokens"] == ref["tokens"]}))


if __name__ == "__main__":
    main()
