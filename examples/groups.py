"""Group-relative advantages (GRPO-style) on CartPole: each batch holds groups of ``group_size`` episodes
that start from the same initial state, and an episode's advantage is its return minus its group's mean.

    python examples/groups.py
    python examples/groups.py --group-size 8 --groups-per-batch 4 --total-frames 200000
    python examples/groups.py --workers 2 --on-update restart   # async envs in 2 worker processes

``Collector(trajs_per_batch=N, group_size=G)`` seeds the resets so that the ``G`` env slots of a group
reset to one state (the same reset seed), and delivers whole groups: ``[N, T]`` with ``split_trajs=True``,
each episode with its ``("collector", "group_id")``. No value function is learnt: the group's mean return
is the baseline, as GRPO does for the G answers to one prompt. ``--workers N`` collects with
``MultiAsyncEnvCollector`` instead (``2 * group_size`` async CartPole envs in each of ``N`` worker
processes, each worker's envs in whole groups); ``--on-update restart`` starts the episodes in flight
at each update again, so that every episode of a batch ran one policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import gymnasium as gym
import torch
from torch import nn

from aiocollect import Collector, GymEnv, MultiAsyncEnvCollector, ThreadedAsyncEnv


@dataclass
class Args:
    total_frames: int = field(default=40_000, metadata={"help": "frames of delivered episodes"})
    group_size: int = field(default=4, metadata={"help": "episodes per group (one initial state)"})
    groups_per_batch: int = field(default=4, metadata={"help": "groups per batch (one update)"})
    lr: float = field(default=0.01, metadata={"help": "Adam learning rate"})
    workers: int = field(
        default=0, metadata={"help": "0: Collector; N: MultiAsyncEnvCollector with N worker processes"}
    )
    on_update: str = field(
        default="continue",
        metadata={"help": "with --workers, 'continue' or 'restart': the episodes in flight at an update"},
    )
    seed: int = field(
        default=1, metadata={"help": "seeds the groups' initial states, the policy and sampling"}
    )


def parse_args() -> Args:
    """One ``--flag`` per ``Args`` field (``total_frames`` -> ``--total-frames``)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for f in dataclasses.fields(Args):
        parser.add_argument(
            "--" + f.name.replace("_", "-"), type=type(f.default), default=f.default, **f.metadata
        )
    return Args(**vars(parser.parse_args()))


class Policy(nn.Module):
    """observation -> logits; called by the collector as ``policy(observation)``, it samples an action."""

    def __init__(self, obs_dim: int = 4, n_actions: int = 2, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, n_actions))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        action: torch.Tensor = torch.distributions.Categorical(logits=self.net(observation)).sample()
        return action


def cartpole() -> ThreadedAsyncEnv:
    """One async CartPole env (a gymnasium env stepped in a thread), for ``--workers``."""
    return ThreadedAsyncEnv(gym.make("CartPole-v1"))


def group_advantages(returns: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each episode's return minus the mean of its group, scaled by the group's spread (the groups are
    ``group_size`` consecutive episodes of the batch)."""
    groups = returns.reshape(-1, group_size)
    centred = groups - groups.mean(-1, keepdim=True)
    return (centred / (groups.std(-1, keepdim=True) + 1e-8)).reshape(-1)


async def main(args: Args) -> None:
    torch.manual_seed(args.seed)
    policy = Policy()
    optim = torch.optim.Adam(policy.parameters(), lr=args.lr)
    episodes: dict[str, Any] = {
        "trajs_per_batch": args.groups_per_batch * args.group_size,
        "group_size": args.group_size,
        "split_trajs": True,
        "total_frames": args.total_frames,
        "seed": args.seed,
        "progress": False,
    }
    collector: Collector | MultiAsyncEnvCollector
    if args.workers:  # each worker's envs in whole groups (a group runs in one worker)
        share = [cartpole] * (2 * args.group_size)
        collector = MultiAsyncEnvCollector(
            [share] * args.workers, policy, on_update=args.on_update, **episodes
        )
    else:  # the env slots form groups: num_envs a multiple of group_size
        collector = Collector(lambda: GymEnv("CartPole-v1", num_envs=2 * args.group_size), policy, **episodes)
    start = time.perf_counter()
    async with collector:
        updates = 0
        async for batch in collector:
            mask = batch["collector", "mask"]  # [N, T]: N episodes, group after group
            group = batch["collector", "group_id"][:, 0]
            assert (group.reshape(-1, args.group_size) == group[:: args.group_size, None]).all()
            first = batch["observation"][:, 0].reshape(-1, args.group_size, 4)
            assert (first == first[:, :1]).all(), "a group starts from one state"
            returns = (batch["next", "reward"].squeeze(-1) * mask).sum(-1)
            advantage = group_advantages(returns, args.group_size)
            logits = policy.net(batch["observation"])
            log_prob = torch.distributions.Categorical(logits=logits).log_prob(batch["action"])
            loss = -(log_prob * advantage[:, None])[mask].mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            await collector.update_weights(policy)  # the next batch's episodes run these weights
            updates += 1
            if updates % 10 == 1:
                spread = returns.reshape(-1, args.group_size).std(-1).mean()
                print(
                    f"update {updates:4d}  mean return {returns.mean():6.1f}  "
                    f"spread within a group {spread:5.1f}"
                )
        stats = collector.episode_statistics()
        assert stats is not None
        elapsed = time.perf_counter() - start
        print(
            f"{stats.frames_delivered} frames in {stats.delivered} episodes "
            f"({stats.delivered // args.group_size} groups), "
            f"{stats.frames_delivered / elapsed:,.0f} frames/s, mean return {stats.mean_length:.1f}"
        )


if __name__ == "__main__":
    anyio.run(main, parse_args())
