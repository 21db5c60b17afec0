"""Benchmark: a CleanRL-style PPO on CartPole-v1 fed by each multi-process collector (issue 15).

Run with ``python benchmarks/onpolicy_ppo.py [--total-frames 100000] [--seeds 2] [--json PATH]``.

The learner is CleanRL's ``ppo.py`` for CartPole (actor and critic MLPs 4 -> 64 -> 64, tanh, orthogonal
init; Adam 2.5e-4 annealed to 0; 512 frames per update; GAE gamma 0.99, lambda 0.95; 4 epochs of 4
minibatches; clip 0.2; entropy 0.01; value 0.5; grad norm 0.5), with two worker processes of 2 envs
each (CleanRL's 4 envs). The actor runs in the workers as a ``TensorDictModule`` writing ``"action"``
and ``"sample_log_prob"`` (the behaviour log-probability PPO's ratio needs); the critic only in the
trainer. Advantages are computed per delivered batch, bootstrapped from the critic at its last
``("next", "observation")`` (and at truncations), so a batch is a valid segment on its own. Variants:

* ``sync``: ``MultiSyncCollector``, 512 frames per batch (256 per worker), one update per batch: every
  frame on the newest weights by construction.
* ``async``: ``MultiAsyncCollector`` as it comes (256 frames per worker batch, 2 batches per update),
  ``update_weights`` after each update: batches may lag the weights (off-policy data fed to PPO).
* ``onpolicy``: ``MultiAsyncCollector(max_policy_lag=0)``, ``--onpolicy-batch`` frames per worker
  batch (default 64), batches gathered until 512 frames, then the update: every frame on the newest
  weights; stale batches are dropped and rollouts in flight restarted at each update, and the frames
  that costs are counted (``statistics().frames_discarded``).

``--slow-worker-ms X`` makes the last worker's envs sleep ``X`` ms per step: a straggler (a slower
machine, a heavier scene), where ``sync`` waits for the slowest worker at every batch and the async
variants take batches as they come.

Per variant: frames/s over the whole run (collection and training: the trainer's throughput), its ratio
to ``sync``'s in the same round (the variants' order rotates every round, so each ratio compares runs
moments apart on this shared machine), the fraction of collected frames discarded, the fraction of
frames trained on that were stale (policy version behind the newest when the update used them), and
the learning curve: the mean return of the last 100 episodes at 20%, 40%, ... 100% of the frames.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import gymnasium as gym
import numpy as np
import psutil
import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn

from aiocollect import GymEnv, MultiAsyncCollector, MultiSyncCollector

VARIANTS = ("sync", "async", "onpolicy")
CHECKPOINTS = (0.2, 0.4, 0.6, 0.8, 1.0)


@dataclass
class Args:
    total_frames: int = 100_000
    seeds: int = 2
    variants: str = ",".join(VARIANTS)
    num_workers: int = 2
    envs_per_worker: int = 2
    frames_per_update: int = 512
    onpolicy_batch: int = 64
    #: the last worker's envs sleep this long per step (0: every worker alike)
    slow_worker_ms: float = 0.0
    learning_rate: float = 2.5e-4
    gamma: float = 0.99
    gae_lambda: float = 0.95
    num_minibatches: int = 4
    update_epochs: int = 4
    clip_coef: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    json: str = ""


def layer_init(layer: nn.Linear, std: float = float(np.sqrt(2)), bias: float = 0.0) -> nn.Linear:
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


class Actor(nn.Module):
    """observation -> (action, log-probability of the action)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            layer_init(nn.Linear(4, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 2), std=0.01),
        )

    def forward(self, observation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dist = torch.distributions.Categorical(logits=self.net(observation))
        action = dist.sample()
        return action, dist.log_prob(action)


def critic() -> nn.Module:
    return nn.Sequential(
        layer_init(nn.Linear(4, 64)),
        nn.Tanh(),
        layer_init(nn.Linear(64, 64)),
        nn.Tanh(),
        layer_init(nn.Linear(64, 1), std=1.0),
    )


class SlowStep(gym.Wrapper):
    """Sleeps ``delay`` seconds per step (a slower worker: another machine, a heavier simulator)."""

    def __init__(self, env: gym.Env, delay: float) -> None:
        super().__init__(env)
        self.delay = delay

    def step(self, action: Any) -> Any:
        time.sleep(self.delay)
        return self.env.step(action)


def slow_cartpole(n: int, delay: float) -> GymEnv:
    return GymEnv(gym.vector.SyncVectorEnv([lambda: SlowStep(gym.make("CartPole-v1"), delay)] * n))


def make_env(n: int, delay: float = 0.0) -> Any:
    if delay:
        return partial(slow_cartpole, n, delay)
    return lambda: GymEnv("CartPole-v1", num_envs=n)


@dataclass
class Run:
    variant: str
    seed: int
    seconds: float = 0.0
    frames: int = 0
    frames_discarded: int = 0
    stale_frames: int = 0
    updates: int = 0
    train_seconds: float = 0.0
    curve: list[tuple[int, float | None]] = field(default_factory=list)

    @property
    def frames_per_second(self) -> float:
        return self.frames / self.seconds

    @property
    def wasted(self) -> float:
        return self.frames_discarded / (self.frames + self.frames_discarded)

    def at(self, fraction: float, total: int) -> float | None:
        target = fraction * total
        for frames, ret in self.curve:
            if frames >= target * 0.98:
                return ret
        return self.curve[-1][1] if self.curve else None


class PPO:
    """CleanRL's PPO update on a list of delivered batches (each ``[..., envs, T]``)."""

    def __init__(self, args: Args, seed: int) -> None:
        torch.manual_seed(seed)
        self.args = args
        self.actor = Actor()
        self.policy = TensorDictModule(
            self.actor, in_keys=["observation"], out_keys=["action", "sample_log_prob"]
        )
        self.critic = critic()
        self.params = list(self.actor.parameters()) + list(self.critic.parameters())
        self.optim = torch.optim.Adam(self.params, lr=args.learning_rate, eps=1e-5)

    def advantages(self, batch: TensorDictBase) -> dict[str, torch.Tensor]:
        """Flattened frames of one batch with GAE advantages and returns (bootstrapped at its end)."""
        a = self.args
        obs = batch["observation"].reshape(-1, batch.shape[-1], 4)
        next_obs = batch["next", "observation"].reshape(-1, batch.shape[-1], 4)
        reward = batch["next", "reward"].reshape(obs.shape[:2])
        terminated = batch["next", "terminated"].reshape(obs.shape[:2]).float()
        done = batch["next", "done"].reshape(obs.shape[:2]).float()
        with torch.no_grad():
            value = self.critic(obs).squeeze(-1)
            next_value = self.critic(next_obs).squeeze(-1)
        delta = reward + a.gamma * next_value * (1 - terminated) - value
        adv = torch.zeros_like(delta)
        last = torch.zeros_like(delta[:, 0])
        for t in range(delta.shape[1] - 1, -1, -1):
            last = delta[:, t] + a.gamma * a.gae_lambda * (1 - done[:, t]) * last
            adv[:, t] = last
        return {
            "obs": obs.reshape(-1, 4),
            "action": batch["action"].reshape(-1),
            "logp": batch["sample_log_prob"].reshape(-1),
            "adv": adv.reshape(-1),
            "ret": (adv + value).reshape(-1),
        }

    def update(self, batches: list[TensorDictBase], frac_left: float) -> None:
        a = self.args
        parts = [self.advantages(b) for b in batches]
        data = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        for group in self.optim.param_groups:
            group["lr"] = frac_left * a.learning_rate
        n = data["obs"].shape[0]
        mb = n // a.num_minibatches
        for _ in range(a.update_epochs):
            order = torch.randperm(n)
            for start in range(0, n, mb):
                idx = order[start : start + mb]
                logits = self.actor.net(data["obs"][idx])
                dist = torch.distributions.Categorical(logits=logits)
                logp = dist.log_prob(data["action"][idx])
                ratio = (logp - data["logp"][idx]).exp()
                adv = data["adv"][idx]
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                pg = torch.max(-adv * ratio, -adv * ratio.clamp(1 - a.clip_coef, 1 + a.clip_coef)).mean()
                v_loss = 0.5 * ((self.critic(data["obs"][idx]).squeeze(-1) - data["ret"][idx]) ** 2).mean()
                loss = pg - a.ent_coef * dist.entropy().mean() + a.vf_coef * v_loss
                self.optim.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(self.params, a.max_grad_norm)
                self.optim.step()


def build(variant: str, ppo: PPO, args: Args, seed: int) -> Any:
    envs = [make_env(args.envs_per_worker)] * (args.num_workers - 1)
    envs.append(make_env(args.envs_per_worker, args.slow_worker_ms / 1000))
    common: dict[str, Any] = {"total_frames": args.total_frames, "seed": seed, "track_policy_version": True}
    if variant == "sync":
        return MultiSyncCollector(envs, ppo.policy, frames_per_batch=args.frames_per_update, **common)
    if variant == "async":
        per_worker = args.frames_per_update // args.num_workers
        return MultiAsyncCollector(envs, ppo.policy, frames_per_batch=per_worker, **common)
    return MultiAsyncCollector(
        envs, ppo.policy, frames_per_batch=args.onpolicy_batch, max_policy_lag=0, **common
    )


async def train(variant: str, args: Args, seed: int) -> Run:
    ppo = PPO(args, seed)
    run = Run(variant, seed)
    start = time.perf_counter()
    pending: list[TensorDictBase] = []
    async with build(variant, ppo, args, seed) as collector:
        async for batch in collector:
            pending.append(batch)
            if sum(b.numel() for b in pending) < args.frames_per_update:
                continue
            newest = collector.policy_version
            for b in pending:
                stale = b["collector", "policy_version"] < newest
                run.stale_frames += int(stale.sum())
            if variant != "async":  # on-policy by construction (sync) or by the flush (onpolicy)
                assert run.stale_frames == 0, f"{variant}: a frame from old weights"
            t0 = time.perf_counter()
            frac_left = 1.0 - collector.statistics().frames / (args.total_frames + args.frames_per_update)
            ppo.update(pending, frac_left)
            run.train_seconds += time.perf_counter() - t0
            pending = []
            run.updates += 1
            await collector.update_weights(ppo.policy)
            stats = collector.statistics()
            run.curve.append((stats.frames, stats.mean_return))
        stats = collector.statistics()
    run.seconds = time.perf_counter() - start
    run.frames = stats.frames
    run.frames_discarded = stats.frames_discarded
    return run


def summarize(runs: list[Run], args: Args) -> list[dict[str, Any]]:
    out = []
    sync = {r.seed: r for r in runs if r.variant == "sync"}
    for variant in [v for v in VARIANTS if any(r.variant == v for r in runs)]:
        mine = [r for r in runs if r.variant == variant]
        ratios = [r.frames_per_second / sync[r.seed].frames_per_second for r in mine if r.seed in sync]
        curve = {}
        for c in CHECKPOINTS:
            values = [r.at(c, args.total_frames) for r in mine]
            values = [v for v in values if v is not None]
            curve[f"{int(c * args.total_frames)}"] = statistics.mean(values) if values else None
        out.append(
            {
                "variant": variant,
                "runs": len(mine),
                "frames_per_s": statistics.median(r.frames_per_second for r in mine),
                "ratio_to_sync": statistics.median(ratios) if ratios else None,
                "ratio_range": [min(ratios), max(ratios)] if ratios else None,
                "wasted": statistics.mean(r.wasted for r in mine),
                "stale_used": statistics.mean(r.stale_frames / max(r.frames, 1) for r in mine),
                "train_share": statistics.mean(r.train_seconds / r.seconds for r in mine),
                "mean_return": curve,
            }
        )
    return out


def table(rows: list[dict[str, Any]]) -> str:
    checkpoints = list(rows[0]["mean_return"])
    head = (
        "| variant | frames/s ÷ sync [min, max] | frames discarded | stale frames trained on | "
        + " | ".join(f"return @ {int(c) // 1000}k" for c in checkpoints)
        + " |"
    )
    lines = [head, "|" + "---|" * (4 + len(checkpoints))]
    for r in rows:
        lo, hi = r["ratio_range"] or (float("nan"), float("nan"))
        returns = " | ".join("-" if v is None else f"{v:.0f}" for v in r["mean_return"].values())
        lines.append(
            f"| {r['variant']} | {r['ratio_to_sync']:.2f} [{lo:.2f}, {hi:.2f}] | {r['wasted']:.1%} | "
            f"{r['stale_used']:.1%} | {returns} |"
        )
    return "\n".join(lines)


async def main(args: Args) -> None:
    torch.set_num_threads(1)
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; choose from {VARIANTS}")
    runs: list[Run] = []
    # the first collector of a process starts the forkserver (imports torch): not part of any variant
    async with MultiSyncCollector([make_env(1)] * args.num_workers, frames_per_batch=8, total_frames=8) as c:
        async for _ in c:
            pass
    for seed in range(args.seeds):
        order = variants[seed % len(variants) :] + variants[: seed % len(variants)]
        for variant in order:
            run = await train(variant, args, seed)
            runs.append(run)
            print(
                f"seed {seed} {variant:>8}: {run.frames} frames in {run.seconds:.1f} s "
                f"({run.frames_per_second:.0f}/s, training {run.train_seconds / run.seconds:.0%}), "
                f"discarded {run.wasted:.1%}, stale trained on {run.stale_frames / run.frames:.1%}, "
                f"final mean return {run.curve[-1][1] if run.curve else None}",
                flush=True,
            )
    rows = summarize(runs, args)
    print()
    print(table(rows))
    print(f"\nload average {psutil.getloadavg()}, {psutil.cpu_count()} cpus, {platform.platform()}")
    if args.json:
        runs_out = [dataclasses.asdict(r) for r in runs]
        report = {"args": dataclasses.asdict(args), "rows": rows, "runs": runs_out}
        await anyio.Path(args.json).write_text(json.dumps(report, indent=1))


def parse() -> Args:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for f in dataclasses.fields(Args):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    return Args(**vars(parser.parse_args()))


if __name__ == "__main__":  # workers start through a forkserver: the guard is required
    anyio.run(main, parse())
