"""Policies: ``RandomPolicy``, ``nn.Module`` / ``TensorDictModule`` / callable wrapping, exploration,
``compile_policy`` and ``torch.no_grad`` around policy calls."""

from __future__ import annotations

from typing import Any

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from tensordict import TensorDict
from tensordict.nn import (
    InteractionType,
    ProbabilisticTensorDictModule,
    ProbabilisticTensorDictSequential,
    TensorDictModule,
    TensorDictSequential,
)
from torch import nn
from torch.distributions import Categorical

from aiocollect import Collector, GymEnv, RandomPolicy

INF = np.inf

ACTION_SPACES = {
    "discrete": spaces.Discrete(5),
    "discrete_start": spaces.Discrete(3, start=-1),
    "multidiscrete": spaces.MultiDiscrete([2, 3, 4]),
    "multidiscrete_start": spaces.MultiDiscrete([3, 2], start=[-1, 10]),
    "multidiscrete_2d": spaces.MultiDiscrete([[2, 3], [4, 5]]),
    "multibinary": spaces.MultiBinary(3),
    "multibinary_2d": spaces.MultiBinary([2, 3]),
    "box": spaces.Box(-2, 3, (2,), np.float32),
    "box_2d": spaces.Box(0, 1, (2, 2), np.float32),
    "box_f64": spaces.Box(-1, 1, (3,), np.float64),
    "box_int": spaces.Box(-2, 2, (4,), np.int64),
    "box_unbounded": spaces.Box(-INF, INF, (3,), np.float32),
    "box_half_bounded": spaces.Box(
        np.array([0, -INF, -INF, -1], np.float32), np.array([INF, 0, INF, 1], np.float32)
    ),
}
EXPECTED = {  # per-env action shape and dtype
    "discrete": ((), torch.int64),
    "discrete_start": ((), torch.int64),
    "multidiscrete": ((3,), torch.int64),
    "multidiscrete_start": ((2,), torch.int64),
    "multidiscrete_2d": ((2, 2), torch.int64),
    "multibinary": ((3,), torch.int8),
    "multibinary_2d": ((2, 3), torch.int8),
    "box": ((2,), torch.float32),
    "box_2d": ((2, 2), torch.float32),
    "box_f64": ((3,), torch.float32),
    "box_int": ((4,), torch.int64),
    "box_unbounded": ((3,), torch.float32),
    "box_half_bounded": ((4,), torch.float32),
}


def _contains(space: spaces.Space, action: torch.Tensor) -> bool:
    value = action.numpy()
    if isinstance(space, spaces.Discrete):
        return space.contains(int(value))
    return space.contains(value.astype(space.dtype))


def collect(env_fn: Any, policy: Any = None, *, batches: int = 1, **kwargs: Any) -> list[TensorDict]:
    """Run a Collector on asyncio (sync tests: the backends are covered by the collector tests)."""

    async def main() -> list[TensorDict]:
        out = []
        with anyio.fail_after(120):
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


def categorical_policy(seed: int = 0, scale: float = 1.0) -> ProbabilisticTensorDictSequential:
    torch.manual_seed(seed)
    linear = nn.Linear(4, 2)
    with torch.no_grad():
        linear.weight.mul_(scale)
        linear.bias.mul_(scale)
    net = TensorDictModule(linear, in_keys=["observation"], out_keys=["logits"])
    dist = ProbabilisticTensorDictModule(
        in_keys=["logits"],
        out_keys=["action"],
        distribution_class=Categorical,
        return_log_prob=True,
    )
    return ProbabilisticTensorDictSequential(net, dist)


def log_prob_key(batch: TensorDict) -> str:
    """tensordict calls it "sample_log_prob" (<= 0.14) or "action_log_prob" (>= 0.15)."""
    keys = [k for k in batch.keys() if isinstance(k, str) and k.endswith("log_prob")]  # noqa: SIM118
    assert len(keys) == 1, list(batch.keys())
    return keys[0]


