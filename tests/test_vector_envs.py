"""Vector envs of every autoreset mode (gymnasium's next-step default, disabled, same-step),
``AsyncVectorEnv`` and EnvPool: the data equal a same-step env's, frame for frame, in every collector."""

from __future__ import annotations

import functools
import itertools
import warnings
from typing import Any

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv
from tensordict import TensorDict

from aiocollect import Collector, GymEnv, MultiAsyncCollector, MultiSyncCollector

pytestmark = pytest.mark.anyio

N = 3  # sub-envs
MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.DISABLED, AutoresetMode.SAME_STEP]


def cartpoles(mode: AutoresetMode = AutoresetMode.NEXT_STEP, *, n: int = N, **kwargs: Any) -> SyncVectorEnv:
    return SyncVectorEnv([lambda: gym.make("CartPole-v1")] * n, autoreset_mode=mode, **kwargs)


def async_cartpoles(mode: AutoresetMode = AutoresetMode.NEXT_STEP, **kwargs: Any) -> AsyncVectorEnv:
    return AsyncVectorEnv([lambda: gym.make("CartPole-v1")] * N, autoreset_mode=mode, **kwargs)


def actions(n: int, steps: int, seed: int = 0) -> np.ndarray:
    """``[n, steps]`` CartPole actions: env ``i`` takes ``actions[i, k]`` at its ``k``-th frame."""
    return np.random.default_rng(seed).integers(0, 2, size=(n, steps))


Frame = tuple[list[float], int, float, list[float], bool, bool]


def gymenv_frames(env: GymEnv, acts: np.ndarray) -> list[list[Frame]]:
    """The frames of each sub-env through GymEnv's public API: (obs, action, reward, next obs, flags)."""
    frames: list[list[Frame]] = [[] for _ in range(acts.shape[0])]
    root = env.reset()["observation"]
    for t in range(acts.shape[1]):
        out = env.step(TensorDict({"action": torch.as_tensor(acts[:, t])}, batch_size=env.batch_size))
        nxt = out["next"]
        for i in range(acts.shape[0]):
            frames[i].append(
                (
                    root[i].tolist(),
                    int(acts[i, t]),
                    float(nxt["reward"][i]),
                    nxt["observation"][i].tolist(),
                    bool(nxt["terminated"][i]),
                    bool(nxt["truncated"][i]),
                )
            )
        done = nxt["done"]
        root = env.reset(TensorDict({"_reset": done}, batch_size=env.batch_size))["observation"]
    return frames


def native_next_step_frames(vec: Any, acts: np.ndarray, seed: int | None) -> list[list[Frame]]:
    """Reference: the env's own next-step autoreset, stepped raw, its reset steps dropped per sub-env
    (a sub-env in its reset step consumes no action of its sequence)."""
    n, steps = acts.shape
    frames: list[list[Frame]] = [[] for _ in range(n)]
    obs, _ = vec.reset() if seed is None else vec.reset(seed=seed)
    resetting = np.zeros(n, dtype=bool)
    while min(len(f) for f in frames) < steps:
        idx = [min(len(f), steps - 1) for f in frames]
        a = np.array([0 if resetting[i] else acts[i, idx[i]] for i in range(n)])
        nxt, rew, term, trunc, _ = vec.step(a)
        for i in range(n):
            if not resetting[i] and len(frames[i]) < steps:
                frames[i].append(
                    (
                        obs[i].tolist(),
                        int(a[i]),
                        float(rew[i]),
                        nxt[i].tolist(),
                        bool(term[i]),
                        bool(trunc[i]),
                    )
                )
        resetting = np.where(resetting, False, term | trunc)
        obs = nxt
    return frames


def assert_ended_episodes(frames: list[list[Frame]]) -> None:
    """The data invariants: a frame's next observation is the next frame's observation unless the
    episode ended; there it is the final one and the next frame starts from a reset state."""
    for env_frames in frames:
        for a, b in itertools.pairwise(env_frames):
            if a[4] or a[5]:
                assert max(abs(x) for x in b[0]) <= 0.05  # CartPole's reset state
            else:
                assert a[3] == b[0]
        assert all(f[2] == 1.0 for f in env_frames)  # no reset step (reward 0) among the frames


