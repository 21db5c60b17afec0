"""A second ``async for`` over a collector whose budget is collected (or that was asked to stop) yields
nothing, as the first one ended: it says so with a warning at the user's line that names the fix; an
iteration that yields batches (the first one, or one after a ``break``) does not warn."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from aiocollect import Collector, MultiSyncCollector
from support import ListBuffer, cartpole

pytestmark = pytest.mark.anyio


def build(kind: str, **kwargs: Any) -> Any:
    if kind == "collector":
        return Collector(cartpole, None, frames_per_batch=20, **kwargs)
    return MultiSyncCollector(
        [cartpole, cartpole], None, frames_per_batch=20, worker_backend="serial", **kwargs
    )


def spent_warnings(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if "yields nothing" in str(w.message)]


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
@pytest.mark.parametrize("kind", ["collector", "sync"])
async def test_a_second_iteration_after_the_budget_warns(kind: str) -> None:
    async with build(kind, total_frames=40) as collector:
        with warnings.catch_warnings(record=True) as first:
            warnings.simplefilter("always")
            batches = [b async for b in collector]
        assert len(batches) == 2 and spent_warnings(first) == []
        with pytest.warns(
            UserWarning, match=r"yields nothing: it has collected its total_frames=40 already"
        ) as w:
            again = [b async for b in collector]
    assert again == []
    assert w[0].filename == __file__  # at the user's line
    assert "Make a new collector for another run" in str(w[0].message)


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
async def test_a_second_iteration_after_a_stop_warns() -> None:
    async with build("collector", total_frames=-1) as collector:
        async for _ in collector:
            collector.request_stop()
        with pytest.warns(UserWarning, match=r"yields nothing: a stop was requested \(request_stop\(\)"):
            again = [b async for b in collector]
    assert again == []


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
async def test_fill_again_after_the_budget_warns() -> None:
    async with Collector(
        cartpole, None, frames_per_batch=20, total_frames=20, replay_buffer=ListBuffer()
    ) as c:
        assert [f async for f in c.fill()] == [20]
        with pytest.warns(
            UserWarning, match=r"Collector yields nothing: it has collected its total_frames=20"
        ):
            assert [f async for f in c.fill()] == []


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
async def test_iterating_again_after_a_break_does_not_warn() -> None:
    async with build("collector", total_frames=-1) as collector:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                async for _ in collector:
                    break
    assert spent_warnings(caught) == []
