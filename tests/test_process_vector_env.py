"""``ProcessVectorEnv``: gymnasium envs stepped in worker processes through shared memory, behind the async
vector env protocol; with ``AsyncEnvCollector`` (central inference). Data against an in-process
``SyncVectorEnv``, spaces (Dict/Tuple, uint8 pixels), vector envs in workers, seeds, errors with their type
and traceback, killed workers, cancellation and leaks."""

from __future__ import annotations

import functools
import os
import signal
import threading
import traceback

import anyio
import anyio.to_thread
import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

from aiocollect import AsyncEnvCollector, AsyncVectorEnvProtocol, ProcessVectorEnv, WorkerDiedError
from support import EnvFailure, HookedEnv, children

pytestmark = pytest.mark.anyio

SAME_STEP = gym.vector.AutoresetMode.SAME_STEP


def cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


def hooked(**hooks: object) -> gym.Env:
    return HookedEnv(gym.make("CartPole-v1"), **hooks)  # type: ignore[arg-type]


def broken() -> gym.Env:
    raise KeyError("no such env")


def suicide() -> gym.Env:
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable")


def pendulum() -> gym.Env:
    return gym.make("Pendulum-v1")


class Echo(gym.Env):
    """Dict observations (uint8 pixels, a nested Box) that echo a Dict action of a Discrete and a Tuple;
    episodes of 3 steps."""

    observation_space = spaces.Dict(
        {
            "pixels": spaces.Box(0, 255, (4, 4, 3), np.uint8),
            "state": spaces.Dict({"echo": spaces.Box(-10, 10, (3,), np.float32)}),
        }
    )
    action_space = spaces.Dict(
        {
            "move": spaces.Discrete(3),
            "pair": spaces.Tuple((spaces.Box(-1, 1, (2,), np.float32), spaces.Discrete(2))),
        }
    )

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.base = int(self.np_random.integers(0, 100))
        return self._obs(0, np.zeros(2, np.float32), 0), {}

    def step(self, action):
        self.t += 1
        move, (box, bit) = action["move"], action["pair"]
        return self._obs(move, box, bit), float(move), self.t >= 3, False, {}

    def _obs(self, move, box, bit):
        pixels = np.full((4, 4, 3), (self.base + 50 * self.t) % 256, np.uint8)
        echo = np.array([move, box[0] + box[1], bit], np.float32)
        return {"pixels": pixels, "state": {"echo": echo}}


async def make(*args, **kwargs) -> ProcessVectorEnv:
    return await anyio.to_thread.run_sync(functools.partial(ProcessVectorEnv, *args, **kwargs))


async def test_steps_like_a_sync_vector_env_seeded_per_sub_env(leaks):
    env = await make([cartpole] * 5, num_workers=2)
    ref = gym.vector.SyncVectorEnv([cartpole] * 5, autoreset_mode=SAME_STEP)
    try:
        assert isinstance(env, AsyncVectorEnvProtocol)
        assert env.num_envs == 5 and env.single_action_space == spaces.Discrete(2)
        obs, info = await env.reset(seed=7)
        ref_obs, _ = ref.reset(seed=7)  # sub-env k seeded with 7 + k
        np.testing.assert_array_equal(obs, ref_obs)
        rng = np.random.default_rng(0)
        ended_any = False
        for _ in range(80):
            actions = rng.integers(0, 2, 5)
            obs, reward, terminated, truncated, info = await env.step(actions)
            r_obs, r_reward, r_term, r_trunc, r_info = ref.step(actions)
            np.testing.assert_array_equal(obs, r_obs)
            np.testing.assert_array_equal(reward, r_reward)
            np.testing.assert_array_equal(terminated, r_term)
            np.testing.assert_array_equal(truncated, r_trunc)
            if terminated.any():
                ended_any = True
                np.testing.assert_array_equal(info["_final_obs"], r_info["_final_obs"])
                for k in np.flatnonzero(terminated):
                    np.testing.assert_array_equal(info["final_obs"][k], r_info["final_obs"][k])
            else:
                assert info == {}
        assert ended_any
    finally:
        await env.close()
        ref.close()
    await env.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        await env.step(np.zeros(5, np.int64))