class TestAutoresetModes:
    @pytest.mark.parametrize("mode", MODES)
    def test_frames_equal_a_same_step_env(self, mode):
        acts = actions(N, 120)
        got = gymenv_frames(GymEnv(cartpoles(mode), seed=7), acts)
        expected = gymenv_frames(GymEnv(cartpoles(AutoresetMode.SAME_STEP), seed=7), acts)
        assert got == expected
        assert sum(f[4] or f[5] for fs in got for f in fs) >= 5  # episodes did end, in every env
        assert_ended_episodes(got)

    def test_frames_equal_the_envs_own_next_step_autoreset(self):
        acts = actions(N, 120, seed=1)
        got = gymenv_frames(GymEnv(cartpoles(), seed=3), acts)
        assert got == native_next_step_frames(cartpoles(), acts, seed=3)

    def test_async_vector_env_frames_equal_a_same_step_env(self):
        acts = actions(N, 80, seed=2)
        env = GymEnv(async_cartpoles(), seed=5)
        try:
            got = gymenv_frames(env, acts)
        finally:
            env.close()
        assert got == gymenv_frames(GymEnv(cartpoles(AutoresetMode.SAME_STEP), seed=5), acts)

    def test_copy_false_vector_env(self):
        # copy=False: one observation buffer, written again by the reset of the ended sub-envs
        acts = actions(N, 80, seed=4)
        got = gymenv_frames(GymEnv(cartpoles(copy=False), seed=1), acts)
        assert got == gymenv_frames(GymEnv(cartpoles(AutoresetMode.SAME_STEP), seed=1), acts)

    def test_async_without_shared_memory_is_refused(self):
        vec = AsyncVectorEnv([lambda: gym.make("CartPole-v1")] * 2, shared_memory=False)
        try:
            with pytest.raises(ValueError, match="shared_memory=True"):
                GymEnv(vec)
        finally:
            vec.close()

    @pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.DISABLED])
    @pytest.mark.parametrize("max_frames_per_traj", [None, 7])
    def test_collector_batches_equal_a_same_step_env(self, mode, max_frames_per_traj):
        kw = {"frames_per_batch": 3 * 40, "seed": 11, "max_frames_per_traj": max_frames_per_traj}
        got = collect(lambda: GymEnv(cartpoles(mode)), batches=3, **kw)
        expected = collect(lambda: GymEnv(cartpoles(AutoresetMode.SAME_STEP)), batches=3, **kw)
        for a, b in zip(got, expected, strict=True):
            assert (a == b).all()
        done = torch.cat([b["next", "done"] for b in got])
        assert done.sum() >= 5
        assert all((b["next", "reward"] == 1).all() for b in got)  # no reset step in the data


def collect(env_fn: Any, policy: Any = None, *, batches: int, **kwargs: Any) -> list[TensorDict]:
    async def main() -> list[TensorDict]:
        with anyio.fail_after(120):
            async with Collector(env_fn, policy, total_frames=-1, **kwargs) as collector:
                out = []
                async for batch in collector:
                    out.append(batch)
                    if len(out) == batches:
                        break
        return out

    return anyio.run(main)


# -- AsyncVectorEnv in every collector ---------------------------------------------------------------
def async_vec_env(context: str | None = None) -> GymEnv:
    return GymEnv(async_cartpoles(context=context))


def check_batches(batches: list[TensorDict]) -> None:
    for b in batches:
        nxt, obs, done = b["next", "observation"], b["observation"], b["next", "done"][..., 0]
        # within a trajectory, the next observation is the following frame's observation
        follows = (~done[..., :-1]).unsqueeze(-1).expand_as(nxt[..., :-1, :])
        assert torch.equal(nxt[..., :-1, :][follows], obs[..., 1:, :][follows])
        assert (b["next", "reward"] == 1).all()


@pytest.mark.parametrize("backend", ["serial", "process"])
async def test_async_vector_env_in_multi_collectors(backend):
    # serial workers are threads of this process, where torch.compile's threads may have run (earlier
    # tests): on Python 3.13 filelock then refuses a fork from another thread, so the envs' subprocesses
    # start through a forkserver there
    make = functools.partial(async_vec_env, "forkserver") if backend == "serial" else async_vec_env
    with anyio.fail_after(120):
        async with MultiSyncCollector(
            [make] * 2,
            frames_per_batch=2 * N * 8,
            total_frames=2 * N * 8 * 2,
            worker_backend=backend,
        ) as c:
            sync_batches = [b async for b in c]
        async with MultiAsyncCollector(
            [make] * 2, frames_per_batch=N * 8, total_frames=N * 8 * 4, worker_backend=backend
        ) as c:
            async_batches = [b async for b in c]
    assert [b.batch_size for b in sync_batches] == [(2, N, 8)] * 2
    assert [b.batch_size for b in async_batches] == [(N, 8)] * 4
    check_batches(sync_batches + async_batches)


