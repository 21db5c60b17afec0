"""Soak run: a multi-process collector for many minutes, checking that nothing grows and no frame is lost.

Run with ``python benchmarks/soak.py [--minutes 10] [--interval 60] [--collector sync|async] [--json PATH]``
(or ``nox -s soak -- --minutes 3``). Not part of the test suite. ``--faults`` is issue 28's soak (below).

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

``--faults`` (``python benchmarks/soak.py --faults --minutes 5``): a ``MultiAsyncCollector`` under
``restart=RestartPolicy(...)`` whose envs fail once per 10,000 steps (each worker's vector env of 32 raises
when its frame count crosses a multiple of ``--fail-every``: the whole vector env is rebuilt) and whose
workers are SIGKILLed in turn every ``--kill-every`` seconds (30). ``total_frames`` is what the collector
delivers in ``--minutes`` at the rate measured by a 15 s run without faults before it. Every env counts the
frames it stepped into a shared counter file (a slot per env built, in every process, the killed ones
included): the ground truth. Checks, besides the memory, fd and segment checks above (the trainer's; a
worker's RSS and fds are compared with its slot's first sample, the process being a replacement by then):

* ``total_frames`` is met exactly: the delivered batches hold ``total_frames`` frames, as
  ``statistics().frames`` says;
* every frame is accounted for: the frames the envs stepped = the frames delivered + ``frames_discarded``
  (what the killed workers lost) + what was still collected ahead when the run ended, the last at most 2
  slots and a batch in progress per worker, plus a step per kill (the one the worker died in);
* restarts are counted: ``statistics().restarts`` = the env restarts (the ``Restarted`` events with
  ``env >= 0``) + the worker replacements (``env == -1``), which equal the kills.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio
import gymnasium as gym
import numpy as np
import psutil
import torch
from torch import nn

from aiocollect import GymEnv, MultiAsyncCollector, MultiSyncCollector, Restarted, RestartPolicy

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
    faults: dict[str, Any] = field(default_factory=dict)


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
    for i, (a, b) in enumerate(zip(first.worker_rss_mib, last.worker_rss_mib, strict=False)):
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


# -- --faults: issue 28's soak -------------------------------------------------------------------------
#: counter slots in the shared counts file: one per env built (restarts and replacements included)
SLOTS = 1 << 16
_COUNTS: dict[str, np.memmap] = {}  # one mapping of the counts file per process


def _counts(directory: str) -> np.memmap:
    if directory not in _COUNTS:
        path = os.path.join(directory, "counts")
        _COUNTS[directory] = np.memmap(path, dtype=np.int64, mode="r+", shape=(SLOTS,))
    return _COUNTS[directory]


def _claim(directory: str) -> int:
    """A counter slot of its own for a new env (an exclusive create: no two envs anywhere share one)."""
    n = 0
    while True:
        try:
            os.close(os.open(os.path.join(directory, f"slot{n}"), os.O_CREAT | os.O_EXCL))
            return n
        except FileExistsError:
            n += 1


class CountingFaults(gym.vector.VectorWrapper):
    """A vector env that adds the frames it stepped to its slot of the shared counts, and raises when its
    frame count would cross a multiple of ``every`` (that step gives no frame; the rebuilt env counts
    from 0 again)."""

    def __init__(self, env: gym.vector.VectorEnv, directory: str, every: int) -> None:
        super().__init__(env)
        self.every, self.frames = every, 0
        self.counts, self.slot = _counts(directory), _claim(directory)

    def step(self, actions: Any) -> Any:
        n = self.num_envs
        if (self.frames + n) // self.every > self.frames // self.every:
            raise RuntimeError(f"the simulator went unstable at frame {self.frames + n}")
        out = self.env.step(actions)
        self.frames += n
        self.counts[self.slot] += n
        return out


def faulty_env(directory: str, every: int) -> GymEnv:
    vec = gym.make_vec("CartPole-v1", num_envs=ENVS, vectorization_mode="sync")
    return GymEnv(CountingFaults(vec, directory, every))


def worker_processes(collector: Any) -> list[psutil.Process]:
    out = []
    for w in collector._pool.workers:
        try:
            out.append(psutil.Process(w.process.pid))
        except (psutil.NoSuchProcess, ValueError, AttributeError):
            pass
    return out


def sample_faults(
    start: float, frames: int, batches: int, last: Sample | None, collector: Any
) -> Sample | None:
    """A sample, or ``None`` while a worker is being replaced (its killed process still in its slot, a
    zombie): the caller samples again at its next batch."""
    if not all(w.attached and w.state == "collecting" for w in collector._pool.workers):
        return None  # a replacement starting: not attached to its slots yet
    try:
        workers = worker_processes(collector)
        if len(workers) < WORKERS or any(w.status() == psutil.STATUS_ZOMBIE for w in workers):
            return None
        return sample(start, frames, batches, last, workers)
    except psutil.NoSuchProcess:
        return None


async def calibrate(policy: nn.Module, fpb: int, seconds: float) -> float:
    """Frames per second the faults run's collector delivers without faults (after its first batch)."""
    async with MultiAsyncCollector([make_env] * WORKERS, policy, frames_per_batch=fpb) as collector:
        frames, start = 0, None
        async for batch in collector:
            if start is None:
                start = time.monotonic()
                continue
            frames += batch.numel()
            await collector.update_weights(policy)
            if time.monotonic() - start >= seconds:
                return frames / (time.monotonic() - start)
    raise AssertionError("unreachable: the collector is endless")


