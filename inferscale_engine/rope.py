"""The one chunked-RoPE implementation.

Stored keys carry the rotation of the position they were encoded at (``FactKV.position``).
Serving them at another position is one more rotation by the position delta, because rotary
embeddings compose: R(a) R(b) = R(a + b). The angles come from the model's own rotary module
(vLLM's ``get_rope`` object: its ``_compute_cos_sin_cache`` already applies llama3 / yarn /
dynamic scaling), recomputed in fp32 so the extra rotation adds one rounding at most.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import nn


@dataclass
class RopeTable:
    """Pure rotation angles of one rotary module, as fp32 cos/sin per relative position."""

    cos: torch.Tensor  # [max_delta + 1, rotary_dim // 2]
    sin: torch.Tensor
    rotary_dim: int
    is_neox_style: bool

    @classmethod
    def from_module(cls, rope: "nn.Module") -> "RopeTable":
        """Build from a vLLM rotary embedding module (any subclass of ``RotaryEmbedding``)."""
        cache = rope._compute_cos_sin_cache().float()  # noqa: SLF001  (model's own angles)
        cos, sin = cache.chunk(2, dim=-1)
        # Yarn/longrope fold an attention scale into cos/sin; a delta rotation must be pure.
        norm = torch.sqrt(cos * cos + sin * sin).clamp_min(1e-12)
        return cls(
            cos=(cos / norm).contiguous(),
            sin=(sin / norm).contiguous(),
            rotary_dim=int(rope.rotary_dim),
            is_neox_style=bool(rope.is_neox_style),
        )

    def to(self, device: torch.device | str) -> "RopeTable":
        return RopeTable(self.cos.to(device), self.sin.to(device), self.rotary_dim, self.is_neox_style)

    @property
    def max_delta(self) -> int:
        return self.cos.shape[0] - 1


def rotate(keys: torch.Tensor, deltas: torch.Tensor, table: RopeTable) -> torch.Tensor:
    """Rotate ``keys`` (``[..., n, heads, head_dim]``) by per-row position ``deltas`` (``[n]``).

    Negative deltas (a fact served earlier than it was encoded) rotate backwards. Rows with
    delta 0 come back bit-identical, which keeps exact-context injection exact.
    """
    if deltas.numel() == 0 or not bool(deltas.any()):
        return keys
    if int(deltas.abs().max()) > table.max_delta:
        raise ValueError(f"position delta {int(deltas.abs().max())} exceeds the rotary table")
    idx = deltas.abs().long().to(table.cos.device)
    cos = table.cos[idx].to(keys.device)  # [n, rd/2]
    sin = table.sin[idx].to(keys.device) * torch.sign(deltas).to(keys.device).unsqueeze(-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads

    rd = table.rotary_dim
    x = keys[..., :rd].float()
    if table.is_neox_style:
        x1, x2 = x[..., : rd // 2], x[..., rd // 2 :]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:  # gptj: interleaved pairs
        x1, x2 = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    out = keys.clone()
    out[..., :rd] = rotated.to(keys.dtype)
    # Rows that do not move keep their exact bits (the fp32 round trip is not always identity).
    still = deltas.to(keys.device) == 0
    if bool(still.any()):
        out[..., still, :, :] = keys[..., still, :, :]
    return out
