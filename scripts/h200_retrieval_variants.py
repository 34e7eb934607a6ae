"""One query's retrieval on the GPU, by encoder precision (diagnostic): the MiniLM-shaped encoder as
the store's CUDA graph in fp32, with TF32 matmuls, and in fp16/bf16, each against fp32's vector
(cosine) and the exact top-50 it finds over 10k stored vectors. The whole retrieval, with the
vector brought to the host and back or left on the device (as the store searches), is timed three
ways: in a warm loop; 20 ms after the last call, as one request among others (`bench ttft` runs
one retrieval per repeat); and right after ~10 ms of other GPU work, as after vLLM's forward pass.

usage: python scripts/h200_retrieval_variants.py
"""

import time

import torch
from transformers import BertConfig, BertModel

from inferscale_apps.bench.common import median
from inferscale_engine.memory.meta.index import ExactIndex
from inferscale_engine.memory.text.query_graph import GraphedQueryEncoder


def timed(fn, reps=100, before=None):
    out = []
    for _ in range(reps + 10):
        if before is not None:
            before()
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        out.append(1e3 * (time.perf_counter() - t))
    return median(out[10:])


def gpu_work():
    """~10 ms of matmuls on the GPU (bf16 8k x 8k, a few), finished before the call is timed."""
    for _ in range(8):
        busy @ busy


torch.manual_seed(0)
busy = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
cfg = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
base = BertModel(cfg).eval()
index = ExactIndex(384, device="cuda")
vecs = torch.nn.functional.normalize(torch.randn(10_000, 384), dim=-1).numpy()
index.add(list(range(10_000)), vecs)
ids = torch.randint(1000, 30000, (24,)).tolist()
ref = None
for name in ("fp32", "tf32", "fp16", "bf16"):
    torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(name, torch.float32)
    enc = GraphedQueryEncoder(BertModel(cfg).eval().to("cuda", dtype).requires_grad_(False))
    enc.model.load_state_dict({k: v.to(dtype) for k, v in base.state_dict().items()})
    vec = enc(ids)
    top = [s for s, _ in index.search(vec.numpy(), 50)]
    if ref is None:
        ref = (vec, set(top))
    cos = float(torch.dot(vec.float(), ref[0].float()))
    query = vec.numpy()
    encode = timed(lambda: enc(ids))  # noqa: B023  (timed in this iteration)
    search = timed(lambda: index.search(query, 50))  # noqa: B023
    assert [s for s, _ in index.search(enc.on_device(ids), 50)] == top
    print(f"{name}: encode {encode:.3f} ms, search {search:.3f} ms; cosine to fp32 {cos:.6f}, "
          f"top-50 overlap {len(ref[1] & set(top))}/50", flush=True)
    # The vector through the host (two waits, a copy back) and left on the device (one wait).
    for way, whole in (("host", lambda: index.search(enc(ids).numpy(), 50)),  # noqa: B023
                       ("device", lambda: index.search(enc.on_device(ids), 50))):  # noqa: B023
        warm = timed(whole)
        paused = timed(whole, reps=50, before=lambda: time.sleep(0.02))
        after_gpu = timed(whole, reps=50, before=gpu_work)
        print(f"{name}: whole, vector via the {way}: warm {warm:.3f} ms, 20 ms after the last {paused:.3f} ms, "
              f"after other GPU work {after_gpu:.3f} ms", flush=True)
