"""``AsyncEnvCollector``'s checkpoints, seeds and resets: resuming twice from one checkpoint gives the same
data; with env state a resumed run delivers what the run that saved delivers after the checkpoint; every
restart (``set_seed``, ``reset``, a resume) gives fresh trajectory ids. One env task (a vector env, or one
env) makes a run's data independent of timing; several single envs with a policy that reads only its
observation make each env's data so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from tensordict import TensorDictBase

from aiocollect import AsyncEnvCollector, MultiAsyncEnvCollector, stop_on_signals
from test_resume import saved, take

pytestmark = pytest.mark.anyio


def vector() -> Any:
    return gym.make_vec("CartPole-v1", num_envs=3, vectorization_mode="sync")


def build(fns: Any = None, policy: Any = None, **kwargs: Any) -> AsyncEnvCollector:
    common: dict[str, Any] = {"frames_per_batch": 30, "total_frames": -1, "seed": 5, **kwargs}
    return AsyncEnvCollector(fns or [vector], policy, **common)


async def run(n: int, state: dict[str, Any] | None = None, **kwargs: Any) -> TensorDictBase:
    async with build(**kwargs) as collector:
        if state is not None:
            with anyio.fail_after(30):
                await collector.load_state_dict(state)
        return torch.cat(await take(collector, n))


def ids(data: TensorDictBase) -> set[int]:
    return set(data["collector", "traj_ids"].unique().tolist())


async def test_resume_without_env_state_twice_is_identical(tmp_path: Path) -> None:
    async with build() as collector:
        head = torch.cat(await take(collector, 2))
        state = saved(await collector.state_dict(), tmp_path / "ckpt.pt")
    assert state["frames"] == 60 and state["batches"] == 2
    first, second = await run(2, state), await run(2, state)
    assert (first == second).all()
    assert not ids(head) & ids(first)  # no trajectory goes on across the resume
    assert min(ids(first)) >= state["next_traj_id"]
    whole = await run(4)
    assert (whole[:60] == head).all()  # the seeded run is reproducible
    assert not (whole[60:]["observation"] == first["observation"]).all()  # the envs started from reset


async def test_resume_with_env_state_continues_the_saving_run(tmp_path: Path) -> None:
    async with build() as collector:
        head = await take(collector, 2)
        state = saved(await collector.state_dict(envs=True), tmp_path / "ckpt.pt")
        after = torch.cat(await take(collector, 3))  # the run that saved goes on from the saved state
    assert len(state["env_state"]["envs"]) == 1
    first, second = await run(3, state), await run(3, state)
    assert (first == after).all() and (second == after).all()
    assert not ids(torch.cat(head)) & ids(after)  # trajectories in flight went on under fresh ids
    steps = after["observation"][:3]  # the first observations are the saved ones, not a reset's
    assert torch.equal(steps, state["env_state"]["obs"][0])
    assert (steps.abs() > 0.05).any()


class Walker:
    """An async env whose state is its position and step count (``get_state``/``set_state``, async)."""

    observation_space = spaces.Box(-1e6, 1e6, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self) -> None:
        self.x, self.t = 0.0, 0

    def obs(self) -> np.ndarray:
        return np.array([self.x, self.t], np.float32)

    async def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict]:
        self.x, self.t = float(seed or 0) * 100, 0
        return self.obs(), {}

    async def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        await anyio.lowlevel.checkpoint()
        self.x += 1 if action else -1
        self.t += 1
        return self.obs(), 1.0, self.t % 7 == 0, False, {}

    async def get_state(self) -> dict[str, Any]:
        return {"x": self.x, "t": self.t}

    async def set_state(self, state: dict[str, Any]) -> None:
        self.x, self.t = float(state["x"]), int(state["t"])

    async def close(self) -> None:
        pass


def by_obs(td: TensorDictBase) -> TensorDictBase:
    return td.set("action", (td["observation"][:, 1] % 3 == 0).long())


def per_env(data: TensorDictBase, env: int) -> torch.Tensor:
    rows = data[data["collector", "env_id"] == env]
    return torch.cat([rows["observation"], rows["next", "observation"]], -1)


async def test_many_envs_resume_per_env_from_their_state(tmp_path: Path) -> None:
    kwargs: dict[str, Any] = {"fns": [Walker] * 4, "policy": by_obs, "frames_per_batch": 20}
    async with build(**kwargs) as collector:
        await take(collector, 2)
        state = saved(await collector.state_dict(envs=True), tmp_path / "ckpt.pt")
        after = torch.cat(await take(collector, 3))
    resumed = await run(3, state, **kwargs)
    for env in range(4):  # each env's frames go on from its saved state, as in the run that saved
        a, b = per_env(after, env), per_env(resumed, env)
        k = min(len(a), len(b))
        assert k > 5 and torch.equal(a[:k], b[:k])
        assert a[0, 0] == state["env_state"]["obs"][env][0]


async def test_set_seed_and_reset() -> None:
    async with build() as a, build(seed=None) as b:
        await take(a, 1)
        await take(b, 2)
        assert await a.set_seed(11) == 13 and await b.set_seed(11) == 13  # three sub-envs: 11, 12, 13
        x, y = torch.cat(await take(a, 2)), torch.cat(await take(b, 2))
        ours = ("collector", "traj_ids")  # the ids go on from each collector's own counter
        assert (x.exclude(ours) == y.exclude(ours)).all()  # the same seed, the same data, whatever ran before
        before = ids(x)
        await a.reset()
        z = torch.cat(await take(a, 1))
        assert min(ids(z)) > max(before)  # new episodes, new ids
        assert (z["observation"][:3].abs() <= 0.05).all()  # reset states


async def test_an_env_that_cannot_save_is_named() -> None:
    class Plain(Walker):
        get_state = None  # type: ignore[assignment]

    async with build([Plain] * 2, by_obs, frames_per_batch=8) as collector:
        await take(collector, 1)
        with anyio.fail_after(30), pytest.raises(TypeError, match="env Plain cannot save its state"):
            await collector.state_dict(envs=True)
        assert (await collector.state_dict())["frames"] == 8  # without env state it saves


async def test_weights_and_version_resume(tmp_path: Path) -> None:
    class Greedy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def forward(self, obs: torch.Tensor) -> torch.Tensor:
            return self.net(obs).argmax(-1)

    source = Greedy()
    async with build(policy=source) as collector:
        await take(collector, 1)
        with torch.no_grad():
            source.net.weight.add_(1.0)
        assert await collector.update_weights(source) == 1
        state = saved(await collector.state_dict(), tmp_path / "ckpt.pt")
    async with build(policy=Greedy()) as fresh:
        with anyio.fail_after(30):
            await fresh.load_state_dict(state)
        assert fresh.policy_version == 1
        assert torch.equal(fresh.policy.net.weight, source.net.weight)
        await take(fresh, 1)
        assert fresh.statistics().frames == 60


async def test_the_budget_goes_on_from_the_checkpoint(tmp_path: Path) -> None:
    async with build(total_frames=120) as collector:
        await take(collector, 2)
        state = saved(await collector.state_dict(), tmp_path / "ckpt.pt")
    async with build(total_frames=120) as collector:
        await collector.load_state_dict(state)
        assert len(await take(collector, 10)) == 2  # 120 frames in all
    async with build(total_frames=60) as collector:
        await collector.load_state_dict(state)
        with pytest.warns(UserWarning, match="yields nothing: it has collected its total_frames=60"):
            assert await take(collector, 10) == []  # spent already


async def test_stop_on_signals_and_request_stop(tmp_path: Path) -> None:
    async with build() as collector, stop_on_signals(collector) as stop:
        got = 0
        with anyio.fail_after(60):
            async for batch in collector:
                got += batch.numel()
                collector.request_stop()
        assert stop.received is None and got == 30
        state = await collector.state_dict(envs=True)
        assert state["frames"] == 30


async def test_a_checkpoint_that_does_not_fit_leaves_the_collector_running() -> None:
    class Greedy(torch.nn.Module):
        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 2))

        def forward(self, obs: torch.Tensor) -> torch.Tensor:
            return self.net(obs).argmax(-1)

    async with build(policy=Greedy(8)) as small:
        state = await small.state_dict()
    async with build(policy=Greedy(16)) as collector:
        with anyio.fail_after(30), pytest.raises(ValueError, match="shape"):
            await collector.load_state_dict(state)
        assert len(await take(collector, 2)) == 2  # still collecting
        with pytest.raises(KeyError, match="next_traj_id"):
            await collector.load_state_dict({"frames": 0, "batches": 0, "policy_version": 0})


async def test_whole_trajectories_refuse_env_state() -> None:
    async with build(trajs_per_batch=2, frames_per_batch=None) as collector:
        await take(collector, 1)
        with anyio.fail_after(30), pytest.raises(ValueError, match="trajs_per_batch"):
            await collector.state_dict(envs=True)
        assert (await collector.state_dict())["batches"] == 1


# -- MultiAsyncEnvCollector: each worker's AsyncEnvCollector saves, loads, seeds and resets ------------------
def multi(policy: Any = None, **kwargs: Any) -> MultiAsyncEnvCollector:
    common: dict[str, Any] = {"frames_per_batch": 30, "total_frames": -1, "seed": 5, **kwargs}
    return MultiAsyncEnvCollector([[vector]] * 2, policy, **common)


def env_rows(data: TensorDictBase, env: int) -> TensorDictBase:
    """Env ``env``'s frames (workers interleave their batches as they are ready: compare per env)."""
    return data[data["collector", "env_id"] == env].exclude(("collector", "worker_id"))


