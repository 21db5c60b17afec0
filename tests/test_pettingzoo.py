"""PettingZoo envs natively (issue 41): ``PettingZooEnv`` in TorchRL's group layout, parallel and turn-based,
action masks, agents that leave, every collector; batches checked against a raw PettingZoo loop."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from gymnasium import spaces
from torch import nn

pettingzoo = pytest.importorskip("pettingzoo")
mpe2 = pytest.importorskip("mpe2")

from mpe2 import simple_adversary_v3, simple_spread_v3  # noqa: E402

from aiocollect import (  # noqa: E402
    AsyncEnvCollector,
    Collector,
    GroupPolicy,
    MultiAsyncCollector,
    MultiSyncCollector,
    PettingZooEnv,
    RestartPolicy,
)

pytestmark = pytest.mark.anyio


def spread(max_cycles: int = 10) -> Any:
    return simple_spread_v3.parallel_env(max_cycles=max_cycles)


def adversary(max_cycles: int = 10) -> Any:
    return simple_adversary_v3.parallel_env(max_cycles=max_cycles)


def tictactoe() -> Any:
    return pettingzoo.make("aec", "classic/tictactoe-v3")


def connect_four() -> Any:
    return pettingzoo.make("aec", "classic/connect_four-v3")


class Relay(pettingzoo.ParallelEnv):
    """Three runners; runner ``i`` finishes (terminates) after ``i + 1`` steps, so agents leave one by one.
    Observation: ``[step, i, action]``; reward ``i + 1`` at each step a runner runs."""

    metadata = {"name": "relay"}  # noqa: RUF012

    def __init__(self, fail_at: int | None = None) -> None:
        self.possible_agents = [f"runner_{i}" for i in range(3)]
        self.agents: list[str] = []
        self.fail_at = fail_at
        self.stepped = 0

    def observation_space(self, agent: str) -> spaces.Space[Any]:
        return spaces.Box(-10, 10, (3,), np.float32)

    def action_space(self, agent: str) -> spaces.Space[Any]:
        return spaces.Discrete(2)

    def _obs(self, agent: str, action: int = 0) -> np.ndarray:
        return np.array([self.t, int(agent[-1]), action], np.float32)

    def reset(self, seed: int | None = None, options: Any = None) -> Any:
        self.agents = list(self.possible_agents)
        self.t = 0
        return {a: self._obs(a) for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions: dict[str, Any]) -> Any:
        self.stepped += 1
        if self.fail_at is not None and self.stepped == self.fail_at:
            raise RuntimeError("relay broke")
        assert set(actions) == set(self.agents), (actions, self.agents)
        self.t += 1
        obs = {a: self._obs(a, int(actions[a])) for a in self.agents}
        rewards = {a: float(int(a[-1]) + 1) for a in self.agents}
        terms = {a: self.t >= int(a[-1]) + 1 for a in self.agents}
        truncs = dict.fromkeys(self.agents, False)
        infos: dict[str, dict[str, Any]] = {a: {} for a in self.agents}
        self.agents = [a for a in self.agents if not terms[a]]
        return obs, rewards, terms, truncs, infos


# -- the layout, and the values a raw PettingZoo loop observes --------------------------------------------
def test_layout_of_simple_adversary() -> None:
    env = PettingZooEnv(lambda: adversary(), num_envs=2, seed=0)
    assert env.group_map == {"adversary": ["adversary_0"], "agent": ["agent_0", "agent_1"]}
    td = env.reset()
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in td.items(include_nested=True, leaves_only=True)}
    assert shapes == {
        ("adversary", "observation"): ((2, 1, 8), torch.float32),
        ("agent", "observation"): ((2, 2, 10), torch.float32),
        ("adversary", "done"): ((2, 1, 1), torch.bool),
        ("adversary", "terminated"): ((2, 1, 1), torch.bool),
        ("adversary", "truncated"): ((2, 1, 1), torch.bool),
        ("agent", "done"): ((2, 2, 1), torch.bool),
        ("agent", "terminated"): ((2, 2, 1), torch.bool),
        ("agent", "truncated"): ((2, 2, 1), torch.bool),
        "state": ((2, 28), torch.float32),
    }
    assert env.action_specs == {
        ("adversary", "action"): env.action_specs[("adversary", "action")],
        ("agent", "action"): env.action_specs[("agent", "action")],
    }
    assert env.action_specs[("agent", "action")].shape == (2,)
    env.close()


def _collect(make: Any, frames: int, seed: int, **kwargs: Any) -> Any:
    async def main() -> Any:
        async with Collector(make, frames_per_batch=frames, total_frames=frames, seed=seed, **kwargs) as c:
            async for batch in c:
                return batch

    return anyio.run(main)


def _replay(batch: Any, make: Any, group_map: dict[str, list[str]], seed: int) -> int:
    """Step raw PettingZoo envs (copy ``i`` reset with ``seed + i``) with the batch's actions and check that
    every entry of the batch is what they observe. Returns the episodes seen."""
    rows = batch if batch.batch_dims == 2 else batch.unsqueeze(0)
    episodes = 0
    for i in range(rows.shape[0]):
        env = make()
        obs, _ = env.reset(seed=seed + i)
        for t in range(rows.shape[1]):
            frame = rows[i, t]
            np.testing.assert_array_equal(frame["state"].numpy(), env.state())
            actions = {}
            for g, agents in group_map.items():
                for j, agent in enumerate(agents):
                    np.testing.assert_array_equal(frame[g, "observation"][j].numpy(), obs[agent])
                    actions[agent] = int(frame[g, "action"][j])
            obs, rewards, terms, truncs, _ = env.step(actions)
            for g, agents in group_map.items():
                for j, agent in enumerate(agents):
                    np.testing.assert_array_equal(frame["next", g, "observation"][j].numpy(), obs[agent])
                    assert float(frame["next", g, "reward"][j, 0]) == pytest.approx(rewards[agent], rel=1e-6)
                    assert bool(frame["next", g, "terminated"][j, 0]) == terms[agent]
                    assert bool(frame["next", g, "truncated"][j, 0]) == truncs[agent]
            np.testing.assert_array_equal(frame["next", "state"].numpy(), env.state())
            ended = not env.agents
            assert bool(frame["next", "done"]) == ended
            if ended:
                episodes += 1
                obs, _ = env.reset()
        env.close()
    return episodes


@pytest.mark.parametrize("num_envs", [None, 2])
@pytest.mark.parametrize("make", [spread, adversary], ids=["simple_spread", "simple_adversary"])
def test_batch_equals_a_raw_pettingzoo_loop(make: Any, num_envs: int | None) -> None:
    batch = _collect(lambda: PettingZooEnv(make, num_envs=num_envs), frames=60, seed=3)
    group_map = PettingZooEnv(make).group_map
    assert _replay(batch, make, group_map, seed=3) >= 5  # max_cycles=10: episodes end inside the batch
    # the episodes' ends are the trajectory ids' changes, and the root after an end is the reset observation
    rows = batch if batch.batch_dims == 2 else batch.unsqueeze(0)
    ids = rows["collector", "traj_ids"]
    assert torch.equal(rows["next", "done"][:, :-1, 0], ids[:, 1:] != ids[:, :-1])


def test_seeded_runs_are_reproducible() -> None:
    make = lambda: PettingZooEnv(adversary, num_envs=2)  # noqa: E731
    a, b = _collect(make, 40, seed=7), _collect(make, 40, seed=7)
    assert (a == b).all()
    assert not (a["agent", "observation"] == _collect(make, 40, seed=8)["agent", "observation"]).all()


# -- action masks, turn-based envs --------------------------------------------------------------------------
@pytest.mark.parametrize("make", [tictactoe, connect_four], ids=["tictactoe", "connect_four"])
def test_random_actions_are_legal_in_classic_games(make: Any) -> None:
    """Thousands of random steps: the acting agent's action is always legal under its action mask."""
    batch = _collect(lambda: PettingZooEnv(make, num_envs=4, group_map="all"), frames=4000, seed=0)
    acting = batch["agents", "mask"]  # [4, T, 2]: the agent whose turn it is
    assert bool((acting.sum(-1) == 1).all())  # exactly one agent acts at each step
    action, legal = batch["agents", "action"], batch["agents", "action_mask"]
    chosen = legal.gather(-1, action.unsqueeze(-1)).squeeze(-1)
    assert bool(chosen[acting].all())
    assert bool(legal[~acting].all())  # an agent not acting may do anything: its action is ignored
    # games end (a win, a loss or a draw) and the next one starts
    assert int(batch["next", "done"].sum()) > 100
    rewards = batch["next", "agents", "reward"][batch["next", "done"][..., 0]]
    assert set(rewards.sum(-2).flatten().tolist()) <= {0.0}  # zero-sum: +1 / -1, or a draw


