"""The rollout's fused loop for a GymEnv of one observation array (``GymEnv._run_steps``), the trajectory
ids worked out once per batch, random actions checked once per batch, and the rollout thread's doorbell.

Each fast path is compared with the general per-step path (``ArrayEnv.fused_gym`` forced to ``None``):
the batches must be the same bit for bit.
"""

from __future__ import annotations

import threading
from typing import Any

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn

from aiocollect import Collector, GymEnv
from aiocollect._envs._adapter import ArrayEnv
from aiocollect._rollout._thread import Doorbell

pytestmark = pytest.mark.anyio


class Argmax(nn.Module):
    def __init__(self, n_obs: int = 4, n_act: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(n_obs, n_act)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).argmax(-1)


class Tanh(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(3, 1)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return 2 * torch.tanh(self.net(observation))


def policy_for(kind: str, env_id: str) -> Any:
    if kind == "random":
        return None
    module = Argmax() if env_id == "CartPole-v1" else Tanh()
    if kind == "module":
        return module
    return TensorDictModule(module, in_keys=["observation"], out_keys=["action"])


async def collect(env_id: str, num_envs: int | None, kind: str, **kwargs: Any) -> list[TensorDictBase]:
    """Six seeded batches (the first two random) and the number of episodes."""
    fpb = 60  # 60 steps of one env, 20 of three
    batches = []
    async with Collector(
        lambda: GymEnv(env_id, num_envs=num_envs),
        policy_for(kind, env_id),
        frames_per_batch=fpb,
        total_frames=6 * fpb,
        seed=7,
        init_random_frames=2 * fpb,
        **kwargs,
    ) as collector:
        async for batch in collector:
            batches.append(batch.clone())
        batches.append(collector.statistics().episodes)  # type: ignore[arg-type]
    return batches


def assert_same(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if not isinstance(x, TensorDictBase):
            assert x == y
            continue
        assert set(x.keys(True, True)) == set(y.keys(True, True))
        for key in x.keys(True, True):
            assert x[key].dtype == y[key].dtype, key
            assert torch.equal(x[key], y[key]), key


def count_fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that gets one entry per call of the fused loop (``GymEnv._run_steps``)."""
    calls: list[int] = []
    run_steps = GymEnv._run_steps

    def counted(self: GymEnv, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return run_steps(self, *args, **kwargs)

    monkeypatch.setattr(GymEnv, "_run_steps", counted)
    return calls


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
@pytest.mark.parametrize("num_envs", [None, 3])
@pytest.mark.parametrize("kind", ["random", "module", "tdmodule"])
async def test_fused_loop_gives_the_per_step_batches(
    env_id: str, num_envs: int | None, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = count_fused_calls(monkeypatch)
    with anyio.fail_after(60):
        fused = await collect(env_id, num_envs, kind)
        assert calls  # the fused loop ran
        monkeypatch.setattr(ArrayEnv, "fused_gym", property(lambda self: None))
        calls.clear()
        general = await collect(env_id, num_envs, kind)
        assert not calls
    assert_same(fused, general)
    if env_id == "CartPole-v1":  # Pendulum's episodes last 200 steps
        ends = sum(int(b["next", "done"].sum()) for b in fused[:-1])
        assert ends > 0  # episodes ended inside batches: resets and new trajectory ids were exercised


async def test_trajectory_ids_follow_episode_ends_in_step_then_env_order() -> None:
    """Ids are handed out at each episode end in step order, then env order, ``stride`` apart."""
    async with Collector(
        lambda: GymEnv("CartPole-v1", num_envs=4),
        frames_per_batch=4 * 50,
        total_frames=4 * 100,
        traj_id_start=10,
        traj_id_stride=3,
        seed=0,
    ) as collector:
        batches = [b.clone() async for b in collector]
    expected = np.arange(10, 22, 3).reshape(4)  # the first trajectory of each env
    next_id = 10 + 3 * 4
    for batch in batches:
        ids = batch["collector", "traj_ids"].numpy()
        done = batch["next", "done"][..., 0].numpy()
        for t in range(ids.shape[1]):
            np.testing.assert_array_equal(ids[:, t], expected)
            for env in np.nonzero(done[:, t])[0]:  # env order within a step
                expected[env] = next_id
                next_id += 3


async def test_random_actions_are_checked_once_per_batch_and_still_valid() -> None:
    """A random batch over a MultiDiscrete space: converted once per batch, every action in the space."""
    space = gym.spaces.MultiDiscrete([3, 5])

    class Env(gym.Env):
        observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
        action_space = space

        def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
            super().reset(seed=seed)
            self.t = 0
            return np.zeros(2, np.float32), {}

        def step(self, action: Any) -> Any:
            assert self.action_space.contains(action), action
            self.t += 1
            return np.full(2, self.t / 100, np.float32), 1.0, False, self.t >= 9, {}

    async with Collector(lambda: GymEnv(Env()), frames_per_batch=40, total_frames=80, seed=1) as c:
        async for batch in c:
            actions = batch["action"].numpy()
            assert ((actions >= 0) & (actions < space.nvec)).all()


async def test_a_policy_action_outside_the_space_still_raises_in_the_fused_loop() -> None:
    class Bad(nn.Module):
        def forward(self, observation: torch.Tensor) -> torch.Tensor:
            return torch.full(observation.shape[:-1], 2, dtype=torch.int64)

    collector = Collector(lambda: GymEnv("CartPole-v1", num_envs=2), Bad(), frames_per_batch=8)
    async with collector:
        with pytest.raises(ValueError, match="outside the action space"):
            await collector.__anext__()


class Env64(gym.Wrapper[Any, Any, Any, Any]):
    """Pendulum whose step records the action it is given."""

    def __init__(self, actions: list[Any]) -> None:
        super().__init__(gym.make("Pendulum-v1"))
        self.actions = actions

    def step(self, action: Any) -> Any:
        self.actions.append(action)
        return super().step(action)


@pytest.mark.parametrize("output", ["float64", "float32", "float16"])
async def test_a_float_box_action_reaches_the_env_as_the_per_step_path_gives_it(
    output: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused loop's own conversion of a float Box action (``GymEnv._policy_action``): the same
    arrays, dtypes and batches as ``GymEnv._leaf_action`` on the per-step path."""

    class Policy(nn.Module):
        def forward(self, observation: torch.Tensor) -> Any:
            return (2 * torch.tanh(observation[..., :1] * 1.7)).to(getattr(torch, output))

    async def run() -> tuple[list[Any], list[TensorDictBase]]:
        actions: list[Any] = []
        batches = []
        async with Collector(
            lambda: GymEnv(Env64(actions)), Policy(), frames_per_batch=30, total_frames=60, seed=3
        ) as c:
            async for batch in c:
                batches.append(batch.clone())
        return actions, batches

    calls = count_fused_calls(monkeypatch)
    with anyio.fail_after(60):
        fused_actions, fused = await run()
        assert calls  # the fused loop ran
        monkeypatch.setattr(ArrayEnv, "fused_gym", property(lambda self: None))
        general_actions, general = await run()
    assert_same(fused, general)
    assert len(fused_actions) == len(general_actions) == 60
    for a, b in zip(fused_actions, general_actions, strict=True):
        assert type(a) is type(b) is np.ndarray and a.dtype == b.dtype == np.float32
        assert np.array_equal(a, b)


@pytest.mark.parametrize("policy", [None, "module"])
async def test_a_gymenv_subclass_override_is_honoured(policy: str | None) -> None:
    """A GymEnv subclass that overrides a method the fused loop stands in for is stepped by the per-step
    path (found by test_events: a subclass whose ``_step_arrays`` raises was never called)."""
    calls = []

    class Watched(GymEnv):
        def _step_arrays(self, action: Any) -> Any:
            calls.append(1)
            return super()._step_arrays(action)

    module = Argmax() if policy else None
    collector = Collector(lambda: Watched("CartPole-v1", num_envs=2), module, frames_per_batch=8)
    async with collector:
        await collector.__anext__()
    assert len(calls) == 4  # every step of the batch went through the override


# -- the doorbell ----------------------------------------------------------------------------------
async def test_doorbell_keeps_a_ring_made_before_the_wait() -> None:
    bell = Doorbell()
    try:
        bell.ring()
        bell.ring()
        with anyio.fail_after(5):
            await bell.wait()  # both rings taken at once
        with anyio.move_on_after(0.05) as scope:
            await bell.wait()
        assert scope.cancelled_caught
    finally:
        bell.close()


async def test_doorbell_wakes_a_waiting_task_from_another_thread() -> None:
    bell = Doorbell()
    try:
        for _ in range(20):
            timer = threading.Timer(0.002, bell.ring)
            timer.start()
            with anyio.fail_after(5):
                await bell.wait()
            timer.join()
    finally:
        bell.close()


async def test_doorbell_keeps_a_ring_that_came_after_the_waiter_was_cancelled() -> None:
    bell = Doorbell()
    try:
        with anyio.move_on_after(0.02):
            await bell.wait()
        bell.ring()  # nobody waits now: kept for the next wait
        with anyio.fail_after(5):
            await bell.wait()
    finally:
        bell.close()


async def test_doorbell_wait_is_a_checkpoint_when_a_ring_is_there() -> None:
    """A task taking rings from a thread that always rang again must still yield: other tasks run, and a
    cancel scope ends its loop (the loop had spun, never yielding, in a CI run of start())."""
    bell = Doorbell()
    others = 0

    async def other() -> None:
        nonlocal others
        while True:
            others += 1
            await anyio.lowlevel.checkpoint()

    try:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(other)
                with anyio.move_on_after(0.1):
                    while True:
                        bell.ring()  # the thread rang again before this task took the last ring
                        await bell.wait()
                tg.cancel_scope.cancel()
        assert others > 10
    finally:
        bell.close()


async def test_doorbell_cancelled_at_its_checkpoint_keeps_the_ring() -> None:
    bell = Doorbell()
    try:
        bell.ring()
        with anyio.CancelScope() as scope:
            scope.cancel()
            await bell.wait()
        with anyio.fail_after(5):
            await bell.wait()  # the ring is still there
    finally:
        bell.close()


async def test_doorbell_ring_after_close_does_not_raise() -> None:
    bell = Doorbell()
    with anyio.move_on_after(0.01):
        await bell.wait()
    bell.close()
    bell.ring()  # a thread finishing its job after the collector closed: nothing to wake, no error


def test_doorbell_ring_to_a_loop_that_has_ended_does_not_raise() -> None:
    """A waiter's wake-up left behind by a loop that ended (its task never resumed) is dropped."""
    bell = Doorbell()

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(bell.wait)
            await anyio.wait_all_tasks_blocked()  # the waiter waits
            tg.cancel_scope.cancel()

    anyio.run(main)
    bell._wake = bell._wake or (lambda: (_ for _ in ()).throw(RuntimeError("Event loop is closed")))
    bell.ring()
    bell.close()


@pytest.mark.parametrize("named", [True, False])
def test_the_batch_tensordict_is_the_constructors(named: bool) -> None:
    """The batch is assembled level by level with ``TensorDict._new_unsafe``: the same keys, tensors,
    batch sizes and dim names as ``TensorDict(...)`` gives, nested keys included."""
    from tensordict import TensorDict

    from aiocollect._rollout._batch import nested_td

    bt = (3, 5)
    keys = ["observation", ("next", "observation"), ("next", "reward"), ("pixels", "left", "rgb"), "action"]
    tensors = {key: torch.zeros(*bt, 2) for key in keys}
    names = [None, "time"] if named else None
    fast = nested_td(tensors, bt, names)
    slow = TensorDict(tensors, batch_size=bt, names=names)
    assert type(fast) is type(slow)
    assert set(fast.keys(True)) == set(slow.keys(True))
    for key in fast.keys(True):
        a, b = fast.get(key), slow.get(key)
        if isinstance(b, torch.Tensor):
            assert a is b
        else:
            assert a.batch_size == b.batch_size and a.names == b.names and a.device == b.device
    assert fast.batch_size == slow.batch_size and fast.names == slow.names and fast.device == slow.device
    assert type(fast.batch_size) is torch.Size and type(fast["next"].batch_size) is torch.Size
    assert fast.reshape(-1).batch_size == (15,)


@pytest.mark.parametrize("num_envs", [None, 1, 3])  # 1: a vector env of one, its carry is [1], not []
def test_episode_statistics_and_ids_match_the_frames(num_envs: int | None) -> None:
    """Returns and lengths of the episodes that end in each batch (one env: its own short path) are the
    sums and counts of their frames, across batch borders; trajectory ids change exactly at ends."""
    collector = Collector(
        lambda: GymEnv("Pendulum-v1" if num_envs is None else "CartPole-v1", num_envs=num_envs),
        frames_per_batch=60 if num_envs is None else 3 * 37,
        seed=3,
    )
    rollout = collector._rollout
    if num_envs is None:  # Pendulum's episodes last 200 steps: several batches each, real rewards
        rollout.env.env.env._max_episode_steps = 70
    n = max(num_envs or 1, 1)
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    for _ in range(8):
        result = rollout.collect()
        batch = result.batch
        ids = batch["collector", "traj_ids"].reshape(n, -1).numpy()
        reward = batch["next", "reward"].reshape(n, -1).numpy().astype(np.float64)
        done = batch["next", "done"].reshape(n, -1).numpy()
        expected_returns, expected_lengths = [], []
        for env in range(n):
            for t in range(ids.shape[1]):
                i = int(ids[env, t])
                sums[i] = sums.get(i, 0.0) + float(reward[env, t])
                counts[i] = counts.get(i, 0) + 1
                if done[env, t]:
                    expected_returns.append(sums[i])
                    expected_lengths.append(counts[i])
                    if t + 1 < ids.shape[1]:
                        assert ids[env, t + 1] != i
                elif t + 1 < ids.shape[1]:
                    assert ids[env, t + 1] == i
        assert result.episode_lengths == expected_lengths
        np.testing.assert_allclose(result.episode_returns, expected_returns, rtol=1e-9)
    assert len(counts) > n  # episodes ended


def envpool_cartpole(shuffled: bool = False) -> GymEnv:
    """An EnvPool CartPole of 5 envs; ``shuffled``: its steps report the envs in reverse order (with
    ``info["env_id"]`` saying so), as a pool may, which the rollout puts back in env order."""
    envpool = pytest.importorskip("envpool")
    pool = envpool.make_gymnasium("CartPole-v1", num_envs=5, seed=3)  # the collector's seed: kept as is
    if shuffled:
        step = pool.step

        def reversed_step(action: Any, env_id: Any = None) -> Any:
            obs, reward, terminated, truncated, info = step(action, env_id)
            back = slice(None, None, -1)
            info = {**info, "env_id": info["env_id"][back]}
            return obs[back], reward[back], terminated[back], truncated[back], info

        pool.step = reversed_step
    return GymEnv(pool)


@pytest.mark.envpool  # nox -s realenvs
@pytest.mark.filterwarnings("ignore::UserWarning")  # EnvPool's spaces warn about float64 bounds
@pytest.mark.parametrize("kind", ["random", "tdmodule"])
async def test_envpool_fused_loop_gives_the_per_step_batches(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EnvPool's fused loop (the pool resets ended envs itself, each env fills its frames at its own
    pace: ``PoolFrames``) gives the per-step path's batches, and a pool reporting its envs out of order
    the same."""

    async def run(shuffled: bool = False) -> list[Any]:
        batches: list[Any] = []
        async with Collector(
            lambda: envpool_cartpole(shuffled),
            policy_for(kind, "CartPole-v1"),
            frames_per_batch=5 * 30,
            total_frames=5 * 30 * 4,
            init_random_frames=5 * 30,
            seed=3,
        ) as collector:
            batches += [b.clone() async for b in collector]
            batches.append(collector.statistics().episodes)
        return batches

    calls = count_fused_calls(monkeypatch)
    with anyio.fail_after(60):
        fused = await run()
        assert calls  # the fused loop ran
        shuffled = await run(shuffled=True)
        monkeypatch.setattr(ArrayEnv, "fused_gym", property(lambda self: None))
        calls.clear()
        general = await run()
        assert not calls
    assert_same(fused, general)
    assert_same(shuffled, general)
    assert sum(int(b["next", "done"].sum()) for b in fused[:-1]) > 5  # partial resets were exercised


@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 4)])
def test_trajectory_ids_are_those_a_per_step_loop_hands_out(shape: tuple[int, ...]) -> None:
    """The vectorised trajectory ids against the per-step rule: a frame has its env's id when the step
    began; after an episode end the env takes the next id, handed out in step order, then env order."""
    from aiocollect._rollout._batch import trajectory_ids

    rng = np.random.default_rng(0)
    for steps in (1, 2, 9, 40):
        for p in (0.0, 0.1, 0.6):
            done = rng.random((*shape, steps)) < p
            ids = rng.integers(0, 100, shape).astype(np.int64)
            start, stride = 1000, 3
            flat_done = done.reshape(-1, steps)
            expected = np.empty(flat_done.shape, dtype=np.int64)
            running, nxt = ids.reshape(-1).copy(), start
            for t in range(steps):
                expected[:, t] = running
                for i in np.flatnonzero(flat_done[:, t]):
                    running[i], nxt = nxt, nxt + stride
            wide = np.full(
                (*shape, steps + 2), -7, dtype=np.int64
            )  # a view short of the time dim, as a stop leaves
            after, next_id = trajectory_ids(wide[..., :steps], done, ids, start, stride)
            assert np.array_equal(wide[..., :steps].reshape(-1, steps), expected)
            assert (wide[..., steps:] == -7).all()
            assert np.array_equal(after.reshape(-1), running) and after.shape == ids.shape
            assert next_id == nxt
