"""Shared-memory blocks holding TensorDicts: one named ``/dev/shm`` segment per block.

The parent creates and unlinks every segment (``aiocollect_<pid>_`` prefix, so leaks are easy to spot);
workers map them by name. A block holds one :class:`~aiocollect._transport._flat.FlatLayout`; its
TensorDict (``td``) is the codec's views on the mapping. A process killed with SIGKILL (an OOM or cgroup
kill of the whole group) never unlinks its segments: the first segment a process creates sweeps those
whose creator's pid is no longer alive.
"""

from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Sequence
from multiprocessing import shared_memory
from typing import Any

import torch
from tensordict import TensorDict

from .._core._pids import pid_alive
from ._flat import FlatBuffer, FlatLayout

__all__ = ["PREFIX", "SHM_DIR", "Segment", "SharedBlock", "new_name", "sweep_orphans"]

PREFIX = "aiocollect_"

SHM_DIR = "/dev/shm"
_swept = False


def sweep_orphans(directory: str = SHM_DIR) -> list[str]:
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


def new_name() -> str:
    """A fresh segment name of this process (the first one sweeps the orphans: :func:`sweep_orphans`)."""
    global _swept
    if not _swept:
        _swept = True
        sweep_orphans()
    return f"{PREFIX}{os.getpid()}_{secrets.token_hex(6)}"


class Segment:
    """A named ``/dev/shm`` segment of ``size`` bytes (``buf``): created by the parent (``name=None``), which
    unlinks it, or mapped by name (a worker: no resource-tracker registration, the parent owns it)."""

    def __init__(self, size: int, name: str | None = None) -> None:
        self._shm: shared_memory.SharedMemory | None = None
        self._mmap: mmap.mmap | None = None
        self.buf: Any
        if name is None:
            self._shm = shared_memory.SharedMemory(name=new_name(), create=True, size=size)
            self.name, self.buf = self._shm.name, self._shm.buf
        else:
            self.name = name
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
            try:
                self._mmap = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            self.buf = self._mmap

    def unlink(self) -> None:
        """Remove the segment (parent). Mappings stay valid until dropped."""
        if self._shm is not None:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unmap it (once the views on it are dropped)."""
        self.buf = None
        for closable in (self._shm, self._mmap):
            if closable is not None:
                try:
                    closable.close()
                except (BufferError, ValueError):  # a view still alive: the GC unmaps it later
                    pass


class SharedBlock:
    """A TensorDict of ``layout`` in a shared segment the caller creates (parent) or maps (worker).

    ``batch_size``, if given, replaces the layout's own."""

    def __init__(
        self, layout: FlatLayout, batch_size: Sequence[int] | None = None, name: str | None = None
    ) -> None:
        if batch_size is not None:
            layout = layout.resized(batch_size)
        self.layout = layout
        self.batch_size = layout.batch_size
        self.nbytes = layout.nbytes
        self.segment = Segment(self.nbytes, name)
        self.name = self.segment.name
        #: the whole block as one ``uint8`` tensor (what a reader copies out in one go)
        self.data: torch.Tensor = torch.frombuffer(self.segment.buf, dtype=torch.uint8, count=self.nbytes)
        self.td: TensorDict = FlatBuffer(layout, data=self.data).views

    def unlink(self) -> None:
        """Remove the segment (parent). Mappings stay valid until dropped."""
        self.segment.unlink()

    def close(self) -> None:
        self.td = self.data = None  # type: ignore[assignment]  # drop the views: the mapping can close
        self.segment.close()
