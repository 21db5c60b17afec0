"""``state_dict(envs=True)`` of a single (unbatched, ``batch_size == ()``) ``EnvProtocol`` env: every per-env
carry (the observation to act on, the trajectory id, the episode's return and length so far) is saved and
restored exactly, so the resumed run gives the uninterrupted run's batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from gymnasium import spaces
from tensordict import TensorDict, TensorDictBase

from aiocollect import Collector, MultiSyncCollector

pytestmark = pytest.mark.anyio


class Walk:
    """One random walk on a line (``batch_size == ()``): +-1 per step, an episode ends at +-3 or after 6
    steps; its state is its position, step count and generator."""

    def __init__(self) -> None:
        self.batch_size = torch.Size([])
        self.observation_space = spaces.Box(-3.0, 3.0, shape=(1,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self.position = torch.zeros(1)
        self.steps = 0
        self.generator = torch.Generator().manual_seed(0)

    def reset(self, td: TensorDict | None = None) -> TensorDict:
        self.position = torch.randint(-1, 2, (1,), generator=self.generator).float()
        self.steps = 0
        return TensorDict({"observation": self.position.clone()}, batch_size=[])

    def step(self, td: TensorDict) -> TensorDict:
        self.position = self.position + (td["action"].reshape(1).float() * 2 - 1)
        self.steps += 1
        terminated = self.position.abs() >= 3
        truncated = torch.tensor([self.steps >= 6]) & ~terminated
        next_td = {
            "observation": self.position.clone(),
            "reward": self.position.clone(),
            "done": terminated | truncated,
            "terminated": terminated,
            "truncated": truncated,
        }
        return TensorDict({"next": next_td}, batch_size=[])

    def set_seed(self, seed: int) -> int:
        self.generator.manual_seed(seed)
        return seed

    def get_state(self) -> dict[str, Any]:
        return {"position": self.position.clone(), "steps": self.steps, "rng": self.generator.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self.position, self.steps = state["position"].clone(), int(state["steps"])
        self.generator.set_state(state["rng"])

    def close(self) -> None:
        pass


def build(kind: str) -> Any:
    if kind == "collector":
        return Collector(Walk, None, frames_per_batch=5, total_frames=-1, seed=4)
    return MultiSyncCollector([Walk, Walk], None, frames_per_batch=10, total_frames=-1, seed=4)


async def take(collector: Any, n: int) -> list[TensorDictBase]:
    out: list[TensorDictBase] = []
    with anyio.fail_after(60):
        async for batch in collector:
            out.append(batch)
            if len(out) == n:
                break
    return out


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
@pytest.mark.parametrize("kind", ["collector", "sync"])
async def test_an_unbatched_env_resumes_exactly(kind: str, tmp_path: Path) -> None:
    uninterrupted = build(kind)
    episodes = uninterrupted.events(kinds={"episode"})
    async with uninterrupted:
        full = await take(uninterrupted, 6)
    async with build(kind) as collector:
        head = await take(collector, 3)
        torch.save(await collector.state_dict(envs=True), tmp_path / "ckpt.pt")
    resumed = build(kind)
    resumed_episodes = resumed.events(kinds={"episode"})
    async with resumed:
        await resumed.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True))
        tail = await take(resumed, 3)
    assert (torch.cat(full) == torch.cat(head + tail)).all()
    # the episodes in flight at the checkpoint end with their whole return and length
    frames = sum(b.numel() for b in head)
    expected = [
        (e.episode_return, e.length) for e in iter(episodes.receive_nowait, None) if e.frames > frames
    ]
    assert (
        expected
        and [(e.episode_return, e.length) for e in iter(resumed_episodes.receive_nowait, None)] == expected
    )
