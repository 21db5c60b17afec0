"""A worker process keeps the memory it frees for its next step (glibc's ``malloc`` only).

A policy's forward pass allocates the same large temporaries at every step: a small CNN over 8 Atari
screens makes two 3.2 MB float copies of its input and as much again in activations. In a fresh worker
process glibc hands blocks that large out with ``mmap`` and gives them back on ``free`` (or trims them off
the heap's top), so every step faults its temporaries in again, zero-filled page by page: 55-80 page faults
and about 200 CPU-µs per Pong frame on our machines, a fifth of the frame's cost. The same loop in a
long-lived trainer process measured 3-6 faults per frame (glibc's adaptive thresholds had settled there),
so a raw loop did not pay it and our workers did.

:func:`keep_freed_memory` raises the ``mmap`` threshold to glibc's maximum (32 MiB) and the trim threshold
to :data:`TRIM_BYTES`: blocks up to 32 MiB come from the heap and up to 64 MiB of free memory stays at its
top, so a worker's resident size stays at its peak instead of being faulted in again at every step. Set
any of glibc's own ``MALLOC_*_`` variables (or ``GLIBC_TUNABLES``) and your setting stands: nothing is
changed. Elsewhere (macOS, musl, Windows) it does nothing.

Example:
    >>> MMAP_BYTES // 2**20, TRIM_BYTES // 2**20  # in a worker: keep_freed_memory()
    (32, 64)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["MMAP_BYTES", "TRIM_BYTES", "keep_freed_memory"]

#: glibc's ``mallopt`` parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: blocks up to this size come from the heap (glibc's largest allowed value on 64-bit: HEAP_MAX_SIZE / 2)
MMAP_BYTES = 32 * 1024 * 1024
#: free memory at the heap's top up to this size is kept (returned to the OS beyond it)
TRIM_BYTES = 64 * 1024 * 1024
#: the user's own malloc settings, which win
_USER_SETTINGS = (
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
)


def _user_has_settings() -> bool:
    return any(name in os.environ for name in _USER_SETTINGS) or "glibc.malloc" in os.environ.get(
        "GLIBC_TUNABLES", ""
    )


def keep_freed_memory() -> bool:
    """In a worker process: let glibc keep freed memory for the next step (see the module). True if the
    settings were applied; False on another C library or where the user set their own."""
    if not sys.platform.startswith("linux") or _user_has_settings():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the mmap threshold first: setting either turns glibc's adaptive thresholds off
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES))