def same_per_env(a: TensorDictBase, b: TensorDictBase, envs: int = 6) -> None:
    """Each env's frames in ``a`` and ``b`` agree as far as both go (which worker's batch comes first is
    timing: one may deliver more than the other)."""
    compared = 0  # take_each: every env has frames on both sides
    for env in range(envs):
        x, y = env_rows(a, env), env_rows(b, env)
        k = min(len(x), len(y))
        differ = [key for key in x.keys(True, True) if not (x[:k][key] == y[:k][key]).all()]
        assert not differ, f"env {env}: {differ} differ"
        compared += k
    assert compared >= 60


async def take_each(collector: Any, n: int) -> TensorDictBase:
    """Batches until each of the two workers delivered ``n`` (so that every env has frames to compare)."""
    out: list[TensorDictBase] = []
    counts = [0, 0]
    with anyio.fail_after(60):
        async for batch in collector:
            out.append(batch)
            counts[int(batch["collector", "worker_id"][0])] += 1
            if min(counts) >= n:
                break
    return torch.cat(out)


async def multi_run(n: int, state: dict[str, Any] | None = None, **kwargs: Any) -> TensorDictBase:
    async with multi(**kwargs) as collector:
        if state is not None:
            with anyio.fail_after(60):
                await collector.load_state_dict(state)
        return await take_each(collector, n)


