"""``AsyncEnvCollector`` over async vector envs (``AsyncVectorEnvProtocol``) and gymnasium vector envs
(``ThreadedAsyncVectorEnv``): data invariants per sub-env, mixing with single envs, exact batches, seeding,
errors (raise and drop), cancellation and bad input."""

from __future__ import annotations

import random
import threading

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from tensordict import TensorDictBase
from torch import nn

from aiocollect import (
    AsyncEnvCollector,
    AsyncVectorEnvProtocol,
    ThreadedAsyncVectorEnv,
    WorkerFailed,
)
from support import ENV_ID, take, take_until

pytestmark = pytest.mark.anyio


class Boom(Exception):
    """An env's own error type."""


def episode_length(env_id: int) -> int:
    return 3 + env_id % 5


class Single:
    """A single async env whose observation says where it is: ``[env_id, episode, step]`` (episodes of
    ``3 + env_id % 5`` steps, every third one truncated; the reward is the action)."""

    observation_space = spaces.Box(0, 10**6, (3,), np.float32)
    action_space = spaces.Discrete(4)

    def __init__(self, env_id: int) -> None:
        self.env_id, self.episode, self.t = env_id, -1, 0
        self.closed = False

    async def reset(self, *, seed=None, options=None):
        self.episode, self.t = self.episode + 1, 0
        return np.array([self.env_id, self.episode, 0], np.float32), {}

    async def step(self, action):
        await anyio.sleep(random.random() * 0.002)
        self.t += 1
        end = self.t >= episode_length(self.env_id)
        truncated = end and self.episode % 3 == 2
        obs = np.array([self.env_id, self.episode, self.t], np.float32)
        return obs, float(action), end and not truncated, truncated, {}

    async def close(self):
        self.closed = True


class VecCounter:
    """An async vector env of ``num_envs`` counters (sub-env ``k`` is env id ``first + k``, as the
    collector numbers it): ``[env_id, episode, step]`` observations, same-step autoreset (the final
    observation in ``info["final_obs"]``). One await per step for all of them. ``fail_at``: the step
    that raises :class:`Boom`."""

    single_observation_space = spaces.Box(0, 10**6, (3,), np.float32)
    single_action_space = spaces.Discrete(4)

    def __init__(self, first: int, num_envs: int, *, delay: float = 0.002, fail_at: int | None = None):
        self.num_envs = num_envs
        self.ids = np.arange(first, first + num_envs)
        self.delay, self.fail_at = delay, fail_at
        self.episode = np.zeros(num_envs, np.int64)
        self.t = np.zeros(num_envs, np.int64)
        self.steps = 0
        self.stepping = 0
        self.closed = False
        self.seeds: list[int | None] = []
        self.actions: list[np.ndarray] = []

    def _obs(self) -> np.ndarray:
        return np.stack([self.ids, self.episode, self.t], axis=1).astype(np.float32)

    async def reset(self, *, seed=None, options=None):
        self.seeds.append(seed)
        self.episode[:] = 0
        self.t[:] = 0
        return self._obs(), {}

    async def step(self, actions):
        assert isinstance(actions, np.ndarray) and actions.shape == (self.num_envs,)
        self.actions.append(actions.copy())
        self.stepping += 1
        try:
            await anyio.sleep(random.random() * self.delay)
            if self.fail_at is not None and self.steps == self.fail_at:
                raise Boom(f"vector env {self.ids[0]} broke")
        finally:
            self.stepping -= 1
        self.steps += 1
        self.t += 1
        end = self.t >= 3 + self.ids % 5
        truncated = end & (self.episode % 3 == 2)
        terminated = end & ~truncated
        info = {}
        if end.any():
            final = np.empty(self.num_envs, dtype=object)
            for k, row in zip(np.flatnonzero(end), self._obs()[end], strict=True):
                final[k] = row
            info = {"final_obs": final, "_final_obs": end}
            self.episode[end] += 1
            self.t[end] = 0
        return self._obs(), actions.astype(np.float64), terminated, truncated, info

    async def close(self):
        self.closed = True


