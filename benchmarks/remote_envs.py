"""Remote envs over loopback (issue 16): ``AsyncEnvCollector`` over 128 remote envs served by 2
``serve_envs`` processes of 64 CartPoles each, against ``MultiAsyncCollector`` stepping the same 128
envs in 2 worker processes (``GymEnv("CartPole-v1", num_envs=64)`` each).

    python benchmarks/remote_envs.py              # 3 interleaved rounds
    python benchmarks/remote_envs.py --quick      # smoke run
    python benchmarks/remote_envs.py --uvloop     # the collector's loop on uvloop

Both run the same MLP policy (4 -> 64 -> 64 -> 2, tanh, argmax): in the collector's thread for the
remote envs (central inference: one forward pass per batch of ready envs), in each worker for
``MultiAsyncCollector``. Two clients: ``RemoteEnvPool`` (one connection per server, the calls of all
its envs batched into one message per round) and ``RemoteEnv`` (one connection per env, a WebSocket
round trip per env step). The servers batch the calls that have arrived into one worker-thread hop.
Servers start once; each round builds a fresh collector of each kind, skips its first two batches
(start-up, resets, a batch ready in advance) and times the next ``--frames``. The table prints each
variant's median frames/s and the median of the per-round ratios to MultiAsyncCollector (target >= 0.5).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import secrets
import statistics
import time
from typing import Any

import anyio
import gymnasium as gym
import torch
from torch import nn

from aiocollect import (
    AsyncEnvCollector,
    GymEnv,
    MultiAsyncCollector,
    RemoteEnv,
    RemoteEnvPool,
    serve_envs_process,
)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).argmax(-1)


def cartpole64() -> GymEnv:
    return GymEnv("CartPole-v1", num_envs=64)


async def timed(collector: Any, frames: int) -> float:
    """Frames/s over ``frames`` frames after the first two batches (start-up, and a batch a
    multi-process collector may have ready in advance)."""
    async with collector:
        it = aiter(collector)
        await anext(it)
        await anext(it)
        start, got = time.perf_counter(), 0
        while got < frames:
            got += (await anext(it)).numel()
        return got / (time.perf_counter() - start)


async def run(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    policy = MLP()
    token = secrets.token_urlsafe(24)
    env_fn = functools.partial(gym.make, "CartPole-v1")
    names = {"pool": "AsyncEnvCollector over RemoteEnvPool", "remote": "AsyncEnvCollector over RemoteEnv"}
    results: dict[str, list[float]] = {"pool": [], "remote": [], "multi": []}
    ratios: dict[str, list[float]] = {"pool": [], "remote": []}
    async with contextlib.AsyncExitStack() as stack:
        servers = [
            await stack.enter_async_context(serve_envs_process([env_fn] * args.envs_per_server, token=token))
            for _ in range(args.servers)
        ]
        env_fns = [
            functools.partial(RemoteEnv, server.url, index=i, token=token)
            for server in servers
            for i in range(args.envs_per_server)
        ]
        n = len(env_fns)
        for r in range(args.rounds):
            fps = {}
            for kind in ("pool", "remote", "multi"):
                async with contextlib.AsyncExitStack() as pools:
                    if kind == "pool":  # one connection per server, the envs' calls batched on it
                        envs: list[Any] = []
                        for server in servers:
                            envs += await pools.enter_async_context(RemoteEnvPool(server.url, token=token))
                        collector: Any = AsyncEnvCollector(
                            envs, policy, frames_per_batch=args.frames_per_batch, min_batch=n // 2, seed=r
                        )
                    elif kind == "remote":  # one connection per env
                        collector = AsyncEnvCollector(
                            env_fns, policy, frames_per_batch=args.frames_per_batch, min_batch=n // 2, seed=r
                        )
                    else:
                        collector = MultiAsyncCollector(
                            [cartpole64] * args.servers,
                            policy,
                            frames_per_batch=args.frames_per_batch,
                            seed=r,
                        )
                    fps[kind] = await timed(collector, args.frames)
                results[kind].append(fps[kind])
            for kind in ratios:
                ratios[kind].append(fps[kind] / fps["multi"])
            print(
                f"round {r}: "
                + ", ".join(f"{kind} {fps[kind]:,.0f} frames/s" for kind in fps)
                + f"; ratios pool {ratios['pool'][-1]:.2f}, remote {ratios['remote'][-1]:.2f}",
                flush=True,
            )
    print(
        f"\n{args.servers} servers x {args.envs_per_server} CartPole envs, loopback, median of {args.rounds}"
    )
    print("| variant | frames/s | ratio to MultiAsyncCollector |\n|---|---|---|")
    for kind, name in names.items():
        print(f"| {name} | {statistics.median(results[kind]):,.0f} | {statistics.median(ratios[kind]):.2f} |")
    multi = statistics.median(results["multi"])
    print(f"| MultiAsyncCollector ({args.servers} workers) | {multi:,.0f} | 1.00 |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--envs-per-server", type=int, default=64)
    parser.add_argument("--frames", type=int, default=60_000, help="frames timed per variant and round")
    parser.add_argument("--frames-per-batch", type=int, default=6400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--uvloop", action="store_true")
    parser.add_argument("--quick", action="store_true", help="1 round of 19,200 frames")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.frames = 1, 19200
    torch.set_num_threads(1)
    anyio.run(run, args, backend="asyncio", backend_options={"use_uvloop": args.uvloop})


if __name__ == "__main__":
    main()
