"""In-process hand-off between an :class:`InferScaleEngine` and its connector's worker half.

The engine runs vLLM in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the
connector's worker half can read span KV straight from memory the engine staged, and leave
captured KV where the engine will pick it up. A bridge id in ``kv_connector_extra_config``
ties the two together; one bridge per engine.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import torch

from inferscale_engine.errors import ConnectorError
from inferscale_engine.kv import FactKV
from inferscale_engine.rope import RopeTable


@dataclass
class CaptureBuffer:
    """Rows of one capture range, filled as vLLM computes them (a range may span steps)."""

    length: int
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    filled: torch.Tensor | None = None

    def _allocate(
        self, num_layers: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.k is None or self.v is None or self.filled is None:
            self.k = torch.empty((num_layers, self.length, *k.shape[-2:]), dtype=k.dtype, device=k.device)
            self.v = torch.empty((num_layers, self.length, *v.shape[-2:]), dtype=v.dtype, device=v.device)
            self.filled = torch.zeros(num_layers, self.length, dtype=torch.bool, device=k.device)
        return self.k, self.v, self.filled

    def write(self, layer: int, num_layers: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """One layer's ``rows`` (``k``/``v``: ``[rows, heads, head_dim]``)."""
        keys, values, filled = self._allocate(num_layers, k, v)
        keys[layer, rows] = k
        values[layer, rows] = v
        filled[layer, rows] = True

    def write_layers(self, first_row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows ``[first_row, first_row + n)`` of every layer (``k``/``v``: ``[layers, n, heads, head_dim]``)."""
        keys, values, filled = self._allocate(k.shape[0], k, v)
        rows = slice(first_row, first_row + k.shape[1])
        keys[:, rows] = k
        values[:, rows] = v
        filled[:, rows] = True

    def result(self, position: int) -> FactKV:
        if self.k is None or self.v is None or self.filled is None or not bool(self.filled.all()):
            raise ConnectorError(
                "capture incomplete: vLLM did not compute every row of the span (with a KV cache "
                "layout InferScale cannot read back, full CUDA graphs hide vLLM's KV writes: "
                "use compilation_config={'cudagraph_mode': 'FULL_AND_PIECEWISE'})"
            )
        return FactKV(self.k, self.v, position)


@dataclass
class Bridge:
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Span KV that in-flight requests inject, keyed by span key; the engine stages and releases.
    staged: dict[str, FactKV] = field(default_factory=dict)
    captures: dict[str, CaptureBuffer] = field(default_factory=dict)
    # Rotary table per attention layer name (filled by the engine from the model's own modules).
    ropes: dict[str, RopeTable] = field(default_factory=dict)


_BRIDGES: dict[str, Bridge] = {}


def new_bridge() -> Bridge:
    bridge = Bridge()
    _BRIDGES[bridge.id] = bridge
    return bridge


def get_bridge(bridge_id: str) -> Bridge:
    try:
        return _BRIDGES[bridge_id]
    except KeyError:
        raise ConnectorError(
            "InferScaleConnector found no engine bridge: it must run in the engine's own process "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=0; InferScaleEngine sets this up)"
        ) from None


def drop_bridge(bridge_id: str) -> None:
    _BRIDGES.pop(bridge_id, None)