def test_turn_based_layout() -> None:
    env = PettingZooEnv(tictactoe, seed=0)
    assert env.group_map == {"player_1": ["player_1"], "player_2": ["player_2"]}  # TorchRL's default
    td = env.reset()
    assert td["player_1", "observation", "observation"].shape == (1, 3, 3, 2)  # the Dict observation
    assert td["player_1", "action_mask"].shape == (1, 9)
    assert td["player_1", "mask"].tolist() == [True]  # player_1 moves first
    assert td["player_2", "mask"].tolist() == [False]
    with pytest.raises(ValueError, match="use_mask=True"):
        PettingZooEnv(tictactoe, use_mask=False)
    env.close()


# -- agents that leave ---------------------------------------------------------------------------------------
def test_agents_that_leave_are_masked_until_the_env_resets() -> None:
    batch = _collect(lambda: PettingZooEnv(Relay, use_mask=True), frames=9, seed=0)
    mask = batch["runner", "mask"]
    # runner i leaves after step i + 1; the episode (3 steps) ends when the last one does, and the next starts
    assert mask.tolist() == [[True] * 3, [False, True, True], [False, False, True]] * 3
    left = [[False, True, True], [False, False, True], [False] * 3]
    assert batch["next", "runner", "mask"][:3].tolist() == left
    obs = batch["next", "runner", "observation"]
    assert obs[1, 0].tolist() == [0.0, 0.0, 0.0]  # a runner that left: zeros
    assert obs[0, 0, :2].tolist() == [1.0, 0.0]  # its last step still has its observation
    assert batch["next", "runner", "reward"][:3, :, 0].tolist() == [[1, 2, 3], [0, 2, 3], [0, 0, 3]]
    assert batch["next", "runner", "terminated"][:3, :, 0].tolist() == [
        [True, False, False],
        [True, True, False],
        [True, True, True],
    ]
    assert batch["next", "done"][:, 0].tolist() == [False, False, True] * 3
    assert batch["collector", "traj_ids"].tolist() == [0] * 3 + [1] * 3 + [2] * 3
    assert batch["runner", "observation"][3].tolist() == [  # the reset after the first episode
        [0, 0, 0],
        [0, 1, 0],
        [0, 2, 0],
    ]


