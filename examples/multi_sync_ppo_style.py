"""On-policy training with two worker processes: collect, train, publish weights, repeat.

A tiny policy-gradient loop (REINFORCE with a batch-mean baseline) on CartPole-v1. Every batch is collected
by ``MultiSyncCollector`` in two worker processes with the weights published after the previous update,
which ``("collector", "policy_version")`` proves frame by frame.

    python examples/multi_sync_ppo_style.py --total-frames 204800
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import torch
from torch import nn

from aiocollect import GymEnv, MultiSyncCollector


@dataclass
class Args:
    total_frames: int = 102_400  # 25 batches of 4096
    frames_per_batch: int = 4096
    num_workers: int = 2
    envs_per_worker: int = 16
    lr: float = 0.01
    gamma: float = 0.99
    seed: int = 0
    uvloop: bool = False
    backend: str = "process"


class Policy(nn.Module):
    """obs -> logits; samples the action (the collector runs it under torch.no_grad())."""

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


def make_env(envs_per_worker: int) -> Callable[[], GymEnv]:
    return lambda: GymEnv("CartPole-v1", num_envs=envs_per_worker)


async def main(args: Args) -> None:
    torch.manual_seed(args.seed)
    policy = Policy()
    optim = torch.optim.Adam(policy.parameters(), lr=args.lr)
    start = time.perf_counter()
    async with MultiSyncCollector(
        [make_env(args.envs_per_worker)] * args.num_workers,
        policy,
        frames_per_batch=args.frames_per_batch,
        total_frames=args.total_frames,
        seed=args.seed,
        track_policy_version=True,
        worker_backend=args.backend,
    ) as collector:
        async for batch in collector:  # [workers, envs, time]
            # on-policy: every frame was produced by the weights we published last
            assert (batch["collector", "policy_version"] == collector.policy_version).all()
            reward = batch["next", "reward"][..., 0]
            done = batch["next", "done"][..., 0]
            returns = discounted_returns(reward, done, args.gamma)
            advantage = (returns - returns.mean()) / (returns.std() + 1e-8)
            loss = -(policy.log_prob(batch["observation"], batch["action"]) * advantage).mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            version = await collector.update_weights(policy)
            stats = collector.statistics()
            print(
                f"frames {stats.frames:>7}  version {version:>3}  "
                f"mean return {stats.mean_return or 0:6.1f}  frames/s {stats.frames_per_second:8.0f}"
            )
    elapsed = time.perf_counter() - start
    print(f"done: {stats.frames} frames in {elapsed:.1f} s ({stats.frames / elapsed:.0f} frames/s overall)")


def parse() -> Args:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for field in dataclasses.fields(Args):
        flag = "--" + field.name.replace("_", "-")
        if field.type == "bool":
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=type(field.default), default=field.default)
    return Args(**vars(parser.parse_args()))


if __name__ == "__main__":  # needed: workers are started with a forkserver
    args = parse()
    anyio.run(main, args, backend_options={"use_uvloop": args.uvloop})