async def test_dict_and_tuple_spaces_and_uint8_pixels(anyio_backend, leaks):
    env = await make([Echo] * 4, num_workers=2)
    try:
        obs, _ = await env.reset(seed=1)
        assert obs["pixels"].dtype == np.uint8 and obs["pixels"].shape == (4, 4, 4, 3)
        actions = {
            "move": np.array([0, 1, 2, 1]),
            "pair": (np.array([[0.5, 0.25], [0, 0], [-1, 1], [1, 1]], np.float32), np.array([1, 0, 1, 0])),
        }
        obs, reward, terminated, _, info = await env.step(actions)
        np.testing.assert_array_equal(reward, [0, 1, 2, 1])
        np.testing.assert_allclose(obs["state"]["echo"], [[0, 0.75, 1], [1, 0, 0], [2, 0, 1], [1, 2, 0]])
        for _ in range(2):
            obs, reward, terminated, _, info = await env.step(actions)
        assert terminated.all() and info["_final_obs"].all()
        final = info["final_obs"][3]
        assert final["pixels"].dtype == np.uint8 and final["state"]["echo"].tolist() == [1, 2, 0]
        assert (obs["pixels"][:, 0, 0, 0] != final["pixels"][0, 0, 0]).all()  # reset: t = 0 again
        with pytest.raises(ValueError, match="move"):
            await env.step({"move": np.zeros(3, np.int64), "pair": actions["pair"]})
        with pytest.raises(ValueError, match="batch of 4 actions"):
            await env.step(np.zeros(4))
    finally:
        await env.close()


async def test_vector_envs_inside_workers(leaks):
    vec = functools.partial(gym.make_vec, "CartPole-v1", num_envs=3, vectorization_mode="sync")  # next-step
    env = await make([vec, vec], num_workers=2)
    ref = gym.vector.SyncVectorEnv([cartpole] * 6, autoreset_mode=SAME_STEP)
    try:
        assert env.num_envs == 6
        obs, _ = await env.reset(seed=0)
        ref_obs, _ = ref.reset(seed=[0, 1, 2, 3, 4, 5])
        np.testing.assert_allclose(obs, ref_obs)
        for _ in range(40):
            obs, *_ = await env.step(np.ones(6, np.int64))
            ref_obs, *_ = ref.step(np.ones(6, np.int64))
            np.testing.assert_allclose(obs, ref_obs, rtol=1e-6)
    finally:
        await env.close()
        ref.close()


class Policy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).argmax(-1)


async def collect(env_fns, seed: int) -> tuple[torch.Tensor, list[int]]:
    torch.manual_seed(0)
    async with AsyncEnvCollector(env_fns, Policy(), frames_per_batch=64, total_frames=256, seed=seed) as c:
        batches = [b async for b in c]
        sizes = list(c.policy_batch_sizes)
    return torch.cat([b["next", "observation"] for b in batches]), sizes


async def test_central_inference_with_async_env_collector(anyio_backend, leaks):
    with anyio.fail_after(60):
        data, sizes = await collect([lambda: ProcessVectorEnv([cartpole] * 8, num_workers=2)], seed=3)
        again, _ = await collect([lambda: ProcessVectorEnv([cartpole] * 8, num_workers=2)], seed=3)
    assert data.shape == (256, 4) and all(n == 8 for n in sizes)
    assert torch.equal(data, again)  # seeds s + k: the same frames


async def test_split_runs_the_policy_on_whichever_workers_are_ready(leaks):
    slow = functools.partial(hooked, step_delay=0.02)
    env = await make([cartpole] * 4 + [slow] * 4, num_workers=2)
    parts = env.split()
    assert [p.num_envs for p in parts] == [4, 4]
    with pytest.raises(RuntimeError, match="split"):
        env.split()
    with anyio.fail_after(60):
        async with AsyncEnvCollector(
            parts, Policy(), frames_per_batch=200, total_frames=400, min_batch=4, max_wait=0.001, seed=0
        ) as c:
            batches = [b async for b in c]
            sizes = list(c.policy_batch_sizes)
    ids = torch.cat([b["collector", "env_id"] for b in batches])
    assert set(ids.tolist()) == set(range(8))
    # the fast worker's 4 envs do not wait for the slow one: most policy calls hold one worker only
    assert sizes.count(4) > sizes.count(8)
    assert (ids < 4).sum() > (ids >= 4).sum()
    with pytest.raises(RuntimeError, match="closed"):
        await env.reset()


