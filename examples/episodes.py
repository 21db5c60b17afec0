"""REINFORCE on whole CartPole episodes: each batch holds ``trajs_per_batch`` complete episodes.

    python examples/episodes.py
    python examples/episodes.py --trajs-per-batch 16 --num-envs 8 --total-frames 200000

``Collector(trajs_per_batch=N, split_trajs=True)`` gives ``[N, T]`` batches of whole episodes (each from
its reset to its end) with a ``("collector", "mask")``: Monte-Carlo returns need no stitching across
batches. Episodes come in the order they started, so a batch is not biased toward short episodes.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass, field

import anyio
import torch
from torch import nn

from aiocollect import Collector, GymEnv


@dataclass
class Args:
    total_frames: int = field(default=100_000, metadata={"help": "frames of delivered episodes"})
    trajs_per_batch: int = field(default=8, metadata={"help": "whole episodes per batch (one update)"})
    num_envs: int = field(default=8, metadata={"help": "envs stepped together"})
    gamma: float = field(default=0.99, metadata={"help": "discount"})
    lr: float = field(default=0.01, metadata={"help": "Adam learning rate"})
    seed: int = field(default=1, metadata={"help": "seeds the envs, the policy weights and sampling"})


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


def returns_to_go(reward: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted returns of padded ``[N, T]`` episodes (zero past each episode's end)."""
    out = torch.zeros_like(reward)
    running = torch.zeros(reward.shape[0])
    for t in reversed(range(reward.shape[1])):
        running = (reward[:, t] + gamma * running) * mask[:, t]
        out[:, t] = running
    return out


async def main(args: Args) -> None:
    torch.manual_seed(args.seed)
    policy = Policy()
    optim = torch.optim.Adam(policy.parameters(), lr=args.lr)
    collector = Collector(
        lambda: GymEnv("CartPole-v1", num_envs=args.num_envs),
        policy,
        trajs_per_batch=args.trajs_per_batch,
        split_trajs=True,
        total_frames=args.total_frames,
        seed=args.seed,
        progress=False,
    )
    start = time.perf_counter()
    async with collector:
        updates = 0
        async for batch in collector:
            mask = batch["collector", "mask"]
            reward = batch["next", "reward"].squeeze(-1)
            returns = returns_to_go(reward, mask.float(), args.gamma)
            advantage = (returns - returns[mask].mean()) / (returns[mask].std() + 1e-8)
            logits = policy.net(batch["observation"])
            log_prob = torch.distributions.Categorical(logits=logits).log_prob(batch["action"])
            loss = -(log_prob * advantage)[mask].mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            await collector.update_weights(policy)  # the next batch's episodes run these weights
            updates += 1
            if updates % 10 == 1:
                episode_return = float(reward.sum(-1).mean())
                print(
                    f"update {updates:4d}  episodes of {mask.sum(-1).float().mean():6.1f} frames  "
                    f"mean return {episode_return:6.1f}"
                )
        stats = collector.episode_statistics()
        assert stats is not None
        elapsed = time.perf_counter() - start
        print(
            f"{stats.frames_delivered} frames in {stats.delivered} episodes, "
            f"{stats.frames_delivered / elapsed:,.0f} frames/s, mean length {stats.mean_length:.1f} "
            f"(longest {stats.max_length})"
        )


if __name__ == "__main__":
    anyio.run(main, parse_args())
