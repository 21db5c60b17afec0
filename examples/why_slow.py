"""Why is my run slow? Four runs, each slow for a different reason, and what ``statistics()`` says of each.

    python examples/why_slow.py --case env        # the env sleeps 1 ms per step: env-bound
    python examples/why_slow.py --case policy     # a wide MLP at batch 1: policy-bound
    python examples/why_slow.py --case trainer    # a 50 ms training step per batch: trainer-bound
    python examples/why_slow.py --case handoff    # 2 worker processes, batches of 16 frames: hand-off-bound

Each prints frames/s, the idle ratios (``trainer_wait``: the trainer awaited data; ``collector_wait``:
data awaited the trainer), the time split of the collector's producers (env, policy, transfer, wait,
other: fractions of their wall time and µs per frame) and the verdict read from them, as
docs/why-slow.md explains.
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

from aiocollect import Collector, CollectorStatistics, GymEnv, MultiSyncCollector


@dataclass
class Args:
    case: str = field(default="env", metadata={"help": "env, policy, trainer or handoff"})
    total_frames: int = field(default=1_600, metadata={"help": "frames to collect"})
    frames_per_batch: int = field(default=200, metadata={"help": "frames per batch (handoff: 16)"})
    env_ms: float = field(default=1.0, metadata={"help": "env: the env's sleep per step (ms)"})
    width: int = field(default=1024, metadata={"help": "policy: the MLP's hidden width"})
    train_ms: float = field(default=50.0, metadata={"help": "trainer: the training step's CPU time (ms)"})


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


class SlowStep(gym.Wrapper[Any, Any, Any, Any]):
    """An env whose step takes ``seconds`` longer (a simulator, a game engine, a remote service)."""

    def __init__(self, env: gym.Env[Any, Any], seconds: float) -> None:
        super().__init__(env)
        self.seconds = seconds

    def step(self, action: Any) -> Any:
        time.sleep(self.seconds)
        return self.env.step(action)


def slow_cartpole(seconds: float) -> GymEnv:
    return GymEnv(SlowStep(gym.make("CartPole-v1"), seconds))


def cartpole() -> GymEnv:
    return GymEnv("CartPole-v1")


class WideMLP(nn.Module):
    """observation -> width -> width -> width -> 2 logits, argmax: a forward pass that costs."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(4, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width)
        )
        self.head = nn.Linear(width, 2)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        action: torch.Tensor = self.head(self.net(observation)).argmax(-1)
        return action


def train_step(ms: float) -> None:
    """A training step: ``ms`` of CPU work on the trainer's thread (as a real SGD step blocks it)."""
    end = time.perf_counter() + ms / 1000
    x = torch.randn(64, 64)
    while time.perf_counter() < end:
        x = torch.tanh(x @ x)


def build(args: Args) -> Collector | MultiSyncCollector:
    frames, budget = args.frames_per_batch, args.total_frames
    if args.case == "env":
        return Collector(
            lambda: slow_cartpole(args.env_ms / 1000), None, frames_per_batch=frames, total_frames=budget
        )
    if args.case == "policy":
        return Collector(cartpole, WideMLP(args.width), frames_per_batch=frames, total_frames=budget)
    if args.case == "trainer":
        return Collector(cartpole, None, frames_per_batch=frames, total_frames=budget)
    if args.case == "handoff":  # tiny batches: a round trip to the workers per 8 frames of each
        return MultiSyncCollector([cartpole] * 2, None, frames_per_batch=16, total_frames=budget)
    raise SystemExit(f"--case must be env, policy, trainer or handoff, got {args.case!r}")


def verdict(stats: CollectorStatistics) -> str:
    """What the numbers say (docs/why-slow.md): who waits for whom, then where the producers' time goes."""
    trainer_wait, collector_wait, split = stats.trainer_wait, stats.collector_wait, stats.time_split
    if trainer_wait is None or collector_wait is None or split is None:
        return "not measured yet"
    if trainer_wait < 0.5 and collector_wait >= 0.5:
        return "trainer-bound: the batches wait for the trainer; a faster collector would not help"
    if trainer_wait >= 0.5 and collector_wait >= 0.3:
        return "hand-off-bound: both sides wait; fewer, larger batches (or fewer workers) help"
    if trainer_wait >= 0.5:
        part = max(("env", "policy", "transfer", "other"), key=lambda k: split[k])
        return f"{part}-bound: the trainer waits for data, and the producers' time goes to the {part}"
    return "balanced: neither side waits much"


async def main(args: Args) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    collector = build(args)
    start = time.perf_counter()
    async with collector:
        async for _batch in collector:
            if args.case == "trainer":
                train_step(args.train_ms)
        stats = collector.statistics()
    elapsed = time.perf_counter() - start
    mean = "n/a" if stats.mean_return is None else f"{stats.mean_return:.1f}"
    print(
        f"case {args.case}: {stats.frames} frames in {elapsed:.1f} s, {stats.frames / elapsed:,.0f} frames/s"
    )
    print(f"mean return {mean}")
    print(f"trainer_wait   {stats.trainer_wait:.2f}  (the trainer awaited the next batch)")
    print(f"collector_wait {stats.collector_wait:.2f}  (ready batches awaited the trainer)")
    if stats.time_split is not None and stats.time_split_us is not None:
        for part, fraction in stats.time_split.items():
            print(f"  {part:9} {fraction:6.1%} {stats.time_split_us[part]:9.1f} µs/frame")
    print("verdict:", verdict(stats))


if __name__ == "__main__":
    anyio.run(main, parse_args())
