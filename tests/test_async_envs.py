"""``AsyncEnvCollector`` and the async env protocol: data invariants per env, dynamic batching, async and
torch policies, weights, errors, drop mode, cancellation, budgets and ``split_trajs``."""

from __future__ import annotations

import random
import threading
import traceback

import anyio
import anyio.lowlevel
import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from tensordict import TensorDictBase
from torch import nn

from aiocollect import (
    AsyncEnvCollector,
    AsyncEnvProtocol,
    Collector,
    GymEnv,
    ThreadedAsyncEnv,
    WorkerFailed,
)
from support import Timing, take

pytestmark = pytest.mark.anyio


class Boom(Exception):
    """An env's own error type."""


class Counter:
    """An async env whose observation says where it is: ``[env_id, episode, step]``.

    Episodes of env ``i`` terminate after ``3 + i % 5`` steps (every third one is truncated instead); the
    reward is the action taken. Each step awaits a random delay (a network call), so envs run at different
    rates. ``fail_at``: the global step at which ``step`` raises :class:`Boom`.
    """

    observation_space = spaces.Box(0, 10**6, (3,), np.float32)
    action_space = spaces.Discrete(4)

    def __init__(self, env_id: int, *, delay: float = 0.002, fail_at: int | None = None) -> None:
        self.env_id = env_id
        self.delay = delay
        self.fail_at = fail_at
        self.rng = random.Random(env_id)
        self.episode = -1
        self.t = 0
        self.steps = 0
        self.stepping = 0
        self.closed = False
        self.seeds: list[int | None] = []

    def _obs(self) -> np.ndarray:
        return np.array([self.env_id, self.episode, self.t], np.float32)

    async def reset(self, *, seed=None, options=None):
        self.seeds.append(seed)
        self.episode += 1
        self.t = 0
        await anyio.sleep(self.rng.random() * self.delay)
        return self._obs(), {}

    async def step(self, action):
        assert isinstance(action, int)
        self.stepping += 1
        try:
            await anyio.sleep(self.rng.random() * self.delay)
            if self.fail_at is not None and self.steps == self.fail_at:
                raise Boom(f"env {self.env_id} broke")
        finally:
            self.stepping -= 1
        self.steps += 1
        self.t += 1
        length = 3 + self.env_id % 5
        end = self.t >= length
        truncated = end and self.episode % 3 == 2
        return self._obs(), float(action), end and not truncated, truncated, {}

    async def close(self):
        self.closed = True


