"""1,000 envs whose step awaits a (simulated) 5 ms network call, on one event loop, with central batched
inference: print frames/s and the mean return.

    python examples/async_envs.py
    python examples/async_envs.py --num-envs 2000 --uvloop
    python examples/async_envs.py --processes 2     # the envs split over 2 worker processes, a loop in each
    python examples/async_envs.py --vector-envs 16  # the envs as 16 vector envs: one network call each

Each env is a CartPole behind a fake 5 ms round trip (a simulator on another machine, say). Stepping
them from threads would take one thread per env in flight; here each env is a task on the collector's
loop, and the policy runs once per batch of the envs that are ready (in the collector's thread). The
loop stays free for the rest of the program: here, a weight update after every batch.

With ``--vector-envs V`` the same CartPoles sit behind ``V`` remote simulators that each step a batch of
them per network call (an async vector env, see ``aiocollect.AsyncVectorEnvProtocol``): one task, one
wait and one round trip per batch of envs instead of per env.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
import torch
from gymnasium.envs.classic_control import CartPoleEnv
from torch import nn

from aiocollect import AsyncEnvCollector, MultiAsyncEnvCollector


@dataclass
class Args:
    num_envs: int = field(default=1000, metadata={"help": "async envs on the loop"})
    total_frames: int = field(default=100_000, metadata={"help": "frames to collect"})
    frames_per_batch: int = field(default=10_000, metadata={"help": "frames per batch"})
    latency_ms: float = field(default=5.0, metadata={"help": "the simulated network call of each step"})
    uvloop: bool = field(default=False, metadata={"help": "run the asyncio loop on uvloop"})
    seed: int = field(default=1, metadata={"help": "seeds the envs and the policy weights"})
    processes: int = field(
        default=0,
        metadata={"help": "worker processes, each a loop over its share of the envs (0: one loop here)"},
    )
    vector_envs: int = field(
        default=0,
        metadata={"help": "serve the envs as this many async vector envs, one call a step each (0: no)"},
    )


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


class RemoteCartPole:
    """An async env (see ``aiocollect.AsyncEnvProtocol``): a CartPole whose step waits for the network."""

    def __init__(self, latency: float) -> None:
        self.sim: Any = CartPoleEnv()  # gymnasium is untyped
        self.latency = latency
        self.observation_space = self.sim.observation_space
        self.action_space = self.sim.action_space

    async def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        return self.sim.reset(seed=seed)

    async def step(self, action: int) -> Any:
        await anyio.sleep(self.latency)  # the request to the remote simulator
        return self.sim.step(action)

    async def close(self) -> None:
        self.sim.close()


class RemoteCartPoles:
    """An async vector env (see ``aiocollect.AsyncVectorEnvProtocol``): ``n`` CartPoles on a remote
    simulator that steps them all per request; ended episodes are reset in the same step (their final
    observations in ``info["final_obs"]``)."""

    def __init__(self, n: int, latency: float) -> None:
        self.sims: list[Any] = [CartPoleEnv() for _ in range(n)]
        self.latency = latency
        self.num_envs = n
        self.single_observation_space = self.sims[0].observation_space
        self.single_action_space = self.sims[0].action_space

    async def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        obs = [sim.reset(seed=None if seed is None else seed + k)[0] for k, sim in enumerate(self.sims)]
        return np.stack(obs), {}

    async def step(self, actions: np.ndarray) -> Any:
        await anyio.sleep(self.latency)  # one request steps every CartPole of this simulator
        obs = np.empty((self.num_envs, 4), np.float32)
        terminated = np.zeros(self.num_envs, bool)
        final = np.empty(self.num_envs, dtype=object)
        for k, (sim, action) in enumerate(zip(self.sims, actions.tolist(), strict=True)):
            obs[k], _, terminated[k], _, _ = sim.step(action)
            if terminated[k]:  # same-step autoreset
                final[k] = obs[k].copy()
                obs[k] = sim.reset()[0]
        info = {"final_obs": final, "_final_obs": terminated} if terminated.any() else {}
        return obs, np.ones(self.num_envs), terminated, np.zeros(self.num_envs, bool), info

    async def close(self) -> None:
        for sim in self.sims:
            sim.close()


class CategoricalMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        action: torch.Tensor = torch.distributions.Categorical(logits=self.net(observation)).sample()
        return action


async def main(args: Args) -> None:
    torch.manual_seed(args.seed)
    policy = CategoricalMLP()
    latency = args.latency_ms / 1000
    collector: AsyncEnvCollector | MultiAsyncEnvCollector
    if args.processes and args.vector_envs:
        raise SystemExit("--vector-envs runs on one loop: MultiAsyncEnvCollector takes single async envs")
    if args.processes:  # MultiAsyncEnvCollector: each worker process runs a loop over its share
        share = args.num_envs // args.processes
        collector = MultiAsyncEnvCollector(
            [[lambda: RemoteCartPole(latency)] * share] * args.processes,
            policy,
            frames_per_batch=args.frames_per_batch // args.processes,
            total_frames=args.total_frames,
            seed=args.seed,
            loop="uvloop" if args.uvloop else "asyncio",
        )
    else:
        env_fns: list[Any] = [lambda: RemoteCartPole(latency)] * args.num_envs
        if args.vector_envs:  # the same envs, a batch of them per simulator
            shares = [len(s) for s in np.array_split(np.arange(args.num_envs), args.vector_envs)]
            env_fns = [lambda n=n: RemoteCartPoles(n, latency) for n in shares]
        collector = AsyncEnvCollector(
            env_fns,
            policy,
            frames_per_batch=args.frames_per_batch,
            total_frames=args.total_frames,
            seed=args.seed,
        )
    start = time.perf_counter()
    async with collector:
        async for batch in collector:
            version = await collector.update_weights(policy)  # a trainer would step its optimiser first
            envs = batch["collector", "env_id"].unique().numel()
            print(f"batch of {batch.numel()} frames from {envs} envs, policy v{version}")
        stats = collector.statistics()
    elapsed = time.perf_counter() - start
    mean_return = "n/a" if stats.mean_return is None else f"{stats.mean_return:.1f}"
    calls = ""
    if isinstance(collector, AsyncEnvCollector):  # the policy calls of the loop here
        sizes = collector.policy_batch_sizes
        calls = f"{len(sizes)} policy calls, {sum(sizes) / len(sizes):.0f} envs each on average; "
    print(
        f"{stats.frames} frames in {elapsed:.1f} s: {stats.frames / elapsed:,.0f} frames/s "
        f"({args.num_envs} envs, {args.latency_ms:g} ms a step: at most {args.num_envs / latency:,.0f}/s); "
        f"{calls}{stats.episodes} episodes, mean return {mean_return}"
    )


if __name__ == "__main__":
    args = parse_args()
    torch.set_num_threads(1)
    anyio.run(main, args, backend="asyncio", backend_options={"use_uvloop": args.uvloop})
