"""A run saved and resumed as docs/long-runs.md shows gives the uninterrupted run's batches exactly, also
with a trainer that publishes new weights after every batch: the observations, actions, rewards, the
trajectory ids and the policy versions, on ``Collector``, ``MultiSyncCollector`` and
``MultiAsyncCollector`` (one worker, ``max_policy_lag=0``), under asyncio and trio.

The checkpoint is the one the uninterrupted run takes after its ``k``-th batch (the trainer's policy
beside the collector's state), through ``save_checkpoint`` / ``load_checkpoint``; the counters the
collector restores (its policy version) are the saved ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import gymnasium as gym
import pytest
import torch
from tensordict import TensorDictBase
from torch import nn

from aiocollect import (
    Collector,
    GymEnv,
    MultiAsyncCollector,
    MultiSyncCollector,
    load_checkpoint,
    save_checkpoint,
)

pytestmark = pytest.mark.anyio

LOOPS = [
    pytest.param(("asyncio", {"use_uvloop": False}), id="asyncio"),
    pytest.param(("trio", {}), id="trio"),
]


def pendulums() -> GymEnv:
    """Two Pendulums whose episodes end after 7 and 11 steps: trajectory ids change inside batches."""
    return GymEnv(
        gym.vector.SyncVectorEnv(
            [
                lambda: gym.make("Pendulum-v1", max_episode_steps=7),
                lambda: gym.make("Pendulum-v1", max_episode_steps=11),
            ]
        )
    )


class Noisy(nn.Module):
    """A continuous policy with weights and sampling noise (from the collector's seeded generator): a
    weight one update behind shows in every action."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)
        with torch.no_grad():
            self.lin.weight.fill_(0.1)
            self.lin.bias.zero_()

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        mean = 2 * torch.tanh(self.lin(observation))
        return (mean + 0.1 * torch.randn_like(mean)).clamp(-2.0, 2.0)


def build(kind: str, policy: nn.Module) -> Any:
    common: dict[str, Any] = {
        "frames_per_batch": 16,
        "total_frames": -1,
        "seed": 11,
        "track_policy_version": True,
    }
    if kind == "collector":
        return Collector(pendulums, policy, **common)
    if kind == "sync":
        return MultiSyncCollector([pendulums, pendulums], policy, **{**common, "frames_per_batch": 32})
    return MultiAsyncCollector([pendulums], policy, max_policy_lag=0, **common)


def train(policy: nn.Module, batch: TensorDictBase) -> None:
    """A deterministic update from the batch (a stand-in for an optimizer step)."""
    with torch.no_grad():
        policy.lin.weight.add_(0.01 * batch["next", "reward"].float().mean())
        policy.lin.bias.add_(0.001)


def comparable(batches: list[TensorDictBase]) -> TensorDictBase:
    return torch.cat([b.exclude(("collector", "worker_id")).reshape(-1) for b in batches])


async def collect(
    kind: str,
    n: int,
    *,
    updates: bool,
    checkpoint_at: int | None = None,
    path: Path | None = None,
    resume: Path | None = None,
) -> tuple[list[TensorDictBase], list[int]]:
    """``n`` batches of a trainer that (``updates``) publishes its weights after each one; the checkpoint
    after batch ``checkpoint_at`` goes to ``path``; ``resume``: start from that checkpoint. Also the
    collector's policy version after each batch's update."""
    policy = Noisy()
    batches: list[TensorDictBase] = []
    versions: list[int] = []
    async with build(kind, policy) as collector:
        if resume is not None:
            state = load_checkpoint(resume)
            policy.load_state_dict(state["trainer"])
            await collector.load_state_dict(state["collector"])
            assert collector.policy_version == state["collector"]["policy_version"]
        with anyio.fail_after(120):
            async for batch in collector:
                batches.append(batch)
                if updates:
                    train(policy, batch)
                    await collector.update_weights(policy)
                versions.append(collector.policy_version)
                if len(batches) == checkpoint_at:
                    assert path is not None
                    state = {
                        "collector": await collector.state_dict(envs=True),
                        "trainer": policy.state_dict(),
                    }
                    save_checkpoint(state, path)
                if len(batches) == n:
                    break
    return batches, versions


@pytest.mark.parametrize("anyio_backend", LOOPS)
@pytest.mark.parametrize("kind", ["collector", "sync", "async"])
@pytest.mark.parametrize("updates", [True, False], ids=["updates", "no-updates"])
async def test_resume_gives_the_uninterrupted_batches(
    kind: str, updates: bool, tmp_path: Path, anyio_backend: Any
) -> None:
    path = tmp_path / "ckpt.pt"
    full, versions = await collect(kind, 7, updates=updates, checkpoint_at=3, path=path)
    tail, resumed_versions = await collect(kind, 4, updates=updates, resume=path)
    expected, got = comparable(full[3:]), comparable(tail)
    assert (expected["collector", "traj_ids"] == got["collector", "traj_ids"]).all()
    assert (expected["collector", "policy_version"] == got["collector", "policy_version"]).all()
    assert (expected["action"] == got["action"]).all()
    assert (expected == got).all()
    assert resumed_versions == versions[3:]