class StepPolicy(nn.Module):
    """Action = the step counter mod 4 (so the reward tells which action the env got)."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.zeros(()))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return (observation[..., 2].long() + self.offset.long()) % 4


def make_envs(n: int, **kwargs) -> tuple[list[Counter], list]:
    envs = [Counter(i, **kwargs) for i in range(n)]
    return envs, [lambda env=env: env for env in envs]


def check_invariants(batches: list[TensorDictBase], num_envs: int) -> None:
    """Per env: frames in order with none lost or repeated, next obs = following obs unless done, the
    trajectory id changes exactly after done, the reward is the action taken."""
    data = torch.cat(batches)
    env_id = data["collector", "env_id"]
    assert torch.equal(data["observation"][:, 0].long(), env_id)
    assert torch.equal(data["next", "reward"][:, 0], data["action"].float())
    assert not data["done"].any() and not data["terminated"].any()
    done = data["next", "done"][:, 0]
    assert torch.equal(done, data["next", "terminated"][:, 0] | data["next", "truncated"][:, 0])
    all_ids: set[int] = set()
    for e in range(num_envs):
        rows = data[env_id == e]
        obs, nxt, ids, d = (
            rows["observation"],
            rows["next", "observation"],
            rows["collector", "traj_ids"],
            rows["next", "done"][:, 0],
        )
        assert len(rows) > 0
        assert obs[0].tolist() == [e, 0, 0]  # the first frame is the first step
        # every step of every episode, in order: (episode, t) goes up by one step or to the next episode
        for k in range(len(rows) - 1):
            if d[k]:
                assert obs[k + 1].tolist() == [e, obs[k, 1] + 1, 0]
                assert ids[k + 1] != ids[k]
            else:
                assert torch.equal(nxt[k], obs[k + 1])
                assert ids[k + 1] == ids[k]
        assert torch.equal(nxt[:, 2], obs[:, 2] + 1)
        traj = set(ids.tolist())
        assert not traj & all_ids  # trajectory ids are unique across envs
        all_ids |= traj


# -- the protocol -------------------------------------------------------------------------------------
async def test_protocol_and_threaded_env() -> None:
    assert isinstance(Counter(0), AsyncEnvProtocol)
    env = ThreadedAsyncEnv(lambda: gym.make("CartPole-v1"))
    assert isinstance(env, AsyncEnvProtocol)
    loop_thread = threading.get_ident()
    seen: list[int] = []
    inner = env.env.unwrapped
    original = inner.step

    def step(action):
        seen.append(threading.get_ident())
        return original(action)

    inner.step = step
    obs, _ = await env.reset(seed=0)
    obs2, reward, *_ = await env.step(1)
    await env.close()
    await env.close()  # idempotent
    assert obs.shape == obs2.shape == (4,) and reward == 1.0
    assert seen and loop_thread not in seen  # stepped off the loop
    with pytest.raises(TypeError, match="gymnasium env"):
        ThreadedAsyncEnv(object())
    from gymnasium.envs.classic_control import CartPoleEnv

    env = ThreadedAsyncEnv(CartPoleEnv)  # a class is a factory
    assert isinstance(env.env, CartPoleEnv)
    await env.close()


# -- data ---------------------------------------------------------------------------------------------
async def test_batches_keep_every_frame_in_order() -> None:
    envs, fns = make_envs(12)
    async with AsyncEnvCollector(
        fns, StepPolicy(), frames_per_batch=60, total_frames=600, min_batch=4, seed=5
    ) as c:
        batches = await take(c)
        stats = c.statistics()
    assert len(batches) == 10 and all(b.batch_size == torch.Size([60]) for b in batches)
    check_invariants(batches, 12)
    keys = set(batches[0].keys(include_nested=True, leaves_only=True))
    assert keys == {
        "observation",
        "action",
        "done",
        "terminated",
        "truncated",
        ("next", "observation"),
        ("next", "reward"),
        ("next", "done"),
        ("next", "terminated"),
        ("next", "truncated"),
        ("collector", "traj_ids"),
        ("collector", "env_id"),
    }
    assert batches[0]["action"].dtype == torch.int64 and batches[0]["observation"].dtype == torch.float32
    assert stats.frames == 600 and stats.episodes > 0 and len(stats.workers) == 12
    assert [e.seeds[0] for e in envs] == [5 + i for i in range(12)]
    assert all(e.closed for e in envs)


class Laggard(Counter):
    """Env 0 steps 20 times slower than the others: its frames land batches after their policy call."""

    def __init__(self, env_id: int) -> None:
        super().__init__(env_id, delay=0.04 if env_id == 0 else 0.002)


async def test_a_slow_env_s_frames_keep_their_own_call_and_every_episode_counts() -> None:
    envs = [Laggard(i) for i in range(16)]
    async with AsyncEnvCollector(
        [lambda env=env: env for env in envs],
        StepPolicy(),
        frames_per_batch=40,
        total_frames=800,
        min_batch=4,
    ) as c:
        batches = await take(c)
        stats = c.statistics()
    check_invariants(batches, 16)  # the observation and action of each frame are its own call's
    frames_of = torch.bincount(torch.cat(batches)["collector", "env_id"], minlength=16)
    assert 0 < frames_of[0] < frames_of[1:].min()  # env 0 lagged: its calls stayed open over batches
    # an episode ending on a batch's last frame counts too: as many episodes as frames with done
    assert stats.episodes == int(torch.cat(batches)["next", "done"].sum())
    assert stats.frames == 800 and sum(w.frames for w in stats.workers) == 800


async def test_same_keys_as_collector() -> None:
    async with AsyncEnvCollector(
        [lambda: gym.make("CartPole-v1")] * 2, frames_per_batch=20, total_frames=20
    ) as c:
        (batch,) = await take(c)
    async with Collector(lambda: GymEnv("CartPole-v1"), frames_per_batch=20, total_frames=20) as c:
        (reference,) = await take(c)
    ours = {k: v.dtype for k, v in batch.items(include_nested=True, leaves_only=True)}
    theirs = {k: v.dtype for k, v in reference.items(include_nested=True, leaves_only=True)}
    assert ours.pop(("collector", "env_id")) == torch.int64
    assert ours == theirs
    for key in theirs:
        assert batch.get(key).shape[1:] == reference.get(key).shape[1:], key


async def test_total_frames_max_frames_per_traj_and_split_trajs() -> None:
    _, fns = make_envs(4)
    with pytest.warns(UserWarning, match="not a multiple"):
        collector = AsyncEnvCollector(fns, frames_per_batch=16, total_frames=40, max_frames_per_traj=2)
    assert len(collector) == 3
    async with collector:
        batches = await take(collector)
    assert [len(b) for b in batches] == [16, 16, 16]
    data = torch.cat(batches)
    assert int(data["observation"][:, 2].max()) <= 1  # no episode went past 2 steps
    assert data["next", "truncated"][data["next", "observation"][:, 2] == 2].all()

    _, fns = make_envs(4)
    async with AsyncEnvCollector(fns, frames_per_batch=32, total_frames=32, split_trajs=True) as c:
        (split,) = await take(c)
    mask = split["collector", "mask"]
    assert split.batch_dims == 2 and int(mask.sum()) == 32
    for row, m in zip(split, mask, strict=True):
        ids = row["collector", "traj_ids"][m]
        assert ids.unique().numel() == 1
        steps = row["observation"][m][:, 2]
        assert torch.equal(steps, steps[0] + torch.arange(len(steps)))


async def test_gymnasium_envs_are_wrapped() -> None:
    async with AsyncEnvCollector(
        [lambda: gym.make("CartPole-v1")] * 3, frames_per_batch=300, total_frames=300, seed=0
    ) as c:
        (batch,) = await take(c)
        assert all(isinstance(env, ThreadedAsyncEnv) for env in c.envs)
        stats = c.statistics()
    assert bool((batch["next", "reward"] == 1).all()) and stats.episodes > 0


# -- dynamic batching ---------------------------------------------------------------------------------
class Stuck(Counter):
    """Never returns from its first step (until cancelled)."""

    async def step(self, action):
        await anyio.sleep_forever()


async def test_min_batch_and_max_wait(timing: Timing) -> None:
    _, fns = make_envs(8, delay=0.0)
    async with AsyncEnvCollector(fns, frames_per_batch=64, total_frames=128, min_batch=8, max_wait=60) as c:
        await take(c)
        sizes = c.policy_batch_sizes
    assert set(sizes) == {8}  # every env was waited for

    # one env never comes back: min_batch is never reached, and max_wait lets the others go on
    _, fns = make_envs(7, delay=0.0)
    fns.append(lambda: Stuck(7))
    calls: list[tuple[int, float]] = []

    async def policy(td):
        calls.append((td.shape[0], anyio.current_time()))
        td["action"] = td["observation"][:, 2].long() % 4
        return td

    # max_wait long enough that the 8 envs' resets (on this loop, at once) meet in the first call on a busy
    # machine too
    async with AsyncEnvCollector(fns, policy, frames_per_batch=14, min_batch=8, max_wait=0.5) as c:
        batches = await take(c, 2)  # the stuck env holds no batch back
        sizes = c.policy_batch_sizes
    assert sizes[0] == 8 and max(sizes[1:]) == 7  # the first call had the stuck env's first step
    gaps = np.diff([t for _, t in calls[1:]])
    # a call with fewer than min_batch envs waited about max_wait (a speed figure: never less, by design)
    timing.share(float(np.median(gaps)), above=0.375, what="the median gap between calls (max_wait 0.5 s)")
    assert 7 not in torch.cat(batches)["collector", "env_id"].tolist()


# -- policies and weights -----------------------------------------------------------------------------
async def test_async_policy() -> None:
    seen = []

    class Client:
        async def __call__(self, td):
            await anyio.sleep(0.001)  # a round trip to a policy server
            return self.answer(td)

    class Remote(Client):  # an inherited async __call__ makes an async policy too
        def answer(self, td):
            seen.append(td.shape[0])
            td["action"] = td["observation"][:, 2].long() % 4
            td["value"] = torch.zeros(td.shape[0], 1)
            return td

    _, fns = make_envs(6)
    async with AsyncEnvCollector(fns, Remote(), frames_per_batch=30, total_frames=90) as c:
        batches = await take(c)
        with pytest.raises(TypeError, match="async policy"):
            await c.update_weights()
    check_invariants(batches, 6)
    assert batches[0]["value"].shape == (30, 1) and sum(seen) >= 90


async def test_update_weights_between_policy_calls() -> None:
    policy = StepPolicy()
    _, fns = make_envs(5, delay=0.0005)
    async with AsyncEnvCollector(fns, policy, frames_per_batch=25, track_policy_version=True) as c:
        assert c.policy is not policy  # its own copy
        first = (await take(c, 1))[0]
        with torch.no_grad():
            policy.offset.fill_(1)
        assert await c.update_weights(policy) == 1
        later = await take(c, 3)
    assert (first["collector", "policy_version"] == 0).all()
    data = torch.cat(later)
    version = data["collector", "policy_version"]
    assert (version == 1).any()
    expected = (data["observation"][:, 2].long() + version) % 4  # version 1 = offset 1
    assert torch.equal(data["action"], expected)


async def test_tensordict_module_policy() -> None:
    from tensordict.nn import TensorDictModule

    module = TensorDictModule(StepPolicy(), in_keys=["observation"], out_keys=["action"])
    _, fns = make_envs(4)
    async with AsyncEnvCollector(fns, module, frames_per_batch=40, total_frames=80) as c:
        batches = await take(c)
    check_invariants(batches, 4)


# -- errors -------------------------------------------------------------------------------------------
async def test_env_error_ends_the_collector_with_its_type() -> None:
    envs, fns = make_envs(6)
    envs[3].fail_at = 4
    async with AsyncEnvCollector(fns, frames_per_batch=12) as c:
        with pytest.raises(Boom, match="env 3 broke") as info:
            await take(c)
        assert c.closed and c.statistics().workers[0].state == "failed"
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "step" in frames  # the env's own traceback
    assert all(e.closed and not e.stepping for e in envs)


async def test_drop_mode_goes_on_without_the_env() -> None:
    envs, fns = make_envs(6)
    envs[2].fail_at = 3
    collector = AsyncEnvCollector(fns, frames_per_batch=30, total_frames=150, on_env_error="drop")
    async with collector as c, c.events() as events:
        batches = await take(c)
        stats = c.statistics()
        failed = []
        with anyio.move_on_after(1):
            async for event in events:
                if isinstance(event, WorkerFailed):
                    failed.append(event)
                    break
    assert failed and failed[0].worker_id == 2 and "Boom" in failed[0].error
    assert envs[2].closed and stats.workers[2].state == "failed"
    data = torch.cat(batches)
    assert len(data) == 150
    assert (data["collector", "env_id"] == 2).sum() == 3  # its steps before the failed one
    check_invariants(batches, 6)

    envs, fns = make_envs(2)
    for env in envs:
        env.fail_at = 1
    async with AsyncEnvCollector(fns, frames_per_batch=10, on_env_error="drop") as c:
        with pytest.raises(RuntimeError, match="every env was dropped") as info:
            await take(c)
    assert isinstance(info.value.__cause__, Boom)


class BadShape(Counter):
    """Its fourth step returns an observation of the wrong shape."""

    async def step(self, action):
        obs, reward, terminated, truncated, info = await super().step(action)
        return (np.zeros(5, np.float32) if self.steps == 4 else obs), reward, terminated, truncated, info


async def test_drop_mode_an_observation_that_does_not_fit_leaves_no_half_frame() -> None:
    envs, fns = make_envs(5)
    envs[1] = BadShape(1)
    fns[1] = lambda: envs[1]
    async with AsyncEnvCollector(
        fns, StepPolicy(), frames_per_batch=20, total_frames=100, on_env_error="drop"
    ) as c:
        batches = await take(c)
        stats = c.statistics()
    assert stats.workers[1].state == "failed" and envs[1].closed
    data = torch.cat(batches)
    assert len(data) == 100 and (data["collector", "env_id"] == 1).sum() == 3
    check_invariants(batches, 5)


async def test_policy_error_and_bad_actions() -> None:
    def wrong(td):
        td["action"] = torch.full(td.shape, 9)
        return td

    _, fns = make_envs(3)
    async with AsyncEnvCollector(fns, wrong, frames_per_batch=9) as c:
        with pytest.raises(ValueError, match="outside the action space"):
            await take(c)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"frames_per_batch": 0}, ValueError, "frames_per_batch"),
        ({"min_batch": 0}, ValueError, "min_batch"),
        ({"max_wait": -1}, ValueError, "max_wait"),
        ({"max_wait": "1"}, TypeError, "max_wait"),
        ({"on_env_error": "ignore"}, ValueError, "on_env_error"),
        ({"total_frames": 0}, ValueError, "total_frames"),
        ({"prefetch": -1}, ValueError, "prefetch"),
        ({"policy": 3}, TypeError, "policy"),
    ],
)
async def test_arguments_are_checked_first(kwargs, error, match) -> None:
    built = []
    kwargs = {"frames_per_batch": 10, **kwargs}
    with pytest.raises(error, match=match):
        AsyncEnvCollector([lambda: built.append(1)], **kwargs)
    assert not built
    with pytest.raises(TypeError, match="env_fns"):
        AsyncEnvCollector([], frames_per_batch=10)
    with pytest.warns(UserWarning, match="the others wait"):
        AsyncEnvCollector([lambda: built.append(1)] * 30, frames_per_batch=10)


async def test_a_gym_env_wrapper_is_refused_with_its_fix() -> None:
    """A ``GymEnv`` (TensorDict reset/step) is not a gymnasium env: named, closed, and the fix given."""
    env = GymEnv("CartPole-v1")
    closed = []
    env.close = lambda: closed.append(True)
    with pytest.raises(TypeError, match=r"env_fns\[0\] gave GymEnv.*gymnasium.make"):
        async with AsyncEnvCollector([lambda: env], frames_per_batch=10):
            pass
    assert closed


async def test_mismatched_spaces_are_refused_and_closed() -> None:
    envs = [Counter(0), gym.make("CartPole-v1")]
    with pytest.raises(ValueError, match=r"env_fns\[1\]"):
        async with AsyncEnvCollector([lambda e=e: e for e in envs], frames_per_batch=10):
            pass
    assert envs[0].closed


# -- cancellation and clean-up ------------------------------------------------------------------------
async def test_cancelled_consumer_leaves_nothing_running() -> None:
    envs, fns = make_envs(20, delay=0.01)
    before = {t.ident for t in threading.enumerate()}
    async with AsyncEnvCollector(fns, StepPolicy(), frames_per_batch=10_000) as c:
        with anyio.move_on_after(0.1) as scope:
            await take(c)
        assert scope.cancelled_caught
        assert any(e.steps for e in envs)
    assert all(e.closed and not e.stepping for e in envs)
    # the policy thread was joined on exit (and the steps' worker threads are anyio's idle pool)
    assert not [t.name for t in threading.enumerate() if "aiocollect" in t.name and t.ident not in before]


async def test_pause_stops_new_steps() -> None:
    envs, fns = make_envs(4, delay=0.001)
    async with AsyncEnvCollector(fns, frames_per_batch=8) as c:
        await take(c, 1)
        async with c.pause():
            steps = [e.steps for e in envs]
            assert not any(e.stepping for e in envs)
            await anyio.sleep(0.02)  # a window for a step that must not come
            assert [e.steps for e in envs] == steps
        await take(c, 1)


class Reach:
    """Dict observations, a Box action: the multi-key path."""

    observation_space = spaces.Dict(
        {"pos": spaces.Box(-100, 100, (2,), np.float32), "t": spaces.Discrete(50)}
    )
    action_space = spaces.Box(-1, 1, (2,), np.float32)

    async def reset(self, *, seed=None, options=None):
        self.pos, self.t = np.zeros(2, np.float32), 0
        return {"pos": self.pos, "t": self.t}, {}

    async def step(self, action):
        assert action.shape == (2,) and action.dtype == np.float32
        await anyio.lowlevel.checkpoint()
        self.pos, self.t = self.pos + action, self.t + 1
        return {"pos": self.pos, "t": self.t}, 0.0, False, self.t == 5, {}

    async def close(self):
        pass


async def test_dict_observations_and_box_actions() -> None:
    async with AsyncEnvCollector([Reach] * 3, frames_per_batch=30, total_frames=30) as c:
        (batch,) = await take(c)
    assert batch["pos"].shape == (30, 2) and batch["t"].dtype == torch.int64
    assert batch["action"].shape == (30, 2) and batch["action"].dtype == torch.float32
    for e in range(3):
        rows = batch[batch["collector", "env_id"] == e]
        assert torch.allclose(rows["next", "pos"], rows["pos"] + rows["action"])
        assert torch.equal(rows["next", "t"], rows["t"] + 1)


async def test_replay_buffer_fill_and_start() -> None:
    from support import ListBuffer

    buffer = ListBuffer()
    _, fns = make_envs(4)
    async with AsyncEnvCollector(fns, frames_per_batch=20, total_frames=60, replay_buffer=buffer) as c:
        written = [frames async for frames in c.fill()]
    assert written == [20, 20, 20] and len(buffer.batches) == 3
    check_invariants(buffer.batches, 4)

    buffer = ListBuffer()
    _, fns = make_envs(4)
    async with AsyncEnvCollector(fns, frames_per_batch=20, total_frames=40, replay_buffer=buffer) as c:
        await c.start()
        with anyio.fail_after(10):
            await buffer.wait_for(2)
    assert c.statistics().frames == 40


async def test_events_and_statistics() -> None:
    from aiocollect import BatchDelivered, EpisodeFinished, WorkerStarted

    _, fns = make_envs(3)
    collector = AsyncEnvCollector(fns, StepPolicy(), frames_per_batch=30, total_frames=60)
    async with collector.events() as events, collector as c:
        await take(c)
        stats = c.statistics()
    seen = [event async for event in events]  # the stream ends when the collector closes
    assert [e.frames for e in seen if isinstance(e, BatchDelivered)] == [30, 30]
    assert sorted(e.worker_id for e in seen if isinstance(e, WorkerStarted)) == [0, 1, 2]
    episodes = [e for e in seen if isinstance(e, EpisodeFinished)]
    assert len(episodes) == stats.episodes > 0
    assert all(e.length == 3 + e.worker_id % 5 for e in episodes)  # Counter's episode lengths
    assert stats.frames == 60 and sum(w.frames for w in stats.workers) == 60
    # the budget is delivered: every env reads stopped, before the collector closes too (issue 15)
    assert {w.state for w in stats.workers} == {"stopped"}
    assert c.statistics().workers[0].state == "stopped"
