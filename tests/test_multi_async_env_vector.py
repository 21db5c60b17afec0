"""``MultiAsyncEnvCollector`` with what ``AsyncEnvCollector`` takes: async vector envs (env ids unique over
the workers, seeds ``seed + env id``), ``on_env_error="drop"`` (an env dropped, its event with its global
id, the others going on; every env of a worker dropped ends the collector with ``RuntimeError``), and a
``ProcessVectorEnv`` per worker (central inference in each worker, on its fused path: its policy in the
fused thread, weights and their versions, an env process killed under a worker)."""

from __future__ import annotations

import functools
import os
import signal
import threading

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn

from aiocollect import MultiAsyncEnvCollector, ProcessVectorEnv, WorkerDiedError, WorkerFailed
from support import take_until
from test_async_envs import Counter
from test_async_vector_envs import Boom, Single, StepPolicy, VecCounter, check_invariants
from test_fused import Constant, cartpole

pytestmark = pytest.mark.anyio

LOOPS = {"asyncio": "asyncio", "asyncio+uvloop": "uvloop", "trio": "trio"}
ASYNCIO_ONLY = pytest.mark.parametrize("anyio_backend", [("asyncio", {"use_uvloop": False})])


def mixed_shares() -> list[list]:
    """Worker 0: two vector envs (env ids 0-2, 3-4); worker 1: a single env, a vector env, a single env
    (env ids 5, 6-8, 9). Each env's observations carry its env id as the collector numbers it."""
    return [
        [lambda: VecCounter(0, 3), lambda: VecCounter(3, 2)],
        [lambda: Single(5), lambda: VecCounter(6, 3), lambda: Single(9)],
    ]


async def collect(c: MultiAsyncEnvCollector, n: int | None = None) -> list[TensorDictBase]:
    out: list[TensorDictBase] = []
    with anyio.fail_after(30):
        async for batch in c:
            out.append(batch)
            if n is not None and len(out) == n:
                break
    return out