def test_an_agent_leaving_without_use_mask_is_refused() -> None:
    with pytest.raises(ValueError, match="use_mask=True"):
        _collect(lambda: PettingZooEnv(Relay, done_on_any=False), frames=9, seed=0)
    # done_on_any (the default without use_mask): the episode ends when the first runner is done
    batch = _collect(lambda: PettingZooEnv(Relay), frames=4, seed=0)
    assert batch["next", "done"][:, 0].tolist() == [True] * 4


# -- bad input ---------------------------------------------------------------------------------------------
def test_bad_arguments_are_refused_with_their_fix() -> None:
    with pytest.raises(TypeError, match="pass a callable"):
        PettingZooEnv(spread(), num_envs=2)
    with pytest.raises(ValueError, match="missing: \\['agent_2'\\]"):
        PettingZooEnv(spread, group_map={"a": ["agent_0", "agent_1"]})
    with pytest.raises(ValueError, match="group_map must be"):
        PettingZooEnv(spread, group_map="some")
    with pytest.raises(TypeError, match=r"different observation spaces.*per_agent"):
        PettingZooEnv(adversary, group_map="all")
    with pytest.raises(TypeError, match="ParallelEnv or AECEnv"):
        PettingZooEnv(lambda: object())
    with pytest.raises(ValueError, match="outside the action space"):
        env = PettingZooEnv(spread)
        env.reset()
        env.step(env.reset().set(("agent", "action"), torch.full((3,), 7)))