async def test_async_vector_env_in_collector():
    with anyio.fail_after(120):
        async with Collector(async_vec_env, frames_per_batch=N * 16, total_frames=N * 16 * 3) as c:
            batches = [b async for b in c]
    assert [b.batch_size for b in batches] == [(N, 16)] * 3
    check_batches(batches)


# -- EnvPool -------------------------------------------------------------------------------------------
def pool(task: str = "CartPole-v1", n: int = N, **kwargs: Any) -> Any:
    envpool = pytest.importorskip("envpool")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # EnvPool's spaces warn about float64 bounds
        return envpool.make_gymnasium(task, num_envs=n, **kwargs)


@pytest.mark.envpool  # nox -s realenvs
@pytest.mark.filterwarnings("ignore::UserWarning")
class TestEnvPool:
    def test_frames_equal_the_pools_own_next_step_autoreset(self):
        acts = actions(N, 150, seed=5)
        got = gymenv_frames(GymEnv(pool(seed=3)), acts)
        assert got == native_next_step_frames(pool(seed=3), acts, seed=None)
        assert_ended_episodes(got)

    def test_frames_equal_single_env_pools(self):
        # sub-env i of a pool made with seed s is the one env of a pool made with seed s + i
        acts = actions(N, 100, seed=6)
        got = gymenv_frames(GymEnv(pool(seed=3)), acts)
        for i in range(N):
            assert got[i] == gymenv_frames(GymEnv(pool(n=1, seed=3 + i)), acts[i : i + 1])[0]

    def test_set_seed_makes_the_pool_anew(self):
        env = GymEnv(pool(seed=0))
        first = env.env
        assert env.set_seed(4) == 4 + N - 1
        assert env.env is not first and env.env.config["seed"] == 4
        assert torch.equal(env.reset()["observation"], GymEnv(pool(seed=4)).reset()["observation"])

    def test_same_seed_same_batches(self):
        env = GymEnv(pool(seed=0))
        first = gymenv_frames(env, actions(N, 60))
        env.set_seed(0)  # the pool has that seed already, but was stepped: it is made anew
        assert gymenv_frames(env, actions(N, 60)) == first
        kw = {"frames_per_batch": N * 20, "seed": 2, "batches": 2}
        a, b = collect(envpool_cartpole, **kw), collect(envpool_cartpole, **kw)
        assert all((x == y).all() for x, y in zip(a, b, strict=True))

    def test_async_mode_is_refused(self):
        with pytest.raises(ValueError, match="async mode") as info:
            GymEnv(pool(n=4, batch_size=2))
        assert "batch_size=num_envs" in str(info.value)

    def test_atari(self):
        env = GymEnv(pool("Pong-v5", n=2, seed=0))
        assert env.obs_specs["observation"].shape == (4, 84, 84)
        (batch,) = collect(lambda: env, frames_per_batch=2 * 8, batches=1)
        assert batch["observation"].shape == (2, 8, 4, 84, 84)
        assert batch["observation"].dtype == torch.uint8
        # the frame stack shifts by one frame each step: next observation == following observation
        assert torch.equal(batch["next", "observation"][:, :-1], batch["observation"][:, 1:])


def envpool_cartpole() -> GymEnv:
    return GymEnv(pool(seed=0))


@pytest.mark.envpool  # nox -s realenvs
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("backend", ["serial", "process"])
async def test_envpool_in_every_collector(backend):
    pytest.importorskip("envpool")
    with anyio.fail_after(120):
        async with Collector(envpool_cartpole, frames_per_batch=N * 16, total_frames=N * 32, seed=1) as c:
            batches = [b async for b in c]
        async with MultiSyncCollector(
            [envpool_cartpole] * 2,
            frames_per_batch=2 * N * 16,
            total_frames=2 * N * 32,
            worker_backend=backend,
        ) as c:
            batches += [b async for b in c]
        async with MultiAsyncCollector(
            [envpool_cartpole] * 2, frames_per_batch=N * 16, total_frames=N * 32, worker_backend=backend
        ) as c:
            batches += [b async for b in c]
    assert len(batches) == 6
    check_batches(batches)