# -- RandomPolicy ------------------------------------------------------------------------------------
class TestRandomPolicy:
    @pytest.mark.parametrize("batch_shape", [(), (7,), (2, 3)])
    @pytest.mark.parametrize("name", list(ACTION_SPACES))
    def test_shapes_dtypes_and_values(self, name, batch_shape):
        space = ACTION_SPACES[name]
        shape, dtype = EXPECTED[name]
        policy = RandomPolicy(space, seed=0)
        actions = policy.sample(batch_shape)
        assert actions.shape == (*batch_shape, *shape)
        assert actions.dtype == dtype
        for action in actions.reshape(-1, *shape):
            assert _contains(space, action), (name, action)
        td = policy(TensorDict({}, batch_size=batch_shape))
        assert td["action"].shape == (*batch_shape, *shape)
        assert td["action"].dtype == dtype

    @pytest.mark.parametrize("name", list(ACTION_SPACES))
    def test_seeded_reproducibility(self, name):
        space = ACTION_SPACES[name]
        a = RandomPolicy(space, seed=3).sample((50,))
        b = RandomPolicy(space, seed=3).sample((50,))
        c = RandomPolicy(space, seed=4).sample((50,))
        assert torch.equal(a, b)
        assert not torch.equal(a, c)
        policy = RandomPolicy(space, seed=4)
        policy.sample((10,))
        policy.set_seed(3)
        assert torch.equal(policy.sample((50,)), a)

    @pytest.mark.parametrize(
        ("name", "values"),
        [
            ("discrete", {0, 1, 2, 3, 4}),
            ("discrete_start", {-1, 0, 1}),
            ("box_int", {-2, -1, 0, 1, 2}),
            ("multibinary", {0, 1}),
        ],
    )
    def test_every_value_is_drawn(self, name, values):
        actions = RandomPolicy(ACTION_SPACES[name], seed=0).sample((400,))
        assert set(actions.flatten().tolist()) == values

    def test_multidiscrete_start_draws_every_value_per_entry(self):
        actions = RandomPolicy(ACTION_SPACES["multidiscrete_start"], seed=0).sample((400,))
        assert set(actions[:, 0].tolist()) == {-1, 0, 1}
        assert set(actions[:, 1].tolist()) == {10, 11}

    def test_box_bounds(self):
        actions = RandomPolicy(ACTION_SPACES["box"], seed=0).sample((1000,))
        assert actions.min() >= -2
        assert actions.max() <= 3
        assert actions.min() < -1.9
        assert actions.max() > 2.9

    def test_box_with_unbounded_dims(self):
        actions = RandomPolicy(ACTION_SPACES["box_half_bounded"], seed=0).sample((1000,))
        assert torch.isfinite(actions).all()
        assert (actions[:, 0] >= 0).all()
        assert (actions[:, 1] <= 0).all()
        assert (actions[:, 2] < 0).any()
        assert (actions[:, 2] > 0).any()
        assert (actions[:, 3].abs() <= 1).all()
        unbounded = RandomPolicy(ACTION_SPACES["box_unbounded"], seed=0).sample((1000,))
        assert torch.isfinite(unbounded).all()
        assert (unbounded < 0).any()
        assert (unbounded > 0).any()

    def test_unseeded_policies_follow_torch_rng(self):
        space = ACTION_SPACES["box"]
        torch.manual_seed(0)
        a = RandomPolicy(space).sample((20,))
        torch.manual_seed(0)
        b = RandomPolicy(space).sample((20,))
        assert torch.equal(a, b)
        assert not torch.equal(RandomPolicy(space).sample((20,)), a)

    @pytest.mark.parametrize(
        ("space", "name"),
        [
            (spaces.Dict({"a": spaces.Text(2)}), "Text"),
            (spaces.Tuple([]), "Tuple"),
            (spaces.Text(3), "Text"),
        ],
    )
    def test_unsupported_space(self, space, name):
        with pytest.raises(TypeError, match=name):
            RandomPolicy(space)

    @pytest.mark.parametrize("seed", [1.5, "0", True])
    def test_bad_seed(self, seed):
        with pytest.raises(TypeError, match="seed"):
            RandomPolicy(spaces.Discrete(2), seed=seed)

    def test_repr(self):
        assert "Discrete(3)" in repr(RandomPolicy(spaces.Discrete(3)))


