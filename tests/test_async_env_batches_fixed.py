"""``AsyncEnvCollector``'s batches, bit for bit, against a reference computed here: the same seeded envs
stepped one by one in a plain loop, the policy called on every env's observation at once, as the engine did
before its per-call hot path was vectorised (issue 31: the per-env Python work of a vector env's step and
of a policy call replaced by block operations). Each case's interleaving of env steps and policy calls is
deterministic (one vector env, or pure-async envs and ``min_batch`` = every env), so the batches are too:
the same collection run twice gives the same bytes, in the same batches, and each env's frames, in order,
are the reference's.

Nothing is compared with data recorded on another machine: floating-point results (a policy's forward
pass, a simulator's physics) may differ in their last bits from one CPU's kernels to another's (issue 43),
so both sides of every comparison are computed in the test, on the machine that runs it.

A case whose interleaving depends on the OS (``ProcessVectorEnv.split()``: whichever worker answers
first) is compared per env only: the frames of each env, in order, equal those of the same seeded
collection over the whole env (one policy call for all).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import gymnasium as gym
import numpy as np
import pytest
import torch

from aiocollect import AsyncEnvCollector, ProcessVectorEnv
from support import ENV_ID, take_until

pytestmark = pytest.mark.anyio

SAME_STEP = gym.vector.AutoresetMode.SAME_STEP


def cartpole() -> gym.Env:
    return gym.make("CartPole-v1", max_episode_steps=30)  # short episodes: many ends and resets


def pendulum() -> gym.Env:
    return gym.make("Pendulum-v1")


class Argmax(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).argmax(-1)


class Torque(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = torch.nn.Linear(3, 1)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return 2 * torch.tanh(self.net(observation))


class PureVector:
    """A gymnasium vector env stepped inline in ``async def`` (no thread: a deterministic interleaving)."""

    def __init__(self, n: int) -> None:
        self.env = gym.vector.SyncVectorEnv([cartpole] * n, autoreset_mode=SAME_STEP)
        self.num_envs = n
        self.single_observation_space = self.env.single_observation_space
        self.single_action_space = self.env.single_action_space

    async def reset(self, *, seed=None, options=None):
        return self.env.reset(seed=seed)

    async def step(self, actions):
        await anyio.lowlevel.checkpoint()
        return self.env.step(actions)

    async def close(self) -> None:
        self.env.close()


class PureSingle:
    """A gymnasium env stepped inline in ``async def``."""

    def __init__(self) -> None:
        self.env = cartpole()
        self.observation_space = self.env.observation_space
        self.action_space = self.env.action_space

    async def reset(self, *, seed=None, options=None):
        return self.env.reset(seed=seed)

    async def step(self, action):
        await anyio.lowlevel.checkpoint()
        return self.env.step(action)

    async def close(self) -> None:
        self.env.close()


def _process_whole() -> ProcessVectorEnv:
    return ProcessVectorEnv([cartpole] * 6, num_workers=2)


async def _batches(env_fns, policy, **kwargs) -> list:
    with anyio.fail_after(60):
        async with AsyncEnvCollector(env_fns, policy, **kwargs) as collector:
            return [batch async for batch in collector]


class Case:
    """A collection: its env fns (``envs`` the gymnasium envs they step, in env-id order), policy and
    keywords (``seed``: env ``i`` is reset with ``seed + i``)."""

    def __init__(self, env_fns: Callable[[], list[Any]], envs: list[Callable[[], gym.Env]], policy, **kwargs):
        self.env_fns, self.envs, self.policy, self.kwargs = env_fns, envs, policy, kwargs

    async def collect(self) -> list:
        return await _batches(self.env_fns(), self.policy(), **self.kwargs)


CASES = {
    # one vector env over 2 worker processes: every policy call takes all 6 envs; batches of 50 split steps
    "process_whole": Case(
        lambda: [_process_whole],
        [cartpole] * 6,
        Argmax,
        frames_per_batch=50,
        total_frames=400,
        seed=3,
        track_policy_version=True,
    ),
    # vector envs of 3 and 2 sub-envs and a single env, every call on all 6 (min_batch=6)
    "pure_mixed": Case(
        lambda: [lambda: PureVector(3), PureSingle, lambda: PureVector(2)],
        [cartpole] * 6,
        Argmax,
        frames_per_batch=40,
        total_frames=480,
        min_batch=6,
        max_wait=30.0,
        seed=5,
    ),
    # continuous actions, a vector env only, random exploration off
    "process_pendulum": Case(
        lambda: [lambda: ProcessVectorEnv([pendulum] * 4, num_workers=1)],
        [pendulum] * 4,
        Torque,
        frames_per_batch=64,
        total_frames=256,
        seed=11,
        exploration_type="deterministic",
    ),
}

#: what each env's frames are compared on (the trajectory ids per env: numbered by the env's own episodes)
KEYS = ("observation", "action", ("next", "observation"), ("next", "reward"), ("next", "terminated"))


def reference(case: Case, steps: int) -> dict[int, dict[Any, torch.Tensor]]:
    """Each env's first ``steps`` frames: the envs reset with ``seed + i`` and stepped one by one, the
    policy called on all their observations at once (a float32 batch in env order), an ended env reset at
    once (same-step autoreset: its frame keeps the final observation)."""
    envs = [make() for make in case.envs]
    seed = case.kwargs["seed"]
    obs = [env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]
    policy = case.policy()
    frames: dict[int, dict[Any, list]] = {
        i: {key: [] for key in (*KEYS, "episode")} for i in range(len(envs))
    }
    episodes = [0] * len(envs)
    for _ in range(steps):
        with torch.no_grad():
            actions = policy(torch.as_tensor(np.stack(obs), dtype=torch.float32))
        for i, env in enumerate(envs):
            action = actions[i].numpy()
            nxt, reward, terminated, truncated, _ = env.step(action)
            out = frames[i]
            out["observation"].append(torch.as_tensor(obs[i], dtype=torch.float32))
            out["action"].append(actions[i])
            out["next", "observation"].append(torch.as_tensor(nxt, dtype=torch.float32))
            out["next", "reward"].append(torch.tensor([reward], dtype=torch.float32))
            out["next", "terminated"].append(torch.tensor([terminated]))
            out["episode"].append(torch.tensor(episodes[i]))
            if terminated or truncated:
                episodes[i] += 1
                obs[i] = env.reset()[0]
            else:
                obs[i] = nxt
    for env in envs:
        env.close()
    return {i: {key: torch.stack(values) for key, values in out.items()} for i, out in frames.items()}


def per_env(batches: list, n: int) -> dict[int, dict[Any, torch.Tensor]]:
    """Each env's frames in the batches, in order (``"episode"``: its trajectories numbered from 0)."""
    data = torch.cat(batches)
    out = {}
    for i in range(n):
        rows = data[data["collector", "env_id"] == i]
        out[i] = {key: rows[key] for key in KEYS}
        out[i]["episode"] = torch.unique_consecutive(rows["collector", "traj_ids"], return_inverse=True)[1]
    return out


