"""``AsyncEnvCollector``'s batches, bit for bit, against a fixed seeded expectation recorded from the engine
before its per-call hot path was vectorised (issue 31: the per-env Python work of a vector env's step and
of a policy call replaced by block operations). Each case's interleaving of env steps and policy calls is
deterministic (one vector env, or pure-async envs and ``min_batch`` = every env), so the batches are too;
the digest covers every key of every batch, its dtype, shape and bytes, and each batch's boundaries.

A case whose interleaving depends on the OS (``ProcessVectorEnv.split()``: whichever worker answers
first) is compared per env instead: the frames of each env, in order, equal those of the same seeded
collection over the whole env (one policy call for all).

To record the digests again (only for a deliberate change of the data): ``python
tests/test_async_env_batches_fixed.py``.
"""

from __future__ import annotations

import hashlib

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


CASES = {
    # one vector env over 2 worker processes: every policy call takes all 6 envs; batches of 50 split steps
    "process_whole": lambda: _batches(
        [_process_whole],
        Argmax(),
        frames_per_batch=50,
        total_frames=400,
        seed=3,
        track_policy_version=True,
    ),
    # vector envs of 3 and 2 sub-envs and a single env, every call on all 6 (min_batch=6)
    "pure_mixed": lambda: _batches(
        [lambda: PureVector(3), PureSingle, lambda: PureVector(2)],
        Argmax(),
        frames_per_batch=40,
        total_frames=480,
        min_batch=6,
        max_wait=30.0,
        seed=5,
    ),
    # continuous actions, a vector env only, random exploration off
    "process_pendulum": lambda: _batches(
        [lambda: ProcessVectorEnv([pendulum] * 4, num_workers=1)],
        Torque(),
        frames_per_batch=64,
        total_frames=256,
        seed=11,
        exploration_type="deterministic",
    ),
}


def digest(batches: list) -> str:
    h = hashlib.sha256()
    for batch in batches:
        h.update(str(batch.batch_size).encode())
        for key in sorted(batch.keys(include_nested=True, leaves_only=True), key=str):
            value = batch.get(key)
            h.update(f"{key}{value.dtype}{tuple(value.shape)}".encode())
            h.update(np.ascontiguousarray(value.numpy()).tobytes())
    return h.hexdigest()


#: recorded from main b49a9cb (the engine before issue 31's vectorised hot path)
EXPECTED = {
    "process_pendulum": "041c946af8f5801de317d7951563a1b57790257dbdacf190efbe965ed01d471d",
    "process_whole": "a41db2398538953bd52f5967bf62e5201c6325c5d0b4c223e73e6ce6fa4bc46a",
    "pure_mixed": "0f0995432f2e2c8f2fede1a21341c9c7c3e3e1e7180d02cdd6d0b10ba4cfa17a",
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_batches_equal_the_recorded_ones(case, anyio_backend_name, leaks):
    if case == "pure_mixed" and anyio_backend_name == "trio":
        pytest.skip("trio runs ready tasks in a random order: the envs' steps interleave differently")
    assert digest(await CASES[case]()) == EXPECTED[case]


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


if __name__ == "__main__":

    async def _record() -> None:
        for case in sorted(CASES):
            print(f'    "{case}": "{digest(await CASES[case]())}",')

    anyio.run(_record)
