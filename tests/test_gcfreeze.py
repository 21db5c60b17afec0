"""``AsyncEnvCollector(freeze_gc=...)``: the objects alive when it starts leave the garbage collector's full
scans while it runs, and come back when the last such collector closes (by ``aclose``, an error or a
cancellation); a process that froze by itself keeps its permanent generation."""

from __future__ import annotations

import gc

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from gymnasium import spaces

from aiocollect import AsyncEnvCollector

pytestmark = pytest.mark.anyio


class Boom(Exception):
    pass


class Tick:
    observation_space = spaces.Box(0, 10**6, (1,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, fail_at: int | None = None) -> None:
        self.t = 0
        self.fail_at = fail_at

    async def reset(self, *, seed=None, options=None):
        return np.zeros(1, np.float32), {}

    async def step(self, action):
        await anyio.lowlevel.checkpoint()
        self.t += 1
        if self.t == self.fail_at:
            raise Boom("step")
        return np.full(1, self.t, np.float32), 1.0, False, False, {}

    async def close(self):
        pass


@pytest.fixture(autouse=True)
def unfrozen():
    """Every test starts and must end with nothing frozen (as a fresh process)."""
    gc.unfreeze()
    yield
    assert gc.get_freeze_count() == 0, "the collector left objects frozen"


async def test_frozen_while_running_and_given_back_on_close() -> None:
    assert gc.get_freeze_count() == 0
    async with AsyncEnvCollector([Tick] * 4, frames_per_batch=8, total_frames=16) as collector:
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # modules, torch, the envs
        assert [b.numel() async for b in collector] == [8, 8]
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


async def test_freeze_gc_false_leaves_the_gc_alone() -> None:
    async with AsyncEnvCollector([Tick] * 4, frames_per_batch=8, total_frames=8, freeze_gc=False) as c:
        assert gc.get_freeze_count() == 0
        assert [b.numel() async for b in c] == [8]


async def test_two_collectors_freeze_once_until_both_closed() -> None:
    first = AsyncEnvCollector([Tick] * 2, frames_per_batch=4)
    second = AsyncEnvCollector([Tick] * 2, frames_per_batch=4)
    async with first:
        count = gc.get_freeze_count()
        async with second:
            assert gc.get_freeze_count() <= count  # not frozen again (frozen objects may die meanwhile)
            await anext(aiter(second))
        assert gc.get_freeze_count() > 0  # `first` still runs
        await anext(aiter(first))
    assert gc.get_freeze_count() == 0


async def test_given_back_when_an_env_fails_or_the_consumer_is_cancelled() -> None:
    with pytest.raises(Boom):
        async with AsyncEnvCollector([lambda: Tick(fail_at=3)] * 2, frames_per_batch=100) as collector:
            async for _ in collector:
                pass
    assert gc.get_freeze_count() == 0
    with anyio.move_on_after(0.2):
        async with AsyncEnvCollector([Tick] * 2, frames_per_batch=4) as collector:
            assert gc.get_freeze_count() > 0
            async for _ in collector:
                await anyio.sleep(0.01)  # a consumer's pace, until it is cancelled
    assert gc.get_freeze_count() == 0


async def test_a_process_that_froze_by_itself_keeps_its_freeze() -> None:
    gc.freeze()
    mine = gc.get_freeze_count()
    try:
        async with AsyncEnvCollector([Tick] * 2, frames_per_batch=4, total_frames=4) as collector:
            assert [b.numel() async for b in collector] == [4]
        assert gc.get_freeze_count() >= mine - 100  # not unfrozen (a few frozen objects may have died)
    finally:
        gc.unfreeze()


async def test_a_freeze_made_while_it_runs_is_kept() -> None:
    try:
        async with AsyncEnvCollector([Tick] * 2, frames_per_batch=4, total_frames=4) as collector:
            junk = [[] for _ in range(300_000)]  # more than can have died since our freeze
            gc.freeze()  # somebody else's freeze on top of ours: we must not undo it
            assert [b.numel() async for b in collector] == [4]
        assert gc.get_freeze_count() > len(junk)
    finally:
        gc.unfreeze()


def test_freeze_gc_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="freeze_gc must be True or False"):
        AsyncEnvCollector([Tick], frames_per_batch=4, freeze_gc="yes")  # type: ignore[arg-type]
