"""Soak run: a multi-process collector for many minutes, checking that nothing grows and no frame is lost.

Run with ``python benchmarks/soak.py [--minutes 10] [--interval 60] [--collector sync|async] [--json PATH]``
(or ``nox -s soak -- --minutes 3``). Not part of the test suite.

Setting: 2 workers x ``GymEnv("CartPole-v1", num_envs=32)``, an MLP policy (obs -> 64 -> 64 -> 2 logits,
argmax; an ``nn.Module`` returning the action), ``frames_per_batch=2048`` (32 steps of 32 envs per worker),
and after every batch a "training step" that nudges the policy's weights followed by
``await collector.update_weights(policy)``.

Every ``--interval`` seconds (and once at the end) it samples:

* the RSS of the trainer (this process) and of every worker process;
* the number of open fds of the trainer and of every worker;
* the number of ``/dev/shm/aiocollect_<pid>_*`` segments.

Checks (exit status 1 if one fails):

* flat: from the first sample (taken after ``--interval`` seconds, once the allocators have settled) to the
  last, no RSS grows by more than ``--rss-tolerance-mib`` (default 16 MiB) and the fd and segment counts do
  not change;
* no frame lost: the frames of the delivered batches add up to ``statistics().frames`` and to the sum of
  the workers' own counters (``await collector.state_dict()``, ``workerN["frames"]``). A sync collector's
  workers idle between batches, so the sums are equal; an async collector's workers collect ahead, at most
  two slots each, so their counters may exceed the delivered frames by up to 2 batches per worker;
* after the collector closes, no worker process and no segment is left.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio
import psutil
import torch
from torch import nn

from aiocollect import GymEnv, MultiAsyncCollector, MultiSyncCollector

WORKERS = 2
ENVS = 32
FRAMES_PER_BATCH = 2048
MIB = 2**20


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).argmax(-1)


def make_env() -> GymEnv:
    return GymEnv("CartPole-v1", num_envs=ENVS)


@dataclass
class Sample:
    elapsed_s: float
    frames: int
    batches: int
    frames_per_s: float
    trainer_rss_mib: float
    worker_rss_mib: list[float]
    trainer_fds: int
    worker_fds: list[int]
    shm_segments: int


@dataclass
class Report:
    collector: str
    minutes: float
    samples: list[Sample] = field(default_factory=list)
    delivered_frames: int = 0
    counted_frames: int = 0
    worker_frames: list[int] = field(default_factory=list)
    weight_updates: int = 0
    failures: list[str] = field(default_factory=list)
    left_behind: dict[str, Any] = field(default_factory=dict)


def segments() -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"aiocollect_{os.getpid()}_")]


def sample(
    start: float, frames: int, batches: int, last: Sample | None, workers: list[psutil.Process]
) -> Sample:
    me = psutil.Process()
    elapsed = time.monotonic() - start
    since = (elapsed - last.elapsed_s) if last else elapsed
    return Sample(
        elapsed_s=round(elapsed, 1),
        frames=frames,
        batches=batches,
        frames_per_s=round((frames - (last.frames if last else 0)) / max(since, 1e-9)),
        trainer_rss_mib=round(me.memory_info().rss / MIB, 1),
        worker_rss_mib=[round(w.memory_info().rss / MIB, 1) for w in workers],
        trainer_fds=me.num_fds(),
        worker_fds=[w.num_fds() for w in workers],
        shm_segments=len(segments()),
    )


def print_sample(s: Sample) -> None:
    workers_rss = " ".join(f"{r:7.1f}" for r in s.worker_rss_mib)
    workers_fds = " ".join(f"{f:3d}" for f in s.worker_fds)
    print(
        f"{s.elapsed_s:8.1f} {s.frames:>12,} {s.frames_per_s:>9,} {s.trainer_rss_mib:9.1f} {workers_rss}"
        f"  {s.trainer_fds:4d} {workers_fds}  {s.shm_segments:4d}",
        flush=True,
    )


def check_flat(report: Report, tolerance_mib: float) -> None:
    first, last = report.samples[0], report.samples[-1]
    growth = last.trainer_rss_mib - first.trainer_rss_mib
    if growth > tolerance_mib:
        report.failures.append(f"trainer RSS grew by {growth:.1f} MiB (tolerance {tolerance_mib} MiB)")
    for i, (a, b) in enumerate(zip(first.worker_rss_mib, last.worker_rss_mib, strict=True)):
        if b - a > tolerance_mib:
            report.failures.append(f"worker {i} RSS grew by {b - a:.1f} MiB (tolerance {tolerance_mib} MiB)")
    if last.trainer_fds != first.trainer_fds:
        report.failures.append(f"trainer fds {first.trainer_fds} -> {last.trainer_fds}")
    if last.worker_fds != first.worker_fds:
        report.failures.append(f"worker fds {first.worker_fds} -> {last.worker_fds}")
    if last.shm_segments != first.shm_segments:
        report.failures.append(f"shared-memory segments {first.shm_segments} -> {last.shm_segments}")


async def soak(args: argparse.Namespace) -> Report:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    policy = MLP()
    cls = MultiSyncCollector if args.collector == "sync" else MultiAsyncCollector
    fpb = FRAMES_PER_BATCH if args.collector == "sync" else FRAMES_PER_BATCH // WORKERS
    report = Report(collector=cls.__name__, minutes=args.minutes)
    duration = args.minutes * 60
    header = (
        f"{'t (s)':>8} {'frames':>12} {'frames/s':>9} {'RSS MiB':>9} "
        + " ".join(f"{'w' + str(i):>7}" for i in range(WORKERS))
        + f"  {'fds':>4} "
        + " ".join(f"{'w' + str(i):>3}" for i in range(WORKERS))
        + f"  {'shm':>4}"
    )
    async with cls([make_env] * WORKERS, policy, frames_per_batch=fpb, worker_timeout=60) as collector:
        workers = [psutil.Process(w.process.pid) for w in collector._pool.workers]
        pids = [w.pid for w in workers]
        print(
            f"{cls.__name__}: {WORKERS} workers x {ENVS} envs, {collector.frames_per_batch} frames per batch,"
        )
        print(f"a weight update after every batch, {args.minutes} min, a sample every {args.interval} s")
        print(header, flush=True)
        start = time.monotonic()
        next_sample = start + args.interval
        frames = batches = 0
        last: Sample | None = None
        async for batch in collector:
            frames += batch.numel()
            batches += 1
            with torch.no_grad():  # a "training step": the weights change every batch
                for p in policy.parameters():
                    p.add_(torch.randn_like(p), alpha=1e-3)
            await collector.update_weights(policy)
            report.weight_updates += 1
            now = time.monotonic()
            if now >= next_sample or now - start >= duration:
                last = sample(start, frames, batches, last, workers)
                report.samples.append(last)
                print_sample(last)
                next_sample += args.interval
            if now - start >= duration:
                break
        state = await collector.state_dict()
        report.delivered_frames = frames
        report.counted_frames = collector.statistics().frames
        report.worker_frames = [int(state[f"worker{i}"]["frames"]) for i in range(WORKERS)]
    # -- after the collector closed ---------------------------------------------------------------
    await anyio.sleep(0.5)
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    report.left_behind = {"workers": alive, "segments": segments()}
    if alive or segments():
        report.failures.append(f"left behind after close: {report.left_behind}")
    if report.counted_frames != report.delivered_frames:
        report.failures.append(
            f"statistics().frames={report.counted_frames} but the batches held {report.delivered_frames}"
        )
    produced = sum(report.worker_frames)
    ahead = 0 if args.collector == "sync" else 2 * WORKERS * fpb
    if not report.delivered_frames <= produced <= report.delivered_frames + ahead:
        report.failures.append(
            f"frames lost or invented: batches held {report.delivered_frames}, the workers counted "
            f"{report.worker_frames} (sum {produced}, up to {ahead} collected ahead allowed)"
        )
    if len(report.samples) >= 2:
        check_flat(report, args.rss_tolerance_mib)
    else:
        report.failures.append("fewer than 2 samples: run longer than --interval")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=60.0, help="seconds between samples")
    parser.add_argument("--collector", choices=["sync", "async"], default="sync")
    parser.add_argument("--rss-tolerance-mib", type=float, default=16.0)
    parser.add_argument("--json", help="write the report there")
    args = parser.parse_args()
    report = anyio.run(soak, args)
    produced = sum(report.worker_frames)
    print(
        f"frames: batches {report.delivered_frames:,}, statistics {report.counted_frames:,}, workers "
        f"{' + '.join(f'{f:,}' for f in report.worker_frames)} = {produced:,}; "
        f"{report.weight_updates:,} weight updates"
    )
    if report.samples:
        first, last = report.samples[0], report.samples[-1]
        print(
            f"from t={first.elapsed_s:.0f} s to t={last.elapsed_s:.0f} s: trainer RSS "
            f"{first.trainer_rss_mib} -> {last.trainer_rss_mib} MiB, workers "
            f"{first.worker_rss_mib} -> {last.worker_rss_mib} MiB, fds {first.trainer_fds} "
            f"{first.worker_fds} -> {last.trainer_fds} {last.worker_fds}, segments "
            f"{first.shm_segments} -> {last.shm_segments}"
        )
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(report), f, indent=1)
    if report.failures:
        print("FAILED:\n  " + "\n  ".join(report.failures))
        sys.exit(1)
    print("OK: flat, no frame lost, nothing left behind")


if __name__ == "__main__":
    main()
