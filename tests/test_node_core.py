"""The hosted-collector core every remote engine runs (torch.distributed and RPC nodes, Ray actors),
driven here in process: built from a typed spec, the trainer's weight versions, batches, and the typed
control operations."""

from __future__ import annotations

import anyio
import cloudpickle
import pytest
import torch

from aiocollect import Collector, GymEnv, MultiSyncCollector, RolloutOptions
from aiocollect._observe._timesplit import SplitWindows
from aiocollect._remote._messages import HostSpec, StageWeights, WaitLoaded
from aiocollect._remote._node import NodeCore
from aiocollect._transport._messages import GetAttr, GetState, LoadState, Reset, SetSeed

pytestmark = pytest.mark.anyio


class ConstantPolicy(torch.nn.Module):
    def __init__(self, value: float = 0.0) -> None:
        super().__init__()
        self.value = torch.nn.Parameter(torch.tensor([value]))

    def forward(self, observation):
        return self.value.expand(*observation.shape[:-1], 1).clone()


def pendulum():
    return GymEnv("Pendulum-v1")


def spec(index: int = 1, count: int = 3, keys: dict | None = None, hosted=None) -> HostSpec:
    given = dict(keys or {})
    rollout = RolloutOptions(frames_per_batch=8, total_frames=-1, **given).for_member(index, count)
    payload = cloudpickle.dumps(hosted or (pendulum, Collector, {}))
    return HostSpec(index, count, payload, cloudpickle.dumps(ConstantPolicy()), rollout)


async def test_batches_weights_and_versions_in_the_trainers_numbers():
    core = NodeCore.from_spec(spec(keys={"max_frames_per_traj": 4}))
    assert core.frames_per_batch == 8
    async with core:
        first = await core.next_batch()
        assert first.frames == 8 and first.policy_version == 0
        assert tuple(first.batch.batch_size) == (8,)
        ids = set(first.batch["collector", "traj_ids"].tolist())
        assert all(i % 3 == 1 for i in ids)  # member 1 of 3 takes ids 1, 4, 7, ...
        assert len(ids) == 2  # max_frames_per_traj=4 reached the collector
        assert first.episodes == [] or all(n == 4 for _, n in first.episodes)
        # the trainer's version 5 (its numbering, not the collector's)
        await core.call(StageWeights({"value": torch.tensor([0.5])}, 5))

        async def loaded(version: int) -> None:
            assert version == 5

        async with anyio.create_task_group() as tg:
            tg.start_soon(core.run_applier, loaded)
            assert await core.call(WaitLoaded(5)) == 5
            batch = await core.next_batch()
            tg.cancel_scope.cancel()
        assert batch.policy_version == 5
        assert set(batch.batch["action"].flatten().tolist()) == {0.5}


async def test_control_operations_are_typed():
    core = NodeCore.from_spec(spec())
    async with core:
        assert await core.call(SetSeed(3)) == await core.call(SetSeed(3))
        await core.call(Reset())
        state = await core.call(GetState())
        versioned = await core.call(GetState(versioned=True))
        assert set(versioned) == {"inner", "version_map", "version", "policy"}
        await core.call(LoadState(state))
        await core.call(LoadState(versioned, versioned=True))
        assert await core.call(GetAttr("env", "batch_size")) == core.collector.env.batch_size
        assert isinstance(await core.call(GetAttr("policy", "value")), torch.nn.Parameter)


async def test_a_hosted_multi_process_collector_answers_from_worker_0():
    hosted = ([pendulum, pendulum], MultiSyncCollector, {"worker_backend": "serial"})
    core = NodeCore.from_spec(spec(hosted=hosted))
    async with core:
        assert await core.call(GetAttr("env", "batch_size")) == torch.Size([])
        assert isinstance(await core.call(GetAttr("policy", "value")), torch.nn.Parameter)
        assert await core.call(SetSeed(3)) == 4  # the seed chain over its two workers
        await core.call(LoadState(await core.call(GetState(versioned=True)), versioned=True))


@pytest.mark.parametrize(
    "hosted",
    [None, ([pendulum, pendulum], MultiSyncCollector, {"worker_backend": "serial"})],
    ids=["collector", "multi-sync"],
)
async def test_batches_carry_the_time_split_of_each_producer(hosted):
    """Each batch carries the hosted collector's producers' totals (one per rollout: the trainer reads
    them as the node's time split), cumulative from batch to batch."""
    core = NodeCore.from_spec(spec(hosted=hosted))
    windows = SplitWindows()
    producers = 1 if hosted is None else 2
    async with core:
        first = await core.next_batch()
        second = await core.next_batch()
    for out in (first, second):
        assert len(out.time_split) == producers
        assert all(len(totals) == 7 for totals in out.time_split)
        windows.add(out.time_split)
    # cumulative: the producers' frames so far grow from batch to batch
    assert sum(t[6] for t in second.time_split) > sum(t[6] for t in first.time_split) > 0
    fractions, per_frame = windows.read()
    assert sum(fractions.values()) == pytest.approx(1.0)
    assert per_frame["env"] > 0 and fractions["env"] > 0
