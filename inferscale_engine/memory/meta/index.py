"""Per-user vector indexes over normalised embeddings (inner product = cosine).

* :class:`ExactIndex` – one ``[n, d]`` tensor on the engine's device; a search is one matmul
  and a ``topk``. Exact, and the fastest choice up to tens of thousands of facts per user. On
  CUDA every access runs on the index's own stream, so a search does not queue behind the
  forward passes a co-located engine puts on the default stream. A query may stay on the
  device (:class:`~inferscale_engine.memory.text.query_graph.DeviceQuery`): the index's stream
  waits for it there, and the host waits once, for the top-k.
* :class:`FaissIndex` – ``faiss.IndexIDMap2(IndexFlatIP)`` (faiss-cpu; moved to the GPU when
  faiss-gpu and CUDA are present). Also exact; for very large per-user stores.
* :class:`UserIndex` – picks one (``"auto"``: exact until :data:`AUTO_FAISS_THRESHOLD` facts,
  then faiss when it is installed).

Rows are keyed by the fact's integer ``seq`` (its SQLite row id).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Literal

import numpy as np
import torch

from inferscale_engine.memory.text.query_graph import DeviceQuery

logger = logging.getLogger(__name__)

IndexKind = Literal["auto", "exact", "faiss"]
AUTO_FAISS_THRESHOLD = 20_000


class ExactIndex:
    def __init__(self, dim: int, device: str | torch.device = "cpu") -> None:
        self.dim = dim
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # Named in full, so that a query's device compares equal to it.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        with self._on_stream():
            self._mat = torch.empty((64, dim), dtype=torch.float32, device=self.device)
        self._seqs: list[int] = []
        self._pos: dict[int, int] = {}

    def _on_stream(self) -> contextlib.AbstractContextManager:
        # Every read and write of _mat on one stream: ordered among themselves, never behind
        # other work on the device.
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def __len__(self) -> int:
        return len(self._seqs)

    def add(self, seqs: list[int], vecs: np.ndarray) -> None:
        if not seqs:
            return
        with self._on_stream():
            self._add(seqs, vecs)

    def _add(self, seqs: list[int], vecs: np.ndarray) -> None:
        for s in seqs:
            if s in self._pos:
                self.remove(s)
        n, m = len(self._seqs), len(seqs)
        if n + m > self._mat.shape[0]:
            grown = torch.empty((max(2 * self._mat.shape[0], n + m), self.dim), dtype=torch.float32, device=self.device)
            grown[:n] = self._mat[:n]
            self._mat = grown
        self._mat[n : n + m] = torch.as_tensor(vecs, dtype=torch.float32).to(self.device)
        for i, s in enumerate(seqs):
            self._pos[s] = n + i
            self._seqs.append(s)

    def remove(self, seq: int) -> None:
        pos = self._pos.pop(seq, None)
        if pos is None:
            return
        last = len(self._seqs) - 1
        if pos != last:  # move the last row into the hole
            moved = self._seqs[last]
            with self._on_stream():
                self._mat[pos] = self._mat[last]
            self._seqs[pos] = moved
            self._pos[moved] = pos
        self._seqs.pop()

    def search(self, query: np.ndarray | DeviceQuery, k: int) -> list[tuple[int, float]]:
        n = len(self._seqs)
        if n == 0:
            return []
        m = min(k, n)
        with self._on_stream():
            q = self._query(query)
            top = torch.topk(self._mat[:n] @ q, m)
            if self._stream is None:  # on the CPU: read in place (packing costs ~40 µs at k=200 there)
                scores, rows = top.values.tolist(), top.indices.tolist()
            else:
                # Scores (their bits) and rows side by side: one device-to-host copy and one wait
                # on the device for both, not one each.
                both = torch.cat((top.values.view(torch.int32), top.indices.to(torch.int32))).cpu()
                scores, rows = both[:m].view(torch.float32).tolist(), both[m:].tolist()
        seqs = self._seqs
        return [(seqs[i], s) for s, i in zip(scores, rows)]

    def _query(self, query: np.ndarray | DeviceQuery) -> torch.Tensor:
        """The query as an fp32 vector on the index's device, ready for this stream's next kernel."""
        if not isinstance(query, DeviceQuery):
            return torch.as_tensor(query, dtype=torch.float32).to(self.device)
        if query.vec.device != self.device:
            return torch.as_tensor(query.numpy(), dtype=torch.float32).to(self.device)
        if query.ready is not None and self._stream is not None:
            self._stream.wait_event(query.ready)
            query.vec.record_stream(self._stream)  # made on the encoder's stream, read on this one
        return query.vec.float()

    def items(self) -> tuple[list[int], np.ndarray]:
        with self._on_stream():
            return list(self._seqs), self._mat[: len(self._seqs)].cpu().numpy()


class FaissIndex:
    def __init__(self, dim: int, device: str | torch.device = "cpu") -> None:
        import faiss

        self.dim = dim
        self._faiss = faiss
        index: faiss.Index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        if torch.device(device).type == "cuda" and hasattr(faiss, "StandardGpuResources"):
            try:
                self._res = faiss.StandardGpuResources()
                index = faiss.index_cpu_to_gpu(self._res, torch.device(device).index or 0, index)
            except Exception as exc:  # pragma: no cover - depends on faiss-gpu
                logger.warning("faiss GPU index unavailable (%s); using faiss-cpu", exc)
        self._index = index
        self._seqs: set[int] = set()

    def __len__(self) -> int:
        return len(self._seqs)

    def add(self, seqs: list[int], vecs: np.ndarray) -> None:
        if not seqs:
            return
        again = [s for s in seqs if s in self._seqs]
        if again:
            self._remove_ids(again)
        self._index.add_with_ids(np.ascontiguousarray(vecs, dtype=np.float32), np.asarray(seqs, dtype=np.int64))
        self._seqs.update(seqs)

    def remove(self, seq: int) -> None:
        if seq in self._seqs:
            self._remove_ids([seq])
            self._seqs.discard(seq)

    def _remove_ids(self, seqs: list[int]) -> None:
        # The selector faiss's Python wrapper makes of an array of ids, which its stubs do not take.
        self._index.remove_ids(self._faiss.IDSelectorBatch(np.asarray(seqs, dtype=np.int64)))

    def search(self, query: np.ndarray | DeviceQuery, k: int) -> list[tuple[int, float]]:
        if not self._seqs:
            return []
        if isinstance(query, DeviceQuery):
            query = query.numpy()
        scores, ids = self._index.search(np.ascontiguousarray(query.reshape(1, -1), dtype=np.float32), min(k, len(self)))
        return [(int(i), float(s)) for s, i in zip(scores[0], ids[0]) if i >= 0]

    def items(self) -> tuple[list[int], np.ndarray]:
        seqs = sorted(self._seqs)
        if not seqs:
            return [], np.zeros((0, self.dim), dtype=np.float32)
        return seqs, np.stack([self._index.reconstruct(int(s)) for s in seqs])


def faiss_available() -> bool:
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


class UserIndex:
    """One user's index; ``kind="auto"`` moves to faiss past :data:`AUTO_FAISS_THRESHOLD` facts."""

    def __init__(self, dim: int, *, kind: IndexKind = "auto", device: str | torch.device = "cpu",
                 threshold: int = AUTO_FAISS_THRESHOLD) -> None:
        if kind not in ("auto", "exact", "faiss"):
            raise ValueError(f"index must be 'auto', 'exact' or 'faiss', got {kind!r}")
        self.kind = kind
        self.device = device
        self.threshold = threshold
        self.backend: ExactIndex | FaissIndex = FaissIndex(dim, device) if kind == "faiss" else ExactIndex(dim, device)

    def __len__(self) -> int:
        return len(self.backend)

    def add(self, seqs: list[int], vecs: np.ndarray) -> None:
        self.backend.add(seqs, vecs)
        if (
            self.kind == "auto"
            and isinstance(self.backend, ExactIndex)
            and len(self.backend) > self.threshold
            and faiss_available()
        ):
            logger.info("user index passed %d facts: switching to faiss", self.threshold)
            all_seqs, mat = self.backend.items()
            backend = FaissIndex(self.backend.dim, self.device)
            backend.add(all_seqs, mat)
            self.backend = backend

    def remove(self, seq: int) -> None:
        self.backend.remove(seq)

    def search(self, query: np.ndarray | DeviceQuery, k: int) -> list[tuple[int, float]]:
        return self.backend.search(query, k)
