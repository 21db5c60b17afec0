"""aiocollect.compat against torchrl 0.14's own collector and envs: lossless action casts, ``"step_count"``
with ``max_frames_per_traj``, and the final checkpoint after the loop.

Run in the torchrl virtualenv: ``nox -s torchrl`` (or ``.venv-trl/bin/python -m pytest -m torchrl``).
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

pytest.importorskip("torchrl")

from torchrl.collectors import Collector as TorchRLCollector
from torchrl.envs import GymEnv

from aiocollect import compat

pytestmark = [pytest.mark.torchrl, pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def cartpole() -> GymEnv:
    """TorchRL's CartPole: a one-hot action spec (int64, shape (2,))."""
    env = GymEnv("CartPole-v1")
    env.set_seed(0)
    return env


def pendulum() -> GymEnv:
    env = GymEnv("Pendulum-v1")
    env.set_seed(0)
    return env


class FloatOneHot(nn.Module):
    """A one-hot action as floats (what a TorchRL user's argmax-and-scatter policy writes)."""

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        index = (observation[..., 2] > 0).long()
        return torch.nn.functional.one_hot(index, 2).float()


class Zero(nn.Module):
    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return torch.zeros(observation.shape[:-1] + (1,))


def float_one_hot() -> TensorDictModule:
    return TensorDictModule(FloatOneHot(), in_keys=["observation"], out_keys=["action"])


def zero_torque() -> TensorDictModule:
    return TensorDictModule(Zero(), in_keys=["observation"], out_keys=["action"])


def theirs(make_env: Any, policy: Any, frames: int, **kwargs: Any) -> list[TensorDict]:
    collector = TorchRLCollector(
        make_env,
        policy,
        frames_per_batch=frames,
        total_frames=2 * frames,
        auto_register_policy_transforms=False,
        **kwargs,
    )
    try:
        return [b.clone() for b in collector]
    finally:
        collector.shutdown()


async def ours(collector: Any) -> list[TensorDict]:
    with anyio.fail_after(120):
        return [b async for b in collector]


async def test_a_float_one_hot_action_is_cast_as_torchrl_collects_it() -> None:
    """TorchRL steps its int64 one-hot env with the policy's float one-hot (and keeps the floats in the
    batch); compat casts what the env gets (one warning) and the batches are the same."""
    expected = theirs(cartpole, float_one_hot(), 16)
    with pytest.warns(UserWarning, match=r"policy output 'action' has dtype torch\.float32"):
        collector = compat.Collector(cartpole, float_one_hot(), frames_per_batch=16, total_frames=32)
    got = await ours(collector)
    for a, b in zip(got, expected, strict=True):
        assert a["action"].dtype == b["action"].dtype == torch.float32
        for key in ("action", "observation", ("next", "observation"), ("next", "reward"), ("next", "done")):
            assert torch.equal(a[key], b[key]), key


@pytest.mark.filterwarnings("ignore:policy output 'action':UserWarning")
async def test_a_lossy_cast_is_still_refused() -> None:
    half = TensorDictModule(
        lambda obs: float_one_hot()(obs) * 0.5, in_keys=["observation"], out_keys=["action"]
    )
    collector = compat.Collector(cartpole, half, frames_per_batch=16, total_frames=16)
    with pytest.raises(TypeError, match=r"policy output 'action' has dtype torch\.float32"):
        await ours(collector)


@pytest.mark.parametrize("cls", ["Collector", "MultiSyncCollector"])
async def test_step_count_as_torchrl_writes_it(cls: str) -> None:
    """TorchRL appends a StepCounter(max_frames_per_traj): its step_count keys, truncation and resets."""
    expected = theirs(pendulum, zero_torque(), 20, max_frames_per_traj=3)
    kwargs = {"num_workers": 1} if cls.startswith("Multi") else {}
    got = await ours(
        getattr(compat, cls)(
            pendulum, zero_torque(), frames_per_batch=20, total_frames=40, max_frames_per_traj=3, **kwargs
        )
    )
    for a, b in zip(got, expected, strict=True):
        a = a.reshape(-1)
        for key in ("step_count", ("next", "step_count"), ("next", "truncated"), ("next", "done")):
            assert a[key].dtype == b[key].dtype, key
            assert torch.equal(a[key], b[key]), key
    assert int(torch.cat(expected)["next", "step_count"].max()) == 3


async def test_a_step_counter_and_max_frames_per_traj_are_refused_as_torchrl_does() -> None:
    from torchrl.envs import StepCounter, TransformedEnv

    with pytest.raises(ValueError, match="step_count"):
        TorchRLCollector(
            lambda: TransformedEnv(GymEnv("Pendulum-v1"), StepCounter()),
            frames_per_batch=8,
            max_frames_per_traj=3,
        )
    with pytest.raises(ValueError, match="has a 'step_count' entry already"):
        compat.Collector(
            lambda: TransformedEnv(GymEnv("Pendulum-v1"), StepCounter()),
            frames_per_batch=8,
            max_frames_per_traj=3,
        )


@pytest.mark.parametrize("cls", ["Collector", "MultiSyncCollector", "MultiAsyncCollector"])
async def test_the_final_checkpoint_resumes(cls: str) -> None:
    """``state_dict()`` after the loop (TorchRL's final checkpoint), loaded into a new collector."""
    kwargs = {"num_workers": 1} if cls.startswith("Multi") else {}
    first = getattr(compat, cls)(pendulum, zero_torque(), frames_per_batch=8, total_frames=16, **kwargs)
    seen = await ours(first)
    state = await first.state_dict()
    assert state["frames"] == 16
    second = getattr(compat, cls)(pendulum, zero_torque(), frames_per_batch=8, total_frames=32, **kwargs)
    # one cancel scope around the start (load_state_dict starts the workers) and the end of the loop
    with anyio.fail_after(120):
        await second.load_state_dict(state)
        later = [b async for b in second]
    assert len(seen) == len(later) == 2
    last_id = int(torch.cat([b["collector", "traj_ids"].reshape(-1) for b in seen]).max())
    assert int(torch.cat([b["collector", "traj_ids"].reshape(-1) for b in later]).min()) > last_id
