"""Trajectory renames after a batch dropped as stale (below its worker's floor:
``update_weights(flush=True)``, ``max_policy_lag``): the trajectories that go on across the dropped
batch take fresh ids, so that no delivered id spans a gap. For the worker pool
(:class:`TrajectoryRenames`) and the remote collectors' trainers (:class:`DroppedBatchRenames`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

__all__ = ["DroppedBatchRenames", "FreshIds", "TrajectoryRenames"]

if TYPE_CHECKING:
    from tensordict import TensorDictBase


class TrajectoryRenames:
    """One worker's trajectories that go on across a batch the parent dropped: they take fresh ids (the
    spare ids the worker sent with the next batch delivered), so that no delivered id spans a gap.

    The worker renames what it can see itself (a rollout it restarted, a batch sent below the floor);
    this covers a batch dropped after the next one started. Fed every batch of the worker, in order."""

    def __init__(self) -> None:
        #: the worker's ids in flight at the end of the last batch delivered (their frames are out)
        self._in_flight: torch.Tensor | None = None
        #: worker ids delivered before a dropped batch and maybe going on after it: renamed if they do
        self._gapped: set[int] = set()
        #: worker id -> the id it is delivered under, for the trajectories renamed and still in flight
        self._names: dict[int, int] = {}

    def dropped(self) -> None:
        if self._in_flight is not None:
            self._gapped.update(self._in_flight.tolist())
            self._in_flight = None

    def delivered(self, ids: torch.Tensor, steps: int, spare_ids: Sequence[int] | FreshIds) -> torch.Tensor:
        """``ids`` (the batch's trajectory ids, time last, ``steps`` valid) as delivered."""
        out = ids
        if self._gapped or self._names:
            present = set(ids.unique().tolist())
            gapped = sorted(self._gapped & present)
            if len(gapped) > len(spare_ids):  # pragma: no cover - a worker protocol bug
                raise RuntimeError(
                    f"trajectories {gapped} go on after a dropped batch and the worker sent "
                    f"{len(spare_ids)} spare ids to rename them"
                )
            self._names.update(zip(gapped, spare_ids, strict=False))
            out = ids.clone()
            for old, new in self._names.items():
                out[ids == old] = new
        self._gapped = set()
        last = min(steps, ids.shape[-1]) - 1 if ids.ndim else -1
        self._in_flight = ids[..., last].reshape(-1).clone() if last >= 0 else None
        if self._names:
            going_on = set(self._in_flight.tolist()) if self._in_flight is not None else set()
            self._names = {old: new for old, new in self._names.items() if old in going_on}
        return out


class FreshIds:
    """Trajectory ids a remote collector's trainer gives out itself, from ``2**62`` up: its nodes (actors)
    take ``i + N k`` and never reach them. Iterating takes ids off one shared count, as many as are used."""

    def __init__(self) -> None:
        self._count = itertools.count(1 << 62)

    def __len__(self) -> int:
        return 1 << 62

    def __iter__(self) -> Iterator[int]:
        return self._count


class DroppedBatchRenames:
    """The trainer side of a remote collector's ``flush``: per node (actor), the trajectories that go on
    after a batch the trainer dropped are delivered under fresh ids (:class:`FreshIds`), so that no
    delivered id spans the gap. Fed every batch of a node, dropped or delivered, in order."""

    def __init__(self) -> None:
        self._per_node: dict[int, TrajectoryRenames] = {}
        self._fresh = FreshIds()

    def dropped(self, index: int) -> None:
        self._per_node.setdefault(index, TrajectoryRenames()).dropped()

    def delivered(self, index: int, batch: TensorDictBase) -> None:
        ids = batch.get(("collector", "traj_ids"), None)
        if ids is None:
            return
        renames = self._per_node.setdefault(index, TrajectoryRenames())
        renamed = renames.delivered(ids, ids.shape[-1], self._fresh)
        if renamed is not ids:
            batch.set(("collector", "traj_ids"), renamed)
