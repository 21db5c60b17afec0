"""The compat conformance tier: ``aiocollect.compat`` against TorchRL's documented collector contract.

Our own tests, written from TorchRL's collector docs (not copied from its test suite), with torchrl's envs,
policies and replay buffers. Run in the torchrl virtualenv: ``nox -s torchrl`` (CI runs it: ``.ci/run``).
"""

from __future__ import annotations

import multiprocessing as mp

import anyio
import pytest
import torch
from tensordict.nn import TensorDictModule
from torch import nn

pytest.importorskip("torchrl")

from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs import GymEnv, ParallelEnv, SerialEnv, StepCounter, TransformedEnv

from aiocollect import compat
from support import children, wait_gone

pytestmark = [pytest.mark.torchrl, pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- envs and policies (module level: the worker processes unpickle them) ----------------------------
def pendulum() -> GymEnv:
    return GymEnv("Pendulum-v1")


def pendulum_steps() -> TransformedEnv:
    return TransformedEnv(GymEnv("Pendulum-v1"), StepCounter())


def parallel_pendulums() -> ParallelEnv:
    """A torchrl ParallelEnv: two processes of its own, started inside the collector's worker."""
    return ParallelEnv(2, pendulum, mp_start_method="fork")


class PendulumClass(TransformedEnv):
    """An env class: torchrl calls ``create_env_fn(**create_env_kwargs)``, a class included."""

    def __init__(self, max_steps: int = 5) -> None:
        super().__init__(GymEnv("Pendulum-v1"), StepCounter(max_steps))


def broken() -> GymEnv:
    raise LookupError("the simulator's licence was not found")


def parallel_broken() -> ParallelEnv:
    """A ParallelEnv whose sub-envs fail in its own processes."""
    return ParallelEnv(2, broken, mp_start_method="fork")


def constant_policy(value: float = 0.0) -> TensorDictModule:
    """``action = bias`` (weight 0): the action says which weights a worker runs."""
    linear = nn.Linear(3, 1)
    with torch.no_grad():
        linear.weight.zero_()
        linear.bias.fill_(value)
    return TensorDictModule(linear, in_keys=["observation"], out_keys=["action"])


def descendants() -> set[int]:
    return {p.pid for p in children()}


def gone(pids: set[int], seconds: float = 5.0) -> bool:
    return wait_gone(pids, seconds) == []


# -- create_env_fn: callables, env classes with create_env_kwargs -------------------------------------
@pytest.mark.parametrize("cls", ["Collector", "MultiSyncCollector", "MultiAsyncCollector", "AsyncCollector"])
async def test_an_env_class_with_create_env_kwargs(cls: str) -> None:
    kwargs = {"num_workers": 2} if cls.startswith("Multi") else {}
    collector = getattr(compat, cls)(
        PendulumClass,
        create_env_kwargs={"max_steps": 3},
        frames_per_batch=12,
        total_frames=12,
        **kwargs,
    )
    with anyio.fail_after(120):
        data = await collector.next()
        await collector.shutdown()
    assert data is not None and int(data["step_count"].max()) <= 3  # the kwargs reached the class


# -- the replay buffer receives frames --------------------------------------------------------------
@pytest.mark.parametrize("cls", ["Collector", "MultiSyncCollector", "MultiAsyncCollector"])
async def test_replay_buffer_gets_one_entry_per_frame(cls: str) -> None:
    """TorchRL's collectors extend ``replay_buffer`` with their frames (each worker its own rollout) and
    yield nothing; a 1-D storage grows by ``frames_per_batch`` per batch."""
    rb = ReplayBuffer(storage=LazyTensorStorage(1_000), batch_size=8)
    kwargs = {"num_workers": 2} if cls.startswith("Multi") else {}
    collector = getattr(compat, cls)(
        pendulum, frames_per_batch=32, total_frames=64, replay_buffer=rb, **kwargs
    )
    with anyio.fail_after(120):
        async for data in collector:
            assert data is None
    assert len(rb) == 64
    assert rb.sample()["next", "observation"].shape == (8, 3)


# -- update_policy_weights_ blocks until the workers run the weights --------------------------------
@pytest.mark.parametrize("cls", ["MultiSyncCollector", "MultiAsyncCollector"])
async def test_update_policy_weights_returns_once_every_worker_has_them(cls: str) -> None:
    policy = constant_policy(0.0)
    collector = getattr(compat, cls)(
        [pendulum] * 2, policy, frames_per_batch=8, total_frames=-1, track_policy_version=True
    )
    async with collector:
        with anyio.fail_after(120):
            await collector.next()
            with torch.no_grad():
                policy.module.bias.fill_(1.5)
            version = await collector.update_policy_weights_()
            # returned: every worker runs the new weights already, with nothing more asked of it
            assert [w.policy_version for w in collector.statistics().workers] == [version] * 2
            for _ in range(6):  # an async worker may hand over one batch collected before the update
                data = await collector.next()
                if int(data["collector", "policy_version"].min()) == version:
                    break
            assert torch.all(data["action"] == 1.5)


# -- processes inside the workers ---------------------------------------------------------------------
@pytest.mark.parametrize("cls", ["MultiSyncCollector", "MultiAsyncCollector"])
async def test_a_parallel_env_runs_inside_the_workers(cls: str) -> None:
    """TorchRL runs a ``ParallelEnv`` inside its collector workers; its processes go with the collector."""
    before = descendants()
    collector = getattr(compat, cls)(parallel_pendulums, num_workers=2, frames_per_batch=16, total_frames=32)
    with anyio.fail_after(180):
        async with collector:
            started = descendants() - before
            data = await collector.next()
    assert data is not None and data["observation"].shape[-1] == 3
    assert len(started) >= 2 + 2 * 2  # two workers, two env processes in each
    assert gone(started)


@pytest.mark.parametrize("make", [broken, parallel_broken], ids=["env", "parallel-env"])
async def test_a_failing_env_surfaces_its_own_error(make) -> None:
    """The env's own error is what the trainer sees first (with a ParallelEnv, the sub-env's message), not
    an error of the clean-up that followed it."""
    collector = compat.MultiSyncCollector([make, pendulum], frames_per_batch=8, total_frames=8)
    with anyio.fail_after(120), pytest.raises(Exception, match="licence") as info:
        await collector.next()
    assert "closed environment" not in str(info.value)


async def test_a_serial_env_and_a_start_method_from_the_user() -> None:
    """A torchrl ``SerialEnv`` as the worker's env, workers started with ``spawn``."""
    collector = compat.MultiSyncCollector(
        lambda: SerialEnv(2, pendulum_steps),
        num_workers=2,
        frames_per_batch=16,
        total_frames=16,
        start_method="spawn" if "spawn" in mp.get_all_start_methods() else None,
    )
    with anyio.fail_after(180):
        data = await collector.next()
        await collector.shutdown()
    assert data is not None and data.batch_size == (2, 2, 4)
