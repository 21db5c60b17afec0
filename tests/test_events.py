"""Observability: statistics() for every collector, and the bounded events() stream."""

from __future__ import annotations

import json

import anyio
import pytest
import torch

from aiocollect import Collector, GymEnv, MultiAsyncCollector, MultiSyncCollector
from support import cartpole2 as cartpole
from support import take_until, wait_until

pytestmark = pytest.mark.anyio


class Policy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, observation):
        # always push left: CartPole episodes end within ~10 steps, whatever the random init
        return (self.linear(observation) * 0).argmax(-1)


def kinds(events) -> list[str]:
    return [e.kind for e in events]


async def drain(stream) -> list:
    out = []
    while (event := stream.receive_nowait()) is not None:
        out.append(event)
    return out


async def test_collector_events_and_statistics():
    async with Collector(cartpole, Policy(), frames_per_batch=100, total_frames=400) as c:
        async with c.events() as events:
            await c.update_weights()
            async with c.pause():
                assert c.statistics().paused
                assert c.statistics().workers[0].state == "paused"
            batches = [b async for b in c]
            seen = await drain(events)
        await wait_until(lambda: c.statistics().loop_lag_ms is not None)  # the loop-lag monitor sampled
        stats = c.statistics()
    assert len(batches) == 4
    names = kinds(seen)
    assert names.count("batch") == 4
    assert names.count("episode") == stats.episodes > 0
    assert {"weights_published", "weights_loaded", "paused", "resumed"} <= set(names)
    json.dumps([e.to_dict() for e in seen])
    episode = next(e for e in seen if e.kind == "episode")
    assert episode.length > 0 and episode.episode_return == episode.length  # CartPole: reward 1 per step
    assert c.statistics().workers[0].state == "stopped"
    assert stats.min_return <= stats.mean_return <= stats.max_return
    assert stats.loop_lag_ms is not None and stats.loop_lag_ms["p99"] >= stats.loop_lag_ms["p50"] >= 0
    json.dumps(stats.to_dict())


async def test_stream_ends_when_the_collector_closes_and_drops_oldest():
    c = Collector(cartpole, frames_per_batch=10)
    async with c:
        stream = c.events(max_buffer=3)
        for _ in range(10):
            await c.__anext__()
    assert stream.dropped > 0
    got = [e async for e in stream]  # ends: the collector closed
    assert len(got) == 3
    assert got[-1].kind == "worker_stopped"
    with pytest.raises(ValueError, match="max_buffer"):
        c.events(max_buffer=0)


async def test_multi_worker_states_and_events():
    async with MultiSyncCollector(
        [cartpole, cartpole], Policy(), frames_per_batch=40, worker_backend="serial"
    ) as c:
        async with c.events() as events:
            stats = c.statistics()
            assert [w.state for w in stats.workers] == ["collecting", "collecting"]
            await c.__anext__()
            await c.update_weights(wait=True)
            await c.__anext__()
            async with c.pause():
                assert [w.state for w in c.statistics().workers] == ["paused", "paused"]
            seen = await drain(events)
        stats = c.statistics()
    assert [w.frames for w in stats.workers] == [40, 40]
    assert [w.policy_version for w in stats.workers] == [1, 1]
    names = kinds(seen)
    assert names.count("batch") == 2
    assert names.count("weights_loaded") == 2
    assert {e.worker_id for e in seen if e.kind == "weights_loaded"} == {0, 1}
    assert [w.state for w in c.statistics().workers] == ["stopped", "stopped"]


async def test_async_events_carry_the_worker():
    c = MultiAsyncCollector([cartpole, cartpole], frames_per_batch=20, worker_backend="serial")
    async with c, c.events() as events:
        await take_until(c, each=2)  # both workers' batches (a fast one could take 4 in a row alone)
        seen = await drain(events)
    assert {e.worker_id for e in seen if e.kind == "batch"} == {0, 1}
    assert all(e.worker_id in (0, 1) for e in seen if e.kind == "episode")


def failing():
    class Boom(GymEnv):
        def _step_arrays(self, action):
            raise OSError("sensor unplugged")

    return Boom("CartPole-v1", num_envs=2)


async def test_failed_worker_is_reported():
    with anyio.fail_after(30):
        async with MultiSyncCollector([cartpole, failing], frames_per_batch=20, worker_backend="serial") as c:
            stream = c.events()
            with pytest.raises(OSError, match="sensor unplugged"):
                await c.__anext__()
            states = [w.state for w in c.statistics().workers]
    assert states[1] == "failed"
    failed = [e for e in await drain(stream) if e.kind == "worker_failed"]
    assert failed[0].worker_id == 1
    assert "sensor unplugged" in failed[0].error
