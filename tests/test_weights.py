"""Weight-sync schemes through the multi collectors: versions, subsets, lag bounds, concurrency, faults."""

from __future__ import annotations

import os
import signal

import anyio
import anyio.from_thread
import pytest
import torch

from aiocollect import (
    MultiAsyncCollector,
    MultiSyncCollector,
    PipeWeightSync,
    SharedMemoryWeightSync,
    WorkerDiedError,
)
from support import pendulum

pytestmark = pytest.mark.anyio


class BufferPolicy(torch.nn.Module):
    """Box action = parameter + buffer: shows that parameters and buffers both travel."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.register_buffer("offset", torch.zeros(1))

    def forward(self, observation):
        return (self.weight + self.offset).expand(*observation.shape[:-1], 1).clone()


@pytest.fixture(params=["shared", "pipe"])
def scheme(request):
    return SharedMemoryWeightSync() if request.param == "shared" else PipeWeightSync()


def set_policy(policy: BufferPolicy, weight: float, offset: float) -> None:
    with torch.no_grad():
        policy.weight.fill_(weight)
        policy.offset.fill_(offset)


async def test_parameters_and_buffers_reach_workers(scheme):
    trainer = BufferPolicy()
    with anyio.fail_after(60):
        async with MultiSyncCollector(
            [pendulum, pendulum], trainer, frames_per_batch=8, weight_sync=scheme, track_policy_version=True
        ) as c:
            set_policy(trainer, 0.25, 0.5)
            assert ((await c.__anext__())["action"] == 0).all()  # no update yet: nothing leaks
            assert await c.update_weights(wait=True) == 1
            batch = await c.__anext__()
            assert torch.allclose(batch["action"], torch.tensor(0.75))
            assert (batch["collector", "policy_version"] == 1).all()


async def test_worker_ids_update_a_subset(scheme):
    trainer = BufferPolicy()
    async with MultiSyncCollector(
        [pendulum, pendulum], trainer, frames_per_batch=8, weight_sync=scheme, worker_backend="serial"
    ) as c:
        set_policy(trainer, 1.0, 0.0)
        await c.update_weights(worker_ids=[1], wait=True)
        batch = await c.__anext__()
        assert (batch["action"][0] == 0).all()
        assert (batch["action"][1] == 1).all()
        assert c.worker_policy_versions() == [0, 1]
        with pytest.raises(ValueError, match="worker_ids"):
            await c.update_weights(worker_ids=[2])
        with pytest.raises(ValueError, match="worker_ids"):
            await c.update_weights(worker_ids=[])


@pytest.mark.parametrize("worker_backend", ["serial", "process"])
async def test_subset_updates_in_a_row_each_reach_their_workers(scheme, worker_backend):
    # different weights for different workers, published back to back (no wait): a worker that had not
    # yet loaded its update must not load the next one, meant for another worker, under its own version
    trainer = BufferPolicy()
    async with MultiSyncCollector(
        [pendulum, pendulum],
        trainer,
        frames_per_batch=8,
        weight_sync=scheme,
        worker_backend=worker_backend,
        track_policy_version=True,
    ) as c:
        await c.__anext__()
        set_policy(trainer, 1.0, 0.0)
        assert await c.update_weights(worker_ids=[0]) == 1
        set_policy(trainer, 2.0, 0.0)
        assert await c.update_weights(worker_ids=[1]) == 2
        batch = await c.__anext__()
        assert (batch["action"][0] == 1).all()
        assert (batch["collector", "policy_version"][0] == 1).all()
        assert (batch["action"][1] == 2).all()
        assert (batch["collector", "policy_version"][1] == 2).all()
        set_policy(trainer, 3.0, 0.0)
        assert await c.update_weights() == 3  # every worker: nothing to wait for
        batch = await c.__anext__()
        assert (batch["action"] == 3).all()


async def test_async_lag_bound_and_monotonic_versions(scheme):
    trainer = BufferPolicy()
    with anyio.fail_after(60):
        async with MultiAsyncCollector(
            [pendulum, pendulum],
            trainer,
            frames_per_batch=8,
            weight_sync=scheme,
            track_policy_version=True,
            max_policy_lag=0,
        ) as c:
            for step in range(1, 4):
                set_policy(trainer, float(step), 0.0)
                version = await c.update_weights()
                assert version == step
                seen: dict[int, list[int]] = {0: [], 1: []}
                while min(len(v) for v in seen.values()) < 3:
                    b = await c.__anext__()
                    (v,) = b["collector", "policy_version"].unique().tolist()
                    seen[int(b["collector", "worker_id"][0])].append(v)
                    assert torch.allclose(b["action"], torch.tensor(float(v)))
                for versions in seen.values():
                    assert versions == sorted(versions)
                    assert versions[2:] == [step] * (len(versions) - 2)


async def test_concurrent_updates_are_serialised():
    trainer = BufferPolicy()
    async with MultiSyncCollector(
        [pendulum, pendulum], trainer, frames_per_batch=8, worker_backend="serial"
    ) as c:
        versions: list[int] = []

        async def update() -> None:
            versions.append(await c.update_weights())

        async with anyio.create_task_group() as tg:
            for _ in range(8):
                tg.start_soon(update)
    assert sorted(versions) == list(range(1, 9))


async def test_update_during_start_and_pause():
    class Buffer:
        def __init__(self):
            self.batches = []
            self.target = None
            self.reached = anyio.Event()

        def extend(self, batch):  # called in a worker thread
            self.batches.append(batch)
            if self.target is not None and len(self.batches) >= self.target:
                anyio.from_thread.run_sync(self.reached.set)

    trainer = BufferPolicy()
    rb = Buffer()
    async with MultiSyncCollector(
        [pendulum, pendulum],
        trainer,
        frames_per_batch=8,
        replay_buffer=rb,
        worker_backend="serial",
        track_policy_version=True,
    ) as c:
        with anyio.fail_after(30):
            await c.start()
            set_policy(trainer, 2.0, 0.0)
            assert await c.update_weights(wait=True) == 1
            async with c.pause():
                set_policy(trainer, 3.0, 0.0)
                assert await c.update_weights(wait=True) == 2
            rb.target = len(rb.batches) + 2
            await rb.reached.wait()
    assert torch.allclose(rb.batches[-1]["action"], torch.tensor(3.0))


async def test_mismatched_weights_are_refused_before_publishing(scheme):
    trainer = BufferPolicy()
    async with MultiSyncCollector(
        [pendulum], trainer, frames_per_batch=8, weight_sync=scheme, worker_backend="serial"
    ) as c:
        with pytest.raises(ValueError, match="offset"):
            await c.update_weights({"weight": torch.ones(1)})
        with pytest.raises(ValueError, match="weight"):
            await c.update_weights({"weight": torch.ones(2), "offset": torch.ones(1)})
        assert c.policy_version == 0
        assert await c.update_weights({"weight": torch.ones(1), "offset": torch.ones(1)}) == 1


async def test_worker_dying_during_update_raises(scheme):
    trainer = BufferPolicy()
    with anyio.fail_after(30), pytest.raises(WorkerDiedError):
        async with MultiAsyncCollector(
            [pendulum, pendulum], trainer, frames_per_batch=8, weight_sync=scheme
        ) as c:
            os.kill(c._pool.workers[0].process.pid, signal.SIGKILL)
            for _ in range(100):
                await c.update_weights(wait=True)


async def test_bad_weight_sync_arguments():
    with pytest.raises(TypeError, match="weight_sync"):
        MultiSyncCollector([pendulum], BufferPolicy(), frames_per_batch=8, weight_sync="shm")
    with pytest.raises(ValueError, match="max_policy_lag"):
        MultiSyncCollector([pendulum], BufferPolicy(), frames_per_batch=8, max_policy_lag=-1)
    async with MultiSyncCollector([pendulum], frames_per_batch=8, worker_backend="serial") as c:
        with pytest.raises(TypeError, match="no weights"):
            await c.update_weights()


async def test_in_process_collector_takes_the_same_arguments():
    from aiocollect import Collector

    trainer = BufferPolicy()
    async with Collector(
        pendulum,
        trainer,
        frames_per_batch=8,
        weight_sync=PipeWeightSync(),
        max_policy_lag=0,
        track_policy_version=True,
    ) as c:
        set_policy(trainer, 0.5, 0.25)
        assert await c.update_weights(worker_ids=[0], wait=True) == 1
        batch = await c.__anext__()
        assert torch.allclose(batch["action"], torch.tensor(0.75))
        assert (batch["collector", "policy_version"] == 1).all()
        with pytest.raises(ValueError, match="worker_ids"):
            await c.update_weights(worker_ids=[1])
    with pytest.raises(TypeError, match="weight_sync"):
        Collector(pendulum, trainer, frames_per_batch=8, weight_sync=object())
    with pytest.raises(ValueError, match="max_policy_lag"):
        Collector(pendulum, trainer, frames_per_batch=8, max_policy_lag=-2)
