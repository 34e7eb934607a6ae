"""The KV of one encoded span: what the encoder produces, the store keeps and the connector injects."""

from __future__ import annotations

import operator
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
        rows = self.__dict__.get("_rows")
        return rows[2] if rows is not None else self.k.shape[1]

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
    def rows_of(cls, block: torch.Tensor, rows: Sequence[tuple[int, int, int]], ready: Any = None) -> list[FactKV]:
        """FactKVs of token rows of one contiguous ``[2, layers, tokens, heads, dim]`` block (K,
        then V), each given as ``(first row, rows, position)``: how a tier hands out a batch of
        facts it has just copied into one block.

        No view is made until ``k`` or ``v`` is read: an injection reads only the
        :meth:`layout`, which follows from the block's by arithmetic. Two views a fact cost
        ~1 µs each on a server's CPU, on the path of every request that reads from a tier.
        """
        if block.dim() != 5 or block.shape[0] != 2 or not block.is_contiguous():
            raise ValueError(f"a block of facts is a contiguous [2, layers, tokens, heads, dim] tensor, "
                             f"got shape {tuple(block.shape)}")
        _, num_layers, tokens, heads, dim = block.shape
        row = heads * dim  # elements; strides in elements, addresses in bytes
        layer = tokens * row
        row_bytes = row * block.element_size()
        k0 = block.data_ptr()
        v0 = k0 + num_layers * layer * block.element_size()
        out = []
        for start, n, position in rows:
            if not 0 <= start <= start + n <= tokens:
                raise ValueError(f"rows [{start}, {start + n}) outside a block of {tokens}")
            fact = cls.__new__(cls)  # no views, no checks: the block stands for all
            offset = start * row_bytes
            fact.__dict__.update(
                position=position, ready=ready, _rows=(block, start, n),
                _layout=(_ADDRESSES.pack(k0 + offset, v0 + offset, layer, layer, row, row), block.dtype,
                         block.is_cuda, num_layers),
            )
            out.append(fact)
        return out

    def __getattr__(self, name: str) -> Any:
        # Only for attributes not set: ``k`` and ``v`` of a FactKV made by rows_of, viewed now.
        rows = self.__dict__.get("_rows")
        if rows is None or name not in ("k", "v"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        block, start, n = rows
        self.__dict__.update(k=block[0, :, start : start + n], v=block[1, :, start : start + n])
        return self.__dict__[name]

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

    def heads(self, first: int, last: int) -> FactKV:
        """KV heads ``[first, last)`` of this span (a view): a tensor-parallel rank's share."""
        return FactKV(self.k[:, :, first:last], self.v[:, :, first:last], self.position, self.ready)


_CACHED_LAYOUT = operator.attrgetter("_layout")


def layouts(kvs: Sequence[FactKV]) -> list[KVLayout]:
    """:meth:`FactKV.layout` of each of ``kvs``. Those already read (a span served before, or
    made by :meth:`FactKV.rows_of`: the usual case) come by ``map``, without a Python call each:
    hundreds of spans a step."""
    out = list(map(_CACHED_LAYOUT, kvs))
    if None in out:
        out = [kv.layout() if layout is None else layout for kv, layout in zip(kvs, out)]
    return out
