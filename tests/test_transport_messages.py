"""Typed control operations (one set for workers, nodes and actors) and the worker-state enum."""

from __future__ import annotations

import json
import pickle
from typing import get_args

import pytest

from aiocollect import MultiSyncCollector, WorkerState, WorkerStatistics
from aiocollect._remote import _messages as remote
from aiocollect._transport._messages import (
    FleetOp,
    GetAttr,
    GetState,
    LoadState,
    MapFn,
    Operation,
    Reset,
    SetSeed,
    WorkerOp,
)
from support import cartpole


def test_one_set_of_fleet_operations() -> None:
    fleet = set(get_args(FleetOp))
    assert fleet == {SetSeed, Reset, GetState, LoadState, GetAttr}
    assert fleet <= set(get_args(WorkerOp)) and fleet <= set(get_args(remote.ControlOp))
    assert set(get_args(remote.ControlOp)) - fleet == {
        remote.WaitLoaded,
        remote.NextBatch,
        remote.StageWeights,
    }
    for cls in fleet:
        assert getattr(remote, cls.__name__, cls) is cls  # no second class of the same name
    ops = [
        SetSeed(3),
        Reset(),
        GetState(),
        LoadState({"frames": 1}),
        GetAttr("policy", "weight"),
        MapFn("env.close"),
    ]
    ops += [remote.WaitLoaded(2), remote.NextBatch(), remote.StageWeights({}, 1)]
    for op in ops:
        assert isinstance(op, Operation)
        assert pickle.loads(pickle.dumps(op)) == op
    assert GetState() == GetState(versioned=False) and LoadState({}) == LoadState({}, versioned=False)


@pytest.mark.anyio
async def test_workers_take_operations_not_names() -> None:
    async with MultiSyncCollector([cartpole], frames_per_batch=8, worker_backend="serial") as c:
        pool = c._active_pool()
        with pytest.raises(TypeError, match="op must be a worker operation"):
            await pool.call(0, "reset")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="op must be a worker operation"):
            await pool.call_all(remote.NextBatch())  # type: ignore[arg-type]
        assert await c.set_seed(1) == 1  # refused before it reached a worker: the collector goes on
        assert await pool.call(0, GetAttr("env", "batch_size")) == await c.getattr_env("batch_size")


@pytest.mark.anyio
async def test_a_worker_refuses_versioned_state() -> None:
    """``versioned`` is the hosted collectors' (their version map); a worker says so rather than ignore it."""
    with pytest.raises(ValueError, match=r"GetState\(versioned=True\) is for hosted collectors"):
        async with MultiSyncCollector([cartpole], frames_per_batch=8, worker_backend="serial") as c:
            await c._active_pool().call(0, GetState(versioned=True))


def test_worker_states_are_their_strings() -> None:
    stats = WorkerStatistics(0, "collecting", 10, 1)
    assert stats.state is WorkerState.COLLECTING
    assert stats.state == "collecting"
    assert f"{stats.state}" == "collecting"
    assert json.loads(json.dumps({"state": stats.state})) == {"state": "collecting"}
    assert [s.value for s in WorkerState] == ["starting", "collecting", "paused", "stopped", "failed"]
    with pytest.raises(ValueError):
        WorkerStatistics(0, "sleeping", 0, 0)
