"""The KV of one encoded span: what the encoder produces, the store keeps and the connector injects."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from inferscale_engine.errors import NonFiniteKVError

#: :meth:`FactKV.layout`: ``(addresses, dtype, is_cuda, num_layers)``. ``addresses`` holds six
#: native int64s, K and V base addresses, K and V layer strides, K and V row strides (strides in
#: elements), as bytes: hundreds of spans' join into one numpy array at C speed, where tuples of
#: Python ints cost a conversion per int. It is ``None`` when a token row of K or V is not one
#: contiguous ``[heads, head_dim]`` block, and ``dtype`` is ``None`` when K's and V's differ.
#: A plain tuple: one is built per span a request is served, and a NamedTuple's constructor is a
#: Python call that costs several times more.
KVLayout = tuple[bytes | None, torch.dtype | None, bool, int]

_ADDRESSES = struct.Struct("=6q")


def check_finite(k: torch.Tensor, v: torch.Tensor, what: str) -> None:
    """Refuse KV with a NaN or an infinity.

    One such value poisons more than its own request. vLLM recycles freed blocks without
    clearing them; a later request, of any user, that gets the block writes only the slots of
    its own tokens, and attention over the block's unused slots multiplies their values by a
    softmax weight of exactly 0 — but ``0 * NaN`` is NaN. Every output of that request becomes
    NaN (empty text, ``finish_reason="length"``) until the block is overwritten.
    """
    if not (_all_finite(k) and _all_finite(v)):
        raise NonFiniteKVError(f"{what} holds non-finite values (NaN or infinity)")


#: 16-bit floats are non-finite exactly when every exponent bit is set.
_EXPONENT_BITS = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


def _all_finite(t: torch.Tensor) -> bool:
    mask = _EXPONENT_BITS.get(t.dtype)
    if mask is None or t.device.type != "cpu":
        return bool(torch.isfinite(t).all())
    # On a CPU, isfinite of bf16 converts every value (~150 ms for one 8B-shaped fact's KV on
    # this box); the exponent bits of the raw integers say the same in one vectorised pass.
    bits = t.contiguous().view(torch.int16).numpy()
    return not bool(((bits & mask) == mask).any())


@dataclass
class FactKV:
    """Per-layer keys and values of ``n`` consecutive tokens.

    Keys are post-RoPE at positions ``[position, position + n)``, the positions they were
    encoded at; :func:`inferscale_engine.rope.rotate` moves them. Tensors are
    ``[num_layers, n, num_kv_heads, head_dim]``: heads stay a separate axis so a
    tensor-parallel rank can take just its own slice.

    ``k`` and ``v`` are never replaced or resized after construction (new spans are new
    FactKVs, as :meth:`rows` and :meth:`to` make), which is what lets :meth:`layout` be read once.
    """

    k: torch.Tensor
    v: torch.Tensor
    position: int
    #: CUDA event recorded on the producer's stream after the copy that made ``k`` and ``v``
    #: (a tier's gather, which itself waits for a promotion's DMA): a reader on another stream
    #: (vLLM's worker runs on its own) waits for it on the device first. ``None``: readable on
    #: any stream.
    ready: Any = field(default=None, repr=False, compare=False)
    _layout: KVLayout | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.k.dim() != 4 or self.k.shape[:3] != self.v.shape[:3]:
            raise ValueError(f"bad KV shapes k={tuple(self.k.shape)} v={tuple(self.v.shape)}")

    @property
    def num_tokens(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def layout(self) -> KVLayout:
        """Addresses, strides, dtype and device of ``k``/``v`` (see :data:`KVLayout`): read from
        the tensors on first use and kept, since an injection needs them per span and each read
        is a call into torch."""
        layout = self._layout
        if layout is None:
            k, v = self.k, self.v
            kl, kr, kh, kd = k.stride()
            vl, vr, vh, vd = v.stride()
            num_layers, _, _, k_dim = k.shape
            rows_contiguous = kd == 1 and vd == 1 and kh == k_dim and vh == v.shape[3]
            dtype = k.dtype
            layout = self._layout = (
                _ADDRESSES.pack(k.data_ptr(), v.data_ptr(), kl, vl, kr, vr) if rows_contiguous else None,
                dtype if v.dtype == dtype else None,
                k.is_cuda,
                num_layers,
            )
        return layout

    @classmethod
    def cut_alike(
        cls,
        ks: Sequence[torch.Tensor],
        vs: Sequence[torch.Tensor],
        positions: Sequence[int],
        ready: Any = None,
    ) -> list[FactKV]:
        """FactKVs for views cut the same way from one K and one V tensor (same shape but for the
        token count, same strides, dtype and device), as a tier hands out a batch of facts.

        Only the first view is checked and has its :meth:`layout` read in full; every other one
        costs two address reads, where one built on its own costs a dozen calls into torch for
        its checks and its layout (``scripts/bench_table_build.py`` times both).
        """
        if not ks:
            return []
        first = cls(ks[0], vs[0], positions[0], ready)
        addresses, dtype, is_cuda, num_layers = first.layout()
        out = [first]
        if addresses is None:  # rows not contiguous: the table builder rejects these anyway
            return out + [cls(k, v, p, ready) for k, v, p in zip(ks[1:], vs[1:], positions[1:])]
        strides = _ADDRESSES.unpack(addresses)[2:]
        for k, v, position in zip(ks[1:], vs[1:], positions[1:]):
            fact = cls.__new__(cls)  # skips the per-fact checks: the first view stood for all
            fact.__dict__.update(
                k=k, v=v, position=position, ready=ready,
                _layout=(_ADDRESSES.pack(k.data_ptr(), v.data_ptr(), *strides), dtype, is_cuda, num_layers),
            )
            out.append(fact)
        return out

    def __getstate__(self) -> dict[str, Any]:
        # Copies and unpickled FactKVs may hold other tensors (deepcopy's do): the cached layout
        # never travels, it is read again from whatever tensors they end up with. Nor does the
        # event (CUDA events do not pickle); a copy's tensors are made after it on its stream.
        return {**self.__dict__, "_layout": None, "ready": None}

    def to(self, device: torch.device | str, non_blocking: bool = False) -> FactKV:
        if self.k.device == torch.device(device):
            return self
        return FactKV(
            self.k.to(device, non_blocking=non_blocking),
            self.v.to(device, non_blocking=non_blocking),
            self.position,
            self.ready,
        )

    def rows(self, start: int, stop: int) -> FactKV:
        """Tokens ``[start, stop)`` of this span (a view)."""
        return FactKV(self.k[:, start:stop], self.v[:, start:stop], self.position + start, self.ready)