class StepPolicy(nn.Module):
    """Action = the step counter mod 4 (so the reward tells which action the env got)."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.zeros(()))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return (observation[..., 2].long() + self.offset.long()) % 4


def vec_fns(widths: list[int], **kwargs) -> tuple[list[VecCounter], list]:
    """Vector envs of ``widths`` sub-envs, numbered as the collector numbers their rows."""
    envs, first = [], 0
    for width in widths:
        envs.append(VecCounter(first, width, **kwargs))
        first += width
    return envs, [lambda env=env: env for env in envs]


def check_invariants(batches: list[TensorDictBase], env_ids: range | list[int]) -> None:
    """Per (sub-)env: every step in order, none lost or repeated; next obs = following obs unless done,
    the final observation at a done and the reset one after it; the trajectory id changes exactly after
    done; the reward is the action; the root flags False."""
    data = torch.cat(batches)
    env_id = data["collector", "env_id"]
    assert torch.equal(data["observation"][:, 0].long(), env_id)
    assert torch.equal(data["next", "observation"][:, 0].long(), env_id)
    assert torch.equal(data["next", "reward"][:, 0], data["action"].float())
    assert not data["done"].any() and not data["terminated"].any()
    done = data["next", "done"][:, 0]
    assert torch.equal(done, data["next", "terminated"][:, 0] | data["next", "truncated"][:, 0])
    assert set(env_id.tolist()) == set(env_ids)
    all_ids: set[int] = set()
    for e in env_ids:
        rows = data[env_id == e]
        obs, nxt, ids = rows["observation"], rows["next", "observation"], rows["collector", "traj_ids"]
        d = rows["next", "done"][:, 0]
        assert obs[0].tolist() == [e, 0, 0]  # the first frame is the first step
        assert torch.equal(nxt[:, 2], obs[:, 2] + 1)  # the next observation is the step's
        assert torch.equal(d, nxt[:, 2] == episode_length(e))  # done at the episode's last step
        for k in range(len(rows) - 1):
            if d[k]:  # the final observation, then the reset one
                assert obs[k + 1].tolist() == [e, obs[k, 1] + 1, 0]
                assert ids[k + 1] != ids[k]
            else:
                assert torch.equal(nxt[k], obs[k + 1])
                assert ids[k + 1] == ids[k]
        traj = set(ids.tolist())
        assert not traj & all_ids  # trajectory ids are unique across (sub-)envs
        all_ids |= traj


# -- the protocol -------------------------------------------------------------------------------------
async def test_protocol_and_threaded_vector_env() -> None:
    assert isinstance(VecCounter(0, 3), AsyncVectorEnvProtocol)
    env = ThreadedAsyncVectorEnv(lambda: gym.make_vec("CartPole-v1", num_envs=3))  # next-step autoreset
    assert isinstance(env, AsyncVectorEnvProtocol)
    assert env.num_envs == 3 and env.single_action_space == spaces.Discrete(2)
    loop_thread = threading.get_ident()
    seen: list[int] = []
    inner = env.env
    original = inner.step

    def step(actions):
        seen.append(threading.get_ident())
        return original(actions)

    inner.step = step
    obs, _ = await env.reset(seed=0)
    assert obs.shape == (3, 4) and obs.dtype == np.float32
    ended = 0
    for _ in range(60):
        prev = obs
        obs, reward, terminated, truncated, info = await env.step(np.ones(3, np.int64))
        assert reward.shape == (3,) and terminated.dtype == bool
        done = terminated | truncated
        if done.any():  # same-step: the reset observation now, the final one in info
            ended += 1
            assert info["_final_obs"].tolist() == done.tolist()
            for k in np.flatnonzero(done):
                assert info["final_obs"][k].shape == (4,)
                assert np.abs(obs[k]).max() <= 0.05  # CartPole's reset state
        assert not np.array_equal(prev, obs)
    assert ended
    await env.close()
    await env.close()  # idempotent
    assert seen and loop_thread not in seen  # stepped off the loop
    with pytest.raises(TypeError, match="VectorEnv"):
        ThreadedAsyncVectorEnv(gym.make("CartPole-v1"))
    with pytest.raises(ValueError, match="options"):
        await ThreadedAsyncVectorEnv(lambda: gym.make_vec("CartPole-v1", num_envs=2)).reset(options={})


# -- data ---------------------------------------------------------------------------------------------
async def test_vector_envs_keep_every_frame_of_every_sub_env() -> None:
    envs, fns = vec_fns([5, 7])
    async with AsyncEnvCollector(fns, StepPolicy(), frames_per_batch=13, total_frames=260, seed=3) as c:
        batches = await take(c)
        stats = c.statistics()
        sizes = c.policy_batch_sizes
    assert [len(b) for b in batches] == [13] * 20  # exact, though 13 is no multiple of 5 or 7
    check_invariants(batches, range(12))
    assert stats.frames == 260 and len(stats.workers) == 12
    assert sum(w.frames for w in stats.workers) == 260
    assert stats.episodes == int(torch.cat(batches)["next", "done"].sum())
    assert set(sizes) <= {5, 7, 12}  # a vector env's rows are never split
    assert [e.seeds for e in envs] == [[3], [8]]  # sub-env k of the vector env at row f: seed + f + k
    assert all(e.closed for e in envs)


async def test_single_and_vector_envs_mix() -> None:
    # rows: single env 0, a vector env at rows 1-2, single env 3, vector envs at rows 4-7 and 8-10
    singles = [Single(0), Single(3)]
    vec_envs = [VecCounter(1, 2), VecCounter(4, 4), VecCounter(8, 3)]
    calls: list[list[int]] = []

    async def policy(td):
        calls.append(td["observation"][:, 0].long().tolist())
        td["action"] = td["observation"][:, 2].long() % 4
        return td

    fns = [lambda e=e: e for e in (singles[0], vec_envs[0], singles[1], vec_envs[1], vec_envs[2])]
    async with AsyncEnvCollector(fns, policy, frames_per_batch=17, total_frames=340, min_batch=3) as c:
        batches = await take(c)
    check_invariants(batches, range(11))
    for ids in calls:  # a vector env's rows, all in one call or none
        for env in vec_envs:
            inside = set(env.ids.tolist()) & set(ids)
            assert not inside or inside == set(env.ids.tolist())


async def test_a_vector_step_that_overfills_the_last_batch() -> None:
    _, fns = vec_fns([8], delay=0.0)
    with pytest.warns(UserWarning, match="not a multiple"):
        collector = AsyncEnvCollector(fns, StepPolicy(), frames_per_batch=5, total_frames=12)
    async with collector as c:
        batches = await take(c)
        stats = c.statistics()
    assert [len(b) for b in batches] == [5, 5, 5]
    assert stats.frames == 15
    data = torch.cat(batches)
    # two steps of the 8 sub-envs: 16 frames collected, the first 15 kept (in row order)
    assert data["collector", "env_id"].tolist() == list(range(8)) + list(range(7))


async def test_update_weights_policy_version_and_split_trajs() -> None:
    policy = StepPolicy()
    _, fns = vec_fns([4, 4], delay=0.0005)
    async with AsyncEnvCollector(fns, policy, frames_per_batch=24, track_policy_version=True) as c:
        first = (await take(c, 1))[0]
        with torch.no_grad():
            policy.offset.fill_(1)
        assert await c.update_weights(policy) == 1
        later = await take(c, 3)
    assert (first["collector", "policy_version"] == 0).all()
    data = torch.cat(later)
    version = data["collector", "policy_version"]
    assert (version == 1).any()
    assert torch.equal(data["action"], (data["observation"][:, 2].long() + version) % 4)

    _, fns = vec_fns([3, 2])
    async with AsyncEnvCollector(fns, frames_per_batch=30, total_frames=30, split_trajs=True) as c:
        (split,) = await take(c)
    mask = split["collector", "mask"]
    assert int(mask.sum()) == 30
    for row, m in zip(split, mask, strict=True):
        assert row["collector", "traj_ids"][m].unique().numel() == 1
        steps = row["observation"][m][:, 2]
        assert torch.equal(steps, steps[0] + torch.arange(len(steps)))


async def test_gymnasium_vector_envs_are_wrapped_and_seeded_reproducibly() -> None:
    async def run() -> TensorDictBase:
        fns = [lambda n=n: gym.make_vec("CartPole-v1", num_envs=n) for n in (4, 3)]

        def policy(td):
            return td.set("action", (td["observation"][:, 2] > 0).long())

        async with AsyncEnvCollector(fns, policy, frames_per_batch=70, seed=11) as c:
            # until every sub-env has 90 frames (a shared budget could go to the vector env faster to step)
            batches = await take_until(c, each=90, members=7, key=ENV_ID, frames=True)
            assert all(isinstance(env, ThreadedAsyncVectorEnv) for env in c.envs)
        return torch.cat(batches)

    first, second = await run(), await run()
    assert int(first["next", "done"].sum()) > 0
    for data in (first, second):
        for e in range(7):
            rows = data[data["collector", "env_id"] == e]
            d = rows["next", "done"][:-1, 0]
            nxt, following = rows["next", "observation"][:-1], rows["observation"][1:]
            assert torch.equal(nxt[~d], following[~d])  # next obs = following obs unless done
            assert (following[d].abs() <= 0.05).all()  # after a done, the reset state
    for e in range(7):  # same seed, same data per sub-env (as far as both runs got)
        a = first[first["collector", "env_id"] == e]["observation"]
        b = second[second["collector", "env_id"] == e]["observation"]
        k = min(len(a), len(b))
        assert k > 10 and torch.equal(a[:k], b[:k])


# -- errors -------------------------------------------------------------------------------------------
async def test_a_vector_env_s_error_ends_the_collector_with_its_type() -> None:
    envs, fns = vec_fns([3, 4])
    envs[1].fail_at = 2
    async with AsyncEnvCollector(fns, frames_per_batch=14) as c:
        with pytest.raises(Boom, match="vector env 3 broke"):
            await take(c)
        assert c.closed
    assert all(e.closed and not e.stepping for e in envs)


async def test_drop_mode_drops_the_whole_vector_env() -> None:
    singles = [Single(0)]
    envs = [VecCounter(1, 3), VecCounter(4, 2, fail_at=2)]
    fns = [lambda e=e: e for e in (*singles, *envs)]
    collector = AsyncEnvCollector(fns, frames_per_batch=12, total_frames=120, on_env_error="drop")
    async with collector as c, c.events() as events:
        batches = await take(c)
        stats = c.statistics()
        failed: list[WorkerFailed] = []
        with anyio.move_on_after(1):
            async for event in events:
                if isinstance(event, WorkerFailed):
                    failed.append(event)
                    if len(failed) == 2:
                        break
    assert sorted(e.worker_id for e in failed) == [4, 5]  # one event per sub-env of the dropped one
    assert all("Boom" in e.error and "env ids 4 to 5" in e.error for e in failed)
    assert envs[1].closed and [w.state for w in stats.workers][4:] == ["failed", "failed"]
    data = torch.cat(batches)
    assert len(data) == 120
    assert (data["collector", "env_id"] >= 4).sum() == 4  # its 2 steps before the failed one
    check_invariants(batches, range(6))

    envs, fns = vec_fns([2, 2], fail_at=1)
    async with AsyncEnvCollector(fns, frames_per_batch=10, on_env_error="drop") as c:
        with pytest.raises(RuntimeError, match="every env was dropped") as info:
            await take(c)
    assert isinstance(info.value.__cause__, Boom)


class BadVector(VecCounter):
    """Its third step returns what the protocol does not allow (``what``)."""

    def __init__(self, what: str) -> None:
        super().__init__(0, 3, delay=0.0)
        self.what = what

    async def step(self, actions):
        obs, reward, terminated, truncated, info = await super().step(actions)
        if self.steps == 3:
            if self.what == "obs":
                obs = obs[:2]
            elif self.what == "reward":
                reward = reward[:, None]
            elif self.what == "final_obs":
                terminated = np.ones(3, bool)
                info = {}
        return obs, reward, terminated, truncated, info


@pytest.mark.parametrize(
    ("what", "match"),
    [
        ("obs", r"observation 'observation' of shape \(2, 3\)"),
        ("reward", "reward"),
        ("final_obs", "final_obs"),
    ],
)
async def test_a_vector_step_that_breaks_the_protocol(what, match) -> None:
    env = BadVector(what)
    async with AsyncEnvCollector([lambda: env], StepPolicy(), frames_per_batch=3, total_frames=30) as c:
        with pytest.raises(ValueError, match=match):
            await take(c)
    assert env.closed


async def test_bad_input_is_refused_and_the_envs_closed() -> None:
    envs, fns = vec_fns([2])
    with pytest.raises(ValueError, match="max_frames_per_traj"):
        async with AsyncEnvCollector(fns, frames_per_batch=10, max_frames_per_traj=5):
            pass
    assert envs[0].closed and envs[0].steps == 0

    single = Single(0)
    cartpoles = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")  # sets .closed
    with pytest.raises(ValueError, match=r"env_fns\[1\].*single_observation_space"):
        async with AsyncEnvCollector([lambda: single, lambda: cartpoles], frames_per_batch=10):
            pass
    assert single.closed and cartpoles.closed

    class NoActionSpace:
        num_envs = 2
        single_observation_space = VecCounter.single_observation_space
        reset, step, close = VecCounter.reset, VecCounter.step, VecCounter.close

    with pytest.raises(TypeError, match="single_action_space"):
        async with AsyncEnvCollector([NoActionSpace], frames_per_batch=10):
            pass


# -- cancellation and clean-up ------------------------------------------------------------------------
async def test_cancelled_mid_batch_leaves_nothing_running() -> None:
    before = {t.ident for t in threading.enumerate()}
    envs, fns = vec_fns([10, 10], delay=0.01)
    async with AsyncEnvCollector(fns, StepPolicy(), frames_per_batch=10_000) as c:
        with anyio.move_on_after(0.2) as scope:
            await take(c)
        assert scope.cancelled_caught
        assert all(e.steps for e in envs)
    assert all(e.closed and not e.stepping for e in envs)

    gym_envs: list = []

    def make():
        gym_envs.append(gym.make_vec("CartPole-v1", num_envs=5, vectorization_mode="sync"))
        return gym_envs[-1]

    async with AsyncEnvCollector([make, make], frames_per_batch=10_000) as c:
        with anyio.move_on_after(0.2) as scope:
            await take(c)
        assert scope.cancelled_caught
    assert len(gym_envs) == 2 and all(env.closed for env in gym_envs)
    # the policy thread was joined on exit (the steps' worker threads are anyio's idle pool)
    assert not [t.name for t in threading.enumerate() if "aiocollect" in t.name and t.ident not in before]


async def test_pause_stops_new_vector_steps() -> None:
    envs, fns = vec_fns([3, 2], delay=0.001)
    async with AsyncEnvCollector(fns, frames_per_batch=10) as c:
        await take(c, 1)
        async with c.pause():
            steps = [e.steps for e in envs]
            assert not any(e.stepping for e in envs)
            await anyio.sleep(0.02)  # a window for a step that must not come
            assert [e.steps for e in envs] == steps
        await take(c, 1)


# -- composite spaces ---------------------------------------------------------------------------------
class Reach(gym.Env):
    """A gymnasium env with a Dict observation and a Dict action: the multi-key paths of both sides."""

    observation_space = spaces.Dict(
        {"pos": spaces.Box(-100, 100, (2,), np.float32), "t": spaces.Discrete(50)}
    )
    action_space = spaces.Dict({"move": spaces.Box(-1, 1, (2,), np.float32), "stay": spaces.Discrete(2)})

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos, self.t = np.zeros(2, np.float32), 0
        return {"pos": self.pos.copy(), "t": self.t}, {}

    def step(self, action):
        assert action["move"].shape == (2,) and action["move"].dtype == np.float32
        if not action["stay"]:
            self.pos = self.pos + action["move"]
        self.t += 1
        return {"pos": self.pos.copy(), "t": self.t}, 0.0, False, self.t == 4, {}


async def test_dict_observations_and_actions_through_a_gymnasium_vector_env() -> None:
    def make():  # gymnasium's default next-step autoreset: made same-step by the wrapper
        return gym.vector.SyncVectorEnv([Reach] * 3)

    async with AsyncEnvCollector([make, make], frames_per_batch=60, total_frames=120, seed=0) as c:
        batches = await take(c)
    data = torch.cat(batches)
    assert data["pos"].shape == (120, 2) and data["t"].dtype == torch.int64
    assert data["action", "move"].shape == (120, 2) and data["action", "stay"].dtype == torch.int64
    for e in range(6):
        rows = data[data["collector", "env_id"] == e]
        moved = rows["pos"] + rows["action", "move"] * (1 - rows["action", "stay"][:, None])
        assert torch.allclose(rows["next", "pos"], moved)
        assert torch.equal(rows["next", "t"], rows["t"] + 1)
        done = rows["next", "done"][:, 0]
        assert torch.equal(done, rows["next", "t"] == 4)  # the final observation at the episode's end
        following = rows["t"][1:][done[:-1]]
        assert following.numel() and (following == 0).all()  # then the reset one


async def test_events_and_statistics_per_sub_env() -> None:
    from aiocollect import BatchDelivered, EpisodeFinished, WorkerStarted, WorkerStopped

    _, fns = vec_fns([3, 4])
    collector = AsyncEnvCollector(fns, StepPolicy(), frames_per_batch=35, total_frames=70, prefetch=0)
    async with collector.events() as events, collector as c:
        batches = await take(c)
        stats = c.statistics()
    seen = [event async for event in events]
    assert [e.frames for e in seen if isinstance(e, BatchDelivered)] == [35, 35]
    assert sorted(e.worker_id for e in seen if isinstance(e, WorkerStarted)) == list(range(7))
    assert sorted(e.worker_id for e in seen if isinstance(e, WorkerStopped)) == list(range(7))
    episodes = [e for e in seen if isinstance(e, EpisodeFinished)]
    assert len(episodes) == stats.episodes == int(torch.cat(batches)["next", "done"].sum()) > 0
    assert all(e.length == episode_length(e.worker_id) for e in episodes)  # each sub-env's own episodes
    frames = torch.bincount(torch.cat(batches)["collector", "env_id"], minlength=7).tolist()
    assert [w.frames for w in stats.workers] == frames and {w.state for w in stats.workers} == {"stopped"}