def test_import_aiocollect_imports_no_multiagent_library() -> None:
    libraries = "{'pettingzoo', 'mpe2', 'vmas', 'pygame'}"
    code = f"import sys, aiocollect; print(sorted({libraries} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=99)
    assert out.stdout.strip() == "[]"


def test_without_the_extra_the_error_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pettingzoo", None)
    with pytest.raises(ImportError, match='pip install "aiocollect\\[multiagent\\]"'):
        PettingZooEnv(spread)


# -- policies per group ------------------------------------------------------------------------------------
class Greedy(nn.Module):
    """The argmax of a linear map of one agent's observation (agent dim kept)."""

    def __init__(self, obs: int, actions: int = 5) -> None:
        super().__init__()
        self.net = nn.Linear(obs, actions)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).argmax(-1)


async def test_a_policy_per_group_and_random_actions_for_the_others() -> None:
    torch.manual_seed(0)
    agent = Greedy(10)
    make = lambda: PettingZooEnv(adversary, num_envs=2)  # noqa: E731
    async with Collector(make, {"agent": agent}, frames_per_batch=20, total_frames=40, seed=0) as c:
        async for batch in c:
            assert torch.equal(batch["agent", "action"], agent(batch["agent", "observation"]))
            # the adversary has no policy: random actions, in its space
            assert batch["adversary", "action"].unique().numel() > 1
        with torch.no_grad():
            agent.net.bias += torch.arange(5.0) * 100  # action 4 everywhere
        assert await c.update_weights({"agent": agent}) == 1
    async with Collector(make, {"agent": agent}, frames_per_batch=20, total_frames=20, seed=0) as c:
        async for batch in c:
            assert bool((batch["agent", "action"] == 4).all())


async def test_group_policy_weights_versions_and_checkpoints_in_workers(leaks: Any) -> None:
    torch.manual_seed(0)
    policy = {"agent": Greedy(18)}
    make = lambda: PettingZooEnv(spread, num_envs=2)  # noqa: E731
    async with MultiSyncCollector(
        [make, make], policy, frames_per_batch=40, total_frames=160, seed=0, track_policy_version=True
    ) as c:
        async for batch in c:
            version = int(batch["collector", "policy_version"].max())
            expect = policy["agent"](batch["agent", "observation"])
            assert torch.equal(batch["agent", "action"], expect)
            with torch.no_grad():
                policy["agent"].net.weight.normal_()
            assert await c.update_weights(policy, wait=True) == version + 1
        state = await c.state_dict()
    assert set(state) >= {"frames", "policy_version"}
    assert state["policy_version"] == 4


