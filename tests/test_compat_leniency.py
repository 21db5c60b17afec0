"""aiocollect.compat's TorchRL leniencies, without torchrl: lossless action casts (a warning; lossy actions
refused with the native message) and ``"step_count"`` with ``max_frames_per_traj``.

The same against torchrl's own envs and collector is in tests/test_torchrl_leniency.py.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

import aiocollect
from aiocollect import compat
from support import cartpole, pendulum

pytestmark = pytest.mark.anyio

CAST = r"policy output 'action' has dtype torch\.float32 and shape"


class FloatArgMax(nn.Module):
    """CartPole's action as a float tensor holding integers, plus ``offset``."""

    def __init__(self, offset: float = 0.0) -> None:
        super().__init__()
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., :2].argmax(-1).float() + self.offset


class Flat(nn.Module):
    """Pendulum's action with shape ``()`` per env instead of ``(1,)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., 2].clamp(-2, 2)


def argmax_policy(offset: float = 0.0) -> TensorDictModule:
    return TensorDictModule(FloatArgMax(offset), in_keys=["observation"], out_keys=["action"])


def flat_policy() -> TensorDictModule:
    return TensorDictModule(Flat(), in_keys=["observation"], out_keys=["action"])


async def collect(collector: Any) -> list[TensorDict]:
    with anyio.fail_after(60):
        return [b async for b in collector]


async def test_a_float_action_holding_integers_is_cast_with_one_warning() -> None:
    with pytest.warns(UserWarning, match=CAST) as record:
        collector = compat.SyncDataCollector(
            lambda: cartpole(2), argmax_policy(), frames_per_batch=32, total_frames=64
        )
    assert len(record) == 1 and "'action'" in str(record[0].message)
    batches = await collect(collector)
    assert len(batches) == 2
    for batch in batches:
        action = batch["action"]  # what the policy wrote, as TorchRL's batch keeps it; the env got int64
        assert action.dtype == torch.float32 and action.shape == (2, 16)
        assert torch.equal(action, batch["observation"][..., :2].argmax(-1).float())


async def test_a_size_one_dim_is_added() -> None:
    with pytest.warns(
        UserWarning, match=r"shape \(\) per env; the action spec has torch\.float32 and shape \(1,\)"
    ):
        collector = compat.SyncDataCollector(pendulum, flat_policy(), frames_per_batch=8, total_frames=8)
    (batch,) = await collect(collector)
    assert batch["action"].shape == (8,)
    assert torch.equal(batch["action"], batch["observation"][:, 2].clamp(-2, 2))


@pytest.mark.parametrize(
    ("make_policy", "match"),
    [
        (argmax_policy, r"has dtype torch\.float32"),
        (flat_policy, r"has shape \(\) per env"),
    ],
    ids=["dtype", "shape"],
)
def test_the_native_collectors_still_refuse(make_policy: Any, match: str) -> None:
    env = cartpole if make_policy is argmax_policy else pendulum
    with pytest.raises((TypeError, ValueError), match=match):
        aiocollect.Collector(env, make_policy(), frames_per_batch=8)


@pytest.mark.filterwarnings("ignore:policy output 'action':UserWarning")
@pytest.mark.parametrize("offset", [0.5, 1e30, float("nan")], ids=["fraction", "out-of-range", "nan"])
async def test_a_lossy_action_is_refused_with_the_native_message(offset: float) -> None:
    collector = compat.SyncDataCollector(cartpole, argmax_policy(offset), frames_per_batch=8, total_frames=8)
    with pytest.raises(TypeError, match=r"policy output 'action' has dtype torch\.float32") as info:
        await collect(collector)
    assert any("are not integers in the range of torch.int64" in note for note in info.value.__notes__)


async def test_a_wrong_size_is_refused_as_today() -> None:
    wide = TensorDictModule(lambda x: x[..., :2], in_keys=["observation"], out_keys=["action"])
    with pytest.raises(ValueError, match=r"policy output 'action' has shape \(2,\) per env"):
        compat.SyncDataCollector(pendulum, wide, frames_per_batch=8)


@pytest.mark.parametrize("name", ["MultiSyncCollector", "MultiAsyncCollector"])
async def test_worker_processes_cast_too(name: str) -> None:
    """In a worker process the warning goes where worker warnings go (hidden unless shown); the casts
    happen all the same."""
    collector = getattr(compat, name)(
        cartpole, num_workers=2, policy=argmax_policy(), frames_per_batch=16, total_frames=32
    )
    for batch in await collect(collector):
        assert torch.equal(batch["action"], batch["observation"][..., :2].argmax(-1).float())


# -- step_count ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["SyncDataCollector", "MultiSyncCollector"])
async def test_step_count_as_a_step_counter_writes_it(name: str) -> None:
    kwargs = {} if name == "SyncDataCollector" else {"num_workers": 1, "worker_backend": "serial"}
    collector = getattr(compat, name)(
        lambda: cartpole(2), frames_per_batch=40, total_frames=80, max_frames_per_traj=4, **kwargs
    )
    batches = await collect(collector)
    data = torch.cat([b.reshape(-1, b.shape[-1]) for b in batches], dim=-1)  # [envs, time]
    count, after = data["step_count"], data["next", "step_count"]
    assert count.dtype == after.dtype == torch.int64 and count.shape == (2, 40, 1)
    assert torch.equal(after, count + 1)
    done = data["next", "done"][..., 0]
    # a new episode starts at 0, an episode goes on counting, and is truncated at 4
    assert (count[:, 0] == 0).all()
    assert torch.equal(count[:, 1:, 0], torch.where(done[:, :-1], 0, after[:, :-1, 0]))
    assert int(after.max()) == 4
    truncated = data["next", "truncated"][..., 0]
    assert torch.equal(truncated, (after[..., 0] == 4) & ~data["next", "terminated"][..., 0])


async def test_the_native_collector_writes_no_step_count() -> None:
    async with aiocollect.Collector(cartpole, frames_per_batch=8, total_frames=8, max_frames_per_traj=4) as c:
        (batch,) = await collect(c)
    assert batch.get("step_count", None) is None


def test_step_count_needs_max_frames_per_traj() -> None:
    with pytest.raises(ValueError, match="step_count=True counts the steps max_frames_per_traj"):
        aiocollect.RolloutOptions(frames_per_batch=8, step_count=True)
