"""Multi-agent keys (issue 18): agent groups as TorchRL (VMAS, PettingZoo) lays them out, with an agent dim
after the batch dims: ``("agents", "observation")``, ``("agents", "action")``, per-agent rewards and done
flags; in process and in worker processes. The env is a protocol env of our own (no torchrl here)."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest
import torch
from gymnasium import spaces
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from aiocollect import Collector, MultiAsyncCollector, MultiSyncCollector

pytestmark = pytest.mark.anyio

AGENTS = 3
LIMIT = 4  # positions -LIMIT..LIMIT


class Walkers:
    """``AGENTS`` walkers on a line, each stepping -1, 0 or +1 (a MultiDiscrete per group) towards 0.

    Per agent: reward ``-|position|`` after the move, done (terminated) once at 0 (it stays done). The env
    terminates when every agent is done, and truncates after ``max_steps``.
    """

    def __init__(self, num_envs: int = 2, max_steps: int = 6, group_truncated: bool = False) -> None:
        self.batch_size = torch.Size([num_envs])
        self.max_steps = max_steps
        self.group_truncated = group_truncated
        self.observation_space = spaces.Dict(
            {"agents": spaces.Dict({"observation": spaces.Box(-LIMIT, LIMIT, (AGENTS, 1), np.float32)})}
        )
        self.action_space = spaces.Dict(
            {"agents": spaces.Dict({"action": spaces.MultiDiscrete([3] * AGENTS)})}
        )
        self.reward_space = spaces.Dict(
            {"agents": spaces.Dict({"reward": spaces.Box(-np.inf, np.inf, (AGENTS, 1), np.float32)})}
        )
        group_names = ("done", "terminated", "truncated") if group_truncated else ("done", "terminated")
        group_flags = {name: spaces.MultiBinary((AGENTS, 1)) for name in group_names}
        self.done_space = spaces.Dict(
            {
                "done": spaces.MultiBinary(1),
                "terminated": spaces.MultiBinary(1),
                "truncated": spaces.MultiBinary(1),
                "agents": spaces.Dict(group_flags),
            }
        )
        self.rng = np.random.default_rng(0)
        self.pos = np.zeros((num_envs, AGENTS), dtype=np.int64)
        self.steps = np.zeros(num_envs, dtype=np.int64)

    def set_seed(self, seed: int) -> int:
        self.rng = np.random.default_rng(seed)
        return seed

    def _obs(self) -> TensorDict:
        out = TensorDict({}, batch_size=self.batch_size)
        out["agents", "observation"] = torch.from_numpy(self.pos.astype(np.float32)[..., None])
        return out

    def reset(self, td: TensorDict | None = None) -> TensorDict:
        mask = np.ones(len(self.pos), dtype=bool) if td is None else td["_reset"].reshape(-1).numpy()
        fresh = self.rng.integers(-LIMIT, LIMIT + 1, self.pos.shape)
        fresh[fresh == 0] = LIMIT
        self.pos[mask] = fresh[mask]
        self.steps[mask] = 0
        return self._obs()

    def step(self, td: TensorDict) -> TensorDict:
        action = td["agents", "action"].numpy()
        assert action.shape == self.pos.shape and action.dtype == np.int64
        at_goal = self.pos == 0
        self.pos = np.where(at_goal, 0, np.clip(self.pos + action - 1, -LIMIT, LIMIT))
        self.steps += 1
        agent_done = torch.from_numpy(self.pos == 0)[..., None]
        terminated = agent_done.all(-2)
        truncated = torch.from_numpy(self.steps >= self.max_steps)[:, None] & ~terminated
        nxt = self._obs()
        nxt["agents", "reward"] = -torch.from_numpy(np.abs(self.pos).astype(np.float32))[..., None]
        nxt["agents", "done"] = nxt["agents", "terminated"] = agent_done
        if self.group_truncated:
            nxt["agents", "truncated"] = truncated[:, None].expand(-1, AGENTS, 1).clone()
            nxt["agents", "done"] = agent_done | nxt["agents", "truncated"]
        nxt.update({"terminated": terminated, "truncated": truncated, "done": terminated | truncated})
        return TensorDict({"next": nxt}, batch_size=self.batch_size)

    def close(self) -> None:
        pass


def walkers() -> Walkers:
    return Walkers()


def long_walkers() -> Walkers:
    """Walkers with a truncated flag per agent too, whose episodes end before they truncate."""
    return Walkers(max_steps=100, group_truncated=True)


class Homing(nn.Module):
    """Per agent: step towards 0 (action 0, 1 or 2), a shared rule over the agent dim."""

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return (1 - torch.sign(observation[..., 0])).to(torch.int64)


def homing_policy() -> TensorDictModule:
    return TensorDictModule(Homing(), in_keys=[("agents", "observation")], out_keys=[("agents", "action")])


async def collect(collector: Any) -> list[TensorDict]:
    with anyio.fail_after(60):
        async with collector as c:
            return [b async for b in c]


async def test_group_keys_have_an_agent_dim() -> None:
    (batch,) = await collect(Collector(walkers, homing_policy(), frames_per_batch=16, total_frames=16))
    layout = {k: (tuple(v.shape), v.dtype) for k, v in batch.items(include_nested=True, leaves_only=True)}
    B, T = 2, 8
    expected = {
        ("agents", "observation"): ((B, T, AGENTS, 1), torch.float32),
        ("next", "agents", "observation"): ((B, T, AGENTS, 1), torch.float32),
        ("agents", "action"): ((B, T, AGENTS), torch.int64),
        ("next", "agents", "reward"): ((B, T, AGENTS, 1), torch.float32),
        ("agents", "done"): ((B, T, AGENTS, 1), torch.bool),
        ("next", "agents", "done"): ((B, T, AGENTS, 1), torch.bool),
        ("next", "agents", "terminated"): ((B, T, AGENTS, 1), torch.bool),
        ("next", "done"): ((B, T, 1), torch.bool),
        ("next", "terminated"): ((B, T, 1), torch.bool),
        ("collector", "traj_ids"): ((B, T), torch.int64),
    }
    for key, spec in expected.items():
        assert layout[key] == spec, key
    assert ("next", "reward") not in layout  # the env has per-agent rewards only, as in TorchRL's batch


@pytest.mark.parametrize("max_steps", [None, 3], ids=["env-ends", "max_frames_per_traj"])
async def test_values_follow_the_env(max_steps: int | None) -> None:
    (batch,) = await collect(
        Collector(
            walkers,
            homing_policy(),
            frames_per_batch=40,
            total_frames=40,
            seed=3,
            max_frames_per_traj=max_steps,
        )
    )
    obs = batch["agents", "observation"][..., 0]
    nxt = batch["next", "agents", "observation"][..., 0]
    action = batch["agents", "action"]
    agent_done = batch["next", "agents", "done"][..., 0]
    done = batch["next", "done"][..., 0]
    assert torch.equal(nxt, torch.where(obs == 0, 0, obs + action - 1))
    assert torch.equal(batch["next", "agents", "reward"][..., 0], -nxt.abs())
    assert torch.equal(agent_done, nxt == 0)
    assert torch.equal(batch["next", "terminated"][..., 0], agent_done.all(-1))
    ids = batch["collector", "traj_ids"]
    assert done.any()
    for t in range(batch.shape[-1] - 1):
        going = ~done[:, t]
        assert torch.equal(ids[:, t + 1] == ids[:, t], going)
        assert torch.equal(obs[going, t + 1], nxt[going, t])
        # an agent's done flag is carried to the next frame, reset with the env
        assert torch.equal(batch["agents", "done"][going, t + 1], batch["next", "agents", "done"][going, t])
        assert not batch["agents", "done"][~going, t + 1].any()


async def test_random_actions_fill_the_group_action() -> None:
    (batch,) = await collect(Collector(walkers, frames_per_batch=40, total_frames=40, seed=0))
    action = batch["agents", "action"]
    assert action.shape == (2, 20, AGENTS) and set(action.unique().tolist()) == {0, 1, 2}


@pytest.mark.parametrize("backend", ["serial", "process"])
async def test_workers_give_the_collectors_batches(backend: str) -> None:
    ours = await collect(Collector(walkers, homing_policy(), frames_per_batch=16, total_frames=48, seed=1))
    multi = await collect(
        MultiSyncCollector(
            [walkers], homing_policy(), frames_per_batch=16, total_frames=48, seed=1, worker_backend=backend
        )
    )
    assert len(ours) == len(multi) == 3
    for a, b in zip(ours, multi, strict=True):
        b = b[0]
        for key in a.keys(include_nested=True, leaves_only=True):
            if key != ("collector", "traj_ids"):
                assert torch.equal(a[key], b[key]), key


async def test_a_group_action_of_the_wrong_shape_is_refused() -> None:
    policy = TensorDictModule(
        lambda obs: torch.zeros(obs.shape[:-2], dtype=torch.int64),
        in_keys=[("agents", "observation")],
        out_keys=[("agents", "action")],
    )
    with pytest.raises(ValueError, match=r"\('agents', 'action'\) has shape \(\)"):
        Collector(walkers, policy, frames_per_batch=8)


async def test_multi_async_collects_groups() -> None:
    out = await collect(
        MultiAsyncCollector([walkers] * 2, homing_policy(), frames_per_batch=16, total_frames=64)
    )
    assert len(out) == 4
    for batch in out:
        assert batch["agents", "action"].shape == (2, 8, AGENTS)
        assert batch["next", "agents", "reward"].shape == (2, 8, AGENTS, 1)


FLAGS = [("next", "truncated"), ("next", "done"), ("next", "agents", "truncated"), ("next", "agents", "done")]


@pytest.mark.parametrize("kind", ["collector", "multi-sync", "multi-async"])
async def test_set_truncated_marks_the_groups_flags(kind: str) -> None:
    """set_truncated sets every truncated flag (the agent group's too) and the done flag beside it on a
    batch's last frame, and nothing else."""

    def build(set_truncated: bool) -> Any:
        kw: dict[str, Any] = {"frames_per_batch": 16, "total_frames": 32, "seed": 5}
        if kind == "collector":
            return Collector(long_walkers, homing_policy(), set_truncated=set_truncated, **kw)
        cls = MultiSyncCollector if kind == "multi-sync" else MultiAsyncCollector
        return cls(
            [long_walkers], homing_policy(), set_truncated=set_truncated, worker_backend="serial", **kw
        )

    plain, marked = await collect(build(False)), await collect(build(True))
    assert len(plain) == len(marked) == 2
    for a, b in zip(plain, marked, strict=True):
        assert not a["next", "agents", "truncated"].any()  # the env itself never truncates here
        for key in FLAGS:
            assert b[..., -1][key].all(), key  # the time dim is the batch's last
            assert torch.equal(a[..., :-1][key], b[..., :-1][key]), key
        assert torch.equal(a["next", "agents", "terminated"], b["next", "agents", "terminated"])
        assert torch.equal(a["collector", "traj_ids"], b["collector", "traj_ids"])  # the episode goes on


@pytest.mark.parametrize("kind", ["collector", "multi-sync"])
async def test_set_truncated_with_split_trajs(kind: str) -> None:
    """With split_trajs, the trajectory cut by the batch end is the one marked truncated, in every env
    row: its last frame, in the group's flags and the env's."""
    kw: dict[str, Any] = {"frames_per_batch": 16, "total_frames": 16, "seed": 5, "set_truncated": True}
    if kind == "collector":
        collector: Any = Collector(long_walkers, homing_policy(), split_trajs=True, **kw)
    else:
        collector = MultiSyncCollector(
            [long_walkers], homing_policy(), split_trajs=True, worker_backend="serial", **kw
        )
    (split,) = await collect(collector)
    mask = split["collector", "mask"]
    lengths = mask.sum(-1)
    last = split[torch.arange(len(split)), lengths - 1]
    truncated = split["next", "agents", "truncated"][..., 0, 0] & mask
    assert int(truncated.sum()) == 2  # one per env row: the cut trajectories
    assert torch.equal(truncated.any(-1), last["next", "agents", "truncated"][:, 0, 0])
    for key in FLAGS:
        flag = last[key].reshape(len(split), -1).all(-1)
        # every trajectory ends done: cut by the batch end (truncated), or ended by the env
        expected = truncated.any(-1) if key[-1] == "truncated" else torch.ones_like(flag)
        assert torch.equal(flag, expected), key
