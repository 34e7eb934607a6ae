"""Where does a CUDA bf16 injection differ from the prompt? (diagnostic, H200)

A tiny random Llama, one 32-token fact at position 0 (no head) and a question. Compares the
first-token logprobs of
  prompt  the whole prompt prefilled at once (fresh engine, empty prefix cache)
  cached  the same prompt again: vLLM's own prefix cache serves the fact, only the question runs
  inject  the fact encoded alone, injected (exact: nothing precedes it in the prompt)
and the fact's KV captured from a prefill of the fact alone against one of fact + question.

    python3 scripts/h200_exactness_probe.py [DTYPE ...]
"""

from __future__ import annotations

import sys
import tempfile

import torch

sys.path.insert(0, "tests")
from tiny_models import build_tiny_model  # noqa: E402

from inferscale_engine import InferScaleEngine, Span  # noqa: E402
from inferscale_engine.encoder import EncodeWindow  # noqa: E402


def diff(a, b) -> float:
    shared = set(a.first_logprobs) & set(b.first_logprobs)
    return max(abs(a.first_logprobs[t] - b.first_logprobs[t]) for t in shared)


def top2(r) -> str:
    best = sorted(r.first_logprobs.items(), key=lambda kv: -kv[1])[:2]
    return f"top {best[0][0]} ({best[0][1]:.3f}) / {best[1][0]} ({best[1][1]:.3f})"


def reference_keys(path: str, fact: list[int], dtype: str, layer: int) -> torch.Tensor:
    """``[tokens, heads, dim]`` rotated keys of ``layer`` from transformers' own forward pass."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
    with torch.no_grad():
        cache = model(torch.tensor([fact], device=device), use_cache=True).past_key_values
    return cache.layers[layer].keys[0].transpose(0, 1).float().cpu()


def probe(path: str, dtype: str, label: str = "", **options) -> None:
    with InferScaleEngine(model=path, device="cuda" if torch.cuda.is_available() else "cpu", dtype=dtype, max_model_len=512, max_logprobs=1000, **options) as engine:
        fact = (engine.tokenize("My dog is called Rex and he likes long walks in the park by the river. ") * 4)[:32]
        question = engine.tokenize(" What is my dog called?")
        sampling = {"max_tokens": 8, "first_logprobs": 1000}
        prompt = engine.generate_segments([fact + question], mode="prompt", **sampling)
        cached = engine.generate_segments([fact + question], mode="prompt", **sampling)
        alone, with_q = engine.encode([EncodeWindow.single(fact), EncodeWindow(tuple(fact + question), ((0, len(fact)),))])
        inject = engine.generate_segments([Span("probe:alone", tuple(fact), alone[0]), question], **sampling)
        inject_q = engine.generate_segments([Span("probe:withq", tuple(fact), with_q[0]), question], **sampling)
        a, b = alone[0], with_q[0]
        print(f"== {dtype} {label}: cached tokens {cached.usage.cached_tokens}, injected {inject.usage.injected_tokens}")
        for name, r in (("prompt", prompt), ("cached", cached), ("inject", inject), ("inject_q", inject_q)):
            print(f"{name:9s} {r.token_ids}  {top2(r)}")
        print(f"logprob diff prompt-cached {diff(prompt, cached):.4f}  prompt-inject {diff(prompt, inject):.4f}  "
              f"cached-inject {diff(cached, inject):.4f}  inject-inject_q {diff(inject, inject_q):.4f}")
        print(f"KV alone vs with question: k max {(a.k.float() - b.k.float()).abs().max().item():.3g}  "
              f"v max {(a.v.float() - b.v.float()).abs().max().item():.3g}  positions {a.position} {b.position}  "
              f"shape {tuple(a.k.shape)}")
        rows(a, b, "batched alone vs with_q")
        # The same windows one per encode call, and the fact plus one token.
        solo = engine.encode([EncodeWindow.single(fact)])[0][0]
        solo_q = engine.encode([EncodeWindow(tuple(fact + question), ((0, len(fact)),))])[0][0]
        plus1 = engine.encode([EncodeWindow(tuple(fact + question[:1]), ((0, len(fact)),))])[0][0]
        short = engine.encode([EncodeWindow.single(fact[:20])])[0][0]
        short_q = engine.encode([EncodeWindow(tuple(fact + question), ((0, 20),))])[0][0]
        rows(solo, solo_q, "solo alone vs solo with_q")
        rows(plus1, solo_q, "fact+1 vs solo with_q")
        rows(solo, a, "solo alone vs batched alone")
        rows(short, short_q, "20-token alone vs with_q")
        for name, kv in (("alone", solo), ("with_q", solo_q)):
            ref = reference_keys(path, fact, "float32", 1)
            got = kv.k[1].float().cpu()
            print(f"transformers fp32 layer-1 keys vs {name}: max {(ref - got).abs().max().item():.3g}")


def rows(a, b, label: str) -> None:
    d = (a.k.float() - b.k.float()).abs()  # [layers, tokens, heads, dim]
    per_layer = d.amax(dim=(1, 2, 3)).tolist()
    per_row = d.amax(dim=(0, 2, 3)).tolist()
    bad = [i for i, x in enumerate(per_row) if x > 0]
    print(f"{label}: per layer {[round(x, 3) for x in per_layer]}; rows differing {bad[:8]}{'...' if len(bad) > 8 else ''} "
          f"({len(bad)} of {len(per_row)}); layer0 row0 {d[0, 0].max().item():.3g}")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_model(tmp, "llama"))
        variants = {"": {}, "eager": {"enforce_eager": True},
                    "piecewise": {"compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"}}}
        for dtype in sys.argv[1:] or ["bfloat16"]:
            try:
                for label, options in variants.items():
                    probe(path, dtype, label, **options)
            except Exception as e:  # float32 may have no CUDA backend that InferScale knows
                print(f"== {dtype}: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
