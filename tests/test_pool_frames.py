"""EnvPool's fused loop (``PoolFrames``): the pool resets ended envs itself, each env fills its row of the
batch at its own pace, and the envs short of frames are stepped alone at the batch's end.

Every delivered frame is checked against CartPole's dynamics: its next observation is the step of its
observation and action (a reset step, whose action the pool ignores, would fail it), frames chain within
and across batches, trajectory ids change exactly at episode ends, and each env has its ``T`` frames.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn

from aiocollect import Collector, GymEnv
from aiocollect._envs._adapter import ArrayEnv

# every test needs envpool: nox -s realenvs runs them (the default suite leaves the envpool marker out)
pytestmark = [pytest.mark.anyio, pytest.mark.envpool, pytest.mark.filterwarnings("ignore::UserWarning")]

N = 7


class PoolCalls:
    """A pool's ``step`` wrapped: records the env ids of each call (``None``: all of them); ``reverse``
    reports the envs in reverse order (``info["env_id"]`` saying so), as a pool may."""

    def __init__(self, pool: Any, reverse: bool = False) -> None:
        self.ids: list[list[int] | None] = []
        self.reverse = reverse
        self._step = pool.step
        pool.step = self

    def __call__(self, action: Any, env_id: Any = None) -> Any:
        self.ids.append(None if env_id is None else [int(i) for i in env_id])
        result = self._step(action, env_id)
        if not self.reverse:
            return result
        obs, reward, terminated, truncated, info = result
        back = slice(None, None, -1)
        return (
            obs[back],
            reward[back],
            terminated[back],
            truncated[back],
            {**info, "env_id": info["env_id"][back]},
        )


def cartpole_pool(seed: int = 5, reverse: bool = False, calls: list[PoolCalls] | None = None) -> GymEnv:
    """A pool made with the collector's seed (another seed would make it anew, unwrapped)."""
    envpool = pytest.importorskip("envpool")
    pool = envpool.make_gymnasium("CartPole-v1", num_envs=N, seed=seed)
    recorder = PoolCalls(pool, reverse)
    if calls is not None:
        calls.append(recorder)
    return GymEnv(pool)


def cartpole_step(obs: np.ndarray, action: int) -> np.ndarray:
    """CartPole's dynamics (gymnasium's and EnvPool's: Euler, tau 0.02), in float64."""
    x, x_dot, theta, theta_dot = (float(v) for v in obs)
    force = 10.0 if action == 1 else -10.0
    cos, sin = math.cos(theta), math.sin(theta)
    temp = (force + 0.05 * theta_dot**2 * sin) / 1.1
    theta_acc = (9.8 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - 0.1 * cos**2 / 1.1))
    x_acc = temp - 0.05 * theta_acc * cos / 1.1
    return np.array(
        [x + 0.02 * x_dot, x_dot + 0.02 * x_acc, theta + 0.02 * theta_dot, theta_dot + 0.02 * theta_acc]
    )


def check_frames(batches: list[TensorDictBase]) -> int:
    """Every frame a CartPole transition, chained within and across batches; returns the episode ends."""
    ends = 0
    last: list[
        tuple[np.ndarray, bool, int]
    ] = []  # per env: next observation, done, traj id of its last frame
    for batch in batches:
        obs, nxt = batch["observation"].numpy(), batch["next", "observation"].numpy()
        action, reward = batch["action"].numpy().reshape(N, -1), batch["next", "reward"].numpy()
        done, terminated = batch["next", "done"][..., 0].numpy(), batch["next", "terminated"][..., 0].numpy()
        ids = batch["collector", "traj_ids"].numpy()
        assert (ids >= 0).all()  # every env has all its frames
        assert (reward == 1).all()  # no reset step (reward 0)
        for i in range(N):
            for k in range(obs.shape[1]):
                np.testing.assert_allclose(cartpole_step(obs[i, k], int(action[i, k])), nxt[i, k], atol=1e-5)
                out = abs(nxt[i, k, 0]) > 2.4 or abs(nxt[i, k, 2]) > 12 * 2 * math.pi / 360
                assert bool(terminated[i, k]) == out
                prev = last[i] if k == 0 and last else (nxt[i, k - 1], bool(done[i, k - 1]), ids[i, k - 1])
                if k == 0 and not last:
                    continue
                if prev[1]:  # a new episode from a reset state, a new trajectory
                    assert np.abs(obs[i, k]).max() <= 0.05 and ids[i, k] != prev[2]
                else:
                    assert np.array_equal(obs[i, k], prev[0]) and ids[i, k] == prev[2]
        last = [(nxt[i, -1], bool(done[i, -1]), ids[i, -1]) for i in range(N)]
        ends += int(done.sum())
    return ends


