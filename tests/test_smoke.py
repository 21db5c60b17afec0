import types

import pytest

import aiocollect
from aiocollect import Collector, GymEnv


def test_all_is_exported():
    for name in aiocollect.__all__:
        assert hasattr(aiocollect, name), name
    # public submodules (aiocollect.compat, aiocollect.dashboard) are imported on demand, not re-exported
    public = {
        n
        for n in dir(aiocollect)
        if not n.startswith("_") and not isinstance(getattr(aiocollect, n), types.ModuleType)
    }
    assert public <= set(aiocollect.__all__) | {"annotations"}


@pytest.mark.anyio
async def test_collect_cartpole():
    async with Collector(lambda: GymEnv("CartPole-v1"), frames_per_batch=16, total_frames=32) as c:
        sizes = [b.batch_size for b in [b async for b in c]]
    assert sizes == [(16,), (16,)]