@pytest.mark.parametrize("where", ["step", "reset"])
async def test_env_error_keeps_its_type_and_worker_traceback(anyio_backend, leaks, where):
    fault = functools.partial(hooked, **{f"fail_{where}_at": 3})
    env = await make([cartpole, cartpole, fault], num_workers=2)
    with anyio.fail_after(30), pytest.raises(EnvFailure) as info:
        try:
            for _ in range(3):
                await env.reset(seed=0)
                for _ in range(5):
                    await env.step(np.zeros(3, np.int64))
        finally:
            await env.close()
    text = "".join(traceback.format_exception(info.value))
    assert f"explode_in_{where}" in text and "ProcessVectorEnv worker 1" in text, text


async def test_env_error_through_the_collector(leaks):
    fault = functools.partial(hooked, fail_step_at=20)
    with anyio.fail_after(60), pytest.raises(EnvFailure):
        async with AsyncEnvCollector(
            [lambda: ProcessVectorEnv([cartpole, fault], num_workers=2)], frames_per_batch=10, seed=0
        ) as c:
            async for _ in c:
                pass


async def test_a_failing_env_fn_raises_from_the_constructor(leaks):
    with anyio.fail_after(30), pytest.raises(KeyError, match="no such env"):
        await make([cartpole, broken], num_workers=2)


async def test_a_worker_dying_while_it_starts_raises_worker_died_error(leaks):
    with anyio.fail_after(30), pytest.raises(WorkerDiedError) as info:
        await make([cartpole, suicide], num_workers=2)
    assert info.value.exitcode == -signal.SIGKILL


async def test_different_spaces_across_workers_are_refused(leaks):
    with anyio.fail_after(30), pytest.raises(ValueError, match="worker 1's envs have the spaces"):
        await make([cartpole, pendulum], num_workers=2)


async def test_killed_worker_raises_worker_died_error(anyio_backend, leaks):
    env = await make([cartpole] * 4, num_workers=2)
    try:
        await env.reset(seed=0)
        os.kill(env._workers[1].process.pid, signal.SIGKILL)
        with anyio.fail_after(30), pytest.raises(WorkerDiedError) as info:
            for _ in range(1000):
                await env.step(np.zeros(4, np.int64))
        assert info.value.exitcode == -signal.SIGKILL
        with pytest.raises(WorkerDiedError):  # for good
            await env.step(np.zeros(4, np.int64))
    finally:
        await env.close()


async def test_cancelled_step_then_step_again_and_close(anyio_backend, leaks):
    slow = functools.partial(hooked, step_delay=0.2)
    env = await make([cartpole, slow], num_workers=2)
    try:
        await env.reset(seed=0)
        with anyio.move_on_after(0.05) as scope:
            await env.step(np.zeros(2, np.int64))
        assert scope.cancelled_caught
        obs, reward, *_ = await env.step(np.zeros(2, np.int64))  # waits for the step in flight first
        assert obs.shape == (2, 4) and reward.tolist() == [1.0, 1.0]
        with anyio.move_on_after(0.05):
            await env.step(np.zeros(2, np.int64))
    finally:
        await env.close()  # a step still in flight


async def test_cancelled_collector_leaves_nothing(leaks):
    with anyio.move_on_after(1.0):
        async with AsyncEnvCollector(
            [lambda: ProcessVectorEnv([cartpole] * 4, num_workers=2)], frames_per_batch=100, seed=0
        ) as c:
            async for _ in c:
                pass


async def test_bad_arguments_raise_before_any_process(leaks):
    lock = threading.Lock()

    def unpicklable() -> gym.Env:
        assert lock is not None
        return cartpole()

    with pytest.raises(TypeError, match="env_fns must be a non-empty list"):
        ProcessVectorEnv([])
    with pytest.raises(TypeError, match="callables"):
        ProcessVectorEnv([cartpole, "CartPole-v1"])
    with pytest.raises(ValueError, match="num_workers must be an int from 1 to len"):
        ProcessVectorEnv([cartpole] * 2, num_workers=3)
    with pytest.raises(TypeError, match="pickle"):
        ProcessVectorEnv([unpicklable])
    assert children() == []
    env = await make([cartpole])
    try:
        with pytest.raises(ValueError, match="options"):
            await env.reset(options={"x": 1})
    finally:
        await env.close()
