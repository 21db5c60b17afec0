"""Remote envs with central inference, started by one command: 2 env server processes (``serve_envs``)
and a collector that steps all their envs over WebSocket and runs the policy on batches of ready envs.

Needs the ``serve`` extra (wsproto): ``pip install -e ".[serve]"`` (or ``pip install "aiocollect[serve]"``).

    python examples/remote_envs.py
    python examples/remote_envs.py --envs-per-server 32 --total-frames 50000 --uvloop
    python examples/remote_envs.py --remote-policy    # the policy served too (serve_policy/RemotePolicy)
    python examples/remote_envs.py --pool             # single envs, each stepped on its own (RemoteEnvPool)

In a real deployment each server runs on a simulator machine (``serve_envs(..., host=<its private
address>, token=...)`` in a script of its own, see docs/serve.md) and the learner connects to them; here
``serve_envs_process`` starts them on this machine, on loopback, with a random shared token. Each server
hosts one vector env of ``--envs-per-server`` CartPoles (``vector_env_fn``), and the collector steps it
through one ``RemoteVectorEnv``: one message per step for all its envs, the fast path. With ``--pool``
the servers host single envs, and one ``RemoteEnvPool`` per server steps each env as it becomes ready
(one message per round of the envs ready meanwhile). The policy runs in the collector's thread, or, with
``--remote-policy``, in a ``serve_policy`` server that batches the requests of every client (here one)
into one forward pass.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import gymnasium as gym
import torch
from tensordict.nn import TensorDictModule
from torch import nn

from aiocollect import (
    AsyncEnvCollector,
    GymEnv,
    RemoteEnvPool,
    RemotePolicy,
    RemoteVectorEnv,
    serve_envs_process,
    serve_policy,
)


@dataclass
class Args:
    servers: int = field(default=2, metadata={"help": "env server processes"})
    envs_per_server: int = field(default=16, metadata={"help": "CartPole envs in each server"})
    total_frames: int = field(default=20_000, metadata={"help": "frames to collect"})
    frames_per_batch: int = field(default=2_000, metadata={"help": "frames per batch"})
    remote_policy: bool = field(default=False, metadata={"help": "serve the policy too (RemotePolicy)"})
    pool: bool = field(default=False, metadata={"help": "single envs and RemoteEnvPool, not a vector env"})
    uvloop: bool = field(default=False, metadata={"help": "run the asyncio loop on uvloop"})
    seed: int = field(default=1, metadata={"help": "seeds the envs and the policy weights"})


def parse_args() -> Args:
    """One ``--flag`` per ``Args`` field (``total_frames`` -> ``--total-frames``)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for f in dataclasses.fields(Args):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, **f.metadata)
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default, **f.metadata)
    return Args(**vars(parser.parse_args()))


class ArgmaxMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        action: torch.Tensor = self.net(observation).argmax(-1)
        return action


async def main(args: Args) -> None:
    torch.manual_seed(args.seed)
    policy = TensorDictModule(ArgmaxMLP(), in_keys=["observation"], out_keys=["action"])
    token = secrets.token_urlsafe(24)  # shared by the servers and this client; never leaves this machine
    make_env = functools.partial(gym.make, "CartPole-v1")
    make_vector = functools.partial(GymEnv, "CartPole-v1", num_envs=args.envs_per_server)
    async with contextlib.AsyncExitStack() as stack:
        envs: list[Any] = []
        for _ in range(args.servers):
            if args.pool:  # single envs, each stepped when it is ready
                server = await stack.enter_async_context(
                    serve_envs_process([make_env] * args.envs_per_server, token=token)
                )
                pool = await stack.enter_async_context(RemoteEnvPool(server.url, token=token))
                envs += pool
            else:  # one vector env per server, stepped whole by one message
                server = await stack.enter_async_context(
                    serve_envs_process(vector_env_fn=make_vector, token=token)
                )
                envs.append(
                    await stack.enter_async_context(await RemoteVectorEnv.open(server.url, token=token))
                )
            print(f"env server pid {server.pid} at {server.url}: {args.envs_per_server} envs")
        acting: Any = policy
        if args.remote_policy:
            policy_server = await stack.enter_async_context(serve_policy(policy, token=token))
            acting = await stack.enter_async_context(RemotePolicy(policy_server.url, token=token))
        collector = AsyncEnvCollector(
            envs,
            acting,
            frames_per_batch=args.frames_per_batch,
            total_frames=args.total_frames,
            seed=args.seed,
        )
        start = time.perf_counter()
        async with collector:
            async for batch in collector:
                served = batch["collector", "env_id"].unique().numel()
                print(f"batch of {batch.numel()} frames from {served} remote envs")
            stats = collector.statistics()
        elapsed = time.perf_counter() - start
    sizes = collector.policy_batch_sizes
    mean_return = "n/a" if stats.mean_return is None else f"{stats.mean_return:.1f}"
    print(
        f"{stats.frames} frames in {elapsed:.1f} s: {stats.frames / elapsed:,.0f} frames/s from "
        f"{args.servers * args.envs_per_server} remote envs in {args.servers} processes; "
        f"{len(sizes)} policy calls, "
        f"{sum(sizes) / max(len(sizes), 1):.0f} envs each on average; {stats.episodes} episodes, "
        f"mean return {mean_return}"
    )


if __name__ == "__main__":
    args = parse_args()
    torch.set_num_threads(1)
    anyio.run(main, args, backend="asyncio", backend_options={"use_uvloop": args.uvloop})
