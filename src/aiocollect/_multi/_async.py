"""First ready, first served: the delivery of ``MultiAsyncCollector``, ``ProcessCollector`` and
``MultiAsyncEnvCollector`` (each batch is one worker's), and the first two collectors."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from functools import partial
from typing import Any, Unpack

import anyio
import torch
from tensordict import TensorDictBase

from .._core._mistakes import explicit_keywords
from .._episodes._args import episode_args, trajs_per_batch_arg
from .._episodes._renames import TrajectoryRenames
from .._fleet._collector import FleetCollector
from .._fleet._transport import Arrival
from .._transport._messages import Release, RunFree
from .._workers._pool import WorkerPool
from .._workers._worker import HALTED
from ._copies import BatchCopies
from ._delivery import WorkersView, episodes_of
from ._episodes import Episodes
from ._keywords import MultiAsyncKeywords, WorkersKeywords
from ._workers import WorkersMixin

__all__ = ["FirstReady", "MultiAsyncCollector", "ProcessCollector"]

_TRAJ_IDS = ("collector", "traj_ids")


class FirstReady:
    """Each batch is one worker's, the first ready first; workers collect ahead into their slots (one
    with ``max_policy_lag=0``, handed back when the trainer asks for its next batch), and a batch below
    its worker's staleness floor is dropped, its slot handed back at once.

    ``renames``: the parent renames the trajectories that go on after a batch it dropped (a rollout
    worker's batch holds a frame of every trajectory in flight, so the ones in flight at the end of the
    last delivered batch and present in the next one went on across the dropped one). ``lazy``: workers
    collect from the first batch asked for on: a ``set_seed`` or ``reset`` before applies to every frame.
    """

    sync = False
    stacked = False  # each batch is one worker's

    def __init__(self, *, renames: bool = True, lazy: bool = True) -> None:
        self._renames_after_drops = renames
        self._lazy = lazy
        self._pending: RunFree | None = None  # what each worker gets at the first batch asked for
        #: batch notices a flush took from the pool's stream and kept (fresh ones, a failure)
        self._backlog: deque[Any] = deque()
        #: on-policy (max_policy_lag=0): slots delivered and not yet handed back (until the next batch
        #: is asked for)
        self._held: list[tuple[int, int]] = []
        #: per worker, the trajectories renamed because they go on across a batch dropped as stale
        self._renames: list[TrajectoryRenames] = []
        self._random_frames = 0
        self._copies = BatchCopies()  # the batches copied out of the slots (_copies.py)

    @staticmethod
    def split_frames(frames_per_batch: int | Sequence[int], n: int) -> list[int]:
        if not isinstance(frames_per_batch, int):  # checked already (RolloutOptions): positive ints
            if len(frames_per_batch) != n:
                raise ValueError(
                    f"frames_per_batch has {len(frames_per_batch)} values for {n} workers: give one per "
                    "worker (worker i's batches hold frames_per_batch[i] frames) or one int for all"
                )
            return list(frames_per_batch)
        return [frames_per_batch] * n

    @staticmethod
    def on_demand(w: WorkersView) -> bool:
        """On-policy (``max_policy_lag=0``): a batch collected while the trainer trains is dropped at its
        next update, and takes CPU from it. So each worker has one slot, handed back when the trainer
        asks for its next batch: the workers collect while the trainer waits for batches, and wait
        while it trains."""
        return w.schedule.max_policy_lag == 0

    def slots_per_worker(self, w: WorkersView) -> int:
        return 1 if self.on_demand(w) else 2

    def check_layouts(self, ready: list[Any]) -> None:
        """Batches are delivered one worker at a time: any layouts go."""

    async def started(self, w: WorkersView) -> None:
        """The workers run: each collects freely from the first batch (``lazy``) or now, random first."""
        self._renames = [TrajectoryRenames() for _ in range(w.num_workers)]
        init_random = w.options.init_random_frames
        per_worker_random = math.ceil(init_random / w.num_workers) if init_random else 0
        self._random_frames = per_worker_random
        self._pending = RunFree(random_frames=per_worker_random)
        w.fleet.on_stop(partial(self._halt, w))
        if not self._lazy:
            await self._run_free(w)

    def _halt(self, w: WorkersView, drain: bool) -> None:
        """``request_stop()``, once no batch is being delivered: no worker starts another batch and the
        ones in flight end at their next step (each worker counts their frames as discarded: never
        delivered). ``drain`` (on the event loop): the batches waiting to be read are counted as
        discarded too. A cheap write to shared memory otherwise: any thread may call it."""
        pool, control = w.pool, w.control
        if pool is None or control is None:  # not started, or closed
            return
        control.td["stop"].fill_(HALTED)
        if not drain:
            return
        for item in self._take_waiting(pool, anyio.EndOfStream, anyio.ClosedResourceError):
            if isinstance(item, tuple):
                w.fleet.discard(item[1].frames)
            else:  # the pool's failure: raised by whoever reads next
                self._backlog.append(item)

    def _take_waiting(self, pool: WorkerPool, *ends: type[Exception]) -> list[Any]:
        """What waits to be read, taken: the backlog, then the pool's deliveries (until it has none, or
        raises one of ``ends``)."""
        waiting = list(self._backlog)
        stop: tuple[type[Exception], ...] = (anyio.WouldBlock, *ends)
        self._backlog.clear()
        while True:
            try:
                waiting.append(pool.receive_nowait())
            except stop:
                return waiting

    async def _run_free(self, w: WorkersView) -> None:
        pending, self._pending, pool = self._pending, None, w.pool
        if pending is not None and pool is not None:
            with anyio.CancelScope(shield=True):  # a worker left out would never deliver
                for i in range(len(pool.workers)):
                    await pool.send(i, pending)
                    pool.workers[i].expected_since = anyio.current_time()

    @staticmethod
    async def _release(pool: WorkerPool, index: int, slot: int) -> None:
        """Hand ``slot`` back to worker ``index``, which collects into it again (shielded: a slot
        received and not handed back would stop that worker for good)."""
        handle = pool.workers[index]
        with anyio.CancelScope(shield=True):
            await pool.send(index, Release(slot))
        handle.held_slots = max(0, handle.held_slots - 1)  # 0 already: a replacement's
        if handle.expected_since is None:  # it was blocked on full slots: it collects again now
            handle.expected_since = anyio.current_time()

    async def replaced(self, w: WorkersView, index: int) -> None:
        """Worker ``index`` was replaced (its batches not read yet were dropped): it collects freely
        once the others do; its trajectories are all new."""
        pool = w.pool
        assert pool is not None
        self._renames[index] = TrajectoryRenames()
        self._held = [(i, slot) for i, slot in self._held if i != index]
        handle = pool.workers[index]
        handle.held_slots = 0
        if self._pending is None:  # the workers collect already
            await pool.send(index, RunFree(random_frames=max(0, self._random_frames - handle.frames)))
            handle.expected_since = anyio.current_time()

    async def drop_stale(self, w: WorkersView) -> None:
        """Drop the batches waiting to be read that are now below their worker's floor: now, not when
        next read (their workers may be blocked on full slots, and collect again once a slot is free)."""
        pool = w.pool
        assert pool is not None
        with anyio.CancelScope(shield=True):
            for item in self._take_waiting(pool):
                if isinstance(item, tuple) and self.stale(w, item[0], item[1].policy_version):
                    self._drop(w, item[0], item[1])
                    await self._release(pool, item[0], item[1].slot)
                else:  # fresh already (loaded before the floor was raised), or the pool's failure
                    self._backlog.append(item)

    def stale(self, w: WorkersView, index: int, policy_version: int) -> bool:
        """Whether a batch of worker ``index`` collected with ``policy_version`` is below its floor."""
        return policy_version < w.floors[index]

    async def _next_notice(self, w: WorkersView, pool: WorkerPool) -> tuple[int, Any]:
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
                index, notice = await w.receive()
            if not self.stale(w, index, notice.policy_version):
                return index, notice
            self._drop(w, index, notice)
            await self._release(pool, index, notice.slot)

    def _drop(self, w: WorkersView, index: int, notice: Any) -> None:
        """Worker ``index``'s batch ``notice`` is stale: counted, not delivered (its trajectories that go
        on in the next batches take fresh ids)."""
        w.fleet.discard(notice.frames)
        self._renames[index].dropped()

    async def next_batch(self, w: WorkersView) -> Arrival:
        pool = w.pool
        assert pool is not None
        await self._run_free(w)  # the first batch asked for: the workers start collecting
        held, self._held = self._held, []
        for index, slot in held:  # the trainer asks for a batch: the workers collect again
            await self._release(pool, index, slot)
        while True:
            index, notice = await self._next_notice(w, pool)
            handle = pool.workers[index]
            batch = self._copies.one(handle.slots[notice.slot])  # the one copy out of shared memory
            if not self.stale(w, index, notice.policy_version) and self.on_demand(w):
                self._held.append((index, notice.slot))
                break
            await self._release(pool, index, notice.slot)
            if not self.stale(w, index, notice.policy_version):
                break
            # overtaken while it was being read (a concurrent update_weights(flush=True))
            self._drop(w, index, notice)
        if self._renames_after_drops:
            ids = batch.get(_TRAJ_IDS)
            renamed = self._renames[index].delivered(ids, notice.steps, notice.spare_ids)
            if renamed is not ids:
                batch.set(_TRAJ_IDS, renamed)
        batch.set(("collector", "worker_id"), torch.full(batch.batch_size, index, dtype=torch.int64))
        if w.schedule.update_at_each_batch and w.sender is not None:
            await w.fleet.update_weights(worker_ids=[index])
        return Arrival(batch, notice.frames, episodes_of(index, notice), index, notice.policy_version)

    @staticmethod
    def frames_for_buffer(w: WorkersView, batch: TensorDictBase) -> TensorDictBase:
        """What ``replay_buffer.extend`` gets: the batch as delivered (one worker's rollout, as torchrl's
        workers extend theirs)."""
        return batch

    async def load_behind(self, w: WorkersView, raised: list[int]) -> None:
        """Nothing: a rollout worker's rollout in flight restarts on the new weights by itself."""