async def soak_faults(args: argparse.Namespace) -> Report:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    policy = MLP()
    fpb = FRAMES_PER_BATCH // WORKERS
    report = Report(collector="MultiAsyncCollector (faults)", minutes=args.minutes)
    rate = await calibrate(policy, fpb, 15.0)
    total = math.ceil(rate * args.minutes * 60 / fpb) * fpb
    directory = tempfile.mkdtemp(prefix="aiocollect-soak-")
    np.memmap(os.path.join(directory, "counts"), dtype=np.int64, mode="w+", shape=(SLOTS,)).flush()
    restart = RestartPolicy(max_restarts=args.max_restarts, window=60.0, backoff=0.0, max_backoff=1.0)
    env_fn = functools.partial(faulty_env, directory, args.fail_every)
    print(
        f"MultiAsyncCollector: {WORKERS} workers x {ENVS} envs, {fpb} frames per batch, a weight update "
        f"after every batch; an env fails every {args.fail_every:,} of its frames, a worker is killed "
        f"every {args.kill_every:g} s; total_frames={total:,} ({rate:,.0f} frames/s measured without "
        f"faults, for {args.minutes} min)",
        flush=True,
    )
    kills, env_restarts, replacements = 0, 0, 0
    try:
        async with (
            MultiAsyncCollector(
                [env_fn] * WORKERS,
                policy,
                frames_per_batch=fpb,
                total_frames=total,
                worker_timeout=60,
                restart=restart,
            ) as collector,
            collector.events(max_buffer=1 << 16) as events,
        ):

            def drain() -> None:
                nonlocal env_restarts, replacements
                while (event := events.receive_nowait()) is not None:
                    if isinstance(event, Restarted):
                        if event.env == -1:
                            replacements += 1
                        else:
                            env_restarts += 1

            async def killer() -> None:
                nonlocal kills
                while True:
                    await anyio.sleep(args.kill_every)  # the fault's schedule, not a synchronisation
                    process = collector._pool.workers[kills % WORKERS].process
                    os.kill(process.pid, signal.SIGKILL)
                    kills += 1

            start = time.monotonic()
            next_sample = start + args.interval
            frames = batches = 0
            last: Sample | None = None
            async with anyio.create_task_group() as tg:
                tg.start_soon(killer)
                async for batch in collector:
                    frames += batch.numel()
                    batches += 1
                    with torch.no_grad():  # a "training step": the weights change every batch
                        for p in policy.parameters():
                            p.add_(torch.randn_like(p), alpha=1e-3)
                    await collector.update_weights(policy)
                    report.weight_updates += 1
                    drain()
                    now = time.monotonic()
                    if now >= next_sample and (
                        taken := sample_faults(start, frames, batches, last, collector)
                    ):
                        report.samples.append(last := taken)
                        print_sample(taken)
                        next_sample += args.interval
                tg.cancel_scope.cancel()
            elapsed = time.monotonic() - start
            with anyio.fail_after(30):  # a worker killed at the very end: its replacement first
                # psutil has no event to wait on: polled
                while (taken := sample_faults(start, frames, batches, last, collector)) is None:  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            report.samples.append(taken)
            print_sample(taken)
            drain()
            stats = collector.statistics()
            pids = [p.pid for p in worker_processes(collector)]
        # -- after the collector closed ---------------------------------------------------------------
        stepped = int(_counts(directory).sum())
    finally:
        _COUNTS.clear()
        shutil.rmtree(directory, ignore_errors=True)
    report.delivered_frames = frames
    report.counted_frames = stats.frames
    ahead = WORKERS * 3 * fpb + kills * ENVS
    unaccounted = stepped - frames - stats.frames_discarded
    report.faults = {
        "seconds": round(elapsed, 1),
        "total_frames": total,
        "frames_stepped_by_the_envs": stepped,
        "frames_discarded": stats.frames_discarded,
        "collected_ahead_at_the_end": unaccounted,
        "collected_ahead_bound": ahead,
        "kills": kills,
        "worker_replacements": replacements,
        "env_restarts": env_restarts,
        "statistics_restarts": stats.restarts,
        "per_worker_restarts": [w.restarts for w in stats.workers],
    }
    await anyio.sleep(0.5)
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    report.left_behind = {"workers": alive, "segments": segments()}
    if alive or segments():
        report.failures.append(f"left behind after close: {report.left_behind}")
    if not frames == stats.frames == total:
        report.failures.append(f"total_frames={total}: the batches held {frames}, statistics {stats.frames}")
    if not 0 <= unaccounted <= ahead:
        report.failures.append(
            f"frames not accounted for: the envs stepped {stepped}, delivered {frames} + discarded "
            f"{stats.frames_discarded} leaves {unaccounted} (0 to {ahead} collected ahead allowed)"
        )
    if stats.restarts != env_restarts + replacements or not kills - 1 <= replacements <= kills:
        report.failures.append(
            f"restarts: statistics {stats.restarts}, events {env_restarts} env + {replacements} worker, "
            f"{kills} kills"
        )
    if kills == 0 or env_restarts == 0 or stats.frames_discarded == 0:
        report.failures.append("no fault met: run longer than --kill-every and --fail-every frames")
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
    parser.add_argument("--faults", action="store_true", help="issue 28's soak: env faults, worker kills")
    parser.add_argument(
        "--fail-every", type=int, default=10_000, help="--faults: an env fails every N frames"
    )
    parser.add_argument("--kill-every", type=float, default=30.0, help="--faults: seconds between kills")
    parser.add_argument("--max-restarts", type=int, default=200, help="--faults: per env or worker, per 60 s")
    args = parser.parse_args()
    report = anyio.run(soak_faults if args.faults else soak, args)
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
    if report.faults:
        print(
            "faults: "
            + ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}" for k, v in report.faults.items())
        )
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(report), f, indent=1)
    if report.failures:
        print("FAILED:\n  " + "\n  ".join(report.failures))
        sys.exit(1)
    print(
        "OK: flat, no frame lost, nothing left behind"
        + (", every frame accounted for" if args.faults else "")
    )


if __name__ == "__main__":
    main()