def logits_then_argmax() -> TensorDictSequential:
    torch.manual_seed(0)
    net = TensorDictModule(nn.Linear(4, 2), in_keys=["observation"], out_keys=["logits"])
    pick = TensorDictModule(lambda logits: logits.argmax(-1), in_keys=["logits"], out_keys=["action"])
    return TensorDictSequential(net, pick)


def policy(kind: str) -> Any:
    return None if kind == "random" else logits_then_argmax()


async def collect(env_fn: Any, kind: str, *, batches: int = 3, seed: int = 5) -> list[TensorDictBase]:
    with anyio.fail_after(60):
        async with Collector(
            env_fn, policy(kind), frames_per_batch=N * 40, total_frames=N * 40 * batches, seed=seed
        ) as collector:
            return [b.clone() async for b in collector]


@pytest.mark.parametrize("kind", ["random", "policy"])
async def test_every_frame_is_a_transition_and_each_env_has_its_frames(kind: str) -> None:
    calls: list[PoolCalls] = []
    batches = await collect(lambda: cartpole_pool(calls=calls), kind)
    assert all(b.batch_size == (N, 40) for b in batches)
    assert check_frames(batches) > 10
    (recorder,) = calls
    tail = [ids for ids in recorder.ids if ids is not None]
    assert any(len(ids) < N for ids in tail)  # envs short of frames were stepped alone
    if kind == "policy":  # the policy's outputs are those of their frames
        net = logits_then_argmax()[0].module
        for b in batches:
            expected = net(b["observation"])
            torch.testing.assert_close(b["logits"], expected.detach(), atol=1e-6, rtol=1e-5)
            assert torch.equal(b["action"], b["logits"].argmax(-1))