# -- the default policy in a collector -----------------------------------------------------------------
class TestDefaultPolicy:
    @pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
    def test_random_actions_inside_the_space(self, env_id):
        (batch,) = collect(lambda: GymEnv(env_id, num_envs=2), frames_per_batch=64, seed=0)
        space = gym.make(env_id).action_space
        assert all(_contains(space, a) for a in batch["action"].reshape(64, *space.shape))
        assert len(set(batch["action"].flatten().tolist())) > 1

    def test_seeded(self):
        def run(seed, policy=None):
            return collect(lambda: GymEnv("Pendulum-v1"), policy, frames_per_batch=16, seed=seed)[0]

        a, b, c = run(0), run(0), run(1)
        assert torch.equal(a["action"], b["action"])
        assert not torch.equal(a["action"], c["action"])
        # an unseeded RandomPolicy given as the policy is seeded by the collector as well
        space = gym.make("Pendulum-v1").action_space
        d = run(0, RandomPolicy(space))
        e = run(0, RandomPolicy(space))
        assert torch.equal(d["action"], e["action"])

    @pytest.mark.anyio
    async def test_set_seed_gives_the_batches_of_a_fresh_collector(self):
        async def first_batch(collector: Collector, seed: int | None = None) -> TensorDict:
            async with collector:
                if seed is not None:
                    await collector.set_seed(seed)
                async for batch in collector:
                    return batch
            raise AssertionError("no batch")

        with anyio.fail_after(30):
            for env_id, make_policy in (
                ("Pendulum-v1", lambda: None),
                ("CartPole-v1", categorical_policy),
            ):
                env_fn = lambda env_id=env_id: GymEnv(env_id)  # noqa: E731
                fresh = await first_batch(Collector(env_fn, make_policy(), frames_per_batch=8, seed=5))
                reseeded = await first_batch(
                    Collector(env_fn, make_policy(), frames_per_batch=8, seed=1), seed=5
                )
                # the same frames; set_seed resets the env, so the trajectories get new ids
                ids = ("collector", "traj_ids")
                assert (fresh.exclude(ids) == reseeded.exclude(ids)).all(), env_id


