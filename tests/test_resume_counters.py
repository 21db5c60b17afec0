"""A resume keeps the counters the checkpoint holds: the policy version is the saved one (not one more), and
``statistics().restarts`` goes on from the saved count (the next ``Restarted`` event numbers the env's
restarts from there), on ``Collector``, ``MultiSyncCollector`` and ``MultiAsyncCollector``."""

from __future__ import annotations

from typing import Any

import anyio
import gymnasium as gym
import pytest
import torch
from torch import nn

from aiocollect import (
    Collector,
    GymEnv,
    MultiAsyncCollector,
    MultiSyncCollector,
    Restarted,
    RestartPolicy,
)
from support import CrashesAt

pytestmark = pytest.mark.anyio

FAST = RestartPolicy(max_restarts=100, window=600.0, backoff=0.0, max_backoff=0.0)


def crashing() -> GymEnv:
    """A Pendulum that raises at its 9th step, each time it is built."""
    return GymEnv(CrashesAt(gym.make("Pendulum-v1"), at=9))


class Mean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(observation))


def build(kind: str, policy: nn.Module) -> Any:
    common: dict[str, Any] = {"frames_per_batch": 20, "total_frames": -1, "seed": 3, "restart": FAST}
    if kind == "collector":
        return Collector(crashing, policy, **common)
    if kind == "sync":
        return MultiSyncCollector([crashing], policy, **common)
    return MultiAsyncCollector([crashing], policy, max_policy_lag=0, **common)


async def batches(collector: Any, n: int, policy: nn.Module) -> None:
    """``n`` batches, a weight update after each."""
    with anyio.fail_after(60):
        async for _ in collector:
            await collector.update_weights(policy)
            n -= 1
            if n == 0:
                return


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
@pytest.mark.parametrize("kind", ["collector", "sync", "async"])
async def test_resume_keeps_the_version_and_the_restarts(kind: str) -> None:
    policy = Mean()
    async with build(kind, policy) as collector:
        await batches(collector, 3, policy)
        state = await collector.state_dict()
        before = collector.statistics()
    assert state["policy_version"] == before.policy_version == 3
    saved = before.restarts
    assert saved > 0  # a restart every 8 steps

    resumed = build(kind, Mean())
    events = resumed.events(kinds={"restarted"})
    async with resumed:
        await resumed.load_state_dict(state)
        assert resumed.policy_version == 3
        assert resumed.statistics().restarts == saved
        assert resumed.statistics().workers[0].restarts == saved
        await batches(resumed, 1, policy)
        assert resumed.policy_version == 4
        after = resumed.statistics().restarts
    numbers = [e.restarts for e in iter(events.receive_nowait, None) if isinstance(e, Restarted)]
    assert numbers == list(range(saved + 1, after + 1))  # the env's restarts go on from the checkpoint's
