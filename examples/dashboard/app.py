"""A live dashboard and control panel beside a collector and a trainer, all on one event loop.

    python examples/dashboard/app.py                  # then open the printed URL (http://127.0.0.1:8000/)
    python examples/dashboard/app.py --seconds 60     # stop after a minute
    python examples/dashboard/app.py --port 0         # any free port

One ``anyio.run`` (asyncio) event loop runs three things:

* a ``MultiSyncCollector`` whose two worker processes (started by forkserver) step CartPole-v1 with a
  small MLP policy;
* a trainer task: REINFORCE on every batch (the gradient step runs in a worker thread, so it does not hold
  the loop), ``collector.log_metrics({"loss": ..., "entropy": ...})`` (plotted beside the collector's
  numbers) and ``collector.update_weights(policy)`` every ``--update-every`` batches;
* uvicorn serving ``aiocollect.dashboard.create_app(collector)`` on 127.0.0.1: live plots, worker states,
  and buttons that pause/resume collection and publish the weights. The server keeps the run's history:
  open the page late, or reload it, and it shows the whole run (CSV/JSON downloads in the header).

Stop it with Ctrl-C, ``--seconds`` or ``--total-frames``. Needs ``pip install 'aiocollect[dashboard]'``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import anyio.to_thread
import torch
from tensordict import TensorDictBase
from torch import nn

from aiocollect import GymEnv, MultiSyncCollector
from aiocollect.dashboard import create_app, serve


@dataclass
class Args:
    host: str = "127.0.0.1"
    port: int = 8000
    total_frames: int = -1
    seconds: float | None = None
    num_workers: int = 2
    envs_per_worker: int = 8
    frames_per_batch: int = 2048
    update_every: int = 4
    lr: float = 0.005
    gamma: float = 0.99
    seed: int = 0
    backend: str = "process"


class Policy(nn.Module):
    """obs -> logits; samples the action."""

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


def make_env(envs_per_worker: int) -> Callable[[], GymEnv]:
    return lambda: GymEnv("CartPole-v1", num_envs=envs_per_worker)


def reinforce_step(
    policy: Policy, optim: torch.optim.Optimizer, batch: TensorDictBase, gamma: float
) -> dict[str, float]:
    """One REINFORCE step with a batch-mean baseline (runs in a worker thread); the loss and entropy."""
    obs, action = batch["observation"], batch["action"]
    reward = batch["next", "reward"].squeeze(-1)
    done = batch["next", "done"].squeeze(-1)
    returns = torch.zeros_like(reward)
    running = torch.zeros_like(reward[..., 0])
    for t in range(reward.shape[-1] - 1, -1, -1):  # reward-to-go along time, cut at episode ends
        running = reward[..., t] + gamma * running * (~done[..., t]).float()
        returns[..., t] = running
    advantage = (returns - returns.mean()) / (returns.std() + 1e-8)
    loss = -(policy.log_prob(obs, action) * advantage).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    with torch.no_grad():
        entropy = torch.distributions.Categorical(logits=policy.net(obs)).entropy().mean()
    return {"loss": loss.item(), "entropy": entropy.item()}


async def train(
    collector: MultiSyncCollector, policy: Policy, args: Args, should_stop: Callable[[], bool]
) -> None:
    """Train on every batch; publish the weights every ``update_every`` batches; stop between batches."""
    optim = torch.optim.Adam(policy.parameters(), lr=args.lr)
    batches = 0
    async for batch in collector:
        metrics = await anyio.to_thread.run_sync(reinforce_step, policy, optim, batch, args.gamma)
        batches += 1
        collector.log_metrics(metrics, step=batches)  # plotted by the dashboard, beside the collector's
        if batches % args.update_every == 0:
            await collector.update_weights(policy)
        if should_stop():
            break


async def main(
    args: Args,
    *,
    on_ready: Callable[[str], object] | None = None,
    stop: anyio.Event | None = None,
) -> None:
    """Run until ``total_frames``, ``seconds``, ``stop`` is set (all checked between batches) or Ctrl-C;
    ``on_ready(url)`` once the page is up."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    policy = Policy()
    start = time.perf_counter()
    async with MultiSyncCollector(
        [make_env(args.envs_per_worker)] * args.num_workers,
        policy,
        frames_per_batch=args.frames_per_batch,
        total_frames=args.total_frames,
        seed=args.seed,
        worker_backend=args.backend,
    ) as collector:
        app = create_app(collector, title=f"CartPole-v1 · {args.num_workers} workers")
        async with serve(app, host=args.host, port=args.port) as server:
            print(f"dashboard: {server.url}  (Ctrl-C to stop)", flush=True)
            # the POST routes (pause, resume, update-weights) need it: curl -H "X-Aiocollect-Token: ..."
            print(f"control token: {app.state.token}", flush=True)
            if on_ready is not None:
                on_ready(server.url)
            deadline = time.monotonic() + (args.seconds if args.seconds is not None else math.inf)
            await train(
                collector,
                policy,
                args,
                lambda: time.monotonic() > deadline or (stop is not None and stop.is_set()),
            )
        stats = collector.statistics()
    elapsed = time.perf_counter() - start
    mean = f"{stats.mean_return:.1f}" if stats.mean_return is not None else "n/a"
    print(
        f"{stats.frames} frames in {elapsed:.1f} s ({stats.frames / elapsed:,.0f} frames/s), "
        f"mean return {mean}, policy version {stats.policy_version}",
        flush=True,
    )


def parse_args(argv: list[str] | None = None) -> Args:
    defaults = Args()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default=defaults.host, help="interface to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=defaults.port, help="0 picks a free port")
    p.add_argument("--total-frames", type=int, default=defaults.total_frames, help="-1: endless")
    p.add_argument("--seconds", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--num-workers", type=int, default=defaults.num_workers)
    p.add_argument("--envs-per-worker", type=int, default=defaults.envs_per_worker)
    p.add_argument("--frames-per-batch", type=int, default=defaults.frames_per_batch)
    p.add_argument("--update-every", type=int, default=defaults.update_every, help="batches per update")
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--backend", choices=["process", "serial"], default=defaults.backend)
    return Args(**vars(p.parse_args(argv)))


if __name__ == "__main__":  # the guard lets forkserver start the worker processes
    try:
        anyio.run(main, parse_args())
    except KeyboardInterrupt:
        print("stopped", flush=True)
