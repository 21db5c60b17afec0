"""Remote envs over loopback (issue 16): ``AsyncEnvCollector`` over 128 remote envs served by 2
``serve_envs`` processes of 64 CartPoles each, against ``MultiAsyncCollector`` stepping the same 128
envs in 2 worker processes (``GymEnv("CartPole-v1", num_envs=64)`` each).

    python benchmarks/remote_envs.py              # 3 interleaved rounds
    python benchmarks/remote_envs.py --quick      # smoke run
    python benchmarks/remote_envs.py --uvloop     # the collector's loop on uvloop

Both run the same MLP policy (4 -> 64 -> 64 -> 2, tanh, argmax): in the collector's thread for the
remote envs (central inference: one forward pass per batch of ready envs), in each worker for
``MultiAsyncCollector``. Three clients: ``RemoteVectorEnv`` (one connection per server, all its envs
stepped by one message per step; those 2 servers host the baseline's own vector env,
``GymEnv("CartPole-v1", num_envs=64)``, through ``serve_envs(vector_env_fn=...)``), ``RemoteEnvPool``
(one connection per server of 64 single ``gym.make`` CartPoles, the calls of its envs batched into one
message per round) and ``RemoteEnv`` (one connection per env, a WebSocket round trip per env step). A
fourth row, "plain loop", steps the 2 ``RemoteVectorEnv`` without a collector (a forward pass in a
worker thread, then one ``await step``, nothing stored): an upper bound for the collector over them.
Servers start once; each round builds a fresh collector of each kind, skips its first two batches
(start-up, resets, a batch ready in advance) and times the next ``--frames``. The table prints each
variant's median frames/s, the median of the per-round ratios to MultiAsyncCollector (target >= 0.5),
and the CPU time per frame of the collector's process and of the two servers together (user + system,
from ``/proc``; the servers' at the remote variants only), with the load average before and after (the
machine may be shared).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
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
    RemoteVectorEnv,
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


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU seconds of process ``pid`` so far (its threads included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def timed(collector: Any, frames: int, servers: list[int]) -> tuple[float, float, float]:
    """Frames/s over ``frames`` frames after the first two batches (start-up, and a batch a
    multi-process collector may have ready in advance), and the CPU µs per frame of this process and of
    the processes ``servers`` together."""
    async with collector:
        it = aiter(collector)
        await anext(it)
        await anext(it)
        cpu0, server0 = cpu_seconds(), sum(map(cpu_seconds, servers))
        start, got = time.perf_counter(), 0
        while got < frames:
            got += (await anext(it)).numel()
        elapsed = time.perf_counter() - start
        cpu, server = cpu_seconds() - cpu0, sum(map(cpu_seconds, servers)) - server0
        return got / elapsed, 1e6 * cpu / got, 1e6 * server / got


async def timed_loop(
    envs: list[RemoteVectorEnv], policy: nn.Module, frames: int, servers: list[int]
) -> tuple[float, float, float]:
    """The upper bound of a collector over ``envs``: a plain loop per vector env (the policy's forward
    pass in a worker thread, then one ``await step``), nothing stored; as :func:`timed`, after a warm-up."""
    counted = {"frames": 0}
    marks = [(frames // 5, anyio.Event()), (frames // 5 + frames, anyio.Event())]

    def act(obs: Any) -> Any:
        with torch.no_grad():
            return policy(torch.from_numpy(obs)).numpy()

    async def run(env: RemoteVectorEnv, seed: int) -> None:
        obs, _ = await env.reset(seed=seed)
        while True:
            action = await anyio.to_thread.run_sync(act, obs)
            obs, *_ = await env.step(action)
            counted["frames"] += env.num_envs
            for mark, event in marks:
                if counted["frames"] >= mark:
                    event.set()

    async with anyio.create_task_group() as tg:
        for i, env in enumerate(envs):
            tg.start_soon(run, env, 1000 * i)
        await marks[0][1].wait()
        cpu0, server0 = cpu_seconds(), sum(map(cpu_seconds, servers))
        start, got0 = time.perf_counter(), counted["frames"]
        await marks[1][1].wait()
        elapsed, got = time.perf_counter() - start, counted["frames"] - got0
        cpu, server = cpu_seconds() - cpu0, sum(map(cpu_seconds, servers)) - server0
        tg.cancel_scope.cancel()
    return got / elapsed, 1e6 * cpu / got, 1e6 * server / got


async def run(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    policy = MLP()
    collector: Any
    token = secrets.token_urlsafe(24)
    env_fn = functools.partial(gym.make, "CartPole-v1")
    names = {
        "pool": "AsyncEnvCollector over RemoteEnvPool",
        "remote": "AsyncEnvCollector over RemoteEnv",
        "vector": "AsyncEnvCollector over RemoteVectorEnv (servers host the vector env)",
        "loop": "plain loop over RemoteVectorEnv (upper bound, nothing stored)",
    }
    kinds = ["vector", "pool", "remote", "loop", "multi"]
    if args.no_remote:
        kinds.remove("remote")
    results: dict[str, list[float]] = {kind: [] for kind in kinds}
    cpu: dict[str, list[tuple[float, float]]] = {kind: [] for kind in kinds}
    load_before = os.getloadavg()
    ratios: dict[str, list[float]] = {kind: [] for kind in kinds if kind != "multi"}
    async with contextlib.AsyncExitStack() as stack:
        servers = [
            await stack.enter_async_context(serve_envs_process([env_fn] * args.envs_per_server, token=token))
            for _ in range(args.servers)
        ]
        # servers hosting the baseline's own vector env (a SyncVectorEnv of 64 CartPoles, same-step)
        vector_servers = [
            await stack.enter_async_context(serve_envs_process(vector_env_fn=cartpole64, token=token))
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
            for kind in kinds:
                async with contextlib.AsyncExitStack() as pools:
                    if kind == "loop":
                        vector_envs = [
                            await pools.enter_async_context(await RemoteVectorEnv.open(s.url, token=token))
                            for s in vector_servers
                        ]
                        pids = [s.pid for s in vector_servers if s.pid]
                        fps[kind], client_us, server_us = await timed_loop(
                            vector_envs, policy, args.frames, pids
                        )
                        results[kind].append(fps[kind])
                        cpu[kind].append((client_us, server_us))
                        continue
                    if kind == "vector":  # one connection per server, one message per step of its 64 envs
                        vector_envs = [
                            await pools.enter_async_context(await RemoteVectorEnv.open(s.url, token=token))
                            for s in vector_servers
                        ]
                        collector = AsyncEnvCollector(
                            vector_envs,
                            policy,
                            frames_per_batch=args.frames_per_batch,
                            min_batch=args.envs_per_server,
                            seed=r,
                        )
                        pids = [s.pid for s in vector_servers if s.pid]
                        fps[kind], client_us, server_us = await timed(collector, args.frames, pids)
                        results[kind].append(fps[kind])
                        cpu[kind].append((client_us, server_us))
                        continue
                    if kind == "pool":  # one connection per server, the envs' calls batched on it
                        envs: list[Any] = []
                        for server in servers:
                            envs += await pools.enter_async_context(RemoteEnvPool(server.url, token=token))
                        collector = AsyncEnvCollector(
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
                    pids = [server.pid for server in servers if server.pid] if kind != "multi" else []
                    fps[kind], client_us, server_us = await timed(collector, args.frames, pids)
                results[kind].append(fps[kind])
                cpu[kind].append((client_us, server_us))
            for kind in ratios:
                if kind in fps:
                    ratios[kind].append(fps[kind] / fps["multi"])
            print(
                f"round {r}: "
                + ", ".join(f"{kind} {fps[kind]:,.0f} frames/s" for kind in fps)
                + "; ratios "
                + ", ".join(f"{kind} {fps[kind] / fps['multi']:.2f}" for kind in ratios if kind in fps),
                flush=True,
            )
    print(
        f"\n{args.servers} servers x {args.envs_per_server} CartPole envs, loopback, "
        f"median of {args.rounds}; "
        f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    print(
        "| variant | frames/s | ratio to MultiAsyncCollector | CPU µs/frame: collector process | servers |"
        "\n|---|---|---|---|---|"
    )
    for kind, name in {**names, "multi": f"MultiAsyncCollector ({args.servers} workers)"}.items():
        if not results.get(kind):
            continue
        client_us = statistics.median(c for c, _ in cpu[kind])
        server_us = f"{statistics.median(s for _, s in cpu[kind]):.1f}" if kind != "multi" else ""
        ratio = f"{statistics.median(ratios[kind]):.2f}" if kind in ratios else "1.00"
        print(
            f"| {name} | {statistics.median(results[kind]):,.0f} | {ratio} | {client_us:.1f} | {server_us} |"
        )


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
    parser.add_argument(
        "--no-remote", action="store_true", help="leave out RemoteEnv (one connection per env)"
    )
    parser.add_argument("--quick", action="store_true", help="1 round of 19,200 frames")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.frames = 1, 19200
    torch.set_num_threads(1)
    anyio.run(run, args, backend="asyncio", backend_options={"use_uvloop": args.uvloop})


if __name__ == "__main__":
    main()
