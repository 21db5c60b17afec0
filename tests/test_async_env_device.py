"""``AsyncEnvCollector`` with a policy on an accelerator (issue 31's GPU-ready path): observations packed
into one reused staging buffer (pinned for CUDA) and moved in one non-blocking host-to-device copy per
policy call; outputs copied back once each. The staging is tested on the CPU (its packing, reuse and one
copy per call, and the collector's wiring with the CPU as the "device"); the CUDA test runs where CUDA is.
"""

from __future__ import annotations

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch

from aiocollect import AsyncEnvCollector, ProcessVectorEnv
from aiocollect._asyncenv import _policy
from aiocollect._asyncenv._policy import DeviceStaging

pytestmark = pytest.mark.anyio


def cartpole() -> gym.Env:
    return gym.make("CartPole-v1", max_episode_steps=30)


def observations(n: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "observation": torch.randn(n, 4, generator=g),
        ("pixels", "rgb"): torch.randint(0, 256, (n, 3, 5, 7), generator=g, dtype=torch.uint8),
        "mask": torch.rand(n, generator=g) > 0.5,
        "ids": torch.randint(-(2**40), 2**40, (n, 3), generator=g),
    }


class CountedTo:
    """``torch.Tensor.to`` counted: the calls that move a CPU tensor to another device."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.copies = 0
        original = torch.Tensor.to

        def to(tensor, *args, **kwargs):
            out = original(tensor, *args, **kwargs)
            if tensor.device.type == "cpu" and out.device.type != "cpu":
                self.copies += 1
            return out

        monkeypatch.setattr(torch.Tensor, "to", to)


def test_staging_packs_every_key_into_one_copy_and_reuses_its_buffer(monkeypatch):
    staging = DeviceStaging(torch.device("meta"), pin=False)  # a real move, without data
    counted = CountedTo(monkeypatch)
    for call, n in enumerate([8, 8, 5, 8]):
        obs = observations(n, call)
        on = staging.to_device(obs)
        assert counted.copies == call + 1 == staging.copies  # one copy per call, whatever the keys
        assert list(on) == list(obs)
        for key, value in obs.items():
            assert on[key].device.type == "meta"
            assert (on[key].shape, on[key].dtype) == (value.shape, value.dtype)
        if call == 0:
            first = staging.host
        assert staging.host is first  # reused (no call is larger than the first)
    staging.to_device(observations(64))
    assert staging.host is not first and staging.host.numel() >= 64 * (16 + 105 + 1 + 24)  # grown


def test_staging_keeps_every_value_bit_for_bit():
    staging = DeviceStaging(torch.device("cpu"), pin=False)
    assert staging.pin is False and DeviceStaging(torch.device("cuda")).pin is True  # pinned for CUDA only
    for n in (3, 17, 2):
        obs = observations(n, n)
        on = staging.to_device(obs)
        for key, value in obs.items():
            assert torch.equal(on[key], value), key
            assert on[key].data_ptr() % 8 == 0  # each block aligned for its dtype


async def _collect(policy: torch.nn.Module) -> tuple[list, list[int], DeviceStaging | None]:
    with anyio.fail_after(60):
        async with AsyncEnvCollector(
            [lambda: ProcessVectorEnv([cartpole] * 6, num_workers=2)],
            policy,
            frames_per_batch=48,
            total_frames=480,
            seed=3,
        ) as collector:
            batches = [batch async for batch in collector]
            return batches, list(collector.policy_batch_sizes), collector._policy.staging


class Lean(torch.nn.Module):
    """Pushes the cart toward the side the pole leans to: exact on any device."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return (observation[:, 2] * self.scale > 0).long()


def _assert_same(batches: list, again: list) -> None:
    assert len(batches) == len(again)
    for a, b in zip(batches, again, strict=True):
        for key in a.keys(include_nested=True, leaves_only=True):
            assert torch.equal(a.get(key), b.get(key)), key


async def test_a_policy_on_a_device_gets_its_observations_through_the_staging(monkeypatch, leaks):
    # the CPU standing in for the device: the collector stages every call's observations (one copy per
    # call) and copies the outputs back, and its batches are those of a policy without a device
    plain, sizes, staging = await _collect(Lean())
    assert staging is None
    monkeypatch.setattr(
        _policy, "_parameter_device", lambda policy: torch.device("cpu") if policy is not None else None
    )
    staged, staged_sizes, staging = await _collect(Lean())
    assert staging is not None and staging.copies == len(staged_sizes) == len(sizes)
    _assert_same(plain, staged)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_a_cuda_policy_one_copy_in_and_its_actions_back_once(monkeypatch, leaks):
    reference, _, _ = await _collect(Lean())
    counted = CountedTo(monkeypatch)
    batches, cuda_sizes, staging = await _collect(Lean().cuda())
    assert staging is not None and staging.pin and staging.host is not None and staging.host.is_pinned()
    assert staging.copies == len(cuda_sizes)
    assert counted.copies == len(cuda_sizes)  # the staging's copy; nothing else moved to the device
    _assert_same(reference, batches)
    assert all(batch["action"].device.type == "cpu" for batch in batches)
    assert np.isfinite(torch.cat(batches)["next", "reward"].numpy()).all()
