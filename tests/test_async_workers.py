"""``MultiAsyncEnvCollector``: async envs in worker processes, an event loop per process. Data invariants per
env over the workers, weights, an env's error type, a killed worker, cancellation and clean-up."""

from __future__ import annotations

import os
import signal

import anyio
import pytest
import torch

from aiocollect import MultiAsyncEnvCollector, WorkerDiedError
from test_async_envs import Boom, Counter, StepPolicy, check_invariants

pytestmark = pytest.mark.anyio

#: the workers' loop for the test's own backend (asyncio, asyncio+uvloop, trio)
LOOPS = {"asyncio": "asyncio", "asyncio+uvloop": "uvloop", "trio": "trio"}
ASYNCIO_ONLY = pytest.mark.parametrize("anyio_backend", [("asyncio", {"use_uvloop": False})])


def shares(workers: int, per_worker: int, **kwargs) -> list[list]:
    """Env fns for ``workers`` processes; env ``i`` (over all workers) is ``Counter(i)``."""
    return [
        [lambda i=w * per_worker + j: Counter(i, **kwargs) for j in range(per_worker)] for w in range(workers)
    ]


async def test_batches_keep_every_frame_of_every_env(request, leaks) -> None:
    loop = LOOPS[request.node.callspec.id]
    async with MultiAsyncEnvCollector(
        shares(2, 6), StepPolicy(), frames_per_batch=60, total_frames=600, min_batch=3, seed=5, loop=loop
    ) as c:
        with anyio.fail_after(20):
            batches = [b async for b in c]
        stats = c.statistics()
    assert len(batches) == 10 and all(b.batch_size == torch.Size([60]) for b in batches)
    check_invariants(batches, 12)  # env ids offset per worker, trajectory ids unique over workers
    for b in batches:  # a batch is one worker's: its envs, its worker id
        worker = int(b["collector", "worker_id"][0])
        assert (b["collector", "worker_id"] == worker).all()
        assert ((b["collector", "env_id"] // 6) == worker).all()
    assert stats.frames == 600 and len(stats.workers) == 2
    assert "MultiAsyncEnvCollector(workers=2, envs=12" in repr(c)


@ASYNCIO_ONLY
async def test_update_weights_reach_every_worker(leaks) -> None:
    policy = StepPolicy()
    async with MultiAsyncEnvCollector(
        shares(2, 4), policy, frames_per_batch=40, track_policy_version=True
    ) as c:
        with anyio.fail_after(20):
            first = await c.__anext__()
            with torch.no_grad():
                policy.offset.fill_(1)
            assert await c.update_weights(policy, wait=True) == 1
            assert c.policy_version == 1
            later: list = []
            updated: set[int] = set()  # the workers that delivered frames of version 1
            while updated != {0, 1}:
                later.append(batch := await c.__anext__())
                if (batch["collector", "policy_version"] == 1).any():
                    updated.add(int(batch["collector", "worker_id"][0]))
            assert all(w.policy_version == 1 for w in c.statistics().workers)
    assert (first["collector", "policy_version"] == 0).all()
    data = torch.cat([first, *later])
    version = data["collector", "policy_version"]
    step = data["observation"][:, 2].long()
    assert torch.equal(data["action"], (step + version) % 4)  # each frame's action from its version
    # each env's frames switch to version 1 once, and stay there (frames are stored as steps return, so
    # across a worker's envs a step acted on before the update may land after one acted on after it)
    for w in (0, 1):
        assert (version[data["collector", "worker_id"] == w] == 1).any()
    for env_id in data["collector", "env_id"].unique().tolist():
        mine = version[data["collector", "env_id"] == env_id]
        assert (mine.diff() >= 0).all()
    with pytest.raises(ValueError, match="flush"):
        await MultiAsyncEnvCollector(shares(1, 1), policy, frames_per_batch=4).update_weights(flush=True)


@ASYNCIO_ONLY
async def test_env_error_keeps_its_type(leaks) -> None:
    envs = shares(2, 3)
    envs[1][1] = lambda: Counter(4, fail_at=3)
    with anyio.fail_after(20), pytest.raises(Boom, match="env 4 broke"):
        async with MultiAsyncEnvCollector(envs, StepPolicy(), frames_per_batch=12) as c:
            async for _ in c:
                pass


@ASYNCIO_ONLY
async def test_killed_worker_raises_worker_died_error(leaks) -> None:
    with anyio.fail_after(20), pytest.raises(WorkerDiedError) as info:
        async with MultiAsyncEnvCollector(shares(2, 3), frames_per_batch=12) as c:
            await c.__anext__()
            os.kill(c._pool.workers[1].process.pid, signal.SIGKILL)
            async for _ in c:
                pass
    assert info.value.exitcode == -signal.SIGKILL


async def test_cancellation_leaves_no_process_or_segment(request, leaks) -> None:
    loop = LOOPS[request.node.callspec.id]
    with anyio.move_on_after(20) as outer:
        async with MultiAsyncEnvCollector(shares(2, 4), StepPolicy(), frames_per_batch=16, loop=loop) as c:
            async for _ in c:
                outer.cancel()  # mid-iteration, workers still collecting
    assert outer.cancel_called
    # the leaks fixture checks: no child process, no /dev/shm segment, no thread, no fd left


@ASYNCIO_ONLY
async def test_bad_input_before_any_process() -> None:
    with pytest.raises(TypeError, match="one list of env fns per worker"):
        MultiAsyncEnvCollector([Counter], frames_per_batch=8)
    with pytest.raises(TypeError, match=r"env_fns_per_worker\[1\]"):
        MultiAsyncEnvCollector([[Counter], [3]], frames_per_batch=8)
    with pytest.raises(ValueError, match="loop must be one of"):
        MultiAsyncEnvCollector([[Counter]], frames_per_batch=8, loop="tornado")
    with pytest.raises(ValueError, match="max_wait"):
        MultiAsyncEnvCollector([[Counter]], frames_per_batch=8, max_wait=-1)
    with pytest.warns(UserWarning, match="fewer than its 20 envs"):
        MultiAsyncEnvCollector([[Counter] * 20], frames_per_batch=8)
    c = MultiAsyncEnvCollector([[Counter]], frames_per_batch=8)
    with pytest.raises(TypeError, match="set_seed"):
        await c.set_seed(1)
    with pytest.raises(TypeError, match="state_dict"):
        await c.state_dict()
