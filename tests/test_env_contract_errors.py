"""An env that breaks gymnasium's API is told so, by name: a ``step`` that returns 4 or 6 values, a ``reset``
that returns a bare observation, an observation that changes shape raise a ``ValueError`` naming the env,
the method and the contract (the original error as its cause), from ``Collector``, a worker process and
``AsyncEnvCollector``; and a ``frames_per_batch`` whose batch cannot fit in memory is refused in the
constructor, naming ``frames_per_batch`` and the bytes it needs, before any process starts."""

from __future__ import annotations

from typing import Any

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from tensordict import TensorDict

from aiocollect import (
    AsyncEnvCollector,
    Collector,
    GymEnv,
    MultiAsyncCollector,
    MultiAsyncEnvCollector,
    MultiSyncCollector,
)
from support import cartpole, children

pytestmark = pytest.mark.anyio


class Broken(gym.Env):
    """A gymnasium env that breaks the API one way (``mode``)."""

    observation_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, mode: str) -> None:
        self.mode, self.t = mode, 0

    def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
        self.t = 0
        obs = np.zeros(3, np.float32)
        return obs if self.mode == "bare-reset" else (obs, {})

    def step(self, action: Any) -> Any:
        self.t += 1
        obs = np.zeros(4 if self.mode == "shape" and self.t > 2 else 3, np.float32)
        if self.mode == "four":
            return obs, 0.0, False, {}
        if self.mode == "six":
            return obs, 0.0, False, False, {}, None
        return obs, 0.0, False, False, {}


def gym_broken(mode: str) -> Any:
    return lambda: GymEnv(Broken(mode))


EXPECTED = {
    "four": r"the env Broken's step\(action\) returned 4 values: gymnasium's API returns 5, \(observation, "
    r"reward, terminated, truncated, info\); 4 is the old gym API's",
    "six": r"the env Broken's step\(action\) returned more than 5 values: gymnasium's API returns 5",
    "bare-reset": r"the env Broken's reset\(\) returned more than 2 values \(a bare observation\?\): "
    r"gymnasium's API returns \(observation, info\)",
    "shape": r"the env Broken returned an observation of shape \(4,\) that does not fit its "
    r"observation_space Box\(-1\.0, 1\.0, \(3,\), float32\)",
}


async def run(collector: Any) -> None:
    with anyio.fail_after(60):
        async with collector:
            async for _ in collector:
                pass


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
@pytest.mark.parametrize("mode", sorted(EXPECTED))
async def test_collector_names_the_env_and_the_contract(mode: str) -> None:
    with pytest.raises(ValueError, match=EXPECTED[mode]) as info:
        await run(Collector(gym_broken(mode), None, frames_per_batch=10, total_frames=20))
    assert isinstance(info.value.__cause__, ValueError)  # Python's own error, as the cause


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
@pytest.mark.parametrize("mode", ["four", "shape"])
async def test_a_worker_process_names_the_env_and_the_contract(mode: str, leaks) -> None:
    with pytest.raises(ValueError, match=EXPECTED[mode]):
        await run(
            MultiSyncCollector([cartpole, gym_broken(mode)], None, frames_per_batch=20, total_frames=40)
        )


@pytest.mark.parametrize("mode", sorted(EXPECTED))
async def test_async_env_collector_names_the_env_and_the_contract(mode: str) -> None:
    with pytest.raises(ValueError, match=EXPECTED[mode]):
        await run(AsyncEnvCollector([lambda: Broken(mode)], None, frames_per_batch=10, total_frames=20))


def test_a_vector_env_names_its_sub_env() -> None:
    async def main() -> None:
        vector = lambda: GymEnv(gym.vector.SyncVectorEnv([lambda: Broken("four")] * 2))  # noqa: E731
        await run(Collector(vector, None, frames_per_batch=10, total_frames=20))

    with pytest.raises(
        ValueError, match=r"the env SyncVectorEnv of Broken's step\(action\) returned 4 values"
    ):
        anyio.run(main)


class EnvBug(ValueError):
    pass


class Buggy(Broken):
    """An env whose own code raises a ValueError that looks like an unpacking one: left as it is."""

    def step(self, action: Any) -> Any:
        a, b = (1, 2, 3)  # the env's own bug
        return a, b


def test_the_envs_own_value_error_is_left_as_it_is() -> None:
    async def main() -> None:
        await run(Collector(lambda: GymEnv(Buggy("ok")), None, frames_per_batch=10, total_frames=20))

    with pytest.raises(ValueError, match=r"^too many values to unpack \(expected 2\)$"):
        anyio.run(main)


TOO_LARGE = [
    ("collector", lambda: Collector(cartpole, None, frames_per_batch=2**40)),
    ("sync", lambda: MultiSyncCollector([cartpole, cartpole], None, frames_per_batch=2**40)),
    ("async", lambda: MultiAsyncCollector([cartpole, cartpole], None, frames_per_batch=2**40)),
    ("asyncenv", lambda: AsyncEnvCollector([lambda: gym.make("CartPole-v1")], None, frames_per_batch=2**40)),
    (
        "multiasyncenv",
        lambda: MultiAsyncEnvCollector([[lambda: gym.make("CartPole-v1")]] * 2, None, frames_per_batch=2**40),
    ),
]


@pytest.mark.parametrize(("kind", "make"), TOO_LARGE, ids=[k for k, _ in TOO_LARGE])
def test_a_batch_too_large_for_memory_is_refused_before_anything_starts(kind: str, make: Any) -> None:
    before = {p.pid for p in children()}
    with pytest.raises(
        ValueError, match=r"^frames_per_batch=1,099,511,627,776 needs 18\.0 TiB per batch \(18 "
    ):
        make()
    assert {p.pid for p in children()} <= before  # no worker process started


class Pixels:
    """An ``EnvProtocol`` env of 1 MiB observations: 2 MiB a frame (the observation and the next one)."""

    batch_size = torch.Size([])
    observation_space = spaces.Box(0, 255, (1 << 20,), np.uint8)
    action_space = spaces.Discrete(2)

    def reset(self, td: Any = None) -> TensorDict:
        return TensorDict({"observation": torch.zeros(1 << 20, dtype=torch.uint8)}, batch_size=[])

    def step(self, td: TensorDict) -> TensorDict:
        raise AssertionError("never stepped")

    def set_seed(self, seed: int) -> int:
        return seed

    def close(self) -> None:
        pass


def test_a_batch_of_large_observations_is_refused_with_its_bytes() -> None:
    # 16 Mi frames: 288 MiB of rewards, flags and ids (the lower bound passes), 32 TiB with the observations
    with pytest.raises(ValueError, match=r"^frames_per_batch=16,777,216 needs 32\.\d TiB per batch \(2,097,"):
        Collector(Pixels, None, frames_per_batch=1 << 24)