async def test_multi_async_collector_and_whole_episodes(leaks: Any) -> None:
    make = lambda: PettingZooEnv(spread, num_envs=2)  # noqa: E731
    async with MultiAsyncCollector([make, make], frames_per_batch=40, total_frames=160, seed=0) as c:
        ids = []
        async for batch in c:
            assert batch["agent", "observation"].shape == (2, 20, 3, 18)
            ids.append(batch["collector", "traj_ids"].unique())
        assert len(torch.cat(ids).unique()) > 8
    async with Collector(make, trajs_per_batch=4, total_frames=80, seed=0) as c:
        async for batch in c:  # 4 whole episodes of 10 steps (max_cycles), flat over frames
            assert batch["agent", "observation"].shape == (40, 3, 18)
            done = batch["next", "done"][:, 0]
            assert int(done.sum()) == 4 and bool(done[-1])
    async with Collector(make, frames_per_batch=30, total_frames=30, split_trajs=True, seed=0) as c:
        async for batch in c:
            assert batch["agent", "observation"].shape[-2:] == (3, 18)
            assert int(batch["collector", "mask"].sum()) == 30


async def test_groups_of_episodes_from_one_initial_state() -> None:
    """group_size: each copy is reset with its slot's seed, so the episodes of a group start alike."""
    make = lambda: PettingZooEnv(spread, num_envs=2)  # noqa: E731
    async with Collector(make, trajs_per_batch=4, group_size=2, total_frames=80, seed=0) as c:
        async for batch in c:  # 4 episodes of 10 steps, flat: two groups of two
            first = batch["agent", "observation"][::10]
            assert torch.equal(first[0], first[1]) and torch.equal(first[2], first[3])
            assert not torch.equal(first[0], first[2])
            assert batch["collector", "group_id"][::10].tolist() in ([0, 0, 1, 1], [2, 2, 3, 3])


async def test_restarts_and_resume() -> None:
    made = []

    def flaky() -> PettingZooEnv:
        made.append(1)
        return PettingZooEnv(lambda: Relay(fail_at=5 if len(made) == 1 else None), use_mask=True)

    fast = RestartPolicy(max_restarts=3, backoff=0.0, max_backoff=0.0)
    async with Collector(flaky, frames_per_batch=9, total_frames=18, seed=0, restart=fast) as c:
        frames = 0
        async for batch in c:
            frames += batch.numel()
        assert len(made) == 2 and frames == 18  # the env was rebuilt after it raised, the run went on
        state = await c.state_dict()
    make = lambda: PettingZooEnv(Relay, use_mask=True)  # noqa: E731

    class Argmax(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(3, 2)

        def forward(self, observation: torch.Tensor) -> torch.Tensor:
            return self.net(observation).argmax(-1)

    policy = {"runner": Argmax()}
    async with Collector(make, policy, frames_per_batch=9, total_frames=27, seed=0) as first:
        async for _ in first:
            break
        saved = await first.state_dict()
    async with Collector(make, {"runner": Argmax()}, frames_per_batch=9, total_frames=27, seed=0) as second:
        await second.load_state_dict(saved)
        assert torch.equal(second._policy["runner"].net.weight, policy["runner"].net.weight)
        n = 0
        async for _ in second:
            n += 1
        assert n == 2  # the frame budget went on from the checkpoint
    assert state["frames"] == 18


async def test_async_env_collector_refuses_a_batched_multi_agent_env() -> None:
    with pytest.raises(TypeError, match="PettingZooEnv"):
        async with AsyncEnvCollector([lambda: PettingZooEnv(spread)], frames_per_batch=10, total_frames=10):
            pass
    cartpole = lambda: __import__("gymnasium").make("CartPole-v1")  # noqa: E731
    with pytest.raises(TypeError, match="a policy per group"):
        async with AsyncEnvCollector([cartpole], {"agent": Greedy(4)}, frames_per_batch=10, total_frames=10):
            pass


def test_unknown_groups_are_refused() -> None:
    with pytest.raises(KeyError, match=r"groups \['players'\].*\['adversary', 'agent'\]"):
        Collector(lambda: PettingZooEnv(adversary), {"players": Greedy(10)}, frames_per_batch=10)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        GroupPolicy({"agent": lambda obs: obs})
