"""Action spaces: Dict and Tuple (nested), Box of any shape, integer actions checked (never wrapped),
and ``GymEnv`` subclasses overriding the protocol methods."""

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

from aiocollect import Collector, GymEnv, RandomPolicy

NESTED = spaces.Dict(
    {
        "move": spaces.Discrete(3),
        "aim": spaces.Box(-1, 1, (2,), np.float32),
        "inner": spaces.Dict({"bits": spaces.MultiBinary(2), "pair": spaces.Tuple([spaces.Discrete(4)])}),
    }
)
TUPLE = spaces.Tuple([spaces.Discrete(2, start=5), spaces.Box(0, 1, (2, 2), np.float64)])
# key -> (shape per env, dtype)
NESTED_KEYS = {
    ("action", "move"): ((), torch.int64),
    ("action", "aim"): ((2,), torch.float32),
    ("action", "inner", "bits"): ((2,), torch.int8),
    ("action", "inner", "pair", "0"): ((), torch.int64),
}
TUPLE_KEYS = {("action", "0"): ((), torch.int64), ("action", "1"): ((2, 2), torch.float32)}


class ActionEnv(gym.Env):
    """Any action space; checks every action is inside it and records it. Episodes of 4 steps."""

    observation_space = spaces.Box(-1, 1, (1,), np.float32)

    def __init__(self, action_space: spaces.Space) -> None:
        self.action_space = action_space
        self.actions: list[Any] = []
        self.t = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action: Any):
        assert self.action_space.contains(action), action
        self.actions.append(action)
        self.t += 1
        return np.zeros(1, np.float32), 0.0, self.t >= 4, False, {}


def make(space: spaces.Space, num_envs: int | None) -> GymEnv:
    if num_envs is None:
        return GymEnv(ActionEnv(space))
    fns = [lambda: ActionEnv(space)] * num_envs
    return GymEnv(SyncVectorEnv(fns, autoreset_mode=AutoresetMode.NEXT_STEP))


def collect(env_fn: Any, policy: Any = None, **kwargs: Any) -> TensorDict:
    async def main() -> TensorDict:
        with anyio.fail_after(60):
            async with Collector(env_fn, policy, total_frames=-1, **kwargs) as collector:
                async for batch in collector:
                    return batch
        raise AssertionError("no batch")

    return anyio.run(main)


@pytest.mark.parametrize("num_envs", [None, 2])
@pytest.mark.parametrize(("space", "keys"), [(NESTED, NESTED_KEYS), (TUPLE, TUPLE_KEYS)])
def test_random_actions_of_a_composite_space(space, keys, num_envs):
    envs: list[GymEnv] = []

    def env_fn() -> GymEnv:
        envs.append(make(space, num_envs))
        return envs[-1]

    batch = collect(env_fn, frames_per_batch=200, seed=0)
    lead = (200,) if num_envs is None else (2, 100)
    actions = {k: v for k, v in batch.items(include_nested=True, leaves_only=True) if k[0] == "action"}
    assert set(actions) == set(keys)
    for key, (shape, dtype) in keys.items():
        assert actions[key].shape == (*lead, *shape), key
        assert actions[key].dtype == dtype, key
    # the full space is sampled: every value of each discrete leaf, the range of each Box leaf
    leaves = _leaves(space, ("action",))
    assert set(leaves) == set(keys)
    for key, leaf in leaves.items():
        values = actions[key]
        if isinstance(leaf, spaces.Discrete):
            assert set(values.unique().tolist()) == set(range(leaf.start, leaf.start + leaf.n)), key
        elif isinstance(leaf, spaces.Box):
            assert values.min() < leaf.low.min() + 0.1 and values.max() > leaf.high.max() - 0.1, key
    # and what the env got is what the batch holds (ActionEnv checked each one is in the space)
    inner = envs[-1].env
    got = inner.actions if num_envs is None else [a for e in inner.envs for a in e.actions]
    assert len(got) == 200


