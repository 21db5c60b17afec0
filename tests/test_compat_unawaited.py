"""A compat method called without ``await`` did nothing (its coroutine was never run): TorchRL's scripts
call ``collector.set_seed(seed)`` in synchronous helpers and ``collector.update_policy_weights_()`` as a
statement. ``aiocollect.compat`` makes that loud: the collector's next step raises a ``RuntimeError``
naming the method and the fix, where the seeding or the update was skipped in silence."""

from __future__ import annotations

import warnings
from typing import Any

import anyio
import pytest
import torch

from aiocollect.compat import MultiSyncCollector, SyncDataCollector
from support import cartpole

pytestmark = pytest.mark.anyio


class Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).argmax(-1)


def build(kind: str) -> Any:
    if kind == "sync":
        return SyncDataCollector(cartpole, Linear(), frames_per_batch=16, total_frames=64)
    return MultiSyncCollector(
        [cartpole] * 2, Linear(), frames_per_batch=32, total_frames=128, worker_backend="serial"
    )


def seed_everything(collector: Any, seed: int) -> None:
    """A synchronous helper, as TorchRL's scripts have (the call's coroutine is dropped)."""
    collector.set_seed(seed)


@pytest.mark.parametrize("kind", ["sync", "multi"])
async def test_a_set_seed_never_awaited_fails_at_the_next_step(kind: str) -> None:
    collector = build(kind)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seed_everything(collector, 7)
        with pytest.raises(
            RuntimeError,
            match=r"\.set_seed\(\.\.\.\) was called but never awaited, so it did "
            r"nothing: write `await collector\.set_seed\(\.\.\.\)`",
        ):
            await collector.next()
        await collector.shutdown()
    assert not [w for w in caught if "never awaited" in str(w.message)]  # the error says it


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
async def test_an_update_never_awaited_fails_at_the_next_step_of_the_loop() -> None:
    collector = build("sync")
    with pytest.raises(RuntimeError, match=r"Collector\.update_policy_weights_\(\.\.\.\) was called but"):
        async for _ in collector:
            collector.update_policy_weights_()  # no await: the workers would keep the old weights
    assert collector.policy_version == 0


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
async def test_awaited_calls_and_calls_started_as_tasks_pass() -> None:
    versions = []
    endless = MultiSyncCollector([cartpole] * 2, Linear(), frames_per_batch=32, worker_backend="serial")
    async with endless as collector:
        await collector.set_seed(3)
        async with anyio.create_task_group() as tg:  # its updates end before the collector closes
            async for _ in collector:
                tg.start_soon(collector.update_policy_weights_)  # a task awaits it
                versions.append(collector.policy_version)
                if len(versions) == 4:
                    break
    assert collector.policy_version == 4
