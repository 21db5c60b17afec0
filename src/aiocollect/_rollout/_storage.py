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
from typing import Any

import numpy as np
import torch

from .._core._validation import batch_memory

__all__ = ["POOL_MIN_BYTES", "StoragePool", "batch_specs", "numpy_dtype", "tensor_at"]

_ALIGN = 64
#: below this a batch is left to the allocator (glibc reuses heap memory under its mmap threshold)
POOL_MIN_BYTES = 1 << 20


def batch_specs(
    shapes: dict[Any, tuple[tuple[int, ...], torch.dtype]], frames: int
) -> tuple[list[Any], list[Any]]:
    """A batch's keys and their ``(shape, dtype)``, checked first: one that would not fit in this machine's
    memory is refused with a ``ValueError`` naming ``frames_per_batch`` and the bytes it would need."""
    specs = list(shapes.values())
    batch_memory(
        frames, sum(prod(shape) * dtype.itemsize for shape, dtype in specs), "every key of the batch"
    )
    return list(shapes), specs


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

    def take_buffer(self, nbytes: int) -> np.ndarray:
        """A ``uint8`` array of ``nbytes`` starting at a 64-byte boundary: a free pooled one (its pages
        warm), else a new one (pooled from :data:`POOL_MIN_BYTES` on). It counts as in use while any array
        made from it (a view, and so a tensor ``torch.from_numpy`` made of one) is alive."""
        if nbytes < POOL_MIN_BYTES:
            return _aligned_array(nbytes)
        buffer = self._free_buffer(nbytes + _ALIGN)
        if buffer is None:
            buffer = np.empty(nbytes + _ALIGN, dtype=np.uint8)
            # the oldest buffers are forgotten (those still in use are freed by their users as usual)
            self._buffers = [*self._buffers[-self.keep :], buffer]
        start = -buffer.ctypes.data % _ALIGN
        return buffer[start : start + nbytes]

    def take(self, specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        return [tensor for tensor, _ in self.take_arrays(specs)]

    def take_arrays(
        self, specs: Sequence[tuple[tuple[int, ...], torch.dtype]]
    ) -> list[tuple[torch.Tensor, np.ndarray | None]]:
        """:meth:`take`, each tensor with the numpy array it shares its memory with (``None`` for a dtype
        numpy lacks, such as bfloat16). Arrays are made first and wrapped by ``torch.from_numpy``: about
        4x cheaper than ``torch.empty`` followed by ``Tensor.numpy()`` for the small entries of a batch."""
        sizes = [prod(shape) * dtype.itemsize for shape, dtype in specs]
        nbytes = sum(_aligned(n) for n in sizes)
        if nbytes < POOL_MIN_BYTES:
            out: list[tuple[torch.Tensor, np.ndarray | None]] = []
            for shape, dtype in specs:
                np_dtype = numpy_dtype(dtype)
                if np_dtype is None:
                    out.append((torch.empty(shape, dtype=dtype), None))
                else:
                    array = np.empty(shape, dtype=np_dtype)
                    out.append((torch.from_numpy(array), array))
            return out
        buffer = self.take_buffer(nbytes)
        out = []
        start = 0
        for (shape, dtype), size in zip(specs, sizes, strict=True):
            out.append(tensor_at(buffer, start, size, shape, dtype))
            start += _aligned(size)
        return out


def _aligned_array(nbytes: int) -> np.ndarray:
    """A new ``uint8`` array of ``nbytes`` that starts at a 64-byte boundary."""
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + nbytes]


def tensor_at(
    buffer: np.ndarray, offset: int, nbytes: int, shape: Sequence[int], dtype: torch.dtype
) -> tuple[torch.Tensor, np.ndarray | None]:
    """The tensor of ``shape`` and ``dtype`` on ``buffer[offset : offset + nbytes]`` (a ``uint8`` array), and
    the numpy array it is made of (``None`` for a dtype numpy lacks, such as bfloat16): either holds a
    reference to ``buffer``, so that a :class:`StoragePool` sees it in use."""
    raw = buffer[offset : offset + nbytes]
    np_dtype = numpy_dtype(dtype)
    if np_dtype is None:
        return torch.from_numpy(raw).view(dtype).view(tuple(shape)), None
    array = raw.view(np_dtype).reshape(tuple(shape))
    return torch.from_numpy(array), array


_NUMPY_DTYPES: dict[torch.dtype, np.dtype[Any] | None] = {}


def numpy_dtype(dtype: torch.dtype) -> np.dtype[Any] | None:
    """The numpy dtype of a torch dtype, or ``None`` where numpy has none (bfloat16, ...)."""
    try:
        return _NUMPY_DTYPES[dtype]
    except KeyError:
        pass
    try:
        np_dtype: np.dtype[Any] | None = torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        np_dtype = None
    _NUMPY_DTYPES[dtype] = np_dtype
    return np_dtype
