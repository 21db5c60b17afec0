"""``state_dict(envs=True)`` saves the state of any wrapper chain whose inner env can be saved: the restart
recipe of docs/faults.md (a wrapper of your own that counts steps) and the checkpoint recipe of
docs/long-runs.md combine, and the resumed run gives the uninterrupted run's batches, restarts included.
A wrapper saves its attributes, or its own state through its ``get_state()``/``set_state(state)`` (the
hook); an attribute a checkpoint cannot hold is named, with the hook."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

from aiocollect import (
    Collector,
    GymEnv,
    MultiSyncCollector,
    RestartPolicy,
    load_checkpoint,
    save_checkpoint,
)

pytestmark = pytest.mark.anyio

RESTART = RestartPolicy(max_restarts=50, window=600.0, backoff=0.0, max_backoff=0.0)


class CrashesAtStep30(gym.Wrapper):
    """docs/faults.md's stand-in for a simulator that goes unstable."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.steps = 0

    def step(self, action: Any) -> Any:
        self.steps += 1
        if self.steps == 30:
            raise RuntimeError("the simulator went unstable")
        return self.env.step(action)


def unstable() -> GymEnv:
    env = gym.wrappers.RecordEpisodeStatistics(CrashesAtStep30(gym.make("CartPole-v1")), buffer_length=5)
    return GymEnv(gym.wrappers.FrameStackObservation(env, 2))


def build(kind: str) -> Any:
    common: dict[str, Any] = {"total_frames": -1, "seed": 0, "restart": RESTART}
    if kind == "collector":
        return Collector(unstable, None, frames_per_batch=16, **common)
    return MultiSyncCollector([unstable, unstable], None, frames_per_batch=32, **common)


async def take(collector: Any, n: int) -> list[Any]:
    out: list[Any] = []
    with anyio.fail_after(60):
        async for batch in collector:
            out.append(batch)
            if len(out) == n:
                break
    return out


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
@pytest.mark.parametrize("kind", ["collector", "sync"])
async def test_the_restart_and_checkpoint_recipes_combine(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    async with build(kind) as collector:
        whole = await take(collector, 8)
        restarts = collector.statistics().restarts
    async with build(kind) as collector:
        head = await take(collector, 3)
        save_checkpoint(await collector.state_dict(envs=True), path)
    async with build(kind) as collector:
        await collector.load_state_dict(load_checkpoint(path))
        tail = await take(collector, 5)
        assert collector.statistics().restarts == restarts > 0  # the restarts after the checkpoint too
    assert (torch.cat(whole) == torch.cat(head + tail)).all()


class Lock:
    """What a wrapper may hold that no checkpoint can: a lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()


class Hooked(gym.Wrapper):
    """A wrapper whose state is an object of its own, saved through its hook."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.counter = Lock()
        self.count = 0

    def step(self, action: Any) -> Any:
        self.count += 1
        return self.env.step(action)

    def get_state(self) -> dict[str, Any]:
        return {"count": self.count}

    def set_state(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])


class Unsaveable(Hooked):
    """The same wrapper without its hook: its lock cannot be saved."""

    get_state = None  # type: ignore[assignment]
    set_state = None  # type: ignore[assignment]


def test_a_wrappers_hook_saves_its_state() -> None:
    env = GymEnv(Hooked(gym.make("CartPole-v1")), seed=0)
    env.reset()
    for _ in range(3):
        env.step(env.reset().set("action", torch.tensor(1)))
    state = env.get_state()
    other = GymEnv(Hooked(gym.make("CartPole-v1")))
    other.set_state(state)
    assert other._env.count == 3


def test_a_wrapper_attribute_no_checkpoint_holds_is_named_with_the_hook() -> None:
    env = GymEnv(Unsaveable(gym.make("CartPole-v1")), seed=0)
    env.reset()
    with pytest.raises(
        TypeError,
        match=r"the attribute 'counter' of the wrapper Unsaveable is a .*Lock.* give "
        r"the wrapper get_state\(\)/set_state\(state\) of its own",
    ):
        env.get_state()


class Counter(gym.Env):
    """An env of your own: its state through its own get_state/set_state."""

    observation_space = spaces.Box(0, 100, (1,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self) -> None:
        self.n = 0

    def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
        super().reset(seed=seed)
        self.n = int(self.np_random.integers(0, 5))
        return np.array([self.n], np.float32), {}

    def step(self, action: Any) -> Any:
        self.n += int(action) + 1
        return np.array([self.n], np.float32), 1.0, self.n > 20, False, {}

    def get_state(self) -> dict[str, Any]:
        return {"n": self.n}

    def set_state(self, state: dict[str, Any]) -> None:
        self.n = int(state["n"])


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
async def test_an_env_of_your_own_with_its_state_methods_resumes_exactly(tmp_path: Path) -> None:
    def make() -> Collector:
        return Collector(
            lambda: GymEnv(gym.wrappers.TimeLimit(Counter(), 9)), None, frames_per_batch=6, seed=2
        )

    async with make() as collector:
        whole = await take(collector, 6)
    async with make() as collector:
        head = await take(collector, 2)
        state = await collector.state_dict(envs=True)
    async with make() as collector:
        await collector.load_state_dict(state)
        tail = await take(collector, 4)
    assert (torch.cat(whole) == torch.cat(head + tail)).all()