async def test_multi_resume_with_env_state_continues_the_saving_run(tmp_path: Path, leaks: Any) -> None:
    async with multi() as collector:
        head = torch.cat(await take(collector, 3))
        with anyio.fail_after(60):
            state = saved(await collector.state_dict(envs=True), tmp_path / "ckpt.pt")
        after = await take_each(collector, 3)  # the run that saved goes on from the saved state
    assert state["frames"] == 90 and len(state["worker0"]["env_state"]["envs"]) == 1
    resumed = await multi_run(3, state)
    same_per_env(after, resumed)  # observations, actions, rewards, trajectory ids
    assert not ids(head) & ids(after)  # the trajectories in flight went on under fresh ids
    for worker, envs in ((0, [0, 1, 2]), (1, [3, 4, 5])):  # each env goes on from its saved observation
        for k, env in enumerate(envs):
            rows = env_rows(after, env)["observation"]
            saved_obs = state[f"worker{worker}"]["env_state"]["obs"][0][k]
            assert not len(rows) or torch.equal(rows[0], saved_obs)


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])  # worker processes: one loop is enough
async def test_multi_resume_without_env_state_twice_is_identical(tmp_path: Path, leaks: Any) -> None:
    async with multi(loop="trio") as collector:
        head = torch.cat(await take(collector, 2))
        state = saved(await collector.state_dict(), tmp_path / "ckpt.pt")
    assert "env_state" not in state["worker0"] and "policy" not in state
    first, second = await multi_run(2, state, loop="trio"), await multi_run(2, state, loop="trio")
    same_per_env(first, second)
    assert not ids(head) & (ids(first) | ids(second))  # no trajectory goes on across the resume
    starts = [env_rows(first, env)["observation"][:1] for env in range(6)]
    assert (torch.cat(starts).abs() <= 0.05).all()  # the envs started from reset


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
async def test_multi_set_seed_and_reset(leaks: Any) -> None:
    async with multi() as a, multi(seed=None) as b:
        await take(a, 1)
        await take(b, 3)
        with anyio.fail_after(60):
            assert await a.set_seed(11) == 16 and await b.set_seed(11) == 16  # 2 workers x 3 sub-envs
        x, y = await take_each(a, 2), await take_each(b, 2)
        ours = ("collector", "traj_ids")  # each collector's ids go on from its own counters
        same_per_env(x.exclude(ours), y.exclude(ours))  # the same seed, the same data
        with anyio.fail_after(60):
            await a.reset()
        z = torch.cat(await take(a, 2))
        assert not ids(x) & ids(z)  # new episodes, new ids
        starts = [env_rows(z, env)["observation"][:1] for env in range(6)]
        assert (torch.cat(starts).abs() <= 0.05).all()  # reset states


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
async def test_multi_weights_and_version_resume(tmp_path: Path, leaks: Any) -> None:
    class Greedy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def forward(self, obs: torch.Tensor) -> torch.Tensor:
            return self.net(obs).argmax(-1)

    source = Greedy()
    async with multi(policy=source) as collector:
        await take(collector, 1)
        with torch.no_grad():
            source.net.weight.add_(1.0)
        assert await collector.update_weights(source, wait=True) == 1
        state = saved(await collector.state_dict(envs=True), tmp_path / "ckpt.pt")
        after = await take_each(collector, 2)
    assert state["policy_version"] == 1
    fresh = Greedy()
    async with multi(policy=fresh) as collector:
        with anyio.fail_after(60):
            await collector.load_state_dict(state)
        assert collector.policy_version >= 1
        weights = await collector.get_distant_attr("policy.net.weight")
        assert all(torch.equal(w, source.net.weight) for w in weights)
        resumed = await take_each(collector, 2)
    same_per_env(after.exclude(("collector", "policy_version")), resumed)


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
async def test_multi_checkpoint_refusals(leaks: Any) -> None:
    async with multi(trajs_per_batch=2, frames_per_batch=None) as collector:
        await take(collector, 1)
        with anyio.fail_after(60), pytest.raises(ValueError, match="trajs_per_batch"):
            await collector.state_dict(envs=True)
        assert (await collector.state_dict())["batches"] == 1

    class Plain(Walker):
        get_state = None  # type: ignore[assignment]

    async with MultiAsyncEnvCollector([[Plain] * 2] * 2, by_obs, frames_per_batch=8) as collector:
        await take(collector, 1)
        with anyio.fail_after(60), pytest.raises(TypeError, match="env Plain cannot save its state"):
            await collector.state_dict(envs=True)


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
async def test_multi_checkpoints_on_policy_and_with_whole_trajectories(leaks: Any) -> None:
    """max_policy_lag=0 (a worker's one slot is the trainer's until the next batch) and trajs_per_batch
    (trajectories being assembled in the trainer) go on after every restart."""
    async with multi(max_policy_lag=0) as collector:
        await take(collector, 2)
        with anyio.fail_after(60):
            assert await collector.set_seed(3) == 8
            state = await collector.state_dict(envs=True)
        before = await take_each(collector, 2)  # from the state saved, and again from it:
        with anyio.fail_after(60):
            await collector.load_state_dict(state)
        same_per_env(before, await take_each(collector, 2))
        with anyio.fail_after(60):
            await collector.reset()
        assert len(await take(collector, 2)) == 2
    async with multi(trajs_per_batch=3, frames_per_batch=None) as collector:
        await take(collector, 2)
        with anyio.fail_after(60):
            await collector.load_state_dict(await collector.state_dict())
        batches = await take(collector, 2)
        assert [len(b["collector", "traj_ids"].unique()) for b in batches] == [3, 3]