async def test_vector_and_single_envs_over_two_workers(request, leaks) -> None:
    loop = LOOPS[request.node.callspec.id]
    c = MultiAsyncEnvCollector(
        mixed_shares(), StepPolicy(), frames_per_batch=30, total_frames=600, min_batch=3, loop=loop
    )
    assert c.num_envs == 5  # env fns, until the workers have built them
    async with c:
        assert c.num_envs == 10  # (sub-)envs
        batches = await collect(c)
        stats = c.statistics()
    assert len(batches) == 20 and all(b.batch_size == torch.Size([30]) for b in batches)
    # every frame of every (sub-)env once, in order; next obs = following obs unless done; trajectory
    # ids change exactly after done and are unique over the workers
    check_invariants(batches, range(10))
    for b in batches:  # a batch is one worker's: worker 0 has env ids 0-4, worker 1 5-9
        worker = int(b["collector", "worker_id"][0])
        assert ((b["collector", "env_id"] // 5) == worker).all()
    assert stats.frames == 600 and len(stats.workers) == 2


@ASYNCIO_ONLY
async def test_split_trajs_flush_and_random_frames_with_vector_envs(leaks) -> None:
    policy = StepPolicy()
    async with MultiAsyncEnvCollector(
        mixed_shares(),
        policy,
        frames_per_batch=20,
        split_trajs=True,
        init_random_frames=40,
        track_policy_version=True,
    ) as c:
        with anyio.fail_after(30):
            before = [await c.__anext__() for _ in range(4)]
            with torch.no_grad():
                policy.offset.fill_(1)
            assert await c.update_weights(policy, flush=True) == 1
            after = [await c.__anext__() for _ in range(4)]
    for batch in [*before, *after]:  # [trajectories, steps], one trajectory and one env per row
        mask = batch["collector", "mask"]
        ids = batch["collector", "traj_ids"]
        envs = batch["collector", "env_id"]
        for row in range(batch.shape[0]):
            assert ids[row][mask[row]].unique().numel() == 1
            assert envs[row][mask[row]].unique().numel() == 1
    new = torch.cat([b[b["collector", "mask"]] for b in after])
    assert (new["collector", "policy_version"] == 1).all()  # nothing older than the flush
    assert torch.equal(new["action"], (new["observation"][:, 2].long() + 1) % 4)


@ASYNCIO_ONLY
@pytest.mark.parametrize("backend", ["process", "serial"])
async def test_on_policy_with_vector_envs(backend, leaks) -> None:
    policy = StepPolicy()
    batches = []
    async with MultiAsyncEnvCollector(
        mixed_shares(),
        policy,
        frames_per_batch=15,
        max_policy_lag=0,
        track_policy_version=True,
        worker_backend=backend,
    ) as c:
        with anyio.fail_after(30):
            for version in range(4):
                batch = await c.__anext__()
                assert (batch["collector", "policy_version"] == version).all()  # the newest weights only
                batches.append(batch)
                with torch.no_grad():
                    policy.offset.fill_(version + 1)
                assert await c.update_weights(policy) == version + 1
    data = torch.cat(batches)
    step, version = data["observation"][:, 2].long(), data["collector", "policy_version"]
    assert torch.equal(data["action"], (step + version) % 4)
    for e in data["collector", "env_id"].unique().tolist():  # no trajectory id spans a gap
        rows = data[data["collector", "env_id"] == e]
        ids, nxt, obs = rows["collector", "traj_ids"], rows["next", "observation"], rows["observation"]
        for k in range(len(rows) - 1):
            if ids[k + 1] == ids[k]:
                assert torch.equal(nxt[k], obs[k + 1])


class Sign(nn.Module):
    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return (observation[..., 2] > 0).long()


@ASYNCIO_ONLY
async def test_seeds_are_seed_plus_the_global_env_id(leaks) -> None:
    vec = functools.partial(gym.make_vec, "CartPole-v1", 2, vectorization_mode="sync")
    single = functools.partial(gym.make, "CartPole-v1")
    vec3 = functools.partial(gym.make_vec, "CartPole-v1", 3, vectorization_mode="sync")
    shares = [[vec, single], [single, vec3]]  # ids 0-2, 3-6

    async def first_obs() -> dict[int, list[float]]:
        out: dict[int, list[float]] = {}
        async with MultiAsyncEnvCollector(shares, Sign(), frames_per_batch=28, seed=100) as c:
            with anyio.fail_after(30):
                async for batch in c:  # until every env's first frame is seen
                    for e in range(7):
                        rows = batch[batch["collector", "env_id"] == e]
                        if e not in out and len(rows):
                            out[e] = rows["observation"][0].tolist()
                    if len(out) == 7:
                        break
        return out

    first = await first_obs()
    assert first == await first_obs()  # reproducible
    for e, obs in first.items():  # env id e was reset with seed 100 + e
        expected, _ = gym.make("CartPole-v1").reset(seed=100 + e)
        assert np.allclose(obs, expected), e


async def test_drop_mode_drops_an_env_and_the_others_go_on(request, leaks) -> None:
    loop = LOOPS[request.node.callspec.id]
    shares = [
        [lambda: Counter(0), lambda: Counter(1), lambda: Counter(2)],
        [lambda: Counter(3), lambda: Counter(4, fail_at=12), lambda: VecCounter(5, 2, fail_at=14)],
    ]
    c = MultiAsyncEnvCollector(
        shares, StepPolicy(), frames_per_batch=12, total_frames=240, on_env_error="drop", loop=loop
    )
    events = c.events(kinds={"worker_failed"})  # before entering: nothing is missed
    failed: list[WorkerFailed] = []
    async with c, events:
        batches = await collect(c)
        with anyio.move_on_after(2):
            async for event in events:
                assert isinstance(event, WorkerFailed)
                failed.append(event)
                if len(failed) == 3:
                    break
    # one event per (sub-)env dropped, with its env id over all workers
    failed.sort(key=lambda e: e.worker_id)
    assert [e.worker_id for e in failed] == [4, 5, 6]
    assert all("Boom" in e.error for e in failed)
    assert "env 4 broke" in failed[0].error
    assert all("worker 1's vector env 2" in e.error and "env ids 5 to 6" in e.error for e in failed[1:])
    data = torch.cat(batches)
    assert len(data) == 240
    env_id = data["collector", "env_id"]
    assert (env_id == 4).sum() == 12 and (env_id == 5).sum() == 14  # their frames up to the error
    check_invariants(batches, range(7))


@ASYNCIO_ONLY
async def test_every_env_of_a_worker_dropped_ends_the_collector(leaks) -> None:
    shares = [
        [lambda: Counter(0), lambda: Counter(1)],
        [lambda: Counter(2, fail_at=10), lambda: VecCounter(3, 2, fail_at=11)],
    ]
    with anyio.fail_after(30), pytest.raises(RuntimeError, match="every env was dropped") as info:
        async with MultiAsyncEnvCollector(shares, StepPolicy(), frames_per_batch=4, on_env_error="drop") as c:
            async for _ in c:
                pass
    message = str(info.value)
    assert "worker 1 (env ids 2 to 4" in message and "Boom" in message


@ASYNCIO_ONLY
async def test_bad_on_env_error_and_max_frames_per_traj_with_vector_envs(leaks) -> None:
    with pytest.raises(ValueError, match="on_env_error must be 'raise'"):
        MultiAsyncEnvCollector([[Counter]], frames_per_batch=8, on_env_error="skip")
    with anyio.fail_after(30), pytest.raises(ValueError, match="max_frames_per_traj=5 cannot be kept"):
        async with MultiAsyncEnvCollector(mixed_shares(), frames_per_batch=10, max_frames_per_traj=5) as c:
            await c.__anext__()


@ASYNCIO_ONLY
async def test_an_error_mode_raise_vector_env_ends_the_collector_with_its_type(leaks) -> None:
    shares = [[lambda: VecCounter(0, 2)], [lambda: VecCounter(2, 2, fail_at=6)]]
    with anyio.fail_after(30), pytest.raises(Boom, match="vector env 2 broke"):
        async with MultiAsyncEnvCollector(shares, StepPolicy(), frames_per_batch=4) as c:
            async for _ in c:
                pass


# -- a ProcessVectorEnv per worker: each worker's AsyncEnvCollector takes its fused path -----------------


def process_env() -> ProcessVectorEnv:
    """4 CartPoles stepped in 2 processes of the worker's own."""
    return ProcessVectorEnv([cartpole] * 4, num_workers=2)


class KilledAt30(gym.Wrapper):
    """A CartPole whose process is killed (SIGKILL) at its 30th step."""

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.steps = 0

    def step(self, action):  # type: ignore[no-untyped-def]
        self.steps += 1
        if self.steps == 30:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.env.step(action)


def process_env_killed() -> ProcessVectorEnv:
    return ProcessVectorEnv([cartpole, KilledAt30], num_workers=2)


class FusedFlag(nn.Module):
    """Argmax of a linear layer, and whether it ran in the fused engine's thread (one flag per env)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 2)

    def forward(self, observation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fused = threading.current_thread().name == "aiocollect-fused"
        return self.net(observation).argmax(-1), torch.full(observation.shape[:1], fused)


@ASYNCIO_ONLY
@pytest.mark.parametrize("loop", ["asyncio", "trio"])  # the workers' loops (the fused path's hand-offs)
async def test_a_process_vector_env_per_worker_runs_central_inference_in_each(loop, leaks) -> None:
    """Two workers, each a ProcessVectorEnv of 4 CartPoles in 2 processes of its own: every action is
    chosen in the worker's fused thread, env ids 0-7 are unique over the workers, each env's frames chain
    (next observation = following observation within a trajectory), and no process is left (the env
    processes are the workers' children)."""
    policy = TensorDictModule(FusedFlag(), in_keys=["observation"], out_keys=["action", "fused"])
    c = MultiAsyncEnvCollector([[process_env], [process_env]], policy, frames_per_batch=40, seed=1, loop=loop)
    async with c:
        assert c.num_envs == 8
        # 6 batches of each worker (a shared frame budget could go to the faster worker alone)
        batches = await take_until(c, each=6)
    assert len(batches) >= 12
    data = torch.cat(batches)
    assert data["fused"].all()
    for b in batches:  # a batch is one worker's: worker 0 has env ids 0-3, worker 1 4-7
        worker = int(b["collector", "worker_id"][0])
        assert ((b["collector", "env_id"] // 4) == worker).all()
    for e in range(8):
        rows = data[data["collector", "env_id"] == e]
        assert len(rows) >= 20
        ids, nxt, obs = rows["collector", "traj_ids"], rows["next", "observation"], rows["observation"]
        for k in range(len(rows) - 1):
            if ids[k + 1] == ids[k]:
                assert torch.equal(nxt[k], obs[k + 1]), (e, k)
            else:
                assert rows["next", "done"][k].item(), (e, k)
    owners: dict[int, int] = {}  # a trajectory id is one env's
    trajs, envs = data["collector", "traj_ids"].tolist(), data["collector", "env_id"].tolist()
    for traj, env in zip(trajs, envs, strict=True):
        assert owners.setdefault(traj, env) == env


@ASYNCIO_ONLY
async def test_weights_reach_process_vector_env_workers_with_their_versions(leaks) -> None:
    """``update_weights(wait=True)`` reaches both workers' fused threads between two policy calls: every
    frame's action is the one its recorded policy version computes."""
    seen: list[TensorDictBase] = []
    async with MultiAsyncEnvCollector(
        [[process_env], [process_env]],
        Constant(-1.0),
        frames_per_batch=32,
        track_policy_version=True,
        seed=0,
    ) as c:
        seen += await collect(c, 4)
        await c.update_weights(Constant(1.0), wait=True)
        # then 8 batches of each worker: at most its 2 slots and the batch in flight ran the old weights
        seen += await take_until(c, each=8)
    data = torch.cat(seen)
    versions = data["collector", "policy_version"]
    assert torch.equal(data["action"], (versions > 0).long())
    assert (versions == 0).any() and (versions == 1).sum() >= 32 * 10
    for worker in (0, 1):  # each worker's later batches were all collected with the new weights
        last = [b for b in seen if int(b["collector", "worker_id"][0]) == worker][-1]
        assert (last["collector", "policy_version"] == 1).all()


@ASYNCIO_ONLY
async def test_an_env_process_killed_under_a_worker_raises_worker_died_error(leaks) -> None:
    """A ProcessVectorEnv process killed inside worker 1: ``async for`` raises ``WorkerDiedError`` with
    the env process's exit code, and every process (the other worker's env processes too) is gone."""
    with anyio.fail_after(60), pytest.raises(WorkerDiedError) as info:
        async with MultiAsyncEnvCollector(
            [[process_env], [process_env_killed]], Constant(1.0), frames_per_batch=16
        ) as c:
            async for _ in c:
                pass
    assert info.value.exitcode == -signal.SIGKILL