# -- policy kinds ------------------------------------------------------------------------------------
class DictObsEnv(gym.Env):
    observation_space = spaces.Dict(
        {"b": spaces.Box(-1, 1, (3,), np.float32), "a": spaces.Box(-1, 1, (2,), np.float32)}
    )
    action_space = spaces.Box(-1, 1, (1,), np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.observation_space.seed(0 if seed is None else seed)
        return self.observation_space.sample(), {}

    def step(self, action: Any):
        return self.observation_space.sample(), float(action[0]), False, False, {}


class TestModules:
    def test_nn_module_action_is_module_of_observation(self):
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
        (batch,) = collect(lambda: GymEnv("Pendulum-v1", num_envs=2), module, frames_per_batch=16)
        assert batch["action"].shape == (2, 8, 1)
        with torch.no_grad():
            expected = module(batch["observation"])
        torch.testing.assert_close(batch["action"], expected)
        assert set(batch.keys()) == {"observation", "action", "next", "collector", *FLAGS}

    def test_nn_module_discrete_action(self):
        class Argmax(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.linear = nn.Linear(4, 2)

            def forward(self, obs: torch.Tensor) -> torch.Tensor:
                return self.linear(obs).argmax(-1)

        torch.manual_seed(0)
        module = Argmax()
        (batch,) = collect(lambda: GymEnv("CartPole-v1"), module, frames_per_batch=16)
        assert batch["action"].dtype == torch.int64
        assert torch.equal(batch["action"], module(batch["observation"]))

    def test_nn_module_gets_one_argument_per_observation_key(self):
        class TwoInputs(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.shapes: list[tuple[tuple[int, ...], ...]] = []

            def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                self.shapes.append((tuple(a.shape), tuple(b.shape)))
                return a[..., :1] + b[..., :1]

        collector_policy = []

        async def main():
            collector = Collector(lambda: GymEnv(DictObsEnv()), TwoInputs(), frames_per_batch=4)
            try:
                async for batch in collector:
                    collector_policy.append(collector.policy)
                    return batch
            finally:
                await collector.aclose()

        batch = anyio.run(main)
        assert collector_policy[0].shapes[-1] == ((2,), (3,))
        torch.testing.assert_close(batch["action"], batch["a"][:, :1] + batch["b"][:, :1])

    def test_nn_module_returning_a_tuple(self):
        class Pair(nn.Module):
            def forward(self, obs):
                return obs[..., :1], obs

        with pytest.raises(TypeError, match="returned tuple"):
            Collector(lambda: GymEnv("Pendulum-v1"), Pair(), frames_per_batch=4)

    def test_tensordict_module_outputs_land_in_the_batch(self):
        policy = categorical_policy()
        (batch,) = collect(lambda: GymEnv("CartPole-v1", num_envs=2), policy, frames_per_batch=32, seed=0)
        lp = log_prob_key(batch)
        assert batch["logits"].shape == (2, 16, 2)
        assert batch["action"].shape == (2, 16)
        assert batch["action"].dtype == torch.int64
        assert batch[lp].shape == (2, 16)
        expected = torch.log_softmax(batch["logits"], -1).gather(-1, batch["action"][..., None])
        torch.testing.assert_close(batch[lp], expected.squeeze(-1))
        with torch.no_grad():
            torch.testing.assert_close(batch["logits"], policy[0](batch.clone())["logits"])

    def test_private_keys_are_left_out(self):
        hidden = TensorDictModule(nn.Linear(4, 3), in_keys=["observation"], out_keys=["_hidden"])
        head = TensorDictModule(nn.Linear(3, 2), in_keys=["_hidden"], out_keys=["logits"])
        dist = ProbabilisticTensorDictModule(
            in_keys=["logits"], out_keys=["action"], distribution_class=Categorical
        )
        extra = TensorDictModule(
            lambda x: (x, x), in_keys=["logits"], out_keys=[("agent", "value"), ("agent", "_aux")]
        )
        policy = ProbabilisticTensorDictSequential(hidden, head, extra, dist)
        (batch,) = collect(lambda: GymEnv("CartPole-v1"), policy, frames_per_batch=8)
        keys = set(batch.keys(include_nested=True, leaves_only=True))
        assert "_hidden" not in keys
        assert ("agent", "_aux") not in keys
        assert ("agent", "value") in keys
        assert "logits" in keys
        assert not any(k.startswith("_") for k in batch.keys())  # noqa: SIM118

    def test_tensordict_sequential(self):
        policy = TensorDictSequential(
            TensorDictModule(nn.Linear(3, 4), in_keys=["observation"], out_keys=["hidden"]),
            TensorDictModule(nn.Linear(4, 1), in_keys=["hidden"], out_keys=["action"]),
        )
        (batch,) = collect(lambda: GymEnv("Pendulum-v1"), policy, frames_per_batch=8)
        assert batch["hidden"].shape == (8, 4)
        assert batch["action"].shape == (8, 1)


class TestCallables:
    def test_callable_td_to_td(self):
        def policy(td):
            td["action"] = torch.zeros(td.batch_size, dtype=torch.int64)
            td["score"] = td["observation"].sum(-1)
            td["_scratch"] = td["observation"]
            td["next", "cheat"] = td["observation"]  # a policy does not write "next" entries
            return td

        (batch,) = collect(lambda: GymEnv("CartPole-v1", num_envs=2), policy, frames_per_batch=8)
        assert (batch["action"] == 0).all()
        torch.testing.assert_close(batch["score"], batch["observation"].sum(-1))
        assert "_scratch" not in batch.keys()  # noqa: SIM118
        assert ("next", "cheat") not in batch.keys(include_nested=True)

    def test_callable_writing_in_place_and_returning_none(self):
        def policy(td):
            td["action"] = torch.ones(td.batch_size, dtype=torch.int64)

        (batch,) = collect(lambda: GymEnv("CartPole-v1"), policy, frames_per_batch=4)
        assert (batch["action"] == 1).all()

    def test_callable_without_action(self):
        def policy(td):
            return td.set("logits", torch.zeros(*td.batch_size, 2))

        with pytest.raises(KeyError, match="'action'") as info:
            Collector(lambda: GymEnv("CartPole-v1"), policy, frames_per_batch=4)
        assert "logits" in str(info.value)

    def test_callable_returning_a_tensor(self):
        with pytest.raises(TypeError, match="TensorDict"):
            Collector(
                lambda: GymEnv("CartPole-v1"),
                lambda td: torch.zeros((), dtype=torch.int64),
                frames_per_batch=4,
            )

    @pytest.mark.parametrize("policy", [3, "random", object()])
    def test_not_a_policy(self, policy):
        with pytest.raises(TypeError, match="policy"):
            Collector(lambda: GymEnv("CartPole-v1"), policy, frames_per_batch=4)


# -- exploration ---------------------------------------------------------------------------------------
FLAGS = ("done", "terminated", "truncated")


class TestExploration:
    @pytest.mark.parametrize(
        "exploration", ["deterministic", "mode", "DETERMINISTIC", InteractionType.DETERMINISTIC]
    )
    def test_deterministic_gives_the_argmax(self, exploration):
        (batch,) = collect(
            lambda: GymEnv("CartPole-v1", num_envs=4),
            categorical_policy(scale=0.1),
            frames_per_batch=128,
            exploration_type=exploration,
            seed=0,
        )
        assert torch.equal(batch["action"], batch["logits"].argmax(-1))

    @pytest.mark.parametrize("exploration", ["random", InteractionType.RANDOM])
    def test_random_samples(self, exploration):
        (batch,) = collect(
            lambda: GymEnv("CartPole-v1", num_envs=4),
            categorical_policy(scale=0.1),  # logits near 0: samples often differ from the argmax
            frames_per_batch=128,
            exploration_type=exploration,
            seed=0,
        )
        mismatch = (batch["action"] != batch["logits"].argmax(-1)).float().mean()
        assert 0.2 < mismatch < 0.8

    def test_default_is_random(self):
        (batch,) = collect(
            lambda: GymEnv("CartPole-v1", num_envs=4),
            categorical_policy(scale=0.1),
            frames_per_batch=128,
            seed=0,
        )
        assert not torch.equal(batch["action"], batch["logits"].argmax(-1))

    @pytest.mark.parametrize("exploration", ["greedy", "", 3, None, True])
    def test_unknown_exploration_type(self, exploration):
        with pytest.raises(ValueError, match="exploration_type") as info:
            Collector(
                lambda: GymEnv("CartPole-v1"),
                categorical_policy(),
                frames_per_batch=4,
                exploration_type=exploration,
            )
        assert "deterministic" in str(info.value)


# -- compile and no_grad -------------------------------------------------------------------------------
class TestCompileAndGrad:
    @pytest.mark.parametrize("kind", ["module", "tensordict"])
    def test_compiled_policy_collects_the_same_batch(self, kind):
        torch._dynamo.reset()
        if kind == "module":
            torch.manual_seed(0)
            policy: Any = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
            env_fn = lambda: GymEnv("Pendulum-v1", num_envs=2)  # noqa: E731
        else:
            policy = categorical_policy()
            env_fn = lambda: GymEnv("CartPole-v1", num_envs=2)  # noqa: E731

        def run(option):
            return collect(env_fn, policy, frames_per_batch=16, batches=2, seed=0, compile_policy=option)

        eager = run(False)
        compiled = run({"backend": "eager"})
        for a, b in zip(eager, compiled, strict=True):
            assert set(a.keys(include_nested=True)) == set(b.keys(include_nested=True))
            assert (a == b).all()

    def test_compile_policy_true_with_random_policy(self):
        (batch,) = collect(lambda: GymEnv("CartPole-v1"), frames_per_batch=4, compile_policy=True)
        assert batch["action"].shape == (4,)

    def test_policy_runs_without_grad(self):
        grad_enabled = []
        linear = nn.Linear(4, 2)

        def policy(td):
            grad_enabled.append(torch.is_grad_enabled())
            logits = linear(td["observation"])
            return td.update({"logits": logits, "action": logits.argmax(-1)})

        (batch,) = collect(lambda: GymEnv("CartPole-v1"), policy, frames_per_batch=8)
        assert grad_enabled and not any(grad_enabled)
        assert not batch["logits"].requires_grad

    @pytest.mark.parametrize("kind", ["module", "tensordict"])
    def test_outputs_do_not_require_grad(self, kind):
        policy = (
            nn.Linear(3, 1)
            if kind == "module"
            else TensorDictModule(nn.Linear(3, 1), in_keys=["observation"], out_keys=["action"])
        )
        (batch,) = collect(lambda: GymEnv("Pendulum-v1"), policy, frames_per_batch=8)
        assert not batch["action"].requires_grad
        assert torch.is_grad_enabled()
