"""One worker's shared-memory slots: numpy arrays carved out of one ``/dev/shm`` segment.

The parent creates the segment (``aiocollect_<pid>_`` prefix, swept if its creator dies) and unlinks it;
the worker maps it by name. A step moves no pickle: the parent writes the actions into ``actions``, the
worker writes ``obs``, ``reward``, the flags and, for sub-envs whose episode ended, ``final`` (their last
observation, same-step autoreset) and ``ended``. A :class:`Block` reads and writes consecutive workers'
slots as one block of rows (a whole env's, or one ``split()`` part's).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._envs._spaces import LeafSpec, NestedKey
from .._transport._shm import Segment

__all__ = ["Block", "Slots"]

_ALIGN = 64


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
        self._segment = Segment(size, name)  # the parent creates it (name=None), a worker maps it
        self.name, buf = self._segment.name, self._segment.buf
        self.obs: dict[NestedKey, np.ndarray] = {}
        self.final: dict[NestedKey, np.ndarray] = {}
        self.actions: dict[NestedKey, np.ndarray] = {}
        flags: dict[NestedKey, np.ndarray] = {}
        groups = {"obs": self.obs, "final": self.final, "actions": self.actions, "flags": flags}
        for (group, key, shape, dtype), offset in zip(fields, offsets, strict=True):
            count = int(np.prod(shape, dtype=np.int64))
            groups[group][key] = np.frombuffer(buf, dtype, count, offset).reshape(shape)
        names = ("reward", "terminated", "truncated", "ended", "seed")
        self.reward, self.terminated, self.truncated, self.ended, self.seed = (flags[k] for k in names)
        self._views = groups

    def close(self, unlink: bool = False) -> None:
        """Drop the views and the mapping; ``unlink`` (the parent) removes the segment too."""
        self.obs = self.final = self.actions = {}
        self.reward = self.terminated = self.truncated = self.ended = self.seed = None  # type: ignore[assignment]
        self._views = {}
        if unlink:
            self._segment.unlink()
        self._segment.close()


class Block:
    """Consecutive workers' sub-envs (``ProcessVectorEnv``'s workers: each with its ``slots`` and its
    sub-envs ``[lo, hi)``) as one block of rows: their slots read (the slot's own views for one worker,
    unless ``copy``; joined copies for several) and written."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers
        lo = workers[0].lo
        self.width = workers[-1].hi - lo
        self.offsets = [(w.lo - lo, w.hi - lo) for w in workers]  # each worker's rows in the block

    def _join(self, arrays: list[np.ndarray], copy: bool) -> np.ndarray:
        if len(arrays) > 1:
            return np.concatenate(arrays)
        return arrays[0].copy() if copy else arrays[0]  # (a third of a concatenate's cost)

    def obs(self, key: NestedKey, copy: bool = False) -> np.ndarray:
        """The observation ``key`` of every sub-env."""
        return self._join([w.slots.obs[key] for w in self.workers], copy)

    def final(self, key: NestedKey) -> np.ndarray:
        """The final observation ``key`` of the sub-envs whose episode ended at the last step."""
        return self._join([w.slots.final[key] for w in self.workers], False)

    def flags(self, copy: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``reward``, ``terminated``, ``truncated`` and ``ended`` of the last step."""
        slots: list[Any] = [w.slots for w in self.workers]
        groups = ("reward", "terminated", "truncated", "ended")
        reward, terminated, truncated, ended = (
            self._join([getattr(s, g) for s in slots], copy) for g in groups
        )
        return reward, terminated, truncated, ended

    def write_actions(self, arrays: dict[NestedKey, np.ndarray], start: int = 0) -> None:
        """The block's actions: rows ``start`` to ``start + width - 1`` of each action leaf."""
        for worker, (lo, hi) in zip(self.workers, self.offsets, strict=True):
            assert worker.slots is not None
            for key, value in arrays.items():
                worker.slots.actions[key][...] = value[start + lo : start + hi]

    def write_seed(self, seed: int | None) -> None:
        """Sub-env ``k`` of the next reset seeded with ``seed + k``."""
        for worker, (lo, _) in zip(self.workers, self.offsets, strict=True):
            assert worker.slots is not None
            worker.slots.seed[0] = seed is not None
            worker.slots.seed[1] = 0 if seed is None else int(seed) + lo
