"""Host-to-device copies of byte ranges at a few microseconds of host time each.

Promoting ``k`` host-tier facts layer group by layer group takes ``groups × k`` copies. Through
``Tensor.copy_`` each costs ~20–30 µs of host time (views, dispatch, an event recorded per
pinned source), which would put milliseconds on the request's critical path; the CUDA runtime's
own ``cudaMemcpyAsync`` costs a few. Without a loadable runtime library, ``copy_`` does the
same work, slower.

The caller keeps the sources alive (and unchanged) until the copies have run: unlike
``copy_``, nothing here tells PyTorch's pinned-memory allocator that a copy is in flight.
"""

from __future__ import annotations

import ctypes
import logging
from functools import lru_cache

import torch

logger = logging.getLogger(__name__)

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (unified addressing)


@lru_cache(maxsize=1)
def _cudart() -> ctypes.CDLL | None:
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
        return lib
    logger.info("CUDA runtime library not found by name; host-to-device copies go through torch")
    return None


class ByteCopier:
    """Queue copies of byte ranges from pinned host tensors into one device tensor on ``stream``."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        self._lib = _cudart()

    def copy(self, dst: torch.Tensor, jobs: list[tuple[int, torch.Tensor, int, int]]) -> None:
        """``jobs``: ``(dst byte offset, src, src byte offset, bytes)`` each."""
        limit = dst.nbytes
        for dst_offset, src, src_offset, nbytes in jobs:
            if dst_offset + nbytes > limit or src_offset + nbytes > src.nbytes or nbytes < 0:
                raise ValueError("copy range outside its tensor")
        if self._lib is None:
            flat = dst.view(-1).view(torch.uint8)
            with torch.cuda.stream(self.stream):
                for dst_offset, src, src_offset, nbytes in jobs:
                    s = src.view(-1).view(torch.uint8)[src_offset : src_offset + nbytes]
                    flat[dst_offset : dst_offset + nbytes].copy_(s, non_blocking=True)
            return
        memcpy, base, stream = self._lib.cudaMemcpyAsync, dst.data_ptr(), self.stream.cuda_stream
        for dst_offset, src, src_offset, nbytes in jobs:  # the hot loop: ints and one C call
            err = memcpy(base + dst_offset, src.data_ptr() + src_offset, nbytes, _MEMCPY_DEFAULT, stream)
            if err:
                raise RuntimeError(f"cudaMemcpyAsync failed: {self._lib.cudaGetErrorString(err).decode()}")
