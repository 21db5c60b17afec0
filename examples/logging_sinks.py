"""Log a collector's statistics and the trainer's own metrics to TensorBoard and Weights & Biases.

    pip install 'aiocollect[tensorboard]'            # and/or 'aiocollect[wandb]'
    python examples/logging_sinks.py                 # then: tensorboard --logdir runs
    python examples/logging_sinks.py --sinks wandb   # offline: wandb sync runs/wandb/offline-run-*

A REINFORCE trainer on CartPole-v1 calls ``collector.log_metrics({"loss": ..., "entropy": ...})`` after
each update; ``await collector.add_sink(...)`` writes those and ``collector.statistics()`` (frames/s, mean
return, ...) every ``--every`` seconds, in a worker thread (the event loop never waits for a disk or a
network), and flushes and closes the sinks when the collector closes. Every curve's x-axis is the number
of frames collected.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.to_thread
import torch
from tensordict import TensorDictBase
from torch import nn

from aiocollect import Collector, GymEnv, Sink, TensorBoardSink, WandbSink


@dataclass
class Args:
    total_frames: int = field(default=50_000, metadata={"help": "frames to collect"})
    num_envs: int = field(default=8, metadata={"help": "envs stepped together"})
    frames_per_batch: int = field(default=1_000, metadata={"help": "frames per batch"})
    sinks: str = field(
        default="auto",
        metadata={"help": "tensorboard, wandb, both comma-separated, or auto (those installed)"},
    )
    logdir: str = field(default="runs", metadata={"help": "TensorBoard's logdir; W&B writes under it too"})
    every: float = field(default=2.0, metadata={"help": "seconds between two writes"})
    lr: float = field(default=0.01, metadata={"help": "Adam's learning rate"})
    seed: int = field(default=1, metadata={"help": "seeds the envs and the policy"})


def parse_args() -> Args:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for f in dataclasses.fields(Args):
        parser.add_argument(
            "--" + f.name.replace("_", "-"), type=type(f.default), default=f.default, **f.metadata
        )
    return Args(**vars(parser.parse_args()))


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        action: torch.Tensor = torch.distributions.Categorical(logits=self.net(observation)).sample()
        return action


def update(policy: Policy, optim: torch.optim.Optimizer, batch: TensorDictBase) -> dict[str, float]:
    """One REINFORCE step with a batch-mean baseline (in a worker thread); the numbers worth logging."""
    reward, done = batch["next", "reward"].squeeze(-1), batch["next", "done"].squeeze(-1)
    returns, running = torch.zeros_like(reward), torch.zeros_like(reward[..., 0])
    for t in range(reward.shape[-1] - 1, -1, -1):  # reward-to-go, cut at episode ends
        running = reward[..., t] + 0.99 * running * (~done[..., t]).float()
        returns[..., t] = running
    advantage = (returns - returns.mean()) / (returns.std() + 1e-8)
    dist = torch.distributions.Categorical(logits=policy.net(batch["observation"]))
    loss = -(dist.log_prob(batch["action"]) * advantage).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    return {"train/loss": loss.item(), "train/entropy": dist.entropy().mean().item()}


def make_sinks(args: Args) -> list[Sink]:
    names = [n.strip() for n in args.sinks.split(",") if n.strip()]
    if names == ["auto"]:
        names = [n for n in ("tensorboard", "wandb") if importlib.util.find_spec(n) is not None]
        if not names:
            print("neither tensorboard nor wandb is installed: pip install 'aiocollect[tensorboard]'")
    sinks: list[Sink] = []
    for name in names:
        if name == "tensorboard":
            sinks.append(TensorBoardSink(Path(args.logdir), every=args.every))
        elif name == "wandb":
            sinks.append(WandbSink(project="aiocollect-example", dir=args.logdir, every=args.every))
        else:
            raise SystemExit(f"--sinks: unknown sink {name!r} (tensorboard, wandb or auto)")
    return sinks


async def main(args: Args) -> None:
    torch.manual_seed(args.seed)
    policy = Policy()
    optim = torch.optim.Adam(policy.parameters(), lr=args.lr)
    sinks = make_sinks(args)
    async with Collector(
        lambda: GymEnv("CartPole-v1", num_envs=args.num_envs),
        policy,
        frames_per_batch=args.frames_per_batch,
        total_frames=args.total_frames,
        seed=args.seed,
    ) as collector:
        for sink in sinks:
            await collector.add_sink(sink)  # open (in a thread) before the first batch
        updates = 0
        async for batch in collector:
            metrics = await anyio.to_thread.run_sync(update, policy, optim, batch)
            updates += 1
            collector.log_metrics(metrics, step=updates)
            await collector.update_weights(policy)
        stats = collector.statistics()
    # leaving `async with` wrote the last statistics and closed the sinks
    mean = "n/a" if stats.mean_return is None else f"{stats.mean_return:.1f}"
    print(f"{stats.frames} frames, {stats.frames_per_second:,.0f} frames/s at the end, mean return {mean}")
    for sink in sinks:
        print(f"{sink!r}: {sink.writes} statistics records written")
    if any(isinstance(s, TensorBoardSink) for s in sinks):
        print(f"view: tensorboard --logdir {args.logdir}")
    if any(isinstance(s, WandbSink) for s in sinks):
        print(f"upload: wandb sync {args.logdir}/wandb/offline-run-*")


if __name__ == "__main__":
    torch.set_num_threads(1)
    anyio.run(main, parse_args())
