"""Environments: ``GymEnv`` (gymnasium Env / VectorEnv / id), spaces, and user envs of ``EnvProtocol``."""

from __future__ import annotations

from typing import Any

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from tensordict import TensorDict

from aiocollect import Collector, EnvProtocol, GymEnv, RandomPolicy

SAME_STEP = {"autoreset_mode": AutoresetMode.SAME_STEP}
INF = np.inf


# -- test envs ---------------------------------------------------------------------------------------
class CounterEnv(gym.Env):
    """Observation ``[episode, t]``: the episode count (1 after the first reset) and the step in it.

    An episode lasts ``length`` steps and ends terminated (or truncated with ``truncate=True``); the
    reward is ``10 * episode + t``, so every frame is recognisable.
    """

    observation_space = spaces.Box(-INF, INF, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, length: int = 3, truncate: bool = False) -> None:
        self.length = length
        self.truncate = truncate
        self.episode = 0
        self.t = 0
        self.seeds: list[int | None] = []

    def _obs(self) -> np.ndarray:
        return np.array([self.episode, self.t], dtype=np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.seeds.append(seed)
        self.episode += 1
        self.t = 0
        return self._obs(), {}

    def step(self, action: Any):
        assert self.action_space.contains(action), action
        self.t += 1
        end = self.t >= self.length
        reward = 10.0 * self.episode + self.t
        return self._obs(), reward, end and not self.truncate, end and self.truncate, {}


class SpaceEnv(gym.Env):
    """Any observation and action space; observations sampled from the (seeded) space.

    Every action is checked against the action space, so a wrong dtype, shape or value fails the step.
    Episodes last ``length`` steps.
    """

    def __init__(
        self,
        observation_space: spaces.Space | None = None,
        action_space: spaces.Space | None = None,
        length: int = 3,
    ) -> None:
        if observation_space is None:
            observation_space = spaces.Box(-1, 1, (2,), np.float32)
        self.observation_space = observation_space
        self.action_space = spaces.Discrete(2) if action_space is None else action_space
        self.length = length
        self.t = 0
        self.actions: list[Any] = []

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.observation_space.seed(int(self.np_random.integers(2**31)))
        self.t = 0
        return self.observation_space.sample(), {}

    def step(self, action: Any):
        if not isinstance(self.action_space, spaces.Discrete):
            action = np.asarray(action)
        assert self.action_space.contains(action), (action, self.action_space)
        self.actions.append(action)
        self.t += 1
        return self.observation_space.sample(), 1.0, self.t >= self.length, False, {}


class InPlaceEnv(gym.Env):
    """Returns the same observation buffer every time, updated in place (as some C envs do)."""

    observation_space = spaces.Box(-INF, INF, (1,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, length: int = 100) -> None:
        self.buf = np.zeros(1, np.float32)
        self.length = length
        self.t = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.t = 0
        self.buf[:] = -1.0
        return self.buf, {}

    def step(self, action: Any):
        self.t += 1
        self.buf[:] = self.t
        return self.buf, 0.0, self.t >= self.length, False, {}


class OddObsEnv(gym.Env):
    """Observations a careless env returns: float64 for a float32 space, read-only, strided."""

    observation_space = spaces.Box(-INF, INF, (3,), np.float32)
    action_space = spaces.Box(-1, 1, (2,), np.float32)

    def __init__(self) -> None:
        self.t = 0

    def _obs(self) -> np.ndarray:
        kind = self.t % 3
        base = np.arange(6, dtype=np.float64) + self.t
        if kind == 0:
            return base[:3]  # float64
        if kind == 1:
            out = base.astype(np.float32)[::2]  # strided view
            return out
        out = base[3:].astype(np.float32)
        out.flags.writeable = False
        return out

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action: Any):
        self.t += 1
        return self._obs(), 0.0, False, self.t >= 5, {}


COUNTER_ID = "aiocollect-tests/Counter-v0"
SPACE_ID = "aiocollect-tests/Space-v0"
for _id, _entry in ((COUNTER_ID, CounterEnv), (SPACE_ID, SpaceEnv)):
    if _id not in gym.registry:
        gym.register(_id, entry_point=_entry, disable_env_checker=True)


def counter_vec(*lengths: int, truncate: bool = False, copy: bool = True) -> SyncVectorEnv:
    return SyncVectorEnv([lambda n=n: CounterEnv(n, truncate) for n in lengths], copy=copy, **SAME_STEP)


def collect(env_fn: Any, policy: Any = None, *, batches: int = 1, **kwargs: Any) -> list[TensorDict]:
    """Run a Collector to completion on asyncio (sync tests: one backend is enough here)."""

    async def main() -> list[TensorDict]:
        out = []
        with anyio.fail_after(60):
            collector = Collector(env_fn, policy, total_frames=-1, **kwargs)
            try:
                async for batch in collector:
                    out.append(batch)
                    if len(out) == batches:
                        break
            finally:
                await collector.aclose()
        return out

    return anyio.run(main)


def step(env: GymEnv, action: Any) -> TensorDict:
    return env.step(TensorDict({"action": torch.as_tensor(action)}, batch_size=env.batch_size))


def reset_where(env: GymEnv, mask: Any) -> TensorDict:
    mask = torch.as_tensor(mask, dtype=torch.bool).reshape(*env.batch_size, 1)
    return env.reset(TensorDict({"_reset": mask}, batch_size=env.batch_size))


# -- construction --------------------------------------------------------------------------------------
class TestConstruction:
    def test_from_id(self):
        env = GymEnv("CartPole-v1")
        try:
            assert env.batch_size == torch.Size([])
            assert env.observation_space == gym.make("CartPole-v1").observation_space
            assert env.action_space == spaces.Discrete(2)
            assert isinstance(env, EnvProtocol)
            assert isinstance(env.env, gym.Env)
        finally:
            env.close()

    def test_from_env_instance(self):
        inner = CounterEnv(4)
        env = GymEnv(inner)
        assert env.env is inner
        assert env.batch_size == torch.Size([])
        td = env.reset()
        assert td["observation"].tolist() == [1.0, 0.0]

    def test_from_vector_env_instance(self):
        vec = counter_vec(2, 3, 4)
        env = GymEnv(vec)
        assert env.env is vec
        assert env.batch_size == torch.Size([3])
        assert env.observation_space == CounterEnv.observation_space  # single-env spaces
        assert env.action_space == spaces.Discrete(2)
        assert env.reset()["observation"].shape == (3, 2)

    def test_next_step_vector_env_is_accepted(self):
        vec = SyncVectorEnv([CounterEnv, CounterEnv])  # gymnasium's default: NEXT_STEP
        env = GymEnv(vec)  # tests/test_vector_envs.py checks its data
        assert env.batch_size == (2,)
        env.close()

    @pytest.mark.parametrize("num_envs", [1, 3])
    def test_num_envs_builds_a_sync_vector_env(self, num_envs):
        env = GymEnv("CartPole-v1", num_envs=num_envs)
        try:
            assert isinstance(env.env, SyncVectorEnv)
            assert env.env.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP
            assert env.batch_size == torch.Size([num_envs])
            assert env.observation_space.shape == (4,)  # single env, not batched
            assert env.action_space == spaces.Discrete(2)
        finally:
            env.close()

    def test_make_kwargs_reach_the_env(self):
        env = GymEnv(COUNTER_ID, length=7)
        assert env.env.unwrapped.length == 7
        vec = GymEnv(COUNTER_ID, num_envs=2, length=5)
        assert [e.unwrapped.length for e in vec.env.envs] == [5, 5]

    def test_vector_kwargs_cannot_switch_off_same_step(self):
        env = GymEnv(COUNTER_ID, num_envs=2, vector_kwargs={"autoreset_mode": AutoresetMode.NEXT_STEP})
        assert env.env.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP

    @pytest.mark.parametrize("num_envs", [0, -2, 1.5, True, "2"])
    def test_bad_num_envs(self, num_envs):
        with pytest.raises(ValueError, match="num_envs"):
            GymEnv("CartPole-v1", num_envs=num_envs)

    def test_num_envs_with_env_instance(self):
        with pytest.raises(ValueError, match="num_envs"):
            GymEnv(CounterEnv(), num_envs=2)

    def test_num_envs_mismatching_vector_env(self):
        with pytest.raises(ValueError, match="num_envs"):
            GymEnv(counter_vec(2, 2), num_envs=3)
        assert GymEnv(counter_vec(2, 2), num_envs=2).batch_size == (2,)

    @pytest.mark.parametrize("make_env", [lambda: CounterEnv(), lambda: counter_vec(2, 2)])
    def test_make_kwargs_with_an_instance(self, make_env):
        with pytest.raises(TypeError, match="length"):
            GymEnv(make_env(), length=3)

    @pytest.mark.parametrize("env", [None, 3, object(), gym.spaces.Discrete(2)])
    def test_not_an_env(self, env):
        with pytest.raises(TypeError, match="gymnasium"):
            GymEnv(env)

    @pytest.mark.parametrize("seed", [1.0, "1", True])
    def test_bad_seed(self, seed):
        with pytest.raises(TypeError, match="seed"):
            GymEnv(CounterEnv(), seed=seed)
        with pytest.raises(TypeError, match="seed"):
            GymEnv(CounterEnv()).set_seed(seed)

    def test_step_before_reset(self):
        env = GymEnv(CounterEnv())
        with pytest.raises(RuntimeError, match="reset"):
            step(env, 0)

    def test_unsupported_space_closes_the_env(self):
        closed = []

        class Bad(SpaceEnv):
            def close(self):
                closed.append(True)

        with pytest.raises(TypeError):
            GymEnv(Bad(observation_space=spaces.Text(4)))
        assert closed == [True]


# -- reset / step outputs ------------------------------------------------------------------------------
class TestOutputs:
    @pytest.mark.parametrize("num_envs", [None, 3])
    def test_cartpole(self, num_envs):
        env = GymEnv("CartPole-v1", num_envs=num_envs, seed=0)
        bs = () if num_envs is None else (num_envs,)
        td = env.reset()
        assert td.batch_size == bs
        assert set(td.keys()) == {"observation"}
        assert td["observation"].shape == (*bs, 4)
        assert td["observation"].dtype == torch.float32
        out = step(env, torch.ones(bs, dtype=torch.int64))
        assert out.batch_size == bs
        assert set(out.keys(include_nested=True)) == {
            "next",
            ("next", "observation"),
            ("next", "reward"),
            ("next", "done"),
            ("next", "terminated"),
            ("next", "truncated"),
        }
        assert out["next", "observation"].shape == (*bs, 4)
        assert out["next", "reward"].shape == (*bs, 1)
        assert out["next", "reward"].dtype == torch.float32
        assert torch.all(out["next", "reward"] == 1.0)
        for flag in ("done", "terminated", "truncated"):
            assert out["next", flag].shape == (*bs, 1)
            assert out["next", flag].dtype == torch.bool
        env.close()

    @pytest.mark.parametrize("num_envs", [None, 2])
    def test_pendulum_box_action(self, num_envs):
        env = GymEnv("Pendulum-v1", num_envs=num_envs, seed=0)
        bs = () if num_envs is None else (num_envs,)
        env.reset()
        out = step(env, torch.zeros(*bs, 1))
        assert out["next", "observation"].shape == (*bs, 3)
        assert out["next", "reward"].shape == (*bs, 1)
        assert out["next", "reward"].dtype == torch.float32
        assert not out["next", "done"].any()
        env.close()

    def test_flags_terminated_and_truncated(self):
        env = GymEnv(counter_vec(1, 2, truncate=False))
        env.reset()
        out = step(env, [0, 0])
        assert out["next", "terminated"].tolist() == [[True], [False]]
        assert out["next", "truncated"].tolist() == [[False], [False]]
        assert out["next", "done"].tolist() == [[True], [False]]
        env = GymEnv(counter_vec(1, 2, truncate=True))
        env.reset()
        out = step(env, [0, 0])
        assert out["next", "terminated"].tolist() == [[False], [False]]
        assert out["next", "truncated"].tolist() == [[True], [False]]
        assert out["next", "done"].tolist() == [[True], [False]]

    def test_rewards(self):
        env = GymEnv(counter_vec(3, 3))
        env.reset()
        assert step(env, [0, 1])["next", "reward"].tolist() == [[11.0], [11.0]]
        assert step(env, [0, 1])["next", "reward"].tolist() == [[12.0], [12.0]]

    def test_discrete_action_with_trailing_dim(self):
        env = GymEnv(counter_vec(3, 3))
        env.reset()
        out = step(env, torch.zeros(2, 1, dtype=torch.int64))
        assert out["next", "observation"][:, 1].tolist() == [1.0, 1.0]
        single = GymEnv(CounterEnv())
        single.reset()
        assert step(single, torch.zeros(1, dtype=torch.int64))["next", "observation"].tolist() == [
            1.0,
            1.0,
        ]


# -- same-step autoreset ---------------------------------------------------------------------------
class TestAutoreset:
    def test_single_env(self):
        env = GymEnv(CounterEnv(2))
        assert env.reset()["observation"].tolist() == [1, 0]
        assert step(env, 0)["next", "observation"].tolist() == [1, 1]
        out = step(env, 0)
        assert out["next", "done"].item()
        assert out["next", "observation"].tolist() == [1, 2]  # the final observation
        # the reset after a done gives the reset observation, without resetting a second time
        assert reset_where(env, out["next", "done"])["observation"].tolist() == [2, 0]
        assert env.env.episode == 2
        assert step(env, 0)["next", "observation"].tolist() == [2, 1]

    def test_vector_env(self):
        env = GymEnv(counter_vec(1, 2, 3))
        env.reset()
        out = step(env, [0, 0, 0])
        assert out["next", "done"].flatten().tolist() == [True, False, False]
        assert out["next", "observation"].tolist() == [[1, 1], [1, 1], [1, 1]]
        root = reset_where(env, out["next", "done"])
        assert root["observation"].tolist() == [[2, 0], [1, 1], [1, 1]]
        out = step(env, [0, 0, 0])
        assert out["next", "done"].flatten().tolist() == [True, True, False]
        assert out["next", "observation"].tolist() == [[2, 1], [1, 2], [1, 2]]
        root = reset_where(env, out["next", "done"])
        assert root["observation"].tolist() == [[3, 0], [2, 0], [1, 2]]
        assert [e.episode for e in env.env.envs] == [3, 2, 1]

    def test_vector_env_of_dict_observations(self):
        space = spaces.Dict({"x": spaces.Box(-INF, INF, (2,), np.float32)})

        class DictCounter(CounterEnv):
            observation_space = space

            def _obs(self):
                return {"x": super()._obs()}

        env = GymEnv(SyncVectorEnv([lambda: DictCounter(1), lambda: DictCounter(2)], **SAME_STEP))
        env.reset()
        out = step(env, [0, 0])
        assert out["next", "x"].tolist() == [[1, 1], [1, 1]]
        assert reset_where(env, out["next", "done"])["x"].tolist() == [[2, 0], [1, 1]]

    def test_collector_batch(self):
        (batch,) = collect(lambda: GymEnv(counter_vec(2, 3)), frames_per_batch=12)
        assert batch.batch_size == (2, 6)
        obs, nxt = batch["observation"], batch["next", "observation"]
        done = batch["next", "done"].squeeze(-1)
        assert obs[0].tolist() == [[1, 0], [1, 1], [2, 0], [2, 1], [3, 0], [3, 1]]
        assert nxt[0].tolist() == [[1, 1], [1, 2], [2, 1], [2, 2], [3, 1], [3, 2]]
        assert obs[1].tolist() == [[1, 0], [1, 1], [1, 2], [2, 0], [2, 1], [2, 2]]
        assert nxt[1].tolist() == [[1, 1], [1, 2], [1, 3], [2, 1], [2, 2], [2, 3]]
        assert done.tolist() == [[False, True] * 3, [False, False, True] * 2]
        # a done frame's next observation is the final one; the following frame starts the next episode
        assert torch.equal(obs[:, 1:][~done[:, :-1]], nxt[:, :-1][~done[:, :-1]])
        ids = batch["collector", "traj_ids"]
        assert ids[0].tolist() == [0, 0, 2, 2, 4, 4]
        assert ids[1].tolist() == [1, 1, 1, 3, 3, 3]

    def test_collector_single_env(self):
        (batch,) = collect(lambda: GymEnv(CounterEnv(3, truncate=True)), frames_per_batch=7)
        assert batch["observation"][:, 1].tolist() == [0, 1, 2, 0, 1, 2, 0]
        assert batch["next", "observation"][:, 1].tolist() == [1, 2, 3, 1, 2, 3, 1]
        assert batch["next", "truncated"].flatten().tolist() == [False, False, True] * 2 + [False]
        assert not batch["next", "terminated"].any()
        assert batch["collector", "traj_ids"].tolist() == [0, 0, 0, 1, 1, 1, 2]


# -- partial reset -----------------------------------------------------------------------------------
class TestPartialReset:
    def test_mask_resets_only_those_envs(self):
        env = GymEnv(counter_vec(5, 5, 5))
        env.reset()
        step(env, [0, 0, 0])
        td = reset_where(env, [True, False, True])
        assert td["observation"].tolist() == [[2, 0], [1, 1], [2, 0]]
        assert [e.episode for e in env.env.envs] == [2, 1, 2]
        out = step(env, [0, 0, 0])
        assert out["next", "observation"].tolist() == [[2, 1], [1, 2], [2, 1]]

    def test_mask_mixing_autoreset_and_live_envs(self):
        env = GymEnv(counter_vec(1, 5, 5))
        env.reset()
        out = step(env, [0, 0, 0])
        assert out["next", "done"].flatten().tolist() == [True, False, False]
        # env 0 was autoreset already (not again), env 1 is reset now, env 2 is left alone
        td = reset_where(env, [True, True, False])
        assert td["observation"].tolist() == [[2, 0], [2, 0], [1, 1]]
        assert [e.episode for e in env.env.envs] == [2, 2, 1]

    def test_all_false_mask_changes_nothing(self):
        env = GymEnv(counter_vec(5, 5))
        env.reset()
        step(env, [0, 0])
        assert reset_where(env, [False, False])["observation"].tolist() == [[1, 1], [1, 1]]
        assert [e.episode for e in env.env.envs] == [1, 1]

    def test_single_env_mask(self):
        env = GymEnv(CounterEnv(5))
        env.reset()
        step(env, 0)
        assert reset_where(env, False)["observation"].tolist() == [1, 1]
        assert reset_where(env, True)["observation"].tolist() == [2, 0]

    def test_reset_without_mask_resets_everything(self):
        env = GymEnv(counter_vec(5, 5))
        env.reset()
        step(env, [0, 0])
        assert env.reset()["observation"].tolist() == [[2, 0], [2, 0]]
        # a td without "_reset" is a full reset too
        assert env.reset(TensorDict({}, [2]))["observation"].tolist() == [[3, 0], [3, 0]]


# -- seeding -------------------------------------------------------------------------------------------
def _trajectory(env: GymEnv, steps: int, seed: int) -> list[list[float]]:
    policy = RandomPolicy(env.action_space, seed=seed)
    td = env.reset()
    out = []
    for _ in range(steps):
        nxt = env.step(policy(td.clone()))["next"]
        out.append(nxt["observation"].flatten().tolist())
        td = env.reset(nxt.select().set("_reset", nxt["done"]))
    return out


class TestSeeding:
    @pytest.mark.parametrize("num_envs", [None, 3])
    def test_same_seed_same_trajectory(self, num_envs):
        a = _trajectory(GymEnv("CartPole-v1", num_envs=num_envs, seed=3), 40, 0)
        b = _trajectory(GymEnv("CartPole-v1", num_envs=num_envs, seed=3), 40, 0)
        c = _trajectory(GymEnv("CartPole-v1", num_envs=num_envs, seed=4), 40, 0)
        assert a == b
        assert a != c

    def test_set_seed_seeds_the_next_reset(self):
        env = GymEnv("CartPole-v1", num_envs=2, seed=1)
        first = env.reset()["observation"]
        env.reset()
        assert env.set_seed(1) == 2
        assert torch.equal(env.reset()["observation"], first)
        # the seed is used once: the following reset is not the same again
        assert not torch.equal(env.reset()["observation"], first)

    @pytest.mark.parametrize(("num_envs", "last"), [(None, 7), (1, 7), (4, 10)])
    def test_set_seed_returns_the_last_seed(self, num_envs, last):
        assert GymEnv("CartPole-v1", num_envs=num_envs).set_seed(7) == last

    def test_sub_env_seeds(self):
        env = GymEnv(counter_vec(3, 3, 3), seed=10)
        env.reset()
        assert [e.seeds for e in env.env.envs] == [[10], [11], [12]]
        env.set_seed(20)
        env.reset()
        assert [e.seeds[-1] for e in env.env.envs] == [20, 21, 22]

    def test_collector_same_seed_same_batches(self):
        def run(seed):
            return collect(
                lambda: GymEnv("CartPole-v1", num_envs=2), frames_per_batch=64, batches=2, seed=seed
            )

        a, b, c = run(0), run(0), run(1)
        for x, y in zip(a, b, strict=True):
            assert (x == y).all()
        assert not (a[0]["observation"] == c[0]["observation"]).all()


# -- numpy -> torch ----------------------------------------------------------------------------------
class _RecordingVec(SyncVectorEnv):
    """Remembers the observation arrays it returned."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.returned: list[np.ndarray] = []

    def reset(self, **kwargs: Any):
        obs, info = super().reset(**kwargs)
        self.returned.append(obs)
        return obs, info

    def step(self, actions: Any):
        out = super().step(actions)
        self.returned.append(out[0])
        return out


def _recording_vec(n: int = 2) -> _RecordingVec:
    return _RecordingVec([lambda: gym.make("CartPole-v1")] * n, **SAME_STEP)


class TestNoCopy:
    def test_reset_and_step_share_memory_with_the_vector_env_arrays(self):
        vec = _recording_vec()
        env = GymEnv(vec, seed=0)
        td = env.reset()
        assert np.shares_memory(td["observation"].numpy(), vec.returned[-1])
        out = step(env, [0, 0])
        assert np.shares_memory(out["next", "observation"].numpy(), vec.returned[-1])

    def test_policy_sees_the_vector_env_arrays_without_a_copy(self):
        vec = _recording_vec()
        shared = []

        def policy(td):
            shared.append(np.shares_memory(td["observation"].numpy(), vec.returned[-1]))
            return td.set("action", torch.zeros(2, dtype=torch.int64))

        collect(lambda: GymEnv(vec), policy, frames_per_batch=16)
        assert len(shared) > 8
        assert all(shared)

    def test_single_env_observations_are_private_copies(self):
        inner = InPlaceEnv()
        env = GymEnv(inner)
        td = env.reset()
        assert not np.shares_memory(td["observation"].numpy(), inner.buf)
        out = step(env, 0)
        assert not np.shares_memory(out["next", "observation"].numpy(), inner.buf)
        assert td["observation"].item() == -1

    def test_env_reusing_its_buffer_single(self):
        (batch,) = collect(lambda: GymEnv(InPlaceEnv(3)), frames_per_batch=7)
        assert batch["observation"].flatten().tolist() == [-1, 1, 2, -1, 1, 2, -1]
        assert batch["next", "observation"].flatten().tolist() == [1, 2, 3, 1, 2, 3, 1]

    def test_vector_env_reusing_its_buffer(self):
        # copy=False: the vector env returns one observation buffer, updated in place at every step
        (batch,) = collect(lambda: GymEnv(counter_vec(2, 3, copy=False)), frames_per_batch=8)
        assert batch["observation"][..., 1].tolist() == [[0, 1, 0, 1], [0, 1, 2, 0]]
        assert batch["next", "observation"][..., 1].tolist() == [[1, 2, 1, 2], [1, 2, 3, 1]]
        assert batch["observation"][..., 0].tolist() == [[1, 1, 2, 2], [1, 1, 1, 2]]

    def test_env_reusing_its_buffer_public_api(self):
        env = GymEnv(InPlaceEnv(2))
        first = env.reset()
        out1 = step(env, 0)
        out2 = step(env, 0)
        root = reset_where(env, out2["next", "done"])
        assert first["observation"].item() == -1
        assert out1["next", "observation"].item() == 1
        assert out2["next", "observation"].item() == 2
        assert root["observation"].item() == -1

    def test_observations_are_converted_to_the_space_dtype(self):
        seen = []

        def policy(td):
            seen.append(td["observation"].dtype)
            return td.set("action", torch.zeros(2))

        (batch,) = collect(lambda: GymEnv(OddObsEnv()), policy, frames_per_batch=6)
        assert set(seen) == {torch.float32}
        assert batch["observation"].dtype == torch.float32
        assert batch["observation"].tolist() == [
            [0, 1, 2],
            [1, 3, 5],
            [5, 6, 7],
            [3, 4, 5],
            [4, 6, 8],
            [0, 1, 2],
        ]
        env = GymEnv(OddObsEnv())
        assert env.reset()["observation"].dtype == torch.float32
        assert step(env, torch.zeros(2))["next", "observation"].dtype == torch.float32
        assert step(env, torch.zeros(2))["next", "observation"].tolist() == [5, 6, 7]


# -- spaces ------------------------------------------------------------------------------------------
NESTED_DICT = spaces.Dict(
    {
        "pos": spaces.Box(-1, 1, (3,), np.float32),
        "mode": spaces.Discrete(3, start=5),
        "inner": spaces.Dict({"bits": spaces.MultiBinary(4), "deep": spaces.Dict({"z": spaces.Discrete(2)})}),
    }
)
# observation space -> {key: (shape, dtype)}
OBS_CASES = {
    "box": (spaces.Box(-1, 1, (3,), np.float32), {"observation": ((3,), torch.float32)}),
    "box_f64_2d": (spaces.Box(-1, 1, (2, 2), np.float64), {"observation": ((2, 2), torch.float64)}),
    "box_uint8": (spaces.Box(0, 255, (2, 3), np.uint8), {"observation": ((2, 3), torch.uint8)}),
    "discrete": (spaces.Discrete(4), {"observation": ((), torch.int64)}),
    "discrete_start": (spaces.Discrete(3, start=-5), {"observation": ((), torch.int64)}),
    "multidiscrete": (spaces.MultiDiscrete([2, 5]), {"observation": ((2,), torch.int64)}),
    "multibinary": (spaces.MultiBinary(3), {"observation": ((3,), torch.int8)}),
    "dict": (
        NESTED_DICT,
        {
            "pos": ((3,), torch.float32),
            "mode": ((), torch.int64),
            ("inner", "bits"): ((4,), torch.int8),
            ("inner", "deep", "z"): ((), torch.int64),
        },
    ),
}
# action space -> (shape, dtype)
ACTION_CASES = {
    "discrete": (spaces.Discrete(3), (), torch.int64),
    "discrete_start": (spaces.Discrete(3, start=-2), (), torch.int64),
    "multidiscrete": (spaces.MultiDiscrete([2, 3, 4]), (3,), torch.int64),
    "multidiscrete_start": (spaces.MultiDiscrete([3, 2], start=[-1, 10]), (2,), torch.int64),
    "multibinary": (spaces.MultiBinary(3), (3,), torch.int8),
    "multibinary_2d": (spaces.MultiBinary([2, 2]), (2, 2), torch.int8),
    "box": (spaces.Box(-2, 2, (2,), np.float32), (2,), torch.float32),
    "box_f64": (spaces.Box(-2, 2, (1,), np.float64), (1,), torch.float32),
    "box_half_bounded": (
        spaces.Box(
            np.array([0, -INF, -INF], np.float32), np.array([INF, 0, INF], np.float32), dtype=np.float32
        ),
        (3,),
        torch.float32,
    ),
}


def _space_env(obs_space: spaces.Space, act_space: spaces.Space, num_envs: int | None) -> GymEnv:
    if num_envs is None:
        return GymEnv(SpaceEnv(obs_space, act_space), seed=0)
    return GymEnv(SyncVectorEnv([lambda: SpaceEnv(obs_space, act_space)] * num_envs, **SAME_STEP), seed=0)


def _check_obs(td: TensorDict, expected: dict, bs: tuple[int, ...], space: spaces.Space) -> None:
    for key, (shape, dtype) in expected.items():
        assert td[key].shape == (*bs, *shape), key
        assert td[key].dtype == dtype, key
    obs_keys = {k for k in td.keys(include_nested=True, leaves_only=True)}
    assert obs_keys == set(expected)
    if not bs and not isinstance(space, spaces.Dict):
        assert space.contains(td["observation"].numpy().astype(space.dtype))


class TestSpaces:
    @pytest.mark.parametrize("num_envs", [None, 2])
    @pytest.mark.parametrize("case", list(OBS_CASES))
    def test_observation_spaces(self, case, num_envs):
        space, expected = OBS_CASES[case]
        env = _space_env(space, spaces.Discrete(2), num_envs)
        bs = () if num_envs is None else (num_envs,)
        _check_obs(env.reset(), expected, bs, space)
        out = step(env, torch.zeros(bs, dtype=torch.int64))
        _check_obs(out["next"].exclude("reward", "done", "terminated", "truncated"), expected, bs, space)

    @pytest.mark.parametrize("num_envs", [None, 2])
    @pytest.mark.parametrize("case", list(ACTION_CASES))
    def test_action_spaces(self, case, num_envs):
        space, shape, dtype = ACTION_CASES[case]
        env = _space_env(spaces.Box(-1, 1, (2,), np.float32), space, num_envs)
        bs = () if num_envs is None else (num_envs,)
        policy = RandomPolicy(env.action_space, seed=0)
        td = env.reset()
        for _ in range(5):  # SpaceEnv asserts every action is inside its space
            td = policy(td)
            assert td["action"].shape == (*bs, *shape)
            assert td["action"].dtype == dtype
            nxt = env.step(td)["next"]
            td = env.reset(nxt.select().set("_reset", nxt["done"]))
        envs = [env.env] if num_envs is None else env.env.envs
        assert all(len(e.actions) == 5 for e in envs)

    @pytest.mark.parametrize(
        ("obs_case", "act_case"),
        [
            ("dict", "multidiscrete_start"),
            ("discrete_start", "multibinary"),
            ("box_uint8", "box_f64"),
            ("multidiscrete", "discrete_start"),
        ],
    )
    @pytest.mark.parametrize("num_envs", [None, 3])
    def test_collector_batch(self, obs_case, act_case, num_envs):
        obs_space, expected = OBS_CASES[obs_case]
        act_space, act_shape, act_dtype = ACTION_CASES[act_case]
        (batch,) = collect(lambda: _space_env(obs_space, act_space, num_envs), frames_per_batch=6, seed=0)
        lead = (6,) if num_envs is None else (3, 2)
        assert batch.batch_size == lead
        for key, (shape, dtype) in expected.items():
            for full in (key, ("next", *((key,) if isinstance(key, str) else key))):
                assert batch[full].shape == (*lead, *shape), full
                assert batch[full].dtype == dtype, full
        assert batch["action"].shape == (*lead, *act_shape)
        assert batch["action"].dtype == act_dtype
        assert batch["next", "reward"].shape == (*lead, 1)
        assert batch["next", "reward"].dtype == torch.float32
        for flag in ("done", "terminated", "truncated"):
            assert batch[flag].shape == (*lead, 1)
            assert batch["next", flag].shape == (*lead, 1)
            assert batch["next", flag].dtype == torch.bool
        assert batch["collector", "traj_ids"].shape == lead
        assert batch["collector", "traj_ids"].dtype == torch.int64
        if num_envs is None:
            assert batch["next", "done"].flatten().tolist() == [False, False, True] * 2
        # every stored action is inside the space (SpaceEnv also checked each one it got)
        for action in batch["action"].reshape(-1, *act_shape).numpy():
            assert act_space.contains(action.astype(act_space.dtype)), action

    @pytest.mark.parametrize(
        ("obs_space", "act_space", "names"),
        [
            (spaces.Tuple([spaces.Discrete(2)]), spaces.Discrete(2), ["observation", "Tuple"]),
            (spaces.Text(5), spaces.Discrete(2), ["observation", "Text"]),
            (
                spaces.Dict({"ok": spaces.Discrete(2), "bad": spaces.Tuple([spaces.Discrete(2)])}),
                spaces.Discrete(2),
                ["observation['bad']", "Tuple"],
            ),
            (
                spaces.Box(-1, 1, (2,)),
                spaces.Dict({"a": spaces.Text(2)}),
                ["action['a']", "Text"],
            ),
            (spaces.Box(-1, 1, (2,)), spaces.Tuple([]), ["action", "Tuple"]),
            (spaces.Box(-1, 1, (2,)), spaces.Text(3), ["action", "Text"]),
        ],
    )
    def test_unsupported_spaces(self, obs_space, act_space, names):
        with pytest.raises(TypeError) as info:
            GymEnv(SpaceEnv(obs_space, act_space))
        for name in names:
            assert name in str(info.value)

    def test_unsupported_space_in_a_user_env(self):
        env = ProtocolEnv(batch=None)
        env.observation_space = spaces.Tuple([spaces.Discrete(2)])
        with pytest.raises(TypeError, match="Tuple"):
            collect(env, frames_per_batch=4)

    @pytest.mark.parametrize("name", ["action", "reward", "done", "next", "collector"])
    def test_dict_entry_colliding_with_a_batch_key(self, name):
        space = spaces.Dict({name: spaces.Discrete(2), "x": spaces.Discrete(3)})
        with pytest.raises(TypeError, match=repr(name)):
            GymEnv(SpaceEnv(space, spaces.Discrete(2)))
        # nested, the same name is no clash: it is stored under the outer key
        nested = spaces.Dict({"inner": spaces.Dict({name: spaces.Discrete(2)})})
        assert set(GymEnv(SpaceEnv(nested)).reset().keys(True, True)) == {("inner", name)}

    def test_empty_dict_observation(self):
        with pytest.raises(TypeError, match="empty"):
            GymEnv(SpaceEnv(spaces.Dict({}), spaces.Discrete(2)))


# -- user envs of the protocol -----------------------------------------------------------------------
class ProtocolEnv:
    """A plain-class env (no GymEnv, no base class), batched (``batch=N``) or not (``batch=None``).

    Observation ``[episode, t]`` per sub-env, episode lengths ``lengths[i]``; records every reset mask.
    """

    def __init__(self, batch: int | None = 2, lengths: tuple[int, ...] = (2, 3)) -> None:
        n = 1 if batch is None else batch
        self.batch_size = torch.Size([]) if batch is None else torch.Size([batch])
        self.observation_space = spaces.Box(-INF, INF, (2,), np.float32)
        self.action_space = spaces.Discrete(2)
        self.lengths = torch.tensor((lengths * n)[:n])
        self.episode = torch.zeros(n)
        self.t = torch.zeros(n)
        self.resets: list[list[bool] | None] = []
        self.seed: int | None = None
        self.closed = False
        self.actions: list[torch.Tensor] = []

    def _shape(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(*self.batch_size, *x.shape[1:])

    def _obs(self) -> torch.Tensor:
        return self._shape(torch.stack([self.episode, self.t], -1))

    def reset(self, td: TensorDict | None = None) -> TensorDict:
        mask = torch.ones(len(self.t), dtype=torch.bool)
        if td is not None and td.get("_reset", None) is not None:
            mask = td["_reset"].reshape(-1)
            self.resets.append(mask.tolist())
        else:
            self.resets.append(None)
        self.episode[mask] += 1
        self.t[mask] = 0
        return TensorDict({"observation": self._obs()}, batch_size=self.batch_size)

    def step(self, td: TensorDict) -> TensorDict:
        self.actions.append(td["action"].clone())
        self.t += 1
        done = self._shape((self.t >= self.lengths).unsqueeze(-1))
        reward = self._shape((10 * self.episode + self.t).unsqueeze(-1))
        nxt = {
            "observation": self._obs(),
            "reward": reward,
            "done": done,
            "terminated": done,
            "truncated": torch.zeros_like(done),
        }
        return TensorDict({"next": nxt}, batch_size=self.batch_size)

    def set_seed(self, seed: int) -> int:
        self.seed = seed
        return seed + max(len(self.t), 1) - 1

    def close(self) -> None:
        self.closed = True


class TestProtocolEnv:
    def test_is_an_env_protocol(self):
        assert isinstance(ProtocolEnv(), EnvProtocol)
        assert isinstance(GymEnv(CounterEnv()), EnvProtocol)
        assert not isinstance(object(), EnvProtocol)

    def test_batched(self):
        env = ProtocolEnv(batch=2, lengths=(2, 3))
        (batch,) = collect(env, frames_per_batch=12, seed=5)
        assert env.seed == 5
        assert env.closed
        assert batch.batch_size == (2, 6)
        assert batch["observation"][0].tolist() == [[1, 0], [1, 1], [2, 0], [2, 1], [3, 0], [3, 1]]
        assert batch["next", "observation"][0].tolist() == [
            [1, 1], [1, 2], [2, 1], [2, 2], [3, 1], [3, 2],
        ]  # fmt: skip
        assert batch["observation"][1].tolist() == [[1, 0], [1, 1], [1, 2], [2, 0], [2, 1], [2, 2]]
        assert batch["next", "reward"][1].flatten().tolist() == [11, 12, 13, 21, 22, 23]
        assert batch["next", "done"].squeeze(-1).tolist() == [
            [False, True] * 3,
            [False, False, True] * 2,
        ]
        # a full reset first, then one reset with a "_reset" mask after each step with a done
        assert env.resets == [None, [True, False], [False, True], [True, False], [True, True]]
        assert batch["collector", "traj_ids"].tolist() == [[0, 0, 2, 2, 4, 4], [1, 1, 1, 3, 3, 3]]
        assert batch["action"].dtype == torch.int64
        assert torch.equal(torch.stack(env.actions, -1), batch["action"])

    def test_unbatched(self):
        env = ProtocolEnv(batch=None, lengths=(3,))
        (batch,) = collect(env, frames_per_batch=7)
        assert batch.batch_size == (7,)
        assert batch["observation"].tolist() == [
            [1, 0], [1, 1], [1, 2], [2, 0], [2, 1], [2, 2], [3, 0],
        ]  # fmt: skip
        assert batch["next", "observation"][:, 1].tolist() == [1, 2, 3, 1, 2, 3, 1]
        assert batch["next", "done"].flatten().tolist() == [False, False, True] * 2 + [False]
        assert batch["collector", "traj_ids"].tolist() == [0, 0, 0, 1, 1, 1, 2]
        assert env.resets == [None, None, None]
        assert all(a.shape == () for a in env.actions)

    def test_traj_ids_go_on_over_batches(self):
        env = ProtocolEnv(batch=2, lengths=(2, 2))
        a, b = collect(env, frames_per_batch=4, batches=2)
        assert a["collector", "traj_ids"].tolist() == [[0, 0], [1, 1]]
        assert b["collector", "traj_ids"].tolist() == [[2, 2], [3, 3]]
        assert b["observation"][:, 0].tolist() == [[2, 0], [2, 0]]

    def test_env_reusing_its_tensors(self):
        class InPlace(ProtocolEnv):
            """Keeps one observation tensor and returns it each time (a common shortcut)."""

            def __init__(self) -> None:
                super().__init__(batch=2, lengths=(2, 3))
                self.buf = torch.zeros(2, 2)
                self.rew = torch.zeros(2, 1)

            def _obs(self):
                self.buf.copy_(super()._obs())
                return self.buf

            def step(self, td):
                out = super().step(td)
                self.rew.copy_(out["next", "reward"])
                out["next", "reward"] = self.rew
                return out

        (batch,) = collect(InPlace(), frames_per_batch=6)
        assert batch["observation"][0].tolist() == [[1, 0], [1, 1], [2, 0]]
        assert batch["next", "observation"][0].tolist() == [[1, 1], [1, 2], [2, 1]]
        assert batch["next", "reward"][1].flatten().tolist() == [11, 12, 13]

    def test_observations_in_another_dtype(self):
        seen = []

        class Float64(ProtocolEnv):
            def _obs(self):
                return super()._obs().to(torch.float64)

        def policy(td):
            seen.append(td["observation"].dtype)
            return td.set("action", torch.zeros(2, dtype=torch.int64))

        (batch,) = collect(Float64(), policy, frames_per_batch=6)
        assert set(seen) == {torch.float32}
        assert batch["observation"].dtype == torch.float32
        assert batch["next", "observation"].dtype == torch.float32

    def test_max_frames_per_traj_resets_with_a_mask(self):
        env = ProtocolEnv(batch=2, lengths=(100, 2))
        (batch,) = collect(env, frames_per_batch=8, max_frames_per_traj=3)
        assert batch["next", "truncated"].squeeze(-1).tolist() == [
            [False, False, True, False],
            [False, False, False, False],
        ]
        assert batch["next", "terminated"].squeeze(-1)[1].tolist() == [False, True, False, True]
        assert batch["observation"][0, :, 1].tolist() == [0, 1, 2, 0]
        assert [True, False] in env.resets  # the truncated env alone

    def test_done_only_env(self):
        class DoneOnly(ProtocolEnv):
            def step(self, td):
                out = super().step(td)
                return out.exclude(("next", "terminated"), ("next", "truncated"))

        (batch,) = collect(DoneOnly(batch=2, lengths=(1, 2)), frames_per_batch=4)
        assert batch["next", "terminated"].squeeze(-1).tolist() == [[True, True], [False, True]]
        assert not batch["next", "truncated"].any()

    def test_missing_members(self):
        class Partial:
            batch_size = torch.Size([])
            observation_space = spaces.Discrete(2)

            def reset(self, td=None):
                return TensorDict({"observation": torch.tensor(0)}, [])

        assert not isinstance(Partial(), EnvProtocol)
        with pytest.raises(TypeError) as info:
            Collector(lambda: Partial(), frames_per_batch=4)
        for name in ("action_space", "step", "set_seed", "close"):
            assert name in str(info.value)
        assert "reset" not in str(info.value).split("lacks")[1].split("of the env")[0]

    @pytest.mark.parametrize(
        ("drop", "match"),
        [("next", "'next'"), ("reward", "reward"), ("observation", "observation")],
    )
    def test_step_missing_entries(self, drop, match):
        class Broken(ProtocolEnv):
            def step(self, td):
                out = super().step(td)
                key = drop if drop == "next" else ("next", drop)
                return out.exclude(key)

        with pytest.raises(KeyError, match=match):
            collect(Broken(), frames_per_batch=4)

    @pytest.mark.anyio
    async def test_collector_on_every_backend(self):
        env = ProtocolEnv(batch=2, lengths=(2, 3))
        with anyio.fail_after(30):
            async with Collector(env, frames_per_batch=12, total_frames=24) as collector:
                batches = [b async for b in collector]
        assert len(batches) == 2
        # the second batch goes on with the ids: 5 and 6 were given at the end of the first one
        assert batches[1]["collector", "traj_ids"].tolist() == [[5, 5, 7, 7, 9, 9], [6, 6, 6, 8, 8, 8]]
        assert env.closed
