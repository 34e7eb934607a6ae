"""The one chunked-RoPE implementation.

Stored keys carry the rotation of the position they were encoded at (``FactKV.position``).
Serving them at another position is one more rotation by the position delta, because rotary
embeddings compose: R(a) R(b) = R(a + b). The angles come from the model's own rotary module
(vLLM's ``get_rope`` object: its ``_compute_cos_sin_cache`` already applies llama3 / yarn /
dynamic scaling), recomputed in fp32 so the extra rotation adds one rounding at most.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class RopeTable:
    """Pure rotation angles of one rotary module, as fp32 cos/sin per relative position."""

    cos: torch.Tensor  # [max_delta + 1, rotary_dim // 2]
    sin: torch.Tensor
    rotary_dim: int
    is_neox_style: bool

    @classmethod
    def from_module(cls, rope: Any) -> RopeTable:
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

    def to(self, device: torch.device | str) -> RopeTable:
        return RopeTable(self.cos.to(device), self.sin.to(device), self.rotary_dim, self.is_neox_style)

    @property
    def max_delta(self) -> int:
        return self.cos.shape[0] - 1


#: CPU: elements of keys rotated per pass. A whole ``[layers, n, heads, dim]`` tensor makes every
#: elementwise op a trip through memory; layer chunks whose fp32 copy fits the cache ran 12x
#: faster on a 2-core box (30 layers x 1,488 rows x 3 heads x 64: 6-8 ms instead of 77-92 ms).
CPU_CHUNK_ELEMS = 1 << 16


def rotate(keys: torch.Tensor, deltas: torch.Tensor, table: RopeTable) -> torch.Tensor:
    """Rotate ``keys`` (``[..., n, heads, head_dim]``) by per-row position ``deltas`` (``[n]``).

    Negative deltas (a fact served earlier than it was encoded) rotate backwards. Rows with
    delta 0 come back bit-identical, which keeps exact-context injection exact. The angles and
    the arithmetic are fp32 whatever the keys' dtype: one rounding back to it at most.
    ``deltas`` on the host cost least, wherever the keys lie: their checks and the angles'
    lookup are numpy's, with no device sync.
    """
    if deltas.numel() == 0:
        return keys
    if deltas.device.type == "cpu":
        angles = _host_angles(deltas.numpy(), table, keys.device)
    else:
        angles = _device_angles(deltas, table, keys.device)
    if angles is None:
        return keys
    cos, sin, still = angles
    cos, sin = cos[:, None, :], sin[:, None, :]  # [n, 1, rd/2]: broadcast over heads

    rd = table.rotary_dim
    stacked = keys.reshape(-1, *keys.shape[-3:])  # [layers (or 1), n, heads, head_dim]
    out = torch.empty_like(stacked) if rd == keys.shape[-1] else stacked.clone()
    # A GPU runs each op over everything at once; a CPU goes a cache-sized chunk at a time.
    per = stacked.shape[0] if keys.is_cuda else max(1, CPU_CHUNK_ELEMS // stacked[0].numel())
    for first in range(0, stacked.shape[0], per):
        if keys.dtype == torch.float32:
            # Straight into ``out``: the same operations on the same values as below, without
            # the copy in, the copy back and the temporary (half the passes over the keys).
            x1, x2 = _halves(stacked[first : first + per, ..., :rd], table.is_neox_style)
            o1, o2 = _halves(out[first : first + per, ..., :rd], table.is_neox_style)
            torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1)
            torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
            continue
        x = stacked[first : first + per, ..., :rd].to(torch.float32, copy=True)  # rotated in place
        x1, x2 = _halves(x, table.is_neox_style)
        new_x1 = (x1 * cos).addcmul_(x2, sin, value=-1)
        x2.mul_(cos).addcmul_(x1, sin)
        x1.copy_(new_x1)
        out[first : first + per, ..., :rd] = x
    out = out.reshape(keys.shape)
    # Rows that do not move keep their exact bits (the fp32 round trip is not always identity).
    if still is not None:
        out[..., still, :, :] = keys[..., still, :, :]
    return out


_Angles = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def _host_angles(deltas: np.ndarray, table: RopeTable, device: torch.device) -> _Angles | None:
    """Per row cos and signed sin ``[n, rd/2]`` on ``device``, and the rows that do not move
    (None: none), from host deltas; None where no row moves. A few numpy calls: each torch call
    on a request's path costs µs to tens of µs on a CPU (the worker runs it once per request,
    before the forward pass)."""
    dist = np.abs(deltas)
    top = int(dist.max())
    if top == 0:
        return None
    if top > table.max_delta:
        raise ValueError(f"position delta {top} exceeds the rotary table")
    if table.cos.device.type == "cpu" and table.cos.dtype == torch.float32:
        sin = table.sin.numpy()[dist]  # a copy (fancy indexing): negated in place
        np.negative(sin, out=sin, where=(deltas < 0)[:, None])
        cos, sin_t = torch.from_numpy(table.cos.numpy()[dist]), torch.from_numpy(sin)
    else:
        idx = torch.from_numpy(dist.astype(np.int64)).to(table.cos.device)
        sign = torch.from_numpy(np.sign(deltas).astype(np.int64)).to(table.cos.device)
        cos, sin_t = table.cos[idx], table.sin[idx] * sign.unsqueeze(-1)
    still = np.flatnonzero(deltas == 0)
    rows = torch.from_numpy(still) if len(still) else None
    if device != cos.device:
        cos, sin_t = cos.to(device), sin_t.to(device)
        rows = None if rows is None else rows.to(device)
    return cos, sin_t, rows


def _device_angles(deltas: torch.Tensor, table: RopeTable, device: torch.device) -> _Angles | None:
    """:func:`_host_angles` from deltas on a device (two syncs)."""
    dist = deltas.abs()
    top = int(dist.max())
    if top == 0:
        return None
    if top > table.max_delta:
        raise ValueError(f"position delta {top} exceeds the rotary table")
    idx = dist.long().to(table.cos.device)
    cos = table.cos[idx].to(device)
    sin = table.sin[idx].to(device) * torch.sign(deltas).to(device).unsqueeze(-1)
    still = deltas.to(device) == 0
    return cos, sin, still if bool(still.any()) else None


def _halves(x: torch.Tensor, neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The two halves of every rotated pair of the last axis: its two halves (neox), or its even
    and odd elements (gptj: interleaved pairs)."""
    rd = x.shape[-1]
    return (x[..., : rd // 2], x[..., rd // 2 :]) if neox else (x[..., 0::2], x[..., 1::2])
