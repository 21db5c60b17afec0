"""``MultiAsyncEnvCollector``: async envs in worker processes, an event loop per process. Data invariants per
env over the workers, weights, an env's error type, a killed worker, cancellation and clean-up."""

from __future__ import annotations

import functools
import os
import signal

import anyio
import pytest
import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn

from aiocollect import MultiAsyncEnvCollector, WorkerDiedError
from support import take_until, wait_until
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
    with pytest.raises(RuntimeError, match="async with"):  # seeds and checkpoints: once entered
        await c.set_seed(1)
    with pytest.raises(RuntimeError, match="async with"):
        await c.state_dict()


# -- flush, max_policy_lag, init_random_frames ---------------------------------------------------------
def frame_index(data: TensorDictBase) -> torch.Tensor:
    """Each frame's index in its env's life: episodes of env ``i`` have ``3 + i % 5`` frames."""
    obs = data["observation"].long()
    return obs[:, 1] * (3 + obs[:, 0] % 5) + obs[:, 2]


def check_gaps(data: TensorDictBase) -> int:
    """No frame delivered twice, and a trajectory id never spans a gap (its frames are consecutive steps
    of one env, done only at its last frame); returns the frames missing between delivered ones."""
    env_id, index = data["collector", "env_id"], frame_index(data)
    traj, done = data["collector", "traj_ids"], data["next", "done"][:, 0]
    missing = 0
    for e in env_id.unique().tolist():
        mine = index[env_id == e].sort().values
        assert (mine.diff() > 0).all(), f"env {e}: a frame delivered twice"
        missing += int(mine[-1] - mine[0] + 1) - len(mine)
    for t in traj.unique().tolist():
        rows = (traj == t).nonzero()[:, 0]
        assert env_id[rows].unique().numel() == 1, f"trajectory {t} spans envs"
        assert torch.equal(index[rows].diff(), torch.ones(len(rows) - 1, dtype=torch.long)), f"{t} has a gap"
        assert not done[rows[:-1]].any()
    return missing


async def test_flush_delivers_only_frames_of_the_new_weights(request, leaks) -> None:
    loop = LOOPS[request.node.callspec.id]
    policy = StepPolicy()
    async with MultiAsyncEnvCollector(
        shares(2, 4), policy, frames_per_batch=20, track_policy_version=True, seed=0, loop=loop
    ) as c:
        with anyio.fail_after(30):
            before = [await c.__anext__() for _ in range(3)]
            # a batch of the old weights waits in a slot (the workers go on collecting): the flush drops it
            await wait_until(lambda: c._pool.deliveries.statistics().current_buffer_used > 0)
            with torch.no_grad():
                policy.offset.fill_(1)
            assert await c.update_weights(policy, flush=True) == 1
            after = [await c.__anext__() for _ in range(8)]
        discarded = c.statistics().frames_discarded
    new = torch.cat(after)
    assert (new["collector", "policy_version"] == 1).all()  # nothing collected before the flush
    step = new["observation"][:, 2].long()
    assert torch.equal(new["action"], (step + 1) % 4)  # every action from the new weights
    assert all(b.batch_size == torch.Size([20]) for b in after)
    # the frames lost between the batches are the ones dropped (the envs were not reset), and counted
    missing = check_gaps(torch.cat([*before, *after]))
    assert 0 < missing <= discarded


async def test_max_policy_lag_0_is_on_policy(request, leaks) -> None:
    loop = LOOPS[request.node.callspec.id]
    policy = StepPolicy()
    batches = []
    async with MultiAsyncEnvCollector(
        shares(2, 3), policy, frames_per_batch=12, max_policy_lag=0, track_policy_version=True, loop=loop
    ) as c:
        with anyio.fail_after(30):
            for version in range(5):
                batch = await c.__anext__()
                assert (batch["collector", "policy_version"] == version).all()  # the newest weights only
                batches.append(batch)
                with torch.no_grad():
                    policy.offset.fill_(version + 1)
                assert await c.update_weights(policy) == version + 1  # no flush=: every update flushes
        discarded = c.statistics().frames_discarded
    assert check_gaps(torch.cat(batches)) <= discarded


@ASYNCIO_ONLY
async def test_max_policy_lag_1_delivers_nothing_older(leaks) -> None:
    policy = StepPolicy()
    seen = set()
    async with MultiAsyncEnvCollector(
        shares(2, 4), policy, frames_per_batch=[16, 8], max_policy_lag=1, track_policy_version=True
    ) as c:
        with anyio.fail_after(30):
            for version in range(8):
                batch = await c.__anext__()
                worker = int(batch["collector", "worker_id"][0])
                assert batch.batch_size == torch.Size([16 if worker == 0 else 8])
                versions = batch["collector", "policy_version"]
                assert (versions >= version - 1).all()  # at most one version behind the newest
                seen |= set(versions.tolist())
                await c.update_weights(policy)
    assert len(seen) > 2