def assert_same(a: list, b: list) -> None:
    """The same batches, bit for bit: sizes, keys, dtypes, shapes and bytes."""
    assert [x.batch_size for x in a] == [y.batch_size for y in b]
    for x, y in zip(a, b, strict=True):
        keys = sorted(x.keys(include_nested=True, leaves_only=True), key=str)
        assert keys == sorted(y.keys(include_nested=True, leaves_only=True), key=str)
        for key in keys:
            u, v = x.get(key), y.get(key)
            assert u.dtype == v.dtype and u.shape == v.shape, key
            assert np.ascontiguousarray(u.numpy()).tobytes() == np.ascontiguousarray(v.numpy()).tobytes(), key


@pytest.mark.parametrize("case", sorted(CASES))
async def test_batches_equal_the_reference(case, anyio_backend_name, leaks):
    if case == "pure_mixed" and anyio_backend_name == "trio":
        pytest.skip("trio runs ready tasks in a random order: the envs' steps interleave differently")
    c = CASES[case]
    first, second = await c.collect(), await c.collect()
    assert_same(first, second)  # deterministic: the same bytes in the same batches
    fpb, total = c.kwargs["frames_per_batch"], c.kwargs["total_frames"]
    assert [b.numel() for b in first] == [fpb] * (total // fpb)
    n = len(c.envs)
    got = per_env(first, n)
    expected = reference(c, steps=max(len(frames["action"]) for frames in got.values()))
    for i in range(n):
        frames = len(got[i]["action"])
        assert frames >= total // n - 1  # every policy call takes every env: they step together
        for key in (*KEYS, "episode"):
            assert torch.equal(got[i][key], expected[i][key][:frames]), (case, i, key)


async def test_split_gives_each_env_the_frames_of_the_whole_env(leaks):
    """``split()``'s frames per env (in order) are those of the whole env with the same seed: the batch
    order differs (whichever worker is ready), the data does not."""

    async def per_env(split: bool) -> dict[int, dict[str, torch.Tensor]]:
        def make() -> ProcessVectorEnv:
            return ProcessVectorEnv([cartpole] * 6, num_workers=2)

        env = await anyio.to_thread.run_sync(make)
        envs = env.split() if split else [env]
        # until every env has 30 frames (a shared frame budget could go to the parts that step faster)
        async with AsyncEnvCollector(
            [lambda e=e: e for e in envs], Argmax(), frames_per_batch=60, seed=7, min_batch=3
        ) as collector:
            batches = await take_until(collector, each=30, members=6, key=ENV_ID, frames=True)
        data = torch.cat(batches)
        out = {}
        for i in range(6):
            rows = data[data["collector", "env_id"] == i]
            out[i] = {
                "obs": rows["observation"],
                "action": rows["action"],
                "next": rows["next", "observation"],
                "reward": rows["next", "reward"],
                "done": rows["next", "done"],
                # trajectories numbered per env: the global counter depends on the order envs end
                "episode": torch.unique_consecutive(rows["collector", "traj_ids"], return_inverse=True)[1],
            }
        return out

    split, whole = await per_env(True), await per_env(False)
    for i in range(6):
        n = min(len(split[i]["obs"]), len(whole[i]["obs"]))
        assert n >= 30
        for key in whole[i]:
            assert torch.equal(split[i][key][:n], whole[i][key][:n]), (i, key)
