"""Checkpoints load with ``torch.load(path)`` (weights only, torch's default): ``state_dict()`` holds
only Python scalars and strings, lists, dicts and tensors, for every collector."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from tensordict.nn import TensorDictModule
from torch import nn

from aiocollect import Collector, GymEnv, MultiAsyncCollector, MultiSyncCollector, ProcessCollector

pytestmark = pytest.mark.anyio

WEIGHTS_ONLY_SCALARS = (bool, int, float, str, type(None))


def cartpole() -> GymEnv:
    return GymEnv("CartPole-v1", num_envs=3)


def policy() -> TensorDictModule:
    return TensorDictModule(PushLeft(), ["observation"], ["action"])


class PushLeft(nn.Module):
    """Always action 0: every CartPole episode ends within ~10 steps (new trajectory ids)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4))  # weights for the state dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.weight).sum(-1).clamp(0, 0).long()


def foreign_values(value: Any, path: str = "state") -> list[str]:
    """Where ``value`` holds something other than plain scalars, lists, dicts and tensors (exact
    types: a ``numpy.int64`` is no ``int`` to torch's weights-only unpickler)."""
    if type(value) in WEIGHTS_ONLY_SCALARS or isinstance(value, torch.Tensor):
        return []
    if type(value) in (list, tuple):
        return [p for i, v in enumerate(value) for p in foreign_values(v, f"{path}[{i}]")]
    if type(value) is dict:
        bad = [f"{path} key {k!r}: {type(k).__name__}" for k in value if type(k) not in (str, int)]
        return bad + [p for k, v in value.items() for p in foreign_values(v, f"{path}[{k!r}]")]
    return [f"{path}: {type(value).__module__}.{type(value).__qualname__}"]


BUILDERS = {
    "Collector": lambda: Collector(cartpole, policy(), frames_per_batch=48, total_frames=192, seed=1),
    "MultiSyncCollector": lambda: MultiSyncCollector(
        [cartpole] * 2, policy(), frames_per_batch=48, total_frames=192, seed=1
    ),
    "MultiAsyncCollector": lambda: MultiAsyncCollector(
        [cartpole] * 2, policy(), frames_per_batch=48, total_frames=192, seed=1
    ),
    "ProcessCollector": lambda: ProcessCollector(
        cartpole, policy(), frames_per_batch=48, total_frames=192, seed=1
    ),
}


@pytest.mark.parametrize("name", list(BUILDERS))
async def test_state_dict_saves_and_loads_weights_only(name: str, tmp_path: Path) -> None:
    path = tmp_path / "collector.pt"
    with anyio.fail_after(120):
        async with BUILDERS[name]() as collector:
            async for _ in collector:
                if collector.statistics().frames >= 96:
                    break
            assert collector.statistics().episodes > 0  # trajectory ids advanced
            state = await collector.state_dict()
        assert foreign_values(state) == []
        torch.save(state, path)
        loaded = torch.load(path, weights_only=True)  # torch's default since 2.6
        async with BUILDERS[name]() as restored:
            await restored.load_state_dict(loaded)
            assert restored.statistics().frames == state["frames"] == 96
            assert [b.numel() async for b in restored] == [48, 48]  # the budget goes on from 96 of 192
