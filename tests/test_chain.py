"""One env's screens are stored once per step: in a batch where no episode ends before the last step,
``observation[t + 1]`` and ``("next", "observation")[t]`` are one memory (``_rollout/_chain.py``).

Every batch is compared bit for bit with the batch of the same run without the chain (``ObsChain.applies``
forced off: each screen copied twice, as before), and the memory the keys share is read from the tensors.
"""

from __future__ import annotations

from typing import Any

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn

from aiocollect import Collector, GymEnv, RestartPolicy
from aiocollect._rollout._chain import CHAIN_MIN_BYTES, ObsChain
from aiocollect._rollout._storage import POOL_MIN_BYTES
from support import EnvFailure

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("leaks")]

STEPS = 50  # frames per batch (one env)


class Screens(gym.Env):
    """64x64 uint8 screens (a page per frame) drawn from the env's RNG; an episode ends with chance
    ``end`` per step (terminated), or at ``length`` steps (truncated). ``owner.fault()`` runs first in
    every step (a restart test's fault), and ``same_buffer`` returns one array written in place."""

    observation_space = spaces.Box(0, 255, (64, 64), np.uint8)
    action_space = spaces.Discrete(3)

    def __init__(self, end: float = 0.01, length: int = 10_000, same_buffer: bool = False, owner=None):
        self.end, self.length, self.owner = end, length, owner
        self.buffer = np.zeros((64, 64), np.uint8) if same_buffer else None
        self.t = 0

    def _screen(self) -> np.ndarray:
        screen = self.np_random.integers(0, 256, (64, 64), dtype=np.uint8)
        if self.buffer is None:
            return screen
        self.buffer[...] = screen
        return self.buffer

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> Any:
        super().reset(seed=seed)
        self.t = 0
        return self._screen(), {}

    def step(self, action: Any) -> Any:
        if self.owner is not None:
            self.owner.fault()
        self.t += 1
        screen = self._screen()
        screen[0, 0] = int(action)
        terminated = bool(self.np_random.random() < self.end)
        return screen, float(action), terminated, self.t >= self.length, {}


class Brightest(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(64 * 64, 3)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation.flatten(-2).float() / 255).argmax(-1)


def policy_for(kind: str) -> Any:
    if kind == "random":
        return None
    return TensorDictModule(Brightest(), in_keys=["observation"], out_keys=["action"])


def shares(batch: TensorDictBase) -> bool:
    """Whether ``observation[1:]`` is ``("next", "observation")[:-1]``'s memory."""
    obs, nxt = batch["observation"], batch["next", "observation"]
    return obs[1:].data_ptr() == nxt[:-1].data_ptr()


def overlaps(batch: TensorDictBase) -> bool:
    """Whether the two keys' memory overlaps at all."""
    obs, nxt = batch["observation"], batch["next", "observation"]
    a, b = obs.data_ptr(), nxt.data_ptr()
    return a < b + nxt.nbytes and b < a + obs.nbytes


async def collect(make: Any, kind: str = "random", batches: int = 8, **kwargs: Any) -> list[Any]:
    """Seeded batches as they arrive (kept, not cloned) with their clones and whether each shares."""
    out = []
    with anyio.fail_after(60):
        async with Collector(
            make, policy_for(kind), frames_per_batch=STEPS, total_frames=batches * STEPS, seed=3, **kwargs
        ) as collector:
            async for batch in collector:
                out.append((batch, batch.clone(), shares(batch), overlaps(batch)))
    return out


def unchained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ObsChain, "applies", staticmethod(lambda batch_shape, obs_specs: False))


