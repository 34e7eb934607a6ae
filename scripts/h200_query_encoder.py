"""One query's embedding on the GPU: eager encoder vs the store's CUDA-graphed path (diagnostic).

usage: python scripts/h200_query_encoder.py   (random-weight all-MiniLM-L6-v2 shape)
"""

import json
import time

import torch
from transformers import BertConfig, BertModel

from inferscale_engine.memory.text.query_graph import GraphedQueryEncoder
from inferscale_engine.testing import query_embedding_eager, query_graph_buckets

cfg = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
torch.manual_seed(0)
model = BertModel(cfg).cuda().eval()
graphed = GraphedQueryEncoder(model)
rows = []
for n in (12, 24, 60):
    ids = torch.randint(1000, 30000, (n,)).tolist()
    eager = query_embedding_eager(model, ids)
    got = graphed(ids)

    def timed(fn, reps=50):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn().cpu()
        return (time.perf_counter() - t) / reps * 1e3

    def eager_fn():
        return query_embedding_eager(model, ids)  # noqa: B023  (timed in this iteration)

    rows.append({"tokens": n, "eager_ms": timed(eager_fn), "graphed_ms": timed(lambda: graphed(ids)),  # noqa: B023
                 "max_abs_diff": (got - eager.cpu()).abs().max().item(), "graphs": query_graph_buckets(graphed)})
    print(json.dumps(rows[-1]), flush=True)
