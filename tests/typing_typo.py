"""A user's script with a misspelt keyword for each public collector, for tests/test_typing.py: ``mypy
--strict`` must flag every call (the keyword lists reach mypy through ``Unpack``), and each call raises a
``TypeError`` that suggests the keyword meant (``explicit_keywords``).

Not collected by pytest (no ``test_`` prefix); its calls run only from the test, each before anything
starts (the keywords are checked first).
"""

from __future__ import annotations

from aiocollect import (
    AsyncEnvCollector,
    Collector,
    DistributedCollector,
    DistributedSyncCollector,
    GymEnv,
    MultiAsyncCollector,
    MultiAsyncEnvCollector,
    MultiSyncCollector,
    ProcessCollector,
    RayCollector,
    RPCCollector,
)


def make_env() -> GymEnv:
    return GymEnv("CartPole-v1")


def collector() -> object:
    return Collector(make_env, frames_per_batch=8, total_frame=16)


def multi_sync() -> object:
    return MultiSyncCollector([make_env] * 2, frames_per_batch=8, total_frame=16)


def multi_async() -> object:
    return MultiAsyncCollector([make_env] * 2, frames_per_batch=8, total_frame=16)


def process() -> object:
    return ProcessCollector(make_env, frames_per_batch=8, total_frame=16)


def distributed() -> object:
    return DistributedCollector(make_env, frames_per_batch=8, total_frame=16)


def distributed_sync() -> object:
    return DistributedSyncCollector(make_env, frames_per_batch=8, total_frame=16)


def rpc() -> object:
    return RPCCollector(make_env, frames_per_batch=8, total_frame=16)


def ray() -> object:
    return RayCollector(make_env, num_collectors=2, frames_per_batch=8, total_frame=16)


def async_envs() -> object:
    return AsyncEnvCollector([make_env] * 2, frames_per_batch=8, total_frame=16)


def multi_async_envs() -> object:
    return MultiAsyncEnvCollector([[make_env]] * 2, frames_per_batch=8, total_frame=16)


CALLS = [
    collector,
    multi_sync,
    multi_async,
    process,
    distributed,
    distributed_sync,
    rpc,
    ray,
    async_envs,
    multi_async_envs,
]
