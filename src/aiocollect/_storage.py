"""Batch storage that is reused once the consumer has let go of a batch.

A new batch of pixel observations is tens of megabytes: the allocator maps fresh pages for it and the
kernel zeroes each page on first write, which costs five times the copy itself (64 vs 11 µs per 100 KB
Atari frame, measured). So a rollout takes its batch's tensors from one buffer, and when no tensor (nor
any view of one) of an earlier batch is alive any more, that earlier buffer, its pages warm, is reused.
Whether anything still uses a buffer is read from its reference count: every tensor made from it holds a
reference, so a buffer is free exactly when the pool holds the only one. Small batches, which the
allocator recycles on its own, are not pooled.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from math import prod

import numpy as np
import torch

__all__ = ["StoragePool"]

_ALIGN = 64
#: below this a batch is left to the allocator (glibc reuses heap memory under its mmap threshold)
POOL_MIN_BYTES = 1 << 20


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class StoragePool:
    """``take(shapes_and_dtypes)`` returns uninitialised tensors backed by one buffer, reused when free.

    Example:
        >>> import torch
        >>> pool = StoragePool()
        >>> a, b = pool.take([((1024, 1024), torch.uint8), ((4,), torch.float32)])
        >>> first = a.data_ptr()
        >>> del a, b  # the consumer let go of the batch
        >>> a, b = pool.take([((1024, 1024), torch.uint8), ((4,), torch.float32)])
        >>> a.data_ptr() == first
        True
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._buffers: list[np.ndarray] = []

    def _free_buffer(self, nbytes: int) -> np.ndarray | None:
        for i in range(len(self._buffers)):
            # references to a free buffer: the pool's list, and getrefcount's argument
            if self._buffers[i].nbytes == nbytes and sys.getrefcount(self._buffers[i]) == 2:
                return self._buffers[i]
        return None

    def take(self, specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        sizes = [prod(shape) * dtype.itemsize for shape, dtype in specs]
        nbytes = sum(_aligned(n) for n in sizes) + _ALIGN
        if nbytes < POOL_MIN_BYTES:
            return [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
        buffer = self._free_buffer(nbytes)
        if buffer is None:
            buffer = np.empty(nbytes, dtype=np.uint8)
            # the oldest buffers are forgotten (those still in use are freed by their users as usual)
            self._buffers = [*self._buffers[-self.keep :], buffer]
        start = -buffer.ctypes.data % _ALIGN
        out = []
        for (shape, dtype), size in zip(specs, sizes, strict=True):
            raw = torch.from_numpy(buffer[start : start + size])
            out.append(raw.view(dtype).view(shape))
            start += _aligned(size)
        return out
