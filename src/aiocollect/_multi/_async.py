"""``MultiAsyncCollector`` (each batch is one worker's, first ready first served) and ``ProcessCollector``."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import anyio
import torch

from .._transport._messages import Release, RunFree
from .._workers._pool import WorkerPool
from ._base import Delivery, MultiCollectorBase, episodes_of
from ._floors import TrajectoryRenames

__all__ = ["MultiAsyncCollector", "ProcessCollector"]

_TRAJ_IDS = ("collector", "traj_ids")


class MultiAsyncCollector(MultiCollectorBase):
    """Each batch is one worker's full rollout, first ready first served; workers never wait for the
    trainer (each collects at most one batch ahead), so batches may lag the newest weights.

    Every frame carries ``("collector", "worker_id")``. Arguments are :class:`MultiSyncCollector`'s
    without ``preemptive_threshold`` and ``cat_results``; ``frames_per_batch`` is per batch (each worker
    collects that many), or a list of one value per worker (worker ``i``'s batches hold
    ``frames_per_batch[i]`` frames).

    For on-policy training, ``max_policy_lag=0`` (or ``update_weights(..., flush=True)``) delivers only
    batches collected entirely with the newest weights: at each update, batches waiting in the slots
    are dropped and rollouts in flight restart on the new weights (the envs are not reset); the frames
    this discards are counted in ``statistics().frames_discarded``. ``max_policy_lag=k`` delivers
    nothing more than ``k`` versions old.

    Example:
        >>> import anyio
        >>> from aiocollect import GymEnv, MultiAsyncCollector
        >>> async def main():
        ...     async with MultiAsyncCollector([lambda: GymEnv("CartPole-v1")] * 2, frames_per_batch=32,
        ...                                    total_frames=64, worker_backend="serial") as c:
        ...         async for batch in c:
        ...             print(batch.batch_size)
        >>> anyio.run(main)
        torch.Size([32])
        torch.Size([32])
    """

    #: the parent renames the trajectories that go on after a batch it dropped (each batch of a rollout
    #: worker holds a frame of every trajectory in flight, so the ones in flight at the end of the last
    #: delivered batch and present in the next one went on across the dropped one)
    _renames_after_drops = True

    _sync = False

    def __init__(self, create_env_fns: Sequence[Any], policy: Any = None, **kwargs: Any) -> None:
        super().__init__(create_env_fns, policy, **kwargs)
        #: batch notices a flush took from the pool's stream and kept (fresh ones, a failure)
        self._backlog: deque[Any] = deque()
        #: on-policy (max_policy_lag=0): slots delivered and not yet handed back (until the next batch
        #: is asked for)
        self._held: list[tuple[int, int]] = []
        #: per worker, the trajectories renamed because they go on across a batch dropped as stale
        self._renames: list[TrajectoryRenames] = []

    @staticmethod
    def _split_frames(frames_per_batch: int | Sequence[int], n: int) -> list[int]:
        if not isinstance(frames_per_batch, int):  # checked already (RolloutOptions): positive ints
            if len(frames_per_batch) != n:
                raise ValueError(
                    f"frames_per_batch has {len(frames_per_batch)} values for {n} workers: give one per "
                    "worker (worker i's batches hold frames_per_batch[i] frames) or one int for all"
                )
            return list(frames_per_batch)
        return [frames_per_batch] * n

    @property
    def _on_demand(self) -> bool:
        """On-policy (``max_policy_lag=0``): a batch collected while the trainer trains is dropped at its
        next update, and takes CPU from it. So each worker has one slot, handed back when the trainer
        asks for its next batch: the workers collect while the trainer waits for batches, and wait
        while it trains."""
        return self._schedule.max_policy_lag == 0

    def _slots_per_worker(self) -> int:
        return 1 if self._on_demand else 2

    def _budget_fits_batches(self) -> bool:
        # batches of different sizes (per-worker frames_per_batch) arrive in no set order: no warning
        return len(set(self._worker_frames)) > 1 or super()._budget_fits_batches()

    def _check_layouts(self, ready: list[Any]) -> None:
        """Batches are delivered one worker at a time: any layouts go."""

    async def _start_workers(self) -> None:
        await super()._start_workers()
        pool = self._active_pool()
        self._renames = [TrajectoryRenames() for _ in range(self.num_workers)]
        init_random = self._options.init_random_frames
        per_worker_random = math.ceil(init_random / self.num_workers) if init_random else 0
        for i in range(self.num_workers):
            await pool.send(i, RunFree(random_frames=per_worker_random))
            pool.workers[i].expected_since = anyio.current_time()

    def _floor_after(self, version: int, flush: bool) -> int | None:
        lag = self._schedule.max_policy_lag
        if flush or lag == 0:
            return version
        return version - lag if lag is not None and version > lag else None

    async def _release(self, pool: WorkerPool, index: int, slot: int) -> None:
        """Hand ``slot`` back to worker ``index``, which collects into it again (shielded: a slot
        received and not handed back would stop that worker for good)."""
        handle = pool.workers[index]
        with anyio.CancelScope(shield=True):
            await pool.send(index, Release(slot))
        handle.held_slots -= 1
        if handle.expected_since is None:  # it was blocked on full slots: it collects again now
            handle.expected_since = anyio.current_time()

    async def _drop_stale(self, pool: WorkerPool) -> None:
        # the batches already waiting are dropped now, not when next read: their workers may be blocked
        # on full slots, and collect again as soon as a slot is free
        with anyio.CancelScope(shield=True):
            waiting = list(self._backlog)
            self._backlog.clear()
            while True:
                try:
                    waiting.append(pool.deliveries.receive_nowait())
                except anyio.WouldBlock:
                    break
            for item in waiting:
                if isinstance(item, tuple) and self._stale(item[0], item[1].policy_version):
                    self._drop(item[0], item[1])
                    await self._release(pool, item[0], item[1].slot)
                else:  # fresh already (loaded before the floor was raised), or the pool's failure
                    self._backlog.append(item)

    async def _next_notice(self, pool: WorkerPool) -> tuple[int, Any]:
        """The next fresh batch notice; stale ones (below their worker's floor) are dropped and their
        slots released, without a delivery."""
        while True:
            if self._backlog:
                item = self._backlog.popleft()
                if not isinstance(item, tuple):  # the pool failed: raise its error
                    self._backlog.appendleft(item)
                    pool.check()
                index, notice = item
            else:
                index, notice = await self._receive(pool)
            if not self._stale(index, notice.policy_version):
                return index, notice
            self._drop(index, notice)
            await self._release(pool, index, notice.slot)

    def _drop(self, index: int, notice: Any) -> None:
        """Worker ``index``'s batch ``notice`` is stale: counted, not delivered (its trajectories that go
        on in the next batches take fresh ids)."""
        self._dropped_frames += notice.frames
        self._renames[index].dropped()

    async def _next_batch(self, pool: WorkerPool) -> Delivery:
        held, self._held = self._held, []
        for index, slot in held:  # the trainer asks for a batch: the workers collect again
            await self._release(pool, index, slot)
        while True:
            index, notice = await self._next_notice(pool)
            handle = pool.workers[index]
            batch = handle.slots[notice.slot].td.clone()  # the one copy out of shared memory
            if not self._stale(index, notice.policy_version) and self._on_demand:
                self._held.append((index, notice.slot))
                break
            await self._release(pool, index, notice.slot)
            if not self._stale(index, notice.policy_version):
                break
            # overtaken while it was being read (a concurrent update_weights(flush=True))
            self._drop(index, notice)
        if self._renames_after_drops:
            ids = batch.get(_TRAJ_IDS)
            renamed = self._renames[index].delivered(ids, notice.steps, notice.spare_ids)
            if renamed is not ids:
                batch.set(_TRAJ_IDS, renamed)
        batch.set(("collector", "worker_id"), torch.full(batch.batch_size, index, dtype=torch.int64))
        batch.names = [None] * (batch.ndim - 1) + ["time"]
        if self._schedule.update_at_each_batch and self._sender is not None:
            await self.update_weights(worker_ids=[index])
        return Delivery(
            batch,
            notice.frames,
            [episodes_of(index, notice)],
            worker_id=index,
            policy_version=notice.policy_version,
        )


class ProcessCollector(MultiAsyncCollector):
    """One collector in a separate process (torchrl's ``AsyncCollector``): it collects the next batch
    while the trainer works on this one.

    Example:
        >>> import anyio
        >>> from aiocollect import GymEnv, ProcessCollector
        >>> async def main():
        ...     async with ProcessCollector(lambda: GymEnv("CartPole-v1"), frames_per_batch=32,
        ...                                 total_frames=32, worker_backend="serial") as c:
        ...         async for batch in c:
        ...             print(batch.batch_size)
        >>> anyio.run(main)
        torch.Size([32])
    """

    def __init__(self, create_env_fn: Any, policy: Any = None, **kwargs: Any) -> None:
        if not callable(create_env_fn):
            raise TypeError(f"create_env_fn must be a callable returning an env, got {create_env_fn!r}")
        super().__init__([create_env_fn], policy, **kwargs)
