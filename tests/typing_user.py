"""A user's script for tests/test_typing.py: ``mypy --strict`` reveals the collector and batch types.

Not collected by pytest (no ``test_`` prefix) and never run: only type-checked.
"""

from __future__ import annotations

from typing import reveal_type

from aiocollect import (
    Collector,
    DistributedCollector,
    DistributedSyncCollector,
    GymEnv,
    MultiAsyncCollector,
    MultiSyncCollector,
    ProcessCollector,
    RayCollector,
    RPCCollector,
)


def make_env() -> GymEnv:
    return GymEnv("CartPole-v1")


async def collector() -> None:
    async with Collector(make_env, frames_per_batch=8, total_frames=16) as c:
        reveal_type(c)
        async for batch in c:
            reveal_type(batch)


async def multi_sync() -> None:
    async with MultiSyncCollector([make_env] * 2, frames_per_batch=8, total_frames=16) as c:
        reveal_type(c)
        async for batch in c:
            reveal_type(batch)


async def multi_async() -> None:
    async with MultiAsyncCollector([make_env] * 2, frames_per_batch=8, total_frames=16) as c:
        reveal_type(c)
        async for batch in c:
            reveal_type(batch)


async def process() -> None:
    async with ProcessCollector(make_env, frames_per_batch=8, total_frames=16) as c:
        reveal_type(c)
        async for batch in c:
            reveal_type(batch)


async def distributed() -> None:
    async with DistributedCollector(make_env, frames_per_batch=8, total_frames=16) as c:
        reveal_type(c)
        async for batch in c:
            reveal_type(batch)


async def distributed_sync() -> None:
    async with DistributedSyncCollector(make_env, frames_per_batch=8, total_frames=16) as c:
        reveal_type(c)
        async for batch in c:
            reveal_type(batch)


async def rpc() -> None:
    async with RPCCollector(make_env, frames_per_batch=8, total_frames=16) as c:
        reveal_type(c)
        async for batch in c:
            reveal_type(batch)


async def ray() -> None:
    async with RayCollector(make_env, num_collectors=2, frames_per_batch=8, total_frames=16) as c:
        reveal_type(c)
        async for batch in c:
            reveal_type(batch)


async def fill(rb: list[object]) -> None:
    async with Collector(make_env, frames_per_batch=8, total_frames=16, replay_buffer=rb) as c:
        async for frames in c.fill():
            reveal_type(frames)
