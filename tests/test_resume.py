"""Checkpoints that resume exactly: with env state (``state_dict(envs=True)``) a resumed seeded run
delivers the frames the uninterrupted run delivers; without it, two resumes from one checkpoint deliver
the same frames, from reset, under new trajectory ids. Checkpoints go through ``torch.save`` and
``torch.load(weights_only=True)``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict, TensorDictBase

from aiocollect import Collector, GymEnv, MultiAsyncCollector, MultiSyncCollector
from test_checkpoints import foreign_values

pytestmark = pytest.mark.anyio

ASYNCIO_ONLY = pytest.mark.parametrize("anyio_backend", [("asyncio", {})])


def cartpole() -> GymEnv:
    return GymEnv("CartPole-v1", num_envs=2)


def pendulum() -> GymEnv:
    return GymEnv("Pendulum-v1")


def build(kind: str, env: Callable[[], Any] = cartpole, **kwargs: Any) -> Any:
    common: dict[str, Any] = {"frames_per_batch": 32, "total_frames": -1, "seed": 7, **kwargs}
    if kind == "collector":
        return Collector(env, None, **common)
    if kind == "sync":
        return MultiSyncCollector([env] * 2, None, **common)
    return MultiAsyncCollector([env], None, max_policy_lag=0, **common)


async def take(collector: Any, n: int) -> list[TensorDictBase]:
    out: list[TensorDictBase] = []
    with anyio.fail_after(60):
        async for batch in collector:
            out.append(batch)
            if len(out) == n:
                break
    return out


def saved(state: dict[str, Any], path: Path) -> dict[str, Any]:
    assert not foreign_values(state)
    torch.save(state, path)
    return torch.load(path, weights_only=True)


def cat(batches: list[TensorDictBase]) -> TensorDictBase:
    return torch.cat([b.exclude(("collector", "worker_id")) for b in batches])


async def run(kind: str, n: int, state: dict[str, Any] | None = None, **kwargs: Any) -> list[TensorDictBase]:
    async with build(kind, **kwargs) as collector:
        if state is not None:
            await collector.load_state_dict(state)
        return await take(collector, n)


@pytest.mark.parametrize(
    ("kind", "env"),
    [("collector", cartpole), ("collector", pendulum), ("sync", cartpole), ("async", cartpole)],
)
async def test_resume_with_env_state_is_exact(
    kind: str, env: Any, tmp_path: Path, anyio_backend: Any
) -> None:
    if kind != "collector" and anyio_backend[0] == "trio":
        pytest.skip("worker processes: one loop is enough (the signal tests run trio)")
    full = await run(kind, 6, env=env)
    async with build(kind, env=env) as collector:
        head = await take(collector, 3)
        state = saved(await collector.state_dict(envs=True), tmp_path / "ckpt.pt")
    assert state["frames"] == sum(b.numel() for b in head)
    tail = await run(kind, 3, state, env=env)
    assert (cat(full) == cat(head + tail)).all()


@ASYNCIO_ONLY
@pytest.mark.parametrize("kind", ["collector", "sync", "async"])
async def test_resume_without_env_state_twice_is_identical(kind: str, tmp_path: Path) -> None:
    async with build(kind) as collector:
        head = await take(collector, 2)
        state = saved(await collector.state_dict(), tmp_path / "ckpt.pt")
    first = cat(await run(kind, 2, state))
    second = cat(await run(kind, 2, state))
    assert (first == second).all()
    old = set(cat(head)["collector", "traj_ids"].unique().tolist())
    new = set(first["collector", "traj_ids"].unique().tolist())
    assert not old & new  # no trajectory goes on across the resume
    uninterrupted = cat((await run(kind, 4))[2:])
    assert not (uninterrupted["observation"] == first["observation"]).all()  # the envs started from reset


async def test_init_random_frames_resume_exactly(tmp_path: Path) -> None:
    kwargs = {"init_random_frames": 96}
    full = await run("collector", 5, **kwargs)
    async with build("collector", **kwargs) as collector:
        head = await take(collector, 2)
        state = saved(await collector.state_dict(envs=True), tmp_path / "ckpt.pt")
    tail = await run("collector", 3, state, **kwargs)
    assert (cat(full) == cat(head + tail)).all()


# -- what cannot be saved says so ------------------------------------------------------------------
class NoState(GymEnv):
    get_state = None  # type: ignore[assignment]


async def test_an_env_without_get_state_is_named() -> None:
    async with Collector(lambda: NoState("CartPole-v1"), frames_per_batch=8, total_frames=-1) as c:
        await take(c, 1)
        with pytest.raises(TypeError, match="NoState cannot save its state"):
            await c.state_dict(envs=True)
        assert "frames" in await c.state_dict()  # without env state it saves


async def test_an_unknown_gym_env_is_named() -> None:
    async with Collector(lambda: GymEnv("FrozenLake-v1"), frames_per_batch=8, total_frames=-1) as c:
        with pytest.raises(TypeError, match="FrozenLakeEnv is not known"):
            await c.state_dict(envs=True)


async def test_prefetch_refuses_env_state() -> None:
    async with Collector(cartpole, frames_per_batch=8, total_frames=-1, prefetch=1) as c:
        with pytest.raises(ValueError, match="prefetch=0"):
            await c.state_dict(envs=True)


@ASYNCIO_ONLY
async def test_async_collector_running_ahead_refuses_env_state() -> None:
    async with MultiAsyncCollector([cartpole], None, frames_per_batch=32, total_frames=-1, seed=0) as c:
        await take(c, 2)
        with anyio.fail_after(30):  # until the worker has sent a batch the trainer was not given
            while c.statistics().workers[0].frames <= c.statistics().frames:  # noqa: ASYNC110 (no event)
                await anyio.sleep(0.01)
        with pytest.raises(ValueError, match="max_policy_lag=0"):
            await c.state_dict(envs=True)


# -- GymEnv.get_state / set_state --------------------------------------------------------------------
CLASSIC = ["CartPole-v1", "Pendulum-v1", "MountainCar-v0", "MountainCarContinuous-v0", "Acrobot-v1"]


def steps(env: GymEnv, n: int) -> TensorDict:
    """``n`` steps (resetting ended sub-envs as the collectors do); actions from the action space."""
    out = []
    space = env.action_space
    bs = env.batch_size
    if env._needs_reset:
        env.reset()
    for i in range(n):
        action = space.sample() if not isinstance(space, gym.spaces.Discrete) else i % int(space.n)
        value = torch.as_tensor(np.asarray(action))
        value = value.expand(*bs, *value.shape) if bs else value
        nxt = env.step(TensorDict({"action": value}, batch_size=bs))["next"]
        out.append(nxt)
        if nxt["done"].any():
            env.reset(TensorDict({"_reset": nxt["done"]}, batch_size=bs))
    return torch.stack(out)


@pytest.mark.parametrize("env_id", CLASSIC)
@pytest.mark.parametrize("num_envs", [None, 3])
def test_gym_env_state_round_trips(env_id: str, num_envs: int | None) -> None:
    env = GymEnv(env_id, num_envs=num_envs, seed=1)
    env.action_space.seed(0)
    steps(env, 5)
    state = env.get_state()
    assert not foreign_values(torch.load(_to_file(state), weights_only=True))
    env.action_space.seed(1)
    a = steps(env, 300)  # across episode ends and TimeLimit truncations
    other = GymEnv(env_id, num_envs=num_envs, seed=99)
    other.reset()
    other.set_state(_loaded(state))
    other.action_space.seed(1)
    b = steps(other, 300)
    assert (a == b).all()
    env.close()
    other.close()


def _to_file(state: Any) -> Any:
    import io

    from aiocollect._core._resume import to_plain

    buffer = io.BytesIO()
    torch.save(to_plain(state), buffer)
    buffer.seek(0)
    return buffer


def _loaded(state: Any) -> Any:
    return torch.load(_to_file(state), weights_only=True)


@pytest.mark.realenvs  # nox -s realenvs: ale-py and mujoco (the bench extra)
def test_ale_state_round_trips() -> None:
    ale_py = pytest.importorskip("ale_py")
    gym.register_envs(ale_py)
    env = GymEnv("ALE/Pong-v5", seed=0, repeat_action_probability=0.0)  # sticky actions: see docs
    steps(env, 10)
    state = _loaded(env.get_state())
    a = steps(env, 50)
    env.set_state(state)
    assert (steps(env, 50) == a).all()
    env.close()


@pytest.mark.realenvs  # nox -s realenvs: ale-py and mujoco (the bench extra)
def test_mujoco_state_round_trips() -> None:
    pytest.importorskip("mujoco")
    pytest.importorskip("imageio")
    env = GymEnv("InvertedPendulum-v5", seed=0)
    env.action_space.seed(0)
    steps(env, 10)
    state = _loaded(env.get_state())
    env.action_space.seed(1)
    a = steps(env, 50)
    env.set_state(state)
    env.action_space.seed(1)
    assert (steps(env, 50) == a).all()
    env.close()


@ASYNCIO_ONLY
async def test_async_collector_of_several_workers_refuses_env_state() -> None:
    async with MultiAsyncCollector(
        [cartpole] * 2, None, frames_per_batch=32, total_frames=-1, seed=0, max_policy_lag=0
    ) as c:
        await take(c, 1)
        with pytest.raises(ValueError, match="with 2 workers"):
            await c.state_dict(envs=True)
        assert "worker1" in await c.state_dict()  # without env state it saves


async def test_remote_collectors_refuse_env_state_by_name() -> None:
    """``state_dict(envs=True)`` on a collector over nodes: a ValueError that says why, before any node
    is asked (the collector need not be entered to see it)."""
    from aiocollect import DistributedCollector

    collector = DistributedCollector([cartpole], None, frames_per_batch=8, total_frames=8)
    with pytest.raises(ValueError, match=r"DistributedCollector.state_dict\(envs=True\).*collects ahead"):
        await collector.state_dict(envs=True)
