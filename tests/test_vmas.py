"""VMAS natively (issue 41): ``VmasEnv`` in TorchRL's ``VmasEnv`` layout, stepped through its torch tensors;
batches checked against a raw VMAS loop with the same seed and actions."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch
from torch import nn

vmas = pytest.importorskip("vmas")

from aiocollect import Collector, MultiSyncCollector, VmasEnv  # noqa: E402

pytestmark = pytest.mark.anyio


def _collect(make: Any, frames: int, seed: int, policy: Any = None) -> Any:
    async def main() -> Any:
        async with Collector(make, policy, frames_per_batch=frames, total_frames=frames, seed=seed) as c:
            async for batch in c:
                return batch

    return anyio.run(main)


def test_layout() -> None:
    env = VmasEnv("balance", num_envs=4, seed=0)
    assert env.group_map == {"agents": ["agent_0", "agent_1", "agent_2"]}
    td = env.reset()
    shapes = {k: tuple(v.shape) for k, v in td.items(include_nested=True, leaves_only=True)}
    assert shapes == {
        ("agents", "observation"): (4, 3, 16),
        ("agents", "info", "pos_rew"): (4, 3, 1),
        ("agents", "info", "ground_rew"): (4, 3, 1),
    }
    assert env.action_specs[("agents", "action")].shape == (3, 2)
    env.close()


@pytest.mark.parametrize("continuous", [True, False])
def test_batch_equals_a_raw_vmas_loop(continuous: bool) -> None:
    """The same seed and the batch's actions give a raw VMAS env the batch's observations and rewards."""
    steps = 12
    make = lambda: VmasEnv("navigation", num_envs=3, continuous_actions=continuous, max_steps=5)  # noqa: E731
    batch = _collect(make, 3 * steps, seed=5)
    # made first: VMAS keeps one random state per process, which making an env draws from
    group_map = VmasEnv("navigation", num_envs=1).group_map
    raw = vmas.make_env("navigation", num_envs=3, continuous_actions=continuous, max_steps=5, seed=5)
    raw.seed(5)
    obs = raw.reset()
    names = [a.name for a in raw.agents]
    assert group_map == {"agents": names}
    for t in range(steps):
        frame = batch[:, t]
        assert torch.equal(frame["agents", "observation"], torch.stack(obs, dim=1))
        action = frame["agents", "action"]
        obs, rewards, dones, _ = raw.step([action[:, j] for j in range(len(names))])
        assert torch.equal(frame["next", "agents", "observation"], torch.stack(obs, dim=1))
        assert torch.equal(frame["next", "agents", "reward"], torch.stack(rewards, dim=1).unsqueeze(-1))
        assert torch.equal(frame["next", "done"][:, 0], dones)
        assert torch.equal(frame["next", "truncated"][:, 0], dones)  # the horizon: truncated, not terminated
        if dones.all():  # as TorchRL's VmasEnv: every world reset at once, else one by one
            obs = raw.reset()
        for i in torch.nonzero(dones).flatten().tolist() if not dones.all() else []:
            obs = raw.reset_at(i)
    assert int(batch["next", "done"].sum()) == 6  # two episodes of 5 steps in each world


async def test_multi_sync_collector_with_a_policy(leaks: Any) -> None:
    class Push(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(16, 2)

        def forward(self, observation: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.net(observation))

    policy = {"agents": Push()}
    make = lambda: VmasEnv("balance", num_envs=8, max_steps=20)  # noqa: E731
    async with MultiSyncCollector([make, make], policy, frames_per_batch=160, total_frames=320, seed=0) as c:
        async for batch in c:
            assert batch["agents", "observation"].shape == (2, 8, 10, 3, 16)
            expect = policy["agents"](batch["agents", "observation"])
            assert torch.allclose(batch["agents", "action"], expect)
            assert await c.update_weights(policy) >= 1


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_envs must be a positive int"):
        VmasEnv("balance", num_envs=0)
    with pytest.raises(ValueError, match="group_map"):
        VmasEnv("balance", num_envs=2, group_map={"a": ["agent_0"]})