@pytest.mark.parametrize("kind", ["random", "policy"])
async def test_the_per_step_path_and_reversed_env_ids_give_the_same_batches(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fused = await collect(cartpole_pool, kind)
    reversed_ids = await collect(lambda: cartpole_pool(reverse=True), kind)
    monkeypatch.setattr(ArrayEnv, "fused_gym", property(lambda self: None))
    general = await collect(cartpole_pool, kind)
    for a, b, c in zip(fused, reversed_ids, general, strict=True):
        for key in c.keys(True, True):
            assert torch.equal(a[key], c[key]), key
            assert torch.equal(b[key], c[key]), key


async def test_seeded_runs_are_equal() -> None:
    a, b = await collect(cartpole_pool, "random"), await collect(cartpole_pool, "random")
    other = await collect(lambda: cartpole_pool(seed=6), "random", seed=6)
    for x, y, z in zip(a, b, other, strict=True):
        assert all(torch.equal(x[k], y[k]) for k in x.keys(True, True))
        assert not torch.equal(x["action"], z["action"])


class StopAfter(PoolCalls):
    """Sets ``event`` at the pool's ``calls``-th step (a collector asked to stop mid-batch)."""

    def __init__(self, pool: Any, calls: int, event: threading.Event) -> None:
        super().__init__(pool)
        self.calls, self.event = calls, event

    def __call__(self, action: Any, env_id: Any = None) -> Any:
        if len(self.ids) + 1 == self.calls:
            self.event.set()
        return super().__call__(action, env_id)


def test_a_stop_mid_batch_gives_every_env_as_many_frames_as_the_furthest() -> None:
    """Stopped after 30 full steps, the envs behind are stepped alone up to the furthest one's frames;
    the next batch goes on from there."""
    envpool = pytest.importorskip("envpool")
    pool = envpool.make_gymnasium("CartPole-v1", num_envs=N, seed=1)
    stop = threading.Event()
    StopAfter(pool, 30, stop)
    rollout = Collector(GymEnv(pool), frames_per_batch=N * 40, seed=1)._rollout
    first = rollout.collect(stop=stop)
    assert 20 < first.steps <= 30  # the furthest env's frames in 30 steps
    ids = first.batch["collector", "traj_ids"]
    assert (ids[:, : first.steps] >= 0).all() and (ids[:, first.steps :] == -1).all()
    stop.clear()
    second = rollout.collect()
    assert check_frames([first.batch[:, : first.steps].clone(), second.batch.clone()]) > 0


class FailAt(PoolCalls):
    """Raises at the pool's ``calls``-th step (an env fault mid-batch)."""

    def __init__(self, pool: Any, calls: int) -> None:
        super().__init__(pool)
        self.calls = calls

    def __call__(self, action: Any, env_id: Any = None) -> Any:
        if len(self.ids) + 1 == self.calls:
            raise RuntimeError("the pool failed")
        return super().__call__(action, env_id)


async def test_a_restart_mid_batch_keeps_every_frame_a_transition() -> None:
    """Under a RestartPolicy a pool is stepped per step (its fused loop writes its frames at the batch's
    end): the frames before the fault are kept, the rebuilt pool's frames follow."""
    from aiocollect import RestartPolicy

    envpool = pytest.importorskip("envpool")
    made: list[Any] = []

    def factory() -> GymEnv:
        pool = envpool.make_gymnasium("CartPole-v1", num_envs=N, seed=5)
        if not made:
            FailAt(pool, 50)
        made.append(pool)
        return GymEnv(pool)

    with anyio.fail_after(60):
        async with Collector(
            factory,
            frames_per_batch=N * 40,
            total_frames=N * 40 * 3,
            seed=5,
            restart=RestartPolicy(backoff=0.0),
        ) as collector:
            batches = [b.clone() async for b in collector]
    assert len(made) == 2
    assert check_frames(batches) > 10


async def test_box_actions_of_a_pendulum_pool_give_the_per_step_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Random actions of a Box space (``[N, 1]`` per step) picked per env as a Discrete one's are."""
    envpool = pytest.importorskip("envpool")

    def pendulums() -> GymEnv:  # short episodes: truncations inside the batches
        return GymEnv(envpool.make_gymnasium("Pendulum-v1", num_envs=N, seed=5, max_episode_steps=23))

    fused = await collect(pendulums, "random")
    monkeypatch.setattr(ArrayEnv, "fused_gym", property(lambda self: None))
    general = await collect(pendulums, "random")
    assert sum(int(b["next", "truncated"].sum()) for b in fused) > 5
    for a, b in zip(fused, general, strict=True):
        for key in b.keys(True, True):
            assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("kind", ["random", "policy"])
async def test_a_plain_pool_called_past_envpools_python_layer_gives_the_per_step_batches(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unwrapped pool is stepped by its C++ ``_send``/``_recv`` (``_pool_io``): the same batches as the
    per-step path, which steps it by ``pool.step``; a wrapped ``step`` is called as it is."""
    envpool = pytest.importorskip("envpool")
    from aiocollect._envs._pool_io import PoolIO, pool_io

    def plain() -> GymEnv:
        return GymEnv(envpool.make_gymnasium("CartPole-v1", num_envs=N, seed=5))

    probe, recorded = plain(), cartpole_pool()
    assert type(pool_io(probe._env)) is not PoolIO  # the direct calls, not the fallback
    assert type(pool_io(recorded._env)) is PoolIO  # a recorded step: the public calls
    probe.close()
    recorded.close()
    fused = await collect(plain, kind)
    assert check_frames(fused) > 10
    monkeypatch.setattr(ArrayEnv, "fused_gym", property(lambda self: None))
    general = await collect(plain, kind)
    for a, b in zip(fused, general, strict=True):
        for key in b.keys(True, True):
            assert torch.equal(a[key], b[key]), key