def _leaves(space: spaces.Space, path: tuple[str, ...]) -> dict[tuple[str, ...], spaces.Space]:
    if isinstance(space, spaces.Dict):
        return {k: v for name, sub in space.spaces.items() for k, v in _leaves(sub, (*path, name)).items()}
    if isinstance(space, spaces.Tuple):
        return {k: v for i, sub in enumerate(space.spaces) for k, v in _leaves(sub, (*path, str(i))).items()}
    return {path: space}


def nested_policy(td: TensorDict) -> TensorDict:
    n = td.batch_size
    td.set(("action", "move"), torch.full(n, 2))
    td.set(("action", "aim"), torch.full((*n, 2), 0.5))
    td.set(("action", "inner", "bits"), torch.ones((*n, 2), dtype=torch.int8))
    td.set(("action", "inner", "pair", "0"), torch.full(n, 3, dtype=torch.int32))
    return td


@pytest.mark.parametrize("num_envs", [None, 3])
def test_policy_writes_nested_action_keys(num_envs):
    env = make(NESTED, num_envs)
    batch = collect(lambda: env, nested_policy, frames_per_batch=12)
    assert (batch["action", "move"] == 2).all()
    assert batch["action", "inner", "pair", "0"].dtype == torch.int32  # stored as the policy wrote it
    sub_envs = [env.env] if num_envs is None else env.env.envs
    for sub in sub_envs:
        for action in sub.actions:
            assert action["move"] == 2 and action["inner"]["pair"] == (3,)
            assert np.array_equal(action["aim"], [0.5, 0.5]) and action["aim"].dtype == np.float32


def test_public_step_takes_a_tensordict_of_actions():
    env = make(TUPLE, 2)
    td = env.reset()
    td.set(("action", "0"), torch.tensor([5, 6]))
    td.set(("action", "1"), torch.zeros(2, 2, 2))
    out = env.step(td)
    assert out["next", "observation"].shape == (2, 1)
    assert env.env.envs[0].actions[0][0] == 5


def test_missing_action_entry():
    def policy(td):
        return td.set(("action", "move"), torch.zeros(td.batch_size, dtype=torch.int64))

    with pytest.raises(KeyError) as info:
        Collector(lambda: make(NESTED, None), policy, frames_per_batch=4)
    assert "('action', 'aim')" in str(info.value)


def test_action_entry_of_the_wrong_shape():
    def policy(td):
        nested_policy(td)
        return td.set(("action", "aim"), torch.zeros((*td.batch_size, 3)))

    with pytest.raises(ValueError, match=r"\('action', 'aim'\) has shape \(3,\)"):
        Collector(lambda: make(NESTED, 2), policy, frames_per_batch=4)


