"""Collect from the vector envs users already have: gymnasium's default vector envs (next-step autoreset,
sync or async) or EnvPool, with an info entry read into the batch.

    python examples/vector_envs.py                      # gymnasium.make_vec("CartPole-v1", 8): sync
    python examples/vector_envs.py --vectorization async
    python examples/vector_envs.py --envpool            # pip install "aiocollect[envpool]"

Nothing is wrapped or reconfigured: GymEnv takes the vector env as made, handles its autoreset mode
(the reset step of next-step autoreset is never a frame), and ``info_keys`` copies each step's
``info["episode"]`` (gymnasium's RecordEpisodeStatistics, per sub-env) into the batch under
``("next", "episode", ...)``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import anyio
import gymnasium as gym
import numpy as np
import torch
from torch import nn

from aiocollect import Collector, GymEnv


@dataclass
class Args:
    num_envs: int = 8
    total_frames: int = 20_000
    frames_per_batch: int = 1_000
    vectorization: str = "sync"
    envpool: bool = False
    seed: int = 0


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        action: torch.Tensor = torch.distributions.Categorical(logits=self.net(observation)).sample()
        return action


def make_env(args: Args) -> GymEnv:
    if args.envpool:
        import envpool

        # EnvPool: a C++ thread pool with next-step autoreset; GymEnv resets ended envs at once. (Typed
        # Any: EnvPool's pools are gymnasium vector envs at run time, not to a type checker)
        pool: Any = envpool.make_gymnasium("CartPole-v1", num_envs=args.num_envs, seed=args.seed)
        return GymEnv(pool)
    # gymnasium's defaults: next-step autoreset. RecordEpisodeStatistics on each sub-env puts an
    # "episode" record (return "r", length "l", time "t") in the info of the step that ends an episode
    vec = gym.make_vec(
        "CartPole-v1",
        num_envs=args.num_envs,
        vectorization_mode=args.vectorization,
        wrappers=[gym.wrappers.RecordEpisodeStatistics],
    )
    episode = gym.spaces.Dict(
        {
            "r": gym.spaces.Box(-np.inf, np.inf, shape=(), dtype=np.float32),
            "l": gym.spaces.Box(0, 2**31 - 1, shape=(), dtype=np.int32),
            "t": gym.spaces.Box(0, np.inf, shape=(), dtype=np.float32),
        }
    )
    return GymEnv(vec, seed=args.seed, info_keys={"episode": episode})


async def main(args: Args) -> None:
    torch.set_num_threads(1)
    frames, start = 0, time.perf_counter()
    async with Collector(
        lambda: make_env(args),
        Policy(),
        frames_per_batch=args.frames_per_batch,
        total_frames=args.total_frames,
        seed=args.seed,
        progress=False,
    ) as collector:
        async for batch in collector:
            frames += batch.numel()
            if not args.envpool:
                ended = batch["next", "done"].squeeze(-1)
                returns = batch["next", "episode", "r"][ended]
                if returns.numel():  # the env's own record agrees with the collector's statistics
                    print(
                        f"episodes ended: {returns.numel()}, their mean return (from info): "
                        f"{returns.mean().item():.1f}"
                    )
        stats = collector.statistics()
    print(f"{frames / (time.perf_counter() - start):,.0f} frames/s, mean return {stats.mean_return:.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for name, default in vars(Args()).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=type(default), default=default)
    anyio.run(main, Args(**vars(parser.parse_args())))
