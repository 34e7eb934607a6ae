"""What every benchmark shares: the synthetic workload, percentiles, environment, JSON/PNG out.

Every ``--json`` file is ``{"bench": name, "env": {...}, "results": [rows]}``; other tools read it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inferscale_engine.engine import InferScaleEngine
    from inferscale_engine.types import Span


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def environment(engine: InferScaleEngine | None = None) -> dict[str, Any]:
    """Versions and hardware, recorded next to every result."""
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
    }
    try:
        import vllm

        env["vllm"] = vllm.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_count"] = torch.cuda.device_count()
    if engine is not None:
        cfg = engine.config
        env.update(model=cfg.model, device=cfg.device, dtype=str(engine.dtype), max_model_len=engine.max_model_len,
                   enforce_eager=cfg.enforce_eager, fused_rope=cfg.fused_rope,
                   prefix_cache_injected=cfg.prefix_cache_injected,
                   block_size=engine.vllm_config.cache_config.block_size, vllm_options=cfg.vllm_options,
                   cudagraph_mode=str(engine.vllm_config.compilation_config.cudagraph_mode))
    return env


def write_json(path: str | os.PathLike | None, bench: str, env: dict[str, Any], results: list[dict[str, Any]]) -> None:
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps({"bench": bench, "env": env, "results": results}, indent=2))
    os.replace(tmp, path)


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    def fmt(v: Any) -> str:
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(fmt(r.get(c, "")).ljust(w) for c, w in zip(columns, widths)), flush=True)


@dataclass
class SyntheticWorkload:
    """Random-token head, fact pool and questions: timing does not depend on what tokens say.

    Facts are encoded once (``w=0``) in one batched pass; each request samples ``k`` of them in
    random order, so prompt injection cannot lean on vLLM's prefix cache past the head.
    """

    head: list[int]
    facts: list[Span]
    fact_ids: list[list[int]]
    question_tokens: int
    rng: random.Random
    vocab: tuple[int, int]

    @classmethod
    def build(
        cls,
        engine: InferScaleEngine,
        *,
        pool: int,
        fact_tokens: int = 28,
        head_tokens: int = 64,
        question_tokens: int = 24,
        seed: int = 0,
    ) -> SyntheticWorkload:
        from inferscale_engine.types import EncodeWindow, Span

        rng = random.Random(seed)
        hi = min(engine.vocab_size, 32000) - 1
        vocab = (min(1000, hi // 2), hi)  # skip the low ids where special tokens usually live
        draw = lambda n: [rng.randint(*vocab) for _ in range(n)]  # noqa: E731
        fact_ids = [draw(fact_tokens) for _ in range(pool)]
        # Keyed by their tokens (encoded with no context, the KV is theirs alone): equal keys
        # must mean equal KV, also across workloads of one engine, whose exchange keeps spans
        # staged. Passed to the encoder as the memory store does: kept staged from the start.
        keys = ["bench:" + hashlib.sha256(repr(ids).encode()).hexdigest()[:20] for ids in fact_ids]
        kvs = engine.encode([EncodeWindow.single(ids) for ids in fact_ids], progress=True, keys=[[k] for k in keys])
        facts = [Span(key, tuple(ids), kv[0]) for key, ids, kv in zip(keys, fact_ids, kvs)]
        return cls(draw(head_tokens), facts, fact_ids, question_tokens, rng, vocab)

    def question(self) -> list[int]:
        return [self.rng.randint(*self.vocab) for _ in range(self.question_tokens)]

    def sample(self, k: int) -> list[int]:
        return self.rng.sample(range(len(self.facts)), k)

    def prompt_segments(self, picks: list[int], question: list[int]) -> list[Any]:
        """Facts pasted as tokens: one plain prompt."""
        return [self.head + [t for i in picks for t in self.fact_ids[i]] + question]

    def inject_segments(self, picks: list[int], question: list[int]) -> list[Any]:
        return [self.head, *(self.facts[i] for i in picks), question]


class SyntheticRetriever:
    """Retrieval with the store's exact index and an all-MiniLM-L6-v2-shaped encoder.

    Weights are random (timing does not depend on them, and machines without the embedding
    package can still run it); the encoder runs the question through a 6-layer, 384-wide BERT,
    mean-pools, normalises (the store's :class:`GraphedQueryEncoder`, as a search on a GPU
    does, leaving the vector on the device), then searches ``facts`` stored vectors with one
    matmul + top-k.
    Calling it returns the seconds it took.
    """

    def __init__(self, device: str, facts: int = 10_000, k: int = 50, seed: int = 0) -> None:
        import numpy as np
        import torch
        from transformers import BertConfig, BertModel

        from inferscale_engine.memory.meta.index import ExactIndex
        from inferscale_engine.memory.text.query_graph import GraphedQueryEncoder

        torch.manual_seed(seed)
        self.device, self.k = device, k
        cfg = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
        # The store's own single-query path (CUDA-graphed on a GPU), over a random-weight MiniLM shape.
        # transformers wraps .to() in a decorator whose type loses the bound model.
        self.encoder = GraphedQueryEncoder(BertModel(cfg).to(device).eval())  # type: ignore[arg-type]
        self.index = ExactIndex(384, device=device)
        vecs = np.random.default_rng(seed).standard_normal((facts, 384)).astype("float32")
        self.index.add(list(range(facts)), vecs / np.linalg.norm(vecs, axis=1, keepdims=True))

    def __call__(self, question_ids: list[int]) -> float:
        import time

        start = time.perf_counter()
        # As the store searches: the vector stays on the device, the index waits for it there.
        self.index.search(self.encoder.on_device([min(t, 30000) for t in question_ids]), self.k)
        return time.perf_counter() - start
