"""Staleness floors of the multi-process collectors: the oldest policy version a worker's batch may be
delivered with (``update_weights(flush=True)``, ``max_policy_lag`` on ``MultiAsyncCollector``), mirrored in
the shared control block so a worker's rollout in flight restarts once it falls below its floor."""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["StalenessFloors"]

if TYPE_CHECKING:
    from ._transport._shm import SharedBlock
    from ._workers._pool import WorkerPool


class StalenessFloors:
    """Mixin of ``MultiCollectorBase``: the per-worker floors and the frames discarded below them."""

    _control: SharedBlock | None
    #: per worker, the oldest policy version a delivered batch may have
    _floors: list[int]
    #: frames of stale batches dropped in the trainer
    _dropped_frames: int
    #: the workers' discarded frames as they were when the control block was closed
    _last_discarded: int

    def _floor_after(self, version: int, flush: bool) -> int | None:
        """The oldest version a batch may be delivered with once ``version`` is published (``None``: no
        floor). ``flush`` asks for ``version`` itself."""
        return version if flush else None

    def _raise_floors(self, ids: list[int], floor: int) -> bool:
        """Workers ``ids`` deliver nothing older than ``floor`` from now on: the shared floor makes their
        rollouts in flight restart (the weights are published already); ``True`` if a floor rose."""
        assert self._control is not None
        floors = self._control.td["floor"]
        raised = False
        for i in ids:
            if floor > self._floors[i]:
                self._floors[i] = floor
                floors[i] = floor
                raised = True
        return raised

    async def _drop_stale(self, pool: WorkerPool) -> None:
        """Drop the batches waiting to be read that are now below their worker's floor (a collector
        whose workers hold batches while the trainer works)."""

    def _stale(self, index: int, policy_version: int) -> bool:
        """Whether a batch of worker ``index`` collected with ``policy_version`` is below its floor."""
        return policy_version < self._floors[index]

    def _frames_discarded(self) -> int:
        """Frames collected and not delivered: rollouts the workers restarted on newer weights, and
        batches dropped here as stale."""
        control = self._control
        in_workers = int(control.td["discarded"].sum()) if control is not None else self._last_discarded
        return in_workers + self._dropped_frames
