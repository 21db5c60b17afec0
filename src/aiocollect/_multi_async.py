"""``MultiAsyncCollector`` (each batch is one worker's, first ready first served) and ``ProcessCollector``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import anyio
import torch

from ._multi_base import Delivery, MultiCollectorBase, episodes_of
from ._transport._messages import Release, RunFree
from ._workers._pool import WorkerPool

__all__ = ["MultiAsyncCollector", "ProcessCollector"]


class MultiAsyncCollector(MultiCollectorBase):
    """Each batch is one worker's full rollout, first ready first served; workers never wait for the
    trainer (each collects at most one batch ahead), so batches may lag the newest weights.

    Every frame carries ``("collector", "worker_id")``. Arguments are :class:`MultiSyncCollector`'s
    without ``preemptive_threshold`` and ``cat_results``; ``frames_per_batch`` is per batch (each worker
    collects that many).

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

    _sync = False

    @staticmethod
    def _split_frames(frames_per_batch: int | Sequence[int], n: int) -> list[int]:
        if not isinstance(frames_per_batch, int):
            raise TypeError("MultiAsyncCollector takes one frames_per_batch (each batch is one worker's)")
        return [frames_per_batch] * n

    def _check_layouts(self, ready: list[Any]) -> None:
        """Batches are delivered one worker at a time: any layouts go."""

    async def _start_workers(self) -> None:
        await super()._start_workers()
        pool = self._active_pool()
        init_random = self._options.init_random_frames
        per_worker_random = math.ceil(init_random / self.num_workers) if init_random else 0
        for i in range(self.num_workers):
            await pool.send(i, RunFree(random_frames=per_worker_random))
            pool.workers[i].expected_since = anyio.current_time()

    async def _next_batch(self, pool: WorkerPool) -> Delivery:
        index, notice = await self._receive(pool)
        handle = pool.workers[index]
        batch = handle.slots[notice.slot].td.clone()  # the one copy out of shared memory
        await pool.send(index, Release(notice.slot))
        handle.held_slots -= 1
        if handle.expected_since is None:  # it was blocked on full slots: it collects again now
            handle.expected_since = anyio.current_time()
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
