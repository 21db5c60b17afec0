"""Typed worker operations and the worker-state enum."""

from __future__ import annotations

import json
import pickle

import pytest

from aiocollect import WorkerState, WorkerStatistics
from aiocollect._transport._messages import GetAttr, MapFn, Operation, Reset, SetSeed, operation


def test_operation_names_map_to_typed_operations() -> None:
    assert operation("set_seed", 3) == SetSeed(3)
    assert operation("reset") == Reset()
    assert operation("getattr_env", "max_steps") == GetAttr("env", "max_steps")
    assert operation("map_fn", "env.close", (), {}) == MapFn("env.close")
    op = GetAttr("policy", "weight")
    assert operation(op) is op
    assert pickle.loads(pickle.dumps(op)) == op


def test_unknown_operation_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown worker operation 'explode'"):
        operation("explode")
    with pytest.raises(TypeError, match="carries its own arguments"):
        operation(Reset(), 1)
    assert isinstance(Reset(), Operation)


def test_worker_states_are_their_strings() -> None:
    stats = WorkerStatistics(0, "collecting", 10, 1)
    assert stats.state is WorkerState.COLLECTING
    assert stats.state == "collecting"
    assert f"{stats.state}" == "collecting"
    assert json.loads(json.dumps({"state": stats.state})) == {"state": "collecting"}
    assert [s.value for s in WorkerState] == ["starting", "collecting", "paused", "stopped", "failed"]
    with pytest.raises(ValueError):
        WorkerStatistics(0, "sleeping", 0, 0)
