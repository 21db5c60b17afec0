"""CPU per frame of whole-trajectory batches (``trajs_per_batch``) against frame batches of the same
collector, interleaved in one run (the machine is shared: only the ratios mean something).

    python benchmarks/episodes.py                       # CartPole-v1 and Pendulum-v1, 8 envs
    python benchmarks/episodes.py --frames 40000 --rounds 5
    python benchmarks/episodes.py --groups 4            # group_size=4 against plain trajs_per_batch

CPU time is the process's and its children's (worker processes), over ``--frames`` frames after one
warm-up batch; the policy is a small MLP (the user's path). Issue 30's target: <= 1.10x. With
``--groups G`` the baseline is ``trajs_per_batch`` and the case measured adds ``group_size=G`` (seeded
resets through the fused loop's reseed hook, the group accounting).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio
import psutil
import torch
from torch import nn

from aiocollect import Collector, GymEnv, MultiSyncCollector


class MLP(nn.Module):
    def __init__(self, obs: int, out: int, discrete: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs, 64), nn.Tanh(), nn.Linear(64, out))
        self.discrete = discrete

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        out = self.net(observation)
        if self.discrete:
            return torch.distributions.Categorical(logits=out).sample()
        return 2 * torch.tanh(out)


def policy_for(task: str) -> MLP:
    return MLP(4, 2, True) if task.startswith("CartPole") else MLP(3, 1, False)


def cpu_seconds() -> float:
    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


async def measure(make: Callable[[], Any], frames: int) -> tuple[float, float]:
    """(CPU microseconds per frame, frames/s) over ``frames`` frames after one warm-up batch."""
    async with make() as collector:
        it = aiter(collector)
        await anext(it)
        cpu, wall, got = cpu_seconds(), time.perf_counter(), 0
        while got < frames:
            got += int((await anext(it)).numel())
        cpu, wall = cpu_seconds() - cpu, time.perf_counter() - wall
    return cpu / got * 1e6, got / wall


def cases(
    task: str, envs: int, trajs: int, chunk: int, groups: int | None = None
) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    def env() -> GymEnv:
        return GymEnv(task, num_envs=envs)

    def workers() -> GymEnv:
        return GymEnv(task, num_envs=envs // 2)

    policy = policy_for(task)
    if groups is not None:  # plain episodes against groups of episodes
        return {
            f"Collector, {envs} envs": (
                lambda: Collector(env, policy, trajs_per_batch=trajs),
                lambda: Collector(env, policy, trajs_per_batch=trajs, group_size=groups),
            ),
            f"MultiSyncCollector, 2 workers x {envs // 2} envs": (
                lambda: MultiSyncCollector([workers] * 2, policy, trajs_per_batch=trajs),
                lambda: MultiSyncCollector([workers] * 2, policy, trajs_per_batch=trajs, group_size=groups),
            ),
        }
    return {
        f"Collector, {envs} envs": (
            lambda: Collector(env, policy, frames_per_batch=chunk),
            lambda: Collector(env, policy, trajs_per_batch=trajs),
        ),
        f"MultiSyncCollector, 2 workers x {envs // 2} envs": (
            lambda: MultiSyncCollector([workers] * 2, policy, frames_per_batch=2 * chunk),
            lambda: MultiSyncCollector([workers] * 2, policy, trajs_per_batch=trajs),
        ),
    }


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    base_name, ours_name = ("episodes", "groups") if args.groups else ("frames", "episodes")
    print(
        f"{'task':<12} {'collector':<40} {base_name + ' us/frame':>16} "
        f"{ours_name + ' us/frame':>18} {'ratio':>7}"
    )
    for task in args.tasks:
        chosen = cases(task, args.envs, args.trajs, args.chunk, args.groups)
        for name, (frames_case, episodes_case) in chosen.items():
            ratios, base, ours = [], [], []
            for _ in range(args.rounds):  # interleaved: both see the same load
                a, _ = await measure(frames_case, args.frames)
                b, _ = await measure(episodes_case, args.frames)
                base.append(a)
                ours.append(b)
                ratios.append(b / a)
            print(
                f"{task:<12} {name:<40} {statistics.median(base):>16.1f} {statistics.median(ours):>18.1f} "
                f"{statistics.median(ratios):>6.2f}x  (per round: {', '.join(f'{r:.2f}' for r in ratios)})"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", nargs="+", default=["CartPole-v1", "Pendulum-v1"])
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--trajs", type=int, default=8, help="trajs_per_batch")
    parser.add_argument("--chunk", type=int, default=256, help="frames_per_batch of the frame batches")
    parser.add_argument("--frames", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--groups", type=int, default=None, help="group_size (against trajs_per_batch)")
    anyio.run(main, parser.parse_args())
