"""One worker's shared-memory slots: numpy arrays carved out of one ``/dev/shm`` segment.

The parent creates the segment (``aiocollect_<pid>_`` prefix, swept if its creator dies) and unlinks it;
the worker maps it by name. A step moves no pickle: the parent writes the actions into ``actions``, the
worker writes ``obs``, ``reward``, the flags and, for sub-envs whose episode ended, ``final`` (their last
observation, same-step autoreset) and ``ended``.
"""

from __future__ import annotations

import mmap
import os
import secrets
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from .._envs._spaces import LeafSpec, NestedKey
from .._transport._shm import PREFIX, sweep_orphans

__all__ = ["Slots"]

_ALIGN = 64
_swept = False


def _fields(
    obs: dict[NestedKey, LeafSpec], act: dict[NestedKey, LeafSpec], n: int
) -> list[tuple[str, NestedKey, tuple[int, ...], np.dtype[Any]]]:
    out: list[tuple[str, NestedKey, tuple[int, ...], np.dtype[Any]]] = []
    for group in ("obs", "final"):
        out += [(group, key, (n, *spec.shape), spec.numpy_dtype) for key, spec in obs.items()]
    out += [("actions", key, (n, *spec.shape), spec.numpy_dtype) for key, spec in act.items()]
    out += [
        ("flags", "reward", (n,), np.dtype(np.float64)),
        ("flags", "terminated", (n,), np.dtype(np.bool_)),
        ("flags", "truncated", (n,), np.dtype(np.bool_)),
        ("flags", "ended", (n,), np.dtype(np.bool_)),
        ("flags", "seed", (2,), np.dtype(np.int64)),  # [has a seed, the seed]
    ]
    return out


class Slots:
    """The arrays of one worker's ``n`` sub-envs; ``name=None`` creates the segment (parent)."""

    def __init__(
        self,
        obs_specs: dict[NestedKey, LeafSpec],
        act_specs: dict[NestedKey, LeafSpec],
        n: int,
        name: str | None = None,
    ) -> None:
        fields = _fields(obs_specs, act_specs, n)
        offsets, size = [], 0
        for _, _, shape, dtype in fields:
            offsets.append(size)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            size += -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        self._shm: shared_memory.SharedMemory | None = None
        self._mmap: mmap.mmap | None = None
        if name is None:
            global _swept
            if not _swept:
                _swept = True
                sweep_orphans()
            self._shm = shared_memory.SharedMemory(
                name=f"{PREFIX}{os.getpid()}_{secrets.token_hex(6)}", create=True, size=size
            )
            self.name = self._shm.name
            buf: Any = self._shm.buf
        else:  # the worker: no resource-tracker registration, the parent owns the segment
            self.name = name
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
            try:
                self._mmap = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            buf = self._mmap
        self.obs: dict[NestedKey, np.ndarray] = {}
        self.final: dict[NestedKey, np.ndarray] = {}
        self.actions: dict[NestedKey, np.ndarray] = {}
        flags: dict[NestedKey, np.ndarray] = {}
        groups = {"obs": self.obs, "final": self.final, "actions": self.actions, "flags": flags}
        for (group, key, shape, dtype), offset in zip(fields, offsets, strict=True):
            count = int(np.prod(shape, dtype=np.int64))
            groups[group][key] = np.frombuffer(buf, dtype, count, offset).reshape(shape)
        self.reward, self.terminated, self.truncated = (
            flags["reward"],
            flags["terminated"],
            flags["truncated"],
        )
        self.ended, self.seed = flags["ended"], flags["seed"]
        self._views = groups

    def close(self, unlink: bool = False) -> None:
        """Drop the views and the mapping; ``unlink`` (the parent) removes the segment too."""
        self.obs = self.final = self.actions = {}
        self.reward = self.terminated = self.truncated = self.ended = self.seed = None  # type: ignore[assignment]
        self._views = {}
        if self._shm is not None and unlink:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
        for closable in (self._shm, self._mmap):
            if closable is not None:
                try:
                    closable.close()
                except (BufferError, ValueError):  # a view still alive: the GC unmaps it later
                    pass
