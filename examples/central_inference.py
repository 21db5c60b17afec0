"""Central inference: 128 CartPoles stepped in 2 worker processes, one policy in the trainer process
batching their observations (the weights live once, here: updated in place, never broadcast).

    python examples/central_inference.py
    python examples/central_inference.py --num-workers 4 --envs-per-worker 32 --total-frames 200000
    python examples/central_inference.py --device cuda   # the policy on a GPU
    python examples/central_inference.py --split         # the policy on whichever worker is ready

``ProcessVectorEnv`` puts the workers' envs behind the async vector env protocol: observations, rewards,
flags and actions travel through shared memory, a step is one byte each way on each worker's socket.
``AsyncEnvCollector`` over it takes the fused path: one thread of the collector waits on the workers'
doorbells, writes their frames and runs the policy on the observations of every worker (one forward pass
of 128; with ``--split``, of whichever worker is ready), and the event loop only receives the batches; its
``update_weights`` copies the trainer's new weights between two policy calls. With the policy on a GPU
(``--device cuda``) each call's observations reach it in one non-blocking copy from a pinned staging
buffer, and its actions come back in one copy.
"""

from __future__ import annotations

import argparse
import time

import anyio
import gymnasium as gym
import torch
from torch import nn

from aiocollect import AsyncEnvCollector, ProcessVectorEnv


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.net(observation)
        return logits.argmax(-1)


def cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


async def main(args: argparse.Namespace) -> None:
    policy = Policy().to(args.device)  # the collector runs its copy on the device of its parameters
    num_envs = args.num_workers * args.envs_per_worker

    def envs() -> ProcessVectorEnv:  # blocks while it starts the processes: build it in a worker thread
        return ProcessVectorEnv([cartpole] * num_envs, num_workers=args.num_workers)

    start = first = time.perf_counter()
    env = await anyio.to_thread.run_sync(envs)
    parts = env.split() if args.split else [env]  # one part per worker, or the whole env
    async with AsyncEnvCollector(
        parts,
        policy,
        frames_per_batch=args.frames_per_batch,
        total_frames=args.total_frames,
        min_batch=args.envs_per_worker,
        seed=0,
    ) as collector:
        async for batch in collector:
            assert batch.batch_size == (args.frames_per_batch,)
            if first == start:  # the first batch: the processes have started (the forkserver too)
                first = time.perf_counter()
            with torch.no_grad():  # a stand-in for a training step
                for weight in policy.parameters():
                    weight.mul_(0.999)
            await collector.update_weights(policy)
        stats, fused = collector.statistics(), collector.fused
        sizes = sorted(collector.policy_batch_sizes)
    end = time.perf_counter()
    rate = (stats.frames - args.frames_per_batch) / (end - first)
    print(f"{stats.frames:,} frames in {end - start:.1f} s ({first - start:.1f} s to the first batch)")
    print(f"{rate:,.0f} frames/s after the first batch")
    print(f"policy batch sizes: median {sizes[len(sizes) // 2]} of {num_envs} envs (fused path: {fused})")
    print(f"mean return {stats.mean_return:.1f}, last batch {tuple(batch.batch_size)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--envs-per-worker", type=int, default=64)
    parser.add_argument("--frames-per-batch", type=int, default=2560)
    parser.add_argument("--total-frames", type=int, default=51_200)
    parser.add_argument("--device", default="cpu", help="where the policy runs, e.g. cuda")
    parser.add_argument(
        "--split", action="store_true", help="a part per worker: the policy on the ready ones"
    )
    anyio.run(main, parser.parse_args())
