"""Collect ~100k CartPole-v1 frames with a small MLP policy; print frames/s and the mean return.

    python examples/quickstart.py
    python examples/quickstart.py --num-envs 8 --frames-per-batch 1000 --uvloop

The env and the policy run in the collector's worker thread, one hand-off per batch, so the event
loop stays free: a trainer, a dashboard or other collectors can share it.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass, field

import anyio
import gymnasium as gym
import torch
from torch import nn

from aiocollect import Collector, GymEnv


@dataclass
class Args:
    env_id: str = field(default="CartPole-v1", metadata={"help": "gymnasium env id"})
    total_frames: int = field(default=100_000, metadata={"help": "frames to collect"})
    num_envs: int = field(default=32, metadata={"help": "envs stepped together (batch [num_envs])"})
    frames_per_batch: int = field(default=4_000, metadata={"help": "frames per batch"})
    seed: int = field(default=1, metadata={"help": "seeds the envs, the policy weights and sampling"})
    uvloop: bool = field(default=False, metadata={"help": "run the asyncio loop on uvloop"})
    torch_threads: int = field(default=1, metadata={"help": "torch intra-op threads (small MLP: 1)"})


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


class CategoricalMLP(nn.Module):
    """observation -> 64 -> 64 -> logits; samples the action from a Categorical over the logits.

    A plain ``nn.Module`` policy is called as ``module(observation)`` and returns the action. (A
    ``TensorDictModule`` would also write ``"logits"`` and a log-prob into the batch.)
    """

    def __init__(self, obs_dim: int, n_actions: int, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(obs_dim, hidden),
            nn.Tanh(),
            nn.Linear(hidden, hidden),
            nn.Tanh(),
            nn.Linear(hidden, n_actions),
        )

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        action: torch.Tensor = torch.distributions.Categorical(logits=self.net(observation)).sample()
        return action


def fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


async def main(args: Args) -> None:
    torch.manual_seed(args.seed)  # the policy's initial weights
    probe = GymEnv(args.env_id)
    obs_shape, action_space = probe.observation_space.shape, probe.action_space
    assert obs_shape, "a Box observation space"
    assert isinstance(action_space, gym.spaces.Discrete), "a Discrete action space"
    policy = CategoricalMLP(obs_shape[0], int(action_space.n))
    probe.close()

    start = time.perf_counter()
    async with Collector(
        lambda: GymEnv(args.env_id, num_envs=args.num_envs),
        policy,
        frames_per_batch=args.frames_per_batch,
        total_frames=args.total_frames,
        seed=args.seed,
    ) as collector:
        async for batch in collector:  # noqa: B007 (the last batch is printed below)
            # batch: a TensorDict [num_envs, T], "time" last: observation, action, next.reward, ...
            # A trainer goes here: loss = ...; await collector.update_weights(policy)
            stats = collector.statistics()
            if stats.batches % 5 == 0:
                print(
                    f"batch {stats.batches:4d}  frames {stats.frames:7d}  "
                    f"{stats.frames_per_second:8,.0f} frames/s  "
                    f"mean return {fmt(stats.mean_return)}"
                )
        stats = collector.statistics()
    elapsed = time.perf_counter() - start

    print(f"batch shape {list(batch.batch_size)} (dims {batch.names}), keys:")
    print("  " + ", ".join(str(k) for k in sorted(batch.keys(True, True), key=str)))
    print(f"{stats.frames} frames in {elapsed:.2f} s: {stats.frames / elapsed:,.0f} frames/s")
    print(f"{stats.episodes} episodes, mean return of the last 100: {fmt(stats.mean_return)}")


if __name__ == "__main__":
    args = parse_args()
    torch.set_num_threads(args.torch_threads)
    anyio.run(main, args, backend="asyncio", backend_options={"use_uvloop": args.uvloop})
