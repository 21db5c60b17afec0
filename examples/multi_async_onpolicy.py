"""On-policy training from an asynchronous collector: every frame from the newest weights.

``MultiAsyncCollector(max_policy_lag=0)`` delivers each worker's batches first come, first served, and
at every ``update_weights`` drops what was collected with older weights (batches waiting in the slots,
rollouts in flight, which restart on the new weights without resetting the envs). Its workers wait
while you train. The trainer gathers batches until it has ``frames_per_update`` frames, then takes a
REINFORCE step (reward-to-go per batch, batch-mean baseline) on CartPole-v1, and prints how many
collected frames the guarantee cost (``statistics().frames_discarded``).

    python examples/multi_async_onpolicy.py --total-frames 204800
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import torch
from tensordict import TensorDictBase
from torch import nn

from aiocollect import GymEnv, MultiAsyncCollector


@dataclass
class Args:
    total_frames: int = 102_400  # 800 batches of 128, 100 updates of 1024
    frames_per_batch: int = 128  # per worker batch: smaller wastes less at each update
    frames_per_update: int = 1024
    num_workers: int = 2
    envs_per_worker: int = 4
    lr: float = 0.01
    gamma: float = 0.99
    seed: int = 0
    backend: str = "process"


class Policy(nn.Module):
    """obs -> sampled action (the collector runs it under torch.no_grad())."""

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


def reward_to_go(batch: TensorDictBase, gamma: float) -> torch.Tensor:
    """Discounted reward-to-go along the batch's time dim (the last), cut at episode ends."""
    reward = batch["next", "reward"][..., 0]
    done = batch["next", "done"][..., 0]
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
    pending: list[TensorDictBase] = []
    async with MultiAsyncCollector(
        [make_env(args.envs_per_worker)] * args.num_workers,
        policy,
        frames_per_batch=args.frames_per_batch,
        total_frames=args.total_frames,
        max_policy_lag=0,  # on-policy: nothing from older weights is delivered
        track_policy_version=True,
        seed=args.seed,
        worker_backend=args.backend,
    ) as collector:
        async for batch in collector:  # [envs, time], one worker's
            assert (batch["collector", "policy_version"] == collector.policy_version).all()
            pending.append(batch)
            if sum(b.numel() for b in pending) < args.frames_per_update:
                continue
            obs = torch.cat([b["observation"].flatten(0, -2) for b in pending])
            action = torch.cat([b["action"].flatten() for b in pending])
            returns = torch.cat([reward_to_go(b, args.gamma).flatten() for b in pending])
            advantage = (returns - returns.mean()) / (returns.std() + 1e-8)
            loss = -(policy.log_prob(obs, action) * advantage).mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            pending = []
            version = await collector.update_weights(policy)  # max_policy_lag=0: a flush
            stats = collector.statistics()
            print(
                f"frames {stats.frames:>7}  version {version:>3}  mean return {stats.mean_return or 0:6.1f}  "
                f"frames/s {stats.frames_per_second:8.0f}  discarded {stats.frames_discarded:>6}"
            )
        stats = collector.statistics()
    elapsed = time.perf_counter() - start
    wasted = stats.frames_discarded / max(stats.frames + stats.frames_discarded, 1)
    print(
        f"done: {stats.frames} frames in {elapsed:.1f} s ({stats.frames / elapsed:.0f} frames/s overall), "
        f"{wasted:.1%} of the collected frames discarded to stay on-policy"
    )


def parse() -> Args:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for field in dataclasses.fields(Args):
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(flag, type=type(field.default), default=field.default)
    return Args(**vars(parser.parse_args()))


if __name__ == "__main__":  # needed: workers are started with a forkserver
    anyio.run(main, parse())
