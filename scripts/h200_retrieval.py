"""Where one retrieval's time goes on the GPU (diagnostic): the bench's SyntheticRetriever split
into query encoding, the host round trip and the exact search.

usage: python scripts/h200_retrieval.py   (last two lines: with the default stream kept busy)
"""

import time

import torch

from inferscale_apps.bench.common import SyntheticRetriever, median


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
print(f"encode (graph, to host) {timed(lambda: r.encoder(ids)):.3f} ms")
print(f"search from numpy    {timed(lambda: r.index.search(host, 50)):.3f} ms")
mat = torch.as_tensor(r.index.items()[1], device="cuda")  # the index's vectors, on the device as it keeps them
torch.cuda.synchronize()  # the index writes on its own stream
print(f"matmul+topk on device {timed(lambda: torch.topk(mat @ vec.cuda(), 50).indices.cpu()):.3f} ms")
print(f"as_tensor.to(device) {timed(lambda: torch.as_tensor(host).to('cuda')):.3f} ms")

# A co-located engine keeps the default stream busy: the retriever runs on its own streams, so a
# search waits for its own kernels only. Queue ~20 large GEMMs on the default stream, then search.
big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)


def behind_busy_default_stream(fn, reps=20):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        for _ in range(20):
            big @ big
        t = time.perf_counter()
        fn()
        out.append(1e3 * (time.perf_counter() - t))
    torch.cuda.synchronize()
    return median(out[2:])


print(f"whole retrieval, default stream busy             {behind_busy_default_stream(lambda: r(ids)):.3f} ms")
print(f"any default-stream sync, default stream busy     {behind_busy_default_stream(lambda: torch.zeros(1, device='cuda').cpu()):.3f} ms")