class Marked(nn.Module):
    """The step policy, with a second output that is 1 (random frames have zeros there)."""

    def forward(self, observation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        action = observation[..., 2].long() % 4
        return action, torch.ones(observation.shape[:-1])


class AsyncMarked:
    """The same as an async policy (awaited on the workers' loops: its random draws are made there)."""

    async def __call__(self, td: TensorDictBase) -> TensorDictBase:
        td["action"], td["marker"] = Marked()(td["observation"])
        return td


@ASYNCIO_ONLY
@pytest.mark.parametrize("kind", ["module", "async"])
async def test_init_random_frames_are_the_first_actions_of_each_worker(kind, leaks) -> None:
    if kind == "async":
        policy = AsyncMarked()
    else:
        policy = TensorDictModule(Marked(), in_keys=["observation"], out_keys=["action", "marker"])
    per_worker: dict[int, list] = {0: [], 1: []}
    async with MultiAsyncEnvCollector(
        shares(2, 4), policy, frames_per_batch=10, init_random_frames=25, track_policy_version=True, seed=1
    ) as c:
        for batch in await take_until(c, each=6, seconds=30):
            per_worker[int(batch["collector", "worker_id"][0])].append(batch)
    for batches in per_worker.values():
        data = torch.cat(batches)
        random = data["marker"] == 0
        # 25 frames over 2 workers: 13 each, rounded up to whole batches: 20 random actions per worker
        assert int(random.sum()) == 20
        assert (data["marker"][~random] == 1).all()
        assert not torch.equal(data["action"][random], data["observation"][random][:, 2].long() % 4)
        assert (data["collector", "policy_version"] == 0).all()
        assert torch.equal(data["next", "reward"][:, 0], data["action"].float())  # the envs took them


async def test_cancellation_mid_flush_leaves_nothing(request, leaks) -> None:
    loop = LOOPS[request.node.callspec.id]
    policy = StepPolicy()
    with anyio.move_on_after(20) as outer:
        async with MultiAsyncEnvCollector(shares(2, 4), policy, frames_per_batch=16, loop=loop) as c:
            await c.__anext__()
            with anyio.move_on_after(0):  # cancelled at its first checkpoint
                await c.update_weights(policy, flush=True)
            await c.__anext__()  # a cancelled update leaves a collector that works
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(c.update_weights, policy, flush=True))
                await anyio.wait_all_tasks_blocked()  # the update waits on the workers
                outer.cancel()  # mid-flush, workers collecting
    assert outer.cancel_called
    # the leaks fixture checks: no child process, no /dev/shm segment, no thread, no fd left


@ASYNCIO_ONLY
async def test_arguments_of_multi_async_collector_it_does_not_take() -> None:
    for name, value, match in [
        ("reset_at_each_iter", True, "reset at the start"),
        ("set_truncated", True, "no last step"),
        ("policy_device", "cpu", r"policy.to\('cuda'\)"),
        ("compile_policy", True, "drop compile_policy"),
    ]:
        with pytest.raises(TypeError, match=f"does not take {name}: .*{match}"):
            MultiAsyncEnvCollector([[Counter]], frames_per_batch=8, **{name: value})
    with pytest.raises(TypeError, match="unexpected keyword argument 'frames'"):
        MultiAsyncEnvCollector([[Counter]], frames_per_batch=8, frames=8)
    with pytest.raises(ValueError, match="2 values for 1 workers"):
        MultiAsyncEnvCollector([[Counter]], frames_per_batch=[8, 8])
    with pytest.raises(ValueError, match="max_policy_lag"):
        MultiAsyncEnvCollector([[Counter]], frames_per_batch=8, max_policy_lag=-1)
    with pytest.raises(ValueError, match="init_random_frames"):
        MultiAsyncEnvCollector([[Counter]], frames_per_batch=8, init_random_frames=-1)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        await MultiAsyncEnvCollector([[Counter]], frames_per_batch=8).update_weights(flush=True)


@ASYNCIO_ONLY
async def test_update_at_each_batch_republishes_the_policy(leaks) -> None:
    policy = StepPolicy()
    batches = []
    async with MultiAsyncEnvCollector(
        shares(2, 2),
        policy,
        frames_per_batch=8,
        update_at_each_batch=True,
        storing_device="cpu",
        track_policy_version=True,
    ) as c:
        with anyio.fail_after(20):
            batches.append(await c.__anext__())  # version 1 (offset 0) is published as it is delivered
            with torch.no_grad():
                policy.offset.fill_(1)  # no update_weights: the next delivery publishes it as version 2
            while not (batches[-1]["collector", "policy_version"] >= 2).any():
                batches.append(await c.__anext__())
    data = torch.cat(batches)
    version, step = data["collector", "policy_version"], data["observation"][:, 2].long()
    # (version 1 went to one worker only; shared-memory weights are one block, so the other worker may
    # load version 2's weights before it learns of version 2)
    assert torch.equal(data["action"][version == 0], step[version == 0] % 4)
    assert torch.equal(data["action"][version >= 2], (step[version >= 2] + 1) % 4)


@pytest.mark.slow
@pytest.mark.parametrize("lag", [None, 0, 1, 2])
async def test_many_updates_keep_every_rule(request, lag, leaks) -> None:
    """Updates at random moments (flushes without a lag): versions within the floor, no frame twice, no
    trajectory id across a gap, every frame lost counted."""
    loop = LOOPS[request.node.callspec.id.split("-")[0]]
    rng = torch.Generator().manual_seed(0)
    policy = StepPolicy()
    batches = []
    async with MultiAsyncEnvCollector(
        shares(3, 7),
        policy,
        frames_per_batch=[24, 16, 40],
        max_policy_lag=lag,
        track_policy_version=True,
        split_trajs=False,
        loop=loop,
    ) as c:
        with anyio.fail_after(120):
            for _ in range(60):
                batch = await c.__anext__()
                versions = batch["collector", "policy_version"]
                assert (versions >= c.policy_version - (lag or 0)).all()
                batches.append(batch)
                await anyio.sleep(float(torch.rand((), generator=rng)) * 0.01)  # a trainer's random pace
                with torch.no_grad():
                    policy.offset.fill_(c.policy_version + 1)
                await c.update_weights(policy, flush=lag is None)
        discarded = c.statistics().frames_discarded
    data = torch.cat(batches)
    step, version = data["observation"][:, 2].long(), data["collector", "policy_version"]
    assert torch.equal(data["action"], (step + version) % 4)  # each frame's action from its version
    assert check_gaps(data) <= discarded
