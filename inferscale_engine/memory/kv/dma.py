"""Copies of many byte ranges between pinned host memory and the device, at a fraction of a
microsecond of host time each.

Moving ``k`` facts between the host tier and the device slab takes a copy per run of pages (about
``k`` to ``2k``). Through ``Tensor.copy_`` each costs ~20–30 µs of host time (views, dispatch, an
event recorded per pinned tensor), which would put milliseconds on the request's critical path.
The CUDA runtime's ``cudaMemcpyBatchAsync`` (CUDA ≥ 12.8) queues them all in one call; older
runtimes get one ``cudaMemcpyAsync`` per range (a few µs each), and without a loadable runtime
library ``copy_`` does the same work, slower.

The caller keeps both sides alive (and the sources unchanged) until the copies have run:
unlike ``copy_``, nothing here tells PyTorch's pinned-memory allocator that a copy is in flight.
"""

from __future__ import annotations

import ctypes
import logging
from _ctypes import CFuncPtr
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import numpy as np
import torch

logger = logging.getLogger(__name__)

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (unified addressing)
_BATCH_SINCE = 12080  # cudaMemcpyBatchAsync appeared in CUDA 12.8 ...
_BATCH_NO_FAIL_INDEX_SINCE = 13000  # ... and lost its failIdx argument in CUDA 13.0
_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream: sources are read in stream order
_LOCATION_DEVICE, _LOCATION_HOST = 1, 2  # cudaMemLocationType
_PREFER_OVERLAP_WITH_COMPUTE = 1  # cudaMemcpyFlagPreferOverlapWithCompute


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_location_hint", _MemLocation),
        ("dst_location_hint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


@dataclass(frozen=True)
class _Runtime:
    lib: ctypes.CDLL
    batch: CFuncPtr | None  # cudaMemcpyBatchAsync, when this runtime has it
    batch_fail_index: bool  # the CUDA 12.8/12.9 signature, with a failIdx out-argument

    def error(self, err: int) -> str:
        """The message of ``err``, which is then cleared: torch checks the runtime's last error
        after its own launches and would otherwise fail on ours."""
        self.lib.cudaGetLastError()
        return self.lib.cudaGetErrorString(err).decode()


@lru_cache(maxsize=1)
def _cudart() -> _Runtime | None:
    # Already loaded by torch: dlopen by soname returns that copy, with its state.
    major = (torch.version.cuda or "").split(".")[0]
    for name in (f"libcudart.so.{major}", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        lib.cudaMemcpyAsync.restype = ctypes.c_int
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        version = ctypes.c_int(0)
        lib.cudaRuntimeGetVersion(ctypes.byref(version))
        batch = getattr(lib, "cudaMemcpyBatchAsync", None) if version.value >= _BATCH_SINCE else None
        fail_index = version.value < _BATCH_NO_FAIL_INDEX_SINCE
        if batch is not None:
            # dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, [failIdx,] stream
            pointer = [ctypes.c_void_p] * 3
            batch.argtypes = [*pointer, ctypes.c_size_t, ctypes.POINTER(_MemcpyAttributes), ctypes.c_void_p,
                              ctypes.c_size_t, *([ctypes.c_void_p] if fail_index else []), ctypes.c_void_p]
            batch.restype = ctypes.c_int
        return _Runtime(lib, batch, fail_index)
    logger.info("CUDA runtime library not found by name; host-device copies go through torch")
    return None


@dataclass(frozen=True)
class Sources:
    """The tensor each range lies in (one entry per range), with their addresses and sizes read
    once: all on the device, or all in pinned host memory."""

    tensors: Sequence[torch.Tensor]
    address: np.ndarray  # int64, as is nbytes
    nbytes: np.ndarray

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> Sources:
        n = len(tensors)
        return cls(
            tensors,
            np.fromiter((t.data_ptr() for t in tensors), dtype=np.int64, count=n),
            np.fromiter((t.nbytes for t in tensors), dtype=np.int64, count=n),
        )


class ByteCopier:
    """Queue copies of byte ranges between pinned host tensors and device tensors on ``stream``.

    ``path`` picks how: ``"auto"`` (a batch per call where the runtime has one, else a call per
    range), ``"per-range"`` (one ``cudaMemcpyAsync`` each) or ``"torch"`` (``Tensor.copy_``);
    the last two exist to compare against and test the fallbacks.
    """

    def __init__(self, stream: torch.cuda.Stream, path: Literal["auto", "per-range", "torch"] = "auto") -> None:
        if path not in ("auto", "per-range", "torch"):
            raise ValueError(f"path must be 'auto', 'per-range' or 'torch', got {path!r}")
        self.stream = stream
        self._runtime = _cudart() if path != "torch" else None
        self._batch = path == "auto" and self._runtime is not None and self._runtime.batch is not None
        device = stream.device.index if stream.device.index is not None else torch.cuda.current_device()
        host, gpu = _MemLocation(_LOCATION_HOST, 0), _MemLocation(_LOCATION_DEVICE, device)
        self._attributes = {  # by whether the destination is on the device
            True: _MemcpyAttributes(_ORDER_STREAM, host, gpu, _PREFER_OVERLAP_WITH_COMPUTE),
            False: _MemcpyAttributes(_ORDER_STREAM, gpu, host, _PREFER_OVERLAP_WITH_COMPUTE),
        }
        self._first_attribute = np.zeros(1, dtype=np.uint64)  # attrsIdxs: one attribute for all

    def copy(
        self, dsts: Sources, dst_offsets: np.ndarray, srcs: Sources, src_offsets: np.ndarray, sizes: np.ndarray
    ) -> None:
        """Copy ``sizes[i]`` bytes of ``srcs.tensors[i]``, from byte ``src_offsets[i]``, into
        ``dsts.tensors[i]`` at byte ``dst_offsets[i]``, for every ``i`` (int64 arrays), in one
        batch where the runtime can. Host to device or device to host, one direction per call."""
        if not len(sizes):
            return
        if ((sizes < 0) | (dst_offsets < 0) | (src_offsets < 0) | (dst_offsets + sizes > dsts.nbytes)
                | (src_offsets + sizes > srcs.nbytes)).any():
            raise ValueError("copy range outside its tensor")
        to_device = dsts.tensors[0].is_cuda  # the first of each side stands for all: checking every one costs µs
        if srcs.tensors[0].is_cuda == to_device:
            raise ValueError("copies go host to device or device to host")
        runtime = self._runtime
        if runtime is None:
            self._copy_torch(dsts.tensors, dst_offsets, srcs.tensors, src_offsets, sizes)
            return
        src_ptrs = srcs.address + src_offsets
        dst_ptrs = dsts.address + dst_offsets
        # One range (a promotion of facts that lie together): a plain cudaMemcpyAsync, which
        # takes less marshalling than a batch of one.
        if self._batch and len(sizes) > 1 and self._copy_batch(runtime, dst_ptrs, src_ptrs, sizes, to_device):
            return
        memcpy, stream = runtime.lib.cudaMemcpyAsync, self.stream.cuda_stream
        for d, s, n in zip(dst_ptrs.tolist(), src_ptrs.tolist(), sizes.tolist()):  # ints and one C call each
            err = memcpy(d, s, n, _MEMCPY_DEFAULT, stream)
            if err:
                raise RuntimeError(f"cudaMemcpyAsync failed: {runtime.error(err)}")

    def _copy_batch(
        self, runtime: _Runtime, dst_ptrs: np.ndarray, src_ptrs: np.ndarray, sizes: np.ndarray, to_device: bool
    ) -> bool:
        """One ``cudaMemcpyBatchAsync``; ``False`` (and per-range copies from then on) when the
        runtime refuses it, which it does before queueing anything."""
        dsts, srcs = dst_ptrs.astype(np.uint64), src_ptrs.astype(np.uint64)
        counts = sizes.astype(np.uint64)
        args = [dsts.ctypes.data, srcs.ctypes.data, counts.ctypes.data, len(counts),
                ctypes.byref(self._attributes[to_device]), self._first_attribute.ctypes.data, 1]
        if runtime.batch_fail_index:
            args.append(ctypes.byref(ctypes.c_size_t(0)))
        assert runtime.batch is not None  # self._batch is set only where the runtime has it
        err = runtime.batch(*args, self.stream.cuda_stream)
        if err:
            logger.warning("cudaMemcpyBatchAsync failed (%s); copying range by range from now on", runtime.error(err))
            self._batch = False
        return not err

    def _copy_torch(
        self, dsts: Sequence[torch.Tensor], dst_offsets: np.ndarray, srcs: Sequence[torch.Tensor],
        src_offsets: np.ndarray, sizes: np.ndarray,
    ) -> None:
        with torch.cuda.stream(self.stream):
            for dst, d, src, s, n in zip(dsts, dst_offsets.tolist(), srcs, src_offsets.tolist(), sizes.tolist()):
                dst.view(-1).view(torch.uint8)[d : d + n].copy_(src.view(-1).view(torch.uint8)[s : s + n], non_blocking=True)
