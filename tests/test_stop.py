"""``request_stop()``: the iteration ends after the batch in flight is delivered, never a partial batch,
and the counts of ``state_dict()`` agree with what the consumer received (signals: test_signals.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import anyio.to_thread
import gymnasium as gym
import pytest
import torch
from tensordict import TensorDictBase

from aiocollect import (
    AsyncEnvCollector,
    Collector,
    GymEnv,
    MultiAsyncCollector,
    MultiAsyncEnvCollector,
    MultiSyncCollector,
    ThreadedAsyncEnv,
    stop_on_signals,
)
from support import ListBuffer

pytestmark = [pytest.mark.anyio, pytest.mark.all_loops]  # stopping: every loop in the README's run


def cartpole() -> GymEnv:
    return GymEnv("CartPole-v1")


class Gate:
    """A policy that blocks at its ``at``-th call until released: a batch is surely in flight."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.calls = 0
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        self.calls += 1
        if self.calls == self.at:
            self.entered.set()
            self.release.wait(30)
        return td.set("action", torch.zeros(td.batch_size, dtype=torch.int64))


@pytest.mark.parametrize("caller", ["task", "thread"])
async def test_stop_delivers_the_batch_in_flight_and_nothing_after(caller: str) -> None:
    gate = Gate(at=8 + 5)  # the dry call, 8 steps of batch 1, then mid batch 2
    async with Collector(cartpole, gate, frames_per_batch=8, total_frames=-1, seed=0) as collector:
        batches: list[TensorDictBase] = []

        async def stopper() -> None:
            await anyio.to_thread.run_sync(gate.entered.wait, abandon_on_cancel=True)
            if caller == "thread":
                await anyio.to_thread.run_sync(collector.request_stop)
            else:
                collector.request_stop()
            gate.release.set()

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(stopper)
                async for batch in collector:
                    batches.append(batch)
        assert collector.stop_requested
        assert [b.numel() for b in batches] == [8, 8]  # the batch in flight, whole
        state = await collector.state_dict()
        assert state["frames"] == 16 and state["batches"] == 2
        with pytest.warns(UserWarning, match="yields nothing: a stop was requested"):  # stopped for good
            assert [b async for b in collector] == []


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_multi_collectors_stop_with_consistent_counts(kind: str, leaks: Any) -> None:
    cls = MultiSyncCollector if kind == "sync" else MultiAsyncCollector
    async with cls([cartpole] * 2, None, frames_per_batch=16, total_frames=-1, seed=0) as collector:
        delivered = 0
        with anyio.fail_after(60):
            async for batch in collector:
                delivered += batch.numel()
                if delivered >= 48:
                    collector.request_stop()
        state = await collector.state_dict()
        assert state["frames"] == delivered == 48
        assert collector.statistics().frames == delivered


class Slow:
    """Action 0 after ``seconds``: batches take a while, so that a worker has one in flight."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        time.sleep(self.seconds)
        return td.set("action", torch.zeros(td.batch_size, dtype=torch.int64))


@pytest.mark.parametrize("backend", ["serial", "process"])
async def test_multi_async_stop_holds_the_workers(backend: str, leaks: Any) -> None:
    """After request_stop() no worker starts a batch (state_dict does not wait for batches collected
    ahead); what the workers sent and the trainer never got is counted as discarded."""
    async with MultiAsyncCollector(
        [cartpole] * 2, Slow(0.005), frames_per_batch=16, total_frames=-1, seed=0, worker_backend=backend
    ) as collector:
        delivered = 0
        with anyio.fail_after(60):
            async for batch in collector:
                delivered += batch.numel()
                if delivered >= 48:
                    collector.request_stop()
            state = await collector.state_dict()
            sent = [w.frames for w in collector.statistics().workers]
            again = await collector.state_dict()  # answered between batches: none started since
            assert [w.frames for w in collector.statistics().workers] == sent
        assert state["frames"] == again["frames"] == delivered == 48
        assert sum(sent) - delivered <= collector.statistics().frames_discarded


async def test_async_env_collector_stops() -> None:
    fns = [lambda: ThreadedAsyncEnv(gym.make("CartPole-v1"))] * 2
    async with AsyncEnvCollector(fns, None, frames_per_batch=16, total_frames=-1) as collector:
        delivered = 0
        with anyio.fail_after(60):
            async for batch in collector:
                delivered += batch.numel()
                collector.request_stop()
        assert delivered == 16 and collector.statistics().frames == 16


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])  # worker processes: one loop is enough
async def test_multi_async_env_collector_stops_with_consistent_counts(leaks: Any) -> None:
    fns = [[lambda: gym.make("CartPole-v1")] * 2] * 2
    async with MultiAsyncEnvCollector(fns, None, frames_per_batch=16, total_frames=-1, seed=0) as collector:
        delivered = 0
        with anyio.fail_after(60):
            async for batch in collector:
                delivered += batch.numel()
                if delivered >= 32:
                    collector.request_stop()
        assert delivered == 32 and collector.statistics().frames == 32
        with anyio.fail_after(60):
            state = await collector.state_dict()
        assert state["frames"] == 32 and state["batches"] == 2


async def test_start_stops_after_the_write_in_progress() -> None:
    buffer = ListBuffer()
    async with (
        Collector(
            cartpole, None, frames_per_batch=8, total_frames=-1, seed=0, replay_buffer=buffer
        ) as collector,
        collector.events(kinds={"batch"}) as events,
    ):
        await collector.start()
        with anyio.fail_after(30):
            async for _ in events:
                collector.request_stop()
                break
            async with collector.pause():  # the write in progress has finished
                written = collector.statistics().frames
            assert written == 8 * len(buffer.batches) and written > 0
            async with collector.pause():
                assert collector.statistics().frames == written  # nothing after the stop


async def test_stop_on_signals_refuses_what_is_no_collector() -> None:
    with pytest.raises(TypeError, match="request_stop"):
        stop_on_signals(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one signal"):
        stop_on_signals(Collector(cartpole, frames_per_batch=8), signals=())
