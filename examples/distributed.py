"""Train while remote collectors collect: torch.distributed, torch RPC or Ray, one script.

A tiny policy-gradient loop (REINFORCE with a batch-mean baseline) on CartPole-v1. The collection runs on
``--nodes`` remote collectors (processes on this machine here; Slurm jobs or Ray nodes in production) and
the trainer publishes its weights after every update; the batches say which weights produced them.

    python examples/distributed.py                              # DistributedCollector, gloo, mp launcher
    python examples/distributed.py --sync                       # DistributedSyncCollector: [nodes, ...]
    python examples/distributed.py --launcher submitit          # one submitit job per node (local here)
    python examples/distributed.py --engine ray                 # RayCollector on a local Ray cluster
    python examples/distributed.py --engine rpc                 # RPCCollector (torch RPC: maintenance mode)

``--engine ray`` needs ``pip install 'aiocollect[ray]'`` and ``--launcher submitit`` needs
``pip install 'aiocollect[distributed]'``. On Slurm, pass ``slurm_kwargs`` (see docs/distributed.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import anyio
import torch
from torch import nn

from aiocollect import DistributedCollector, GymEnv, RayCollector, RPCCollector


@dataclass
class Args:
    engine: str = "torch"  # torch | rpc | ray
    launcher: str = "mp"  # mp | submitit (torch and rpc)
    sync: bool = False
    nodes: int = 2
    total_frames: int = 51_200  # 25 batches of 2048
    frames_per_batch: int = 2048
    envs_per_node: int = 8
    lr: float = 0.01
    gamma: float = 0.99
    seed: int = 0


class Policy(nn.Module):
    """obs -> logits; samples the action (the collectors run it under torch.no_grad())."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        action: torch.Tensor = torch.distributions.Categorical(logits=self.net(observation)).sample()
        return action

    def log_prob(self, observation: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        dist = torch.distributions.Categorical(logits=self.net(observation))
        log_prob: torch.Tensor = dist.log_prob(action)
        return log_prob


def discounted_returns(reward: torch.Tensor, done: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go along the last (time) dim, cut at episode ends."""
    out = torch.zeros_like(reward)
    running = torch.zeros_like(reward[..., 0])
    for t in range(reward.shape[-1] - 1, -1, -1):
        running = reward[..., t] + gamma * running * (~done[..., t]).float()
        out[..., t] = running
    return out


class MakeEnv:
    """A picklable env constructor (it travels to every node)."""

    def __init__(self, num_envs: int) -> None:
        self.num_envs = num_envs

    def __call__(self) -> GymEnv:
        return GymEnv("CartPole-v1", num_envs=self.num_envs)


def build(args: Args, policy: Policy, workdir: str) -> RayCollector | DistributedCollector | RPCCollector:
    common: dict[str, Any] = {
        "frames_per_batch": args.frames_per_batch,
        "total_frames": args.total_frames,
        "num_collectors": args.nodes,
        "collector_kwargs": {"track_policy_version": True, "seed": args.seed},
        "sync": args.sync,
        "progress": False,
    }
    if args.engine == "ray":
        # a local cluster of this machine's cores; ray_init_config={"address": "auto"} joins a running one
        return RayCollector(MakeEnv(args.envs_per_node), policy, **common)
    cls = DistributedCollector if args.engine == "torch" else RPCCollector
    kwargs: dict[str, Any] = {}
    if args.launcher == "submitit":  # "cluster": None picks Slurm where sbatch exists, else local jobs
        kwargs["slurm_kwargs"] = {"folder": os.path.join(workdir, "%j"), "cluster": None, "timeout_min": 30}
    return cls(MakeEnv(args.envs_per_node), policy, launcher=args.launcher, **common, **kwargs)


async def main(args: Args) -> None:
    torch.manual_seed(args.seed)
    policy = Policy()
    optim = torch.optim.Adam(policy.parameters(), lr=args.lr)
    update_ms: list[float] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        async with build(args, policy, workdir) as collector:
            print(f"{type(collector).__name__}: {args.nodes} nodes up in {time.perf_counter() - start:.1f} s")
            async for batch in collector:  # sync: [nodes, envs, time]; async: one node's [envs, time]
                versions = batch["collector", "policy_version"]
                reward = batch["next", "reward"][..., 0]
                done = batch["next", "done"][..., 0]
                returns = discounted_returns(reward, done, args.gamma)
                advantage = (returns - returns.mean()) / (returns.std() + 1e-8)
                loss = -(policy.log_prob(batch["observation"], batch["action"]) * advantage).mean()
                optim.zero_grad()
                loss.backward()
                optim.step()
                t0 = time.perf_counter()
                version = await collector.update_weights(policy)  # every node gets them before its next batch
                update_ms.append((time.perf_counter() - t0) * 1e3)
                stats = collector.statistics()
                print(
                    f"frames {stats.frames:>7}  batch of policy v{int(versions.min())}-v{int(versions.max())}"
                    f"  published v{version:<3}  mean return {stats.mean_return or 0:6.1f}"
                    f"  frames/s {stats.frames_per_second:8.0f}"
                )
    elapsed = time.perf_counter() - start
    print(
        f"done: {stats.frames} frames in {elapsed:.1f} s ({stats.frames / elapsed:.0f} frames/s overall, "
        f"start-up included); update_weights median {statistics.median(update_ms):.2f} ms"
    )
    # where the time went (docs/why-slow.md): the trainer's wait for batches, the nodes' (actors') split
    split = ", ".join(f"{part} {fraction:.0%}" for part, fraction in (stats.time_split or {}).items())
    print(f"trainer_wait {stats.trainer_wait or 0:.2f}; the nodes' time: {split}")


def parse() -> Args:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for field in dataclasses.fields(Args):
        flag = "--" + field.name.replace("_", "-")
        if field.type == "bool":
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=type(field.default), default=field.default)
    args = Args(**vars(parser.parse_args()))
    if args.engine not in ("torch", "rpc", "ray"):
        parser.error(f"--engine must be torch, rpc or ray, got {args.engine!r}")
    if args.launcher not in ("mp", "submitit") or (args.engine == "ray" and args.launcher != "mp"):
        parser.error("--launcher is mp or submitit, for --engine torch or rpc")
    return args


if __name__ == "__main__":  # needed: nodes are started with a forkserver (or as jobs)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # this machine only; drop it on a cluster
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    anyio.run(main, parse())
