"""``async with collector, stop_on_signals(collector):`` (docs/long-runs.md's recipe) lets every error of the
run leave as itself, as it does without ``stop_on_signals``: the trainer's own exception, a worker's
``WorkerDiedError``, a cancellation; never an ``ExceptionGroup``. Under asyncio, uvloop and trio."""

from __future__ import annotations

import os
import signal

import anyio
import pytest

from aiocollect import Collector, MultiAsyncCollector, WorkerDiedError, stop_on_signals
from support import cartpole

pytestmark = pytest.mark.anyio


class TrainerBug(Exception):
    pass


async def test_the_bodys_own_error_leaves_as_itself() -> None:
    collector = Collector(cartpole, frames_per_batch=16, total_frames=-1)
    with pytest.raises(TrainerBug) as info:
        async with collector, stop_on_signals(collector):
            async for _ in collector:
                raise TrainerBug("the loss is nan")
    assert type(info.value) is TrainerBug


async def test_a_workers_death_is_caught_as_worker_died_error(leaks) -> None:
    collector = MultiAsyncCollector([cartpole, cartpole], frames_per_batch=16, total_frames=-1)
    caught: list[BaseException] = []
    try:
        async with collector, stop_on_signals(collector) as stop:
            with anyio.fail_after(60):
                killed = False
                async for _ in collector:  # worker 0's batches may come until its death is seen
                    if not killed:
                        os.kill(collector._pool.workers[1].process.pid, signal.SIGKILL)
                        killed = True
    except WorkerDiedError as exc:
        caught.append(exc)
    assert len(caught) == 1 and caught[0].exitcode == -signal.SIGKILL
    assert stop.received is None


async def test_a_cancellation_leaves_as_itself() -> None:
    collector = Collector(cartpole, frames_per_batch=16, total_frames=-1)
    with anyio.move_on_after(0.2) as scope:
        async with collector, stop_on_signals(collector):
            async for _ in collector:
                await anyio.sleep(0.05)
    assert scope.cancelled_caught
    assert collector.closed