@pytest.mark.parametrize("num_envs", [None, 2])
@pytest.mark.parametrize("shape", [(2, 3), (1, 2, 2)])
def test_box_of_any_shape(shape, num_envs):
    space = spaces.Box(-2, 2, shape, np.float32)
    batch = collect(lambda: make(space, num_envs), frames_per_batch=8, seed=0)
    lead = (8,) if num_envs is None else (num_envs, 8 // num_envs)
    assert batch["action"].shape == (*lead, *shape)
    assert RandomPolicy(space).sample((5,)).shape == (5, *shape)


# -- integer actions: checked, never wrapped (issue 18) -------------------------------------------------
@pytest.mark.parametrize("num_envs", [None, 2])
@pytest.mark.parametrize(
    ("space", "value", "shape"),
    [
        (spaces.Box(0, 200, (1,), np.uint8), 300, (1,)),  # uint8 would wrap 300 to 44
        (spaces.Box(-5, 5, (), np.int8), -129, ()),
        (spaces.MultiBinary(2), 257, (2,)),  # int8 would wrap 257 to 1
        (spaces.Discrete(4), 2**32 + 1, ()),
    ],
)
def test_integer_action_outside_the_space_raises(space, value, shape, num_envs):
    def policy(td):
        return td.set("action", torch.full((*td.batch_size, *shape), value, dtype=torch.int64))

    with pytest.raises(ValueError) as info:
        collect(lambda: make(space, num_envs), policy, frames_per_batch=4)
    message = str(info.value)
    assert "'action'" in message and str(space) in message and str(value) in message


@pytest.mark.parametrize("num_envs", [None, 2])
def test_integer_action_of_another_dtype_is_cast_exactly(num_envs):
    space = spaces.Box(0, 200, (1,), np.uint8)

    def policy(td):  # int32 actions for a uint8 space: cast, values checked
        return td.set("action", torch.full((*td.batch_size, 1), 150, dtype=torch.int32))

    env = make(space, num_envs)
    collect(lambda: env, policy, frames_per_batch=4)
    sub_envs = [env.env] if num_envs is None else env.env.envs
    assert all(a.tolist() == [150] and a.dtype == np.uint8 for e in sub_envs for a in e.actions)


# -- subclasses ------------------------------------------------------------------------------------------
class DoubledReward(GymEnv):
    """Overrides the protocol's ``step``: the collectors honour it."""

    def step(self, td: TensorDict) -> TensorDict:
        out = super().step(td)
        out["next", "reward"] *= 2
        return out


class CountingReset(GymEnv):
    resets = 0

    def reset(self, td: TensorDict | None = None) -> TensorDict:
        self.resets += 1
        return super().reset(td)


@pytest.mark.parametrize("num_envs", [None, 2])
def test_subclass_overriding_step_is_honoured(num_envs):
    batch = collect(lambda: DoubledReward("CartPole-v1", num_envs=num_envs), frames_per_batch=40, seed=0)
    assert (batch["next", "reward"] == 2).all()
    reference = collect(lambda: GymEnv("CartPole-v1", num_envs=num_envs), frames_per_batch=40, seed=0)
    assert (batch.exclude(("next", "reward")) == reference.exclude(("next", "reward"))).all()


def test_subclass_overriding_reset_is_honoured():
    env = CountingReset("CartPole-v1", num_envs=2)
    batch = collect(lambda: env, frames_per_batch=200, seed=0)
    assert env.resets >= 1 + int(batch["next", "done"].any(dim=0).sum())


@pytest.mark.torchrl
@pytest.mark.parametrize(("value", "ok"), [(1, True), (300, False), (-129, False)])
def test_torchrl_integer_action_of_another_dtype(value, ok):
    """An int32 action for an int8 torchrl spec: cast where it fits, refused where a cast would wrap."""
    pytest.importorskip("torchrl")
    from torchrl.data import Categorical, Composite, Unbounded
    from torchrl.envs import EnvBase

    class Int8ActionEnv(EnvBase):
        def __init__(self) -> None:
            super().__init__(batch_size=())
            self.observation_spec = Composite(observation=Unbounded(shape=(1,)))
            self.action_spec = Composite(action=Categorical(n=4, shape=(1,), dtype=torch.int8))
            self.reward_spec = Unbounded(shape=(1,))
            self.seen: list[torch.Tensor] = []

        def _reset(self, td):
            return self.observation_spec.zero().update(self.full_done_spec.zero())

        def _step(self, td):
            self.seen.append(td["action"].clone())
            out = self.observation_spec.zero().update(self.full_done_spec.zero())
            return out.update(self.full_reward_spec.zero())

        def _set_seed(self, seed):
            pass

    def policy(td):
        return td.set("action", torch.full((1,), value, dtype=torch.int32))

    env = Int8ActionEnv()
    if ok:
        collect(lambda: env, policy, frames_per_batch=4)
        assert all(a.dtype == torch.int8 and a.tolist() == [value] for a in env.seen)
        return
    with pytest.raises(ValueError) as info:
        collect(lambda: env, policy, frames_per_batch=4)
    message = str(info.value)
    assert "'action'" in message and f"[{value}]" in message and "Categorical" in message


def test_random_policy_on_a_composite_space():
    policy = RandomPolicy(NESTED, seed=0)
    sample = policy.sample((5,))
    assert isinstance(sample, TensorDict) and sample.batch_size == (5,)
    assert sample["inner", "pair", "0"].shape == (5,)
    td = policy(TensorDict({}, batch_size=[2, 3]))
    assert set(td.keys(include_nested=True, leaves_only=True)) == set(NESTED_KEYS)
    assert td["action", "aim"].shape == (2, 3, 2)
    again = RandomPolicy(NESTED, seed=0).sample((5,))
    assert (again == sample).all()