def assert_same(a: TensorDictBase, b: TensorDictBase) -> None:
    assert set(a.keys(True, True)) == set(b.keys(True, True))
    assert a.names == b.names
    for key in a.keys(True, True):
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("kind", ["random", "tdmodule"])
@pytest.mark.parametrize("same_buffer", [False, True], ids=["new-arrays", "one-buffer"])
async def test_chained_batches_equal_the_unchained_bit_for_bit(
    kind: str, same_buffer: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    def make() -> GymEnv:
        return GymEnv(Screens(end=0.02, same_buffer=same_buffer))

    chained = await collect(make, kind, batches=10)
    unchained(monkeypatch)
    plain = await collect(make, kind, batches=10)
    for (batch, arrived, linked, overlap), (_, reference, plain_linked, plain_overlap) in zip(
        chained, plain, strict=True
    ):
        assert_same(batch, reference)  # the same data
        assert_same(batch, arrived)  # and a kept batch was never written again
        ended = bool(batch["next", "done"][:-1].any())  # an episode ended before the last step
        assert linked == (not ended) and overlap == linked
        assert not plain_linked and not plain_overlap
    linked = [c[2] for c in chained]
    assert any(linked) and not all(linked)  # both kinds of batch were exercised


async def test_a_chained_batch_is_one_copy_per_screen_and_a_reset_splits_it() -> None:
    """An episode of exactly ``STEPS + 10`` steps: batch 0 has no end (chained), batch 1 ends at its
    step 9 (its observations split off from step 10: the reset screen), and an episode that ends on a
    batch's last step keeps the chain."""
    batches = await collect(lambda: GymEnv(Screens(end=0.0, length=STEPS + 10)), batches=3)
    (first, _, linked0, _), (second, _, linked1, overlap1), _ = batches
    assert linked0 and not linked1 and not overlap1
    obs, nxt = second["observation"], second["next", "observation"]
    assert torch.equal(obs[1:10], nxt[:9]) and torch.equal(obs[11:], nxt[10:-1])
    assert not torch.equal(obs[10], nxt[9])  # the final screen, then the reset one
    assert bool(second["next", "truncated"][9]) and second["next", "done"].sum() == 1
    assert torch.equal(second["observation"][0], first["next", "observation"][-1])  # carried over
    # an in-place write to a chained batch's observation shows in the next observation before it
    first["observation"][5].fill_(7)
    assert bool((first["next", "observation"][4] == 7).all())

    ends_last = await collect(lambda: GymEnv(Screens(end=0.0, length=STEPS)), batches=2)
    for batch, reference, linked, _ in ends_last:
        assert linked and bool(batch["next", "truncated"][-1]) and not batch["next", "done"][:-1].any()
        assert_same(batch, reference)
    assert not torch.equal(ends_last[1][0]["observation"][0], ends_last[0][0]["next", "observation"][-1])


async def test_a_dropped_chained_batch_leaves_its_buffer_to_the_next() -> None:
    """A consumer that drops each batch before asking for the next gets every batch in one buffer (of
    the pool's: 200 frames of 2 x 4 KiB, past ``POOL_MIN_BYTES``)."""
    addresses = []
    frames = 200
    assert 2 * frames * 64 * 64 > POOL_MIN_BYTES
    async with Collector(
        lambda: GymEnv(Screens(end=0.0)), None, frames_per_batch=frames, total_frames=4 * frames
    ) as collector:
        async for batch in collector:
            assert shares(batch)
            addresses.append(batch["next", "observation"].data_ptr())
            del batch
    assert len(set(addresses)) == 1


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: GymEnv("CartPole-v1"), id="state-vector"),
        pytest.param(lambda: GymEnv(gym.vector.SyncVectorEnv([Screens, Screens])), id="two-envs"),
    ],
)
async def test_small_observations_and_several_envs_are_not_chained(make: Any) -> None:
    assert 4 * 4 < CHAIN_MIN_BYTES <= 64 * 64  # CartPole's 4 floats; a Screens frame
    for batch, reference, linked, overlap in await collect(make, batches=3):
        assert not linked and not overlap
        assert_same(batch, reference)


async def test_the_per_step_loop_keeps_two_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """``max_frames_per_traj`` steps one env per step (not the fused loop): never chained, the same data."""
    batches = await collect(lambda: GymEnv(Screens(end=0.0)), batches=3, max_frames_per_traj=30)
    unchained(monkeypatch)
    plain = await collect(lambda: GymEnv(Screens(end=0.0)), batches=3, max_frames_per_traj=30)
    for (batch, _, linked, overlap), (_, reference, _, _) in zip(batches, plain, strict=True):
        assert not linked and not overlap
        assert_same(batch, reference)
    assert bool(batches[0][0]["next", "truncated"][29])  # the per-step loop's own truncation ran


class FailsOnce:
    """``create_env_fn`` of Screens envs whose step raises at its ``at``-th call (over every env)."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def fault(self) -> None:
        self.calls += 1
        if self.calls == self.at:
            raise EnvFailure(f"step {self.calls} failed")

    def __call__(self) -> GymEnv:
        return GymEnv(Screens(end=0.0, owner=self))


@pytest.mark.parametrize("at", [1, 20, STEPS + 1], ids=["first-step", "mid-batch", "batch-start"])
async def test_a_restart_mid_batch_splits_the_chain(at: int, monkeypatch: pytest.MonkeyPatch) -> None:
    fast = RestartPolicy(max_restarts=10, window=60.0, backoff=0.0, max_backoff=0.0)
    chained = await collect(FailsOnce(at), batches=3, restart=fast)
    unchained(monkeypatch)
    plain = await collect(FailsOnce(at), batches=3, restart=fast)
    for (batch, _, linked, _), (_, reference, _, _) in zip(chained, plain, strict=True):
        assert_same(batch, reference)
        assert linked == (not batch["next", "done"][:-1].any())
    assert [c[2] for c in chained] == [at != 20, True, True]