class MultiAsyncCollector(WorkersMixin, FleetCollector):
    """Each batch is one worker's full rollout, first ready first served; workers never wait for the
    trainer (each collects at most one batch ahead, from the first batch asked for on: a ``set_seed``
    right after ``async with`` seeds every batch), so batches may lag the newest weights.

    Every frame carries ``("collector", "worker_id")``. Arguments are :class:`MultiSyncCollector`'s
    without ``preemptive_threshold`` and ``cat_results``; ``frames_per_batch`` is per batch (each worker
    collects that many), or a list of one value per worker (worker ``i``'s batches hold
    ``frames_per_batch[i]`` frames).

    For on-policy training, ``max_policy_lag=0`` (or ``update_weights(..., flush=True)``) delivers only
    batches collected entirely with the newest weights: at each update, batches waiting in the slots
    are dropped and rollouts in flight restart on the new weights (the envs are not reset); the frames
    this discards are counted in ``statistics().frames_discarded``. ``max_policy_lag=k`` delivers
    nothing more than ``k`` versions old. With ``trajs_per_batch`` an episode goes on across weight
    updates (each frame keeps its ``policy_version``), ``max_policy_lag=k`` discards an episode whose
    oldest frame is more than ``k`` versions old, and one a flush tears is discarded; with
    ``on_update="restart"`` the episodes in flight start again from their initial state when a worker
    loads new weights, and ``group_size`` delivers groups of episodes (see :class:`Collector`).

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

    @explicit_keywords(keywords=MultiAsyncKeywords)
    def __init__(
        self, create_env_fns: Sequence[Any], policy: Any = None, **kwargs: Unpack[MultiAsyncKeywords]
    ) -> None:
        lag, owner = kwargs["max_policy_lag"], type(self).__name__
        trajs = trajs_per_batch_arg(owner, kwargs["trajs_per_batch"], kwargs["frames_per_batch"])
        # with trajs_per_batch, max_policy_lag bounds each episode's oldest frame (the workers drop none)
        group, update = episode_args(
            owner, trajs, kwargs["group_size"], kwargs["on_update"], kwargs["restart"]
        )
        delivery = Episodes.over(FirstReady(), trajs, lag=lag, group_size=group, on_update=update)
        frames = Episodes.frames(kwargs["frames_per_batch"], trajs, kwargs["rollout"])  # per worker
        own = {"frames_per_batch": frames, "max_policy_lag": None if trajs else lag}
        self._init_workers(create_env_fns, policy, delivery, {**kwargs, **own})


class ProcessCollector(WorkersMixin, FleetCollector):
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

    @explicit_keywords(keywords=WorkersKeywords)
    def __init__(self, create_env_fn: Any, policy: Any = None, **kwargs: Unpack[WorkersKeywords]) -> None:
        if not callable(create_env_fn):
            raise TypeError(f"create_env_fn must be a callable returning an env, got {create_env_fn!r}")
        self._init_workers([create_env_fn], policy, FirstReady(), kwargs)
