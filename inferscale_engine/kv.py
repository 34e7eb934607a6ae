"""The KV of one encoded span: what the encoder produces, the store keeps and the connector injects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class FactKV:
    """Per-layer keys and values of ``n`` consecutive tokens.

    Keys are post-RoPE at positions ``[position, position + n)``, the positions they were
    encoded at; :func:`inferscale_engine.rope.rotate` moves them. Tensors are
    ``[num_layers, n, num_kv_heads, head_dim]``: heads stay a separate axis so a
    tensor-parallel rank can take just its own slice.
    """

    k: torch.Tensor
    v: torch.Tensor
    position: int
    #: CUDA event recorded after the copy that produced ``k``/``v`` was queued (a promotion
    #: still in flight); whoever reads them on the device waits on it there, not on the host.
    ready: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.k.dim() != 4 or self.k.shape[:3] != self.v.shape[:3]:
            raise ValueError(f"bad KV shapes k={tuple(self.k.shape)} v={tuple(self.v.shape)}")

    @property
    def num_tokens(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "FactKV":
        if self.k.device == torch.device(device):
            return self
        return FactKV(
            self.k.to(device, non_blocking=non_blocking),
            self.v.to(device, non_blocking=non_blocking),
            self.position,
            self.ready,
        )

    def rows(self, start: int, stop: int) -> "FactKV":
        """Tokens ``[start, stop)`` of this span (a view)."""
        return FactKV(self.k[:, start:stop], self.v[:, start:stop], self.position + start, self.ready)
