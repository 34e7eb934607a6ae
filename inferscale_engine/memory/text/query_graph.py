"""One query's embedding on CUDA as a CUDA-graph replay.

A search embeds one short query, and at that size a 6-layer encoder run eagerly is all Python and
kernel-launch overhead (milliseconds on an H200 for what the GPU does in microseconds). This
captures the encoder + mean pooling + L2 normalisation once per padded length and replays it.
Any model whose forward fails to capture (data-dependent control flow) runs eagerly instead.

On CUDA the query path runs in half precision by default, on its own copy of the encoder (the
facts' batched embeddings keep the model's precision): half the replay time of fp32 on an H100
(0.33 against 0.74 ms for a 24-token query) for the same vector to six decimals of cosine and the
same top 50 of 10k (``scripts/h200_retrieval_variants.py``).

On CUDA the query runs on a high-priority stream of its own: a search in a process that also
serves (vLLM's forward passes queue on the default stream) does not queue behind whatever the
engine has queued, though its kernels still share the SMs with the engine's.

A search needs the vector on the device, not on the host: :meth:`GraphedQueryEncoder.on_device`
leaves it there as a :class:`DeviceQuery`, and the index's stream waits for its event. The host
then waits once per query (for the top-k) instead of twice, and the vector is not copied back
to the device.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger(__name__)

BUCKETS = (16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class DeviceQuery:
    """A query's unit-length fp32 embedding on the encoder's device. ``ready``: recorded on the
    encoder's ``stream`` after the vector was written (both ``None`` on the CPU); a reader on
    another stream waits for it first."""

    vec: torch.Tensor
    ready: torch.cuda.Event | None = None
    stream: torch.cuda.Stream | None = None

    def numpy(self) -> np.ndarray:
        """The vector on the host (waits for it, not for the default stream's queue)."""
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            return self.vec.cpu().numpy()


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    io: torch.Tensor  # [2, bucket]: token ids, attention mask
    out: torch.Tensor  # [dim], unit length
    host: torch.Tensor  # io's pinned host twin: one asynchronous copy a query
    host_view: np.ndarray  # host, written in place
    copied: torch.cuda.Event  # recorded after the last copy out of host


def _fill(io: np.ndarray, token_ids: list[int]) -> None:
    """Token ids, then zeros; the attention mask: ones over the ids. Written with numpy: the four
    small torch ops it replaces took ~12 µs of host time, this ~2 µs (CPU, 24 tokens)."""
    n = len(token_ids)
    io[0, :n] = token_ids
    io[0, n:] = 0
    io[1, :n] = 1
    io[1, n:] = 0


def _embed(model: "nn.Module", ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    embeddings, encoder = getattr(model, "embeddings", None), getattr(model, "encoder", None)
    if isinstance(embeddings, torch.nn.Module) and isinstance(encoder, torch.nn.Module):
        # BERT-style: build the additive mask here; transformers' own mask helpers inspect the
        # mask's values (a device sync, which a CUDA graph capture refuses) in some releases.
        hidden = embeddings(input_ids=ids)
        additive = (1.0 - mask[:, None, None, :].to(hidden.dtype)) * torch.finfo(hidden.dtype).min
        hidden = encoder(hidden, attention_mask=additive)[0][0]
    else:
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state[0]
    weights = mask[0].to(hidden.dtype)[:, None]
    pooled = (hidden * weights).sum(0) / weights.sum().clamp_min(1)
    return torch.nn.functional.normalize(pooled.float(), dim=-1)


class GraphedQueryEncoder:
    """``encoder(token_ids) -> [dim]`` unit-length fp32 embedding, on the CPU: a
    BERT-style ``model`` (``input_ids``/``attention_mask`` in, ``last_hidden_state`` out)
    followed by mean pooling over real tokens, as sentence-transformers' MiniLM does. Graphs
    on CUDA; elsewhere (and past the longest bucket) the same computation runs eagerly.
    ``dtype``: the precision of the query path on CUDA (``None``: the model's own)."""

    def __init__(self, model: "nn.Module", *, dtype: torch.dtype | None = torch.float16) -> None:
        self.device = next(model.parameters()).device
        if self.device.type == "cuda" and dtype is not None and next(model.parameters()).dtype != dtype:
            model = copy.deepcopy(model).to(dtype)
        self.model = model
        self._graphs: dict[int, _Graph | None] = {}
        self._stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.device, priority=-1)  # ahead of queued engine kernels
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the weights' upload

    def __call__(self, token_ids: list[int]) -> torch.Tensor:
        with self._on_stream():
            return self._run(token_ids).cpu()  # waits for this stream alone

    def on_device(self, token_ids: list[int]) -> DeviceQuery:
        """The embedding left on the device, without waiting for it: for a search there."""
        with self._on_stream():
            vec = self._run(token_ids)
            if self._stream is None:
                return DeviceQuery(vec)
            # A copy: the next replay overwrites the graph's output buffer.
            vec = vec.clone()
            ready = torch.cuda.Event()
            ready.record(self._stream)
            return DeviceQuery(vec, ready, self._stream)

    def _on_stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def _run(self, token_ids: list[int]) -> torch.Tensor:
        """The embedding on the encoder's device, queued on the current stream."""
        n = len(token_ids)
        bucket = next((b for b in BUCKETS if b >= n), None)
        with torch.inference_mode():
            graph = self._graph(bucket) if bucket is not None and self._stream is not None else None
            if graph is None:
                host = np.empty((2, bucket or n), dtype=np.int64)
                _fill(host, token_ids)
                io = torch.from_numpy(host).to(self.device)
                return _embed(self.model, io[0:1], io[1:2])
            # The last query may not have waited for its vector: its copy out of graph.host must
            # be done before the buffer is written again (it is, unless queries come back to back).
            graph.copied.synchronize()
            _fill(graph.host_view, token_ids)
            graph.io.copy_(graph.host, non_blocking=True)
            graph.copied.record()
            graph.graph.replay()
            return graph.out

    def _graph(self, bucket: int) -> _Graph | None:
        if bucket not in self._graphs:
            self._graphs[bucket] = self._capture(bucket)
        return self._graphs[bucket]

    def _capture(self, bucket: int) -> _Graph | None:
        io = torch.zeros(2, bucket, dtype=torch.long, device=self.device)
        io[:, 0] = 1
        try:
            with torch.inference_mode():
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(2):  # warm up kernels and allocator outside the capture
                        _embed(self.model, io[0:1], io[1:2])
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = _embed(self.model, io[0:1], io[1:2])
            host = torch.zeros(2, bucket, dtype=torch.long, pin_memory=True)
            return _Graph(graph, io, out, host, host.numpy(), torch.cuda.Event())
        except Exception as exc:  # a forward that cannot be captured still embeds, eagerly
            logger.warning("query encoder runs eagerly for %d-token queries: CUDA graph capture failed: %s", bucket, exc)
            return None
