"""The batches a ``MultiAsyncEnvCollector`` worker sends: its ``AsyncEnvCollector``'s frames cut into batches
of ``frames_per_batch``, without the frames below the worker's version floor (``update_weights(flush=True)``,
``max_policy_lag``), with env ids over all workers and trajectory ids that are unique over the workers and
never span a gap.

Each frame carries the policy version its action was computed with, and one env's frames are in time
order with versions that never go down: the frames below a floor are a prefix of each env's frames, so
dropping them leaves each env's frames contiguous after one gap. The envs are not reset for this: a
trajectory that loses frames (here, or in a batch the trainer drops as stale) goes on under a fresh id.
"""

from __future__ import annotations

from typing import cast

import torch
from tensordict import TensorDictBase

__all__ = ["FLOOR", "VERSION", "WorkerFrames"]

VERSION = ("collector", "policy_version")
#: the floor the worker knew when it cut the batch (the trainer's check, removed before delivery)
FLOOR = ("collector", "worker_floor")
_ENV_ID = ("collector", "env_id")
_TRAJ = ("collector", "traj_ids")
_GROUP = ("collector", "group_id")
_DONE = ("next", "done")
_NONE_SENT = 2**62  # the oldest version of the batches sent since the last split: none yet


class WorkerFrames:
    """Frames in, batches of ``frames_per_batch`` fresh frames out.

    The collector's trajectory id ``t`` becomes ``2 t`` in this worker's id space, a fresh id ``k`` becomes
    ``2 k + 1`` (so fresh ids never meet the collector's); a worker id ``w`` becomes
    ``traj_start + traj_stride * w`` over all workers. Group ids (``group_size``) go over all workers the
    same way (the collector's group id ``g`` becomes ``traj_start + traj_stride * g``).

    Example:
        >>> frames = WorkerFrames(4, env_offset=0, traj_start=0, traj_stride=1)
        >>> frames.take(floor=0) is None  # nothing added yet
        True
    """

    def __init__(self, frames_per_batch: int, *, env_offset: int, traj_start: int, traj_stride: int) -> None:
        self.frames_per_batch = frames_per_batch
        self.env_offset = env_offset
        self.traj_start = traj_start
        self.traj_stride = traj_stride
        #: frames dropped below the floor here
        self.discarded = 0
        #: fresh ids given so far (in a checkpoint: no fresh id is given twice across a resume)
        self.fresh = 0
        self._pending: TensorDictBase | None = None
        self.restart()

    def restart(self, unsent: int = 0) -> None:
        """The collector restarted its engine (a seed, a reset, a checkpoint with env state, a load): the
        frames taken in and not sent, and ``unsent`` more, are dropped (counted in :attr:`discarded`);
        the trajectories go on under new collector ids, so none is renamed any more."""
        self.discarded += self.pending + unsent
        self._pending = None
        #: collector trajectory id -> fresh id in this worker's id space (trajectories that lost frames)
        self._renamed: dict[int, int] = {}
        #: the newest collector trajectory id taken in so far
        self._newest = -1
        #: after a batch sent may have been dropped: the collector ids up to this one take a fresh id at
        #: their next frame (``_split_seen``: those that did already)
        self._split_upto = -1
        self._split_seen: set[int] = set()
        self._sent_oldest = _NONE_SENT
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def pending(self) -> int:
        """Frames taken in and not sent yet."""
        return 0 if self._pending is None else self._pending.shape[0]

    def add(self, batch: TensorDictBase) -> None:
        """Take in a batch of the collector (flat ``[frames]``, every frame with its policy version)."""
        self._newest = max(self._newest, int(batch.get(_TRAJ).max()))
        if self._pending is None:
            self._pending = batch
        else:
            self._pending = cast("TensorDictBase", torch.cat([self._pending, batch]))

    def take(self, floor: int) -> TensorDictBase | None:
        """The next batch of ``frames_per_batch`` frames of version ``floor`` or newer (older ones are
        dropped and counted in :attr:`discarded`), or ``None`` until enough are added."""
        if self._sent_oldest < floor:  # a batch sent may be dropped as stale: every trajectory so far
            self._split_upto, self._split_seen = self._newest, set()
            self._sent_oldest = _NONE_SENT
        data = self._pending
        if data is None:
            return None
        if floor > 0:
            data = self._drop_stale(data, floor)
        if data.shape[0] < self.frames_per_batch:
            return None
        if data.shape[0] == self.frames_per_batch:  # the common case: one collector batch, no copy
            out, self._pending = data, None
        else:
            out, rest = data[: self.frames_per_batch], data[self.frames_per_batch :]
            self._pending = rest if rest.shape[0] else None
        self._sent_oldest = min(self._sent_oldest, int(out.get(VERSION).min()))
        out.set(FLOOR, torch.full((self.frames_per_batch,), floor, dtype=torch.int64))
        return self._globalise(out)

    def _drop_stale(self, data: TensorDictBase, floor: int) -> TensorDictBase:
        stale = data.get(VERSION) < floor
        if not bool(stale.any()):
            return data
        inner = data.get(_TRAJ)
        ended = set(inner[stale & data.get(_DONE).reshape(-1)].tolist())
        for t in inner[stale].unique().tolist():
            if t in ended:  # it ended in the frames dropped: never seen again
                self._renamed.pop(t, None)
                self._table = None
            else:  # it goes on after a gap: a fresh id
                self._rename(t)
        self.discarded += int(stale.sum())
        data = data[~stale]
        self._pending = data if data.shape[0] else None
        return data

    def _rename(self, t: int) -> None:
        self._renamed[t] = 2 * self.fresh + 1
        self.fresh += 1
        self._table = None
        if t <= self._split_upto:
            self._split_seen.add(t)

    def _lookup(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The renamed ids, sorted, and their fresh ids."""
        if self._table is None:
            table = torch.tensor(sorted(self._renamed.items()), dtype=torch.int64)
            self._table = table[:, 0].contiguous(), table[:, 1].contiguous()
        return self._table

    def _globalise(self, out: TensorDictBase) -> TensorDictBase:
        inner = out.get(_TRAJ)
        if self._split_upto >= 0 and int(inner.min()) <= self._split_upto:
            for t in inner[inner <= self._split_upto].unique().tolist():
                if t not in self._split_seen:
                    self._rename(t)
        local = inner * 2
        if self._renamed:
            keys, values = self._lookup()
            mask = torch.isin(inner, keys)
            if bool(mask.any()):
                local[mask] = values[torch.searchsorted(keys, inner[mask])]
            for t in inner[out.get(_DONE).reshape(-1)].tolist():  # ended: never seen again
                if self._renamed.pop(t, None) is not None:
                    self._table = None
        out.set_(_TRAJ, local * self.traj_stride + self.traj_start)
        groups = out.get(_GROUP, None)
        if groups is not None:  # group_size: the engine's group ids in the worker's id space, as its own
            out.set_(_GROUP, groups * self.traj_stride + self.traj_start)
        out.set_(_ENV_ID, out.get(_ENV_ID) + self.env_offset)
        return out
