"""Shared-memory blocks holding TensorDicts: one named ``/dev/shm`` segment per block.

The parent creates and unlinks every segment (``aiocollect_<pid>_`` prefix, so leaks are easy to spot);
workers map them by name. A layout is a list of ``(key, shape, dtype)``; the block's tensors are views on
it. A process killed with SIGKILL (an OOM or cgroup kill of the whole group) never unlinks its segments:
the first segment a process creates sweeps those whose creator's pid is no longer alive.
"""

from __future__ import annotations

import mmap
import os
import secrets
from math import prod
from multiprocessing import shared_memory
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from .._pids import pid_alive

PREFIX = "aiocollect_"
_ALIGN = 64

Layout = list[tuple[Any, tuple[int, ...], torch.dtype]]

_SHM_DIR = "/dev/shm"
_swept = False


def sweep_orphans(directory: str = _SHM_DIR) -> list[str]:
    """Unlink the ``aiocollect_<pid>_*`` segments of processes that no longer exist (this pid namespace;
    our own files only) and return their names. Run once per process, before its first segment."""
    try:
        names = os.listdir(directory)
    except OSError:  # no /dev/shm (not Linux)
        return []
    removed = []
    me, uid = os.getpid(), os.getuid()
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid_text = name[len(PREFIX) :].split("_", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == me or pid_alive(int(pid_text)):
            continue
        path = os.path.join(directory, name)
        try:
            if os.stat(path).st_uid != uid:
                continue
            os.unlink(path)
        except OSError:  # gone meanwhile, or not ours to remove
            continue
        removed.append(name)
    return removed


def layout_of(td: TensorDictBase) -> Layout:
    return [
        (key, tuple(value.shape), value.dtype)
        for key, value in td.items(include_nested=True, leaves_only=True)
    ]


def _offsets(layout: Layout) -> tuple[list[int], int]:
    offsets, pos = [], 0
    for _, shape, dtype in layout:
        offsets.append(pos)
        nbytes = prod(shape) * torch.empty((), dtype=dtype).element_size()
        pos += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return offsets, max(pos, _ALIGN)


def _views(buf: Any, layout: Layout, batch_size: tuple[int, ...]) -> TensorDict:
    offsets, _ = _offsets(layout)
    td = TensorDict({}, batch_size=batch_size)
    for (key, shape, dtype), off in zip(layout, offsets, strict=True):
        itemsize = torch.empty((), dtype=dtype).element_size()
        n = prod(shape)
        flat = torch.frombuffer(buf, dtype=torch.uint8, count=n * itemsize, offset=off) if n else None
        tensor = flat.view(dtype).reshape(shape) if flat is not None else torch.empty(shape, dtype=dtype)
        td.set(key, tensor)
    return td


class SharedBlock:
    """A TensorDict of ``layout`` in a shared segment the caller creates (parent) or maps (worker)."""

    def __init__(self, layout: Layout, batch_size: tuple[int, ...], name: str | None = None) -> None:
        self.layout = layout
        self.batch_size = batch_size
        _, self.nbytes = _offsets(layout)
        self._shm: shared_memory.SharedMemory | None = None
        self._mmap: mmap.mmap | None = None
        if name is None:  # create (parent)
            global _swept
            if not _swept:
                _swept = True
                sweep_orphans()
            self._shm = shared_memory.SharedMemory(
                name=f"{PREFIX}{os.getpid()}_{secrets.token_hex(6)}", create=True, size=self.nbytes
            )
            self.name = self._shm.name
            buf: Any = self._shm.buf
        else:  # map an existing one (worker): no resource-tracker registration, the parent owns it
            self.name = name
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
            try:
                self._mmap = mmap.mmap(fd, self.nbytes)
            finally:
                os.close(fd)
            buf = self._mmap
        self.td = _views(buf, layout, batch_size)

    def unlink(self) -> None:
        """Remove the segment (parent). Mappings stay valid until dropped."""
        if self._shm is not None:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.td = None  # type: ignore[assignment]
        for closable in (self._shm, self._mmap):
            if closable is not None:
                try:
                    closable.close()
                except (BufferError, ValueError):  # a view still alive: the GC unmaps it later
                    pass
