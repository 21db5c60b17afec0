"""Frames/s of the env kinds GymEnv takes, against our multi-process workers (random actions).

    python benchmarks/vector_envs.py                # CartPole-v1, 8 envs
    python benchmarks/vector_envs.py --pong         # and ALE/Pong-v5 (needs ale-py), 4 envs

Each row collects ``--frames`` frames (after one warm-up batch) and prints the best of ``--rounds``.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio
import gymnasium as gym
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv

from aiocollect import Collector, GymEnv, MultiSyncCollector


def make_task(task: str) -> gym.Env:
    if task.startswith("ALE/"):  # in every process that makes one
        import ale_py

        gym.register_envs(ale_py)
    return gym.make(task)


def vector(cls: type, task: str, n: int, mode: AutoresetMode) -> GymEnv:
    return GymEnv(cls([partial(make_task, task)] * n, autoreset_mode=mode))


def envpool_env(task: str, n: int) -> GymEnv:
    import envpool

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GymEnv(envpool.make_gymnasium(task.removeprefix("ALE/"), num_envs=n, seed=0))


async def rate(make: Callable[[], Any], frames: int, fpb: int) -> float:
    async with make(fpb) as collector:
        it = aiter(collector)
        await anext(it)  # warm-up: processes started, first reset done
        start, got = time.perf_counter(), 0
        while got < frames:
            got += (await anext(it)).numel()
        return got / (time.perf_counter() - start)


def cases(task: str, n: int) -> dict[str, Callable[[int], Any]]:
    def one(env_fn: Callable[[], GymEnv]) -> Callable[[int], Any]:
        return lambda fpb: Collector(env_fn, frames_per_batch=fpb)

    out = {
        f"SyncVectorEnv same-step, {n} envs": one(
            partial(vector, SyncVectorEnv, task, n, AutoresetMode.SAME_STEP)
        ),
        f"SyncVectorEnv next-step, {n} envs": one(
            partial(vector, SyncVectorEnv, task, n, AutoresetMode.NEXT_STEP)
        ),
        f"AsyncVectorEnv next-step, {n} envs": one(
            partial(vector, AsyncVectorEnv, task, n, AutoresetMode.NEXT_STEP)
        ),
        f"MultiSyncCollector, 2 processes x {n // 2} envs": lambda fpb: MultiSyncCollector(
            [partial(vector, SyncVectorEnv, task, n // 2, AutoresetMode.SAME_STEP)] * 2,
            frames_per_batch=fpb,
            worker_backend="process",
        ),
    }
    try:
        import envpool  # noqa: F401

        out[f"EnvPool, {n} envs"] = one(partial(envpool_env, task, n))
    except ImportError:
        pass
    return out


async def main(args: argparse.Namespace) -> None:
    tasks = [("CartPole-v1", 8, args.frames, 8 * 64)]
    if args.pong:
        tasks.append(("ALE/Pong-v5", 4, args.frames // 20, 4 * 32))
    for task, n, frames, fpb in tasks:
        print(f"{task}: frames/s (best of {args.rounds}, {frames} frames each)")
        for name, make in cases(task, n).items():
            best = max([await rate(make, frames, fpb) for _ in range(args.rounds)])
            print(f"  {name:<45} {best:>10,.0f}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pong", action="store_true")
    anyio.run(main, parser.parse_args())
