"""Where one retrieval's time goes on the GPU (diagnostic): the bench's SyntheticRetriever split
into query encoding, the host round trip and the exact search.

usage: python scripts/h200_retrieval.py
"""

import time

import torch

from inferscale_engine.bench.common import SyntheticRetriever, median


def timed(fn, reps=50):
    out = []
    for _ in range(reps + 5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        out.append(1e3 * (time.perf_counter() - t))
    return median(out[5:])


r = SyntheticRetriever("cuda", facts=10_000, k=50)
ids = torch.randint(1000, 30000, (24,)).tolist()
vec = r.encoder(ids)
host = vec.cpu().numpy()
print(f"whole retrieval      {timed(lambda: r(ids)):.3f} ms")
print(f"encode (graph, sync) {timed(lambda: r.encoder(ids).cpu()):.3f} ms")
print(f"encode (no sync)     {timed(lambda: r.encoder(ids)):.3f} ms")
print(f"search from numpy    {timed(lambda: r.index.search(host, 50)):.3f} ms")
mat = r.index._mat[: len(r.index)]
print(f"matmul+topk on device {timed(lambda: torch.topk(mat @ vec, 50).indices.cpu()):.3f} ms")
print(f"as_tensor.to(device) {timed(lambda: torch.as_tensor(host).to('cuda')):.3f} ms")
