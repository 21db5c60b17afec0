"""Benchmark: multi-process collectors against the in-process ``Collector``, measured in one run.

Run with ``python benchmarks/multi.py [--quick] [--json PATH]``.

Setting: CartPole-v1, 2 workers x ``GymEnv("CartPole-v1", num_envs=32)``, an MLP policy (obs -> 64 -> 64
-> 2 logits, tanh, argmax; an ``nn.Module`` returning the action), ``frames_per_batch=4096``. The
baseline is the in-process ``Collector`` with ``GymEnv("CartPole-v1", num_envs=64)`` and the same policy,
with ``torch.set_num_threads(1)`` in this (the parent) process. Measured:

1. throughput: frames/s of ``MultiSyncCollector``, ``MultiAsyncCollector`` and (threads, for comparison)
   ``MultiSyncCollector(worker_backend="serial")``, each divided by the in-process ``Collector``'s. Every
   measurement builds and enters a fresh collector, collects one untimed warm-up batch, then collects
   for ``--seconds``; the variants alternate over ``--rounds`` rounds (the order reversed every other
   round) and ratios are medians of per-round ratios, so that each compares numbers taken seconds apart
   (this shared machine's speed drifts). The other processes' CPU use during each measurement (busy CPU
   time of the whole machine minus our process tree's) is reported next to the load average.
2. event-loop lag: a task asks to sleep 1 ms in a loop while the collector collects, and records how
   late it wakes up (p50, p99, max over every tick of every round).
3. weight updates of a ~1M-parameter MLP policy (obs -> 1000 -> 1000 -> 2) to 2 workers: the latency of
   ``await update_weights()`` and ``await update_weights(wait=True)`` between batches of a
   ``MultiSyncCollector`` (workers idle: the trainer's loop) and while a ``MultiAsyncCollector``'s
   workers collect (``wait=True`` then waits for each worker's batch boundary), against a plain
   ``copy_`` of the same weights in this process. A check that the workers run the published weights
   (they make the policy's action constant) follows.
4. start-up: time from building the collector to the end of ``async with``'s entry (every worker
   ready): the first time in the process (which starts the forkserver, that imports torch once), the
   second time, and the median of the later ones; the memory of the process tree (this process and
   every descendant: forkserver, resource tracker, workers) while collecting, as the sum of RSS (pages
   shared between processes, e.g. torch's libraries in the forkserver and the workers it forked,
   counted once per process) and the sum of PSS (shared pages split between the processes mapping
   them: the real total).

After every multi-worker measurement the benchmark checks that no worker process and no
``/dev/shm/aiocollect_<pid>_*`` segment is left; the exit status is 1 if one was, or if the weight check
failed (targets missed on a busy machine do not fail the run).
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio
import numpy as np
import psutil
import torch
from torch import nn

from aiocollect import Collector, GymEnv, MultiAsyncCollector, MultiSyncCollector

ENV_ID = "CartPole-v1"
NUM_WORKERS = 2
ENVS_PER_WORKER = 32
FRAMES_PER_BATCH = 4096
BIG_HIDDEN = 1000

TARGET_RATIO = 1.5  # multi-process frames/s / in-process frames/s, on an idle 2-core machine
TARGET_LAG_P99_MS = 2.0
TARGET_UPDATE_MS = 5.0
TARGET_STARTUP_S = 2.0
TARGET_MEMORY_MB = 500.0
TORCHRL_STARTUP = "4.6-5.8 s"
TORCHRL_MEMORY = "~830 MB"


# -- the policy ------------------------------------------------------------------------------------
class MLPPolicy(nn.Module):
    """obs -> hidden -> hidden -> 2 logits (tanh), argmax: returns CartPole's action."""

    def __init__(self, hidden: int = 64, obs_dim: int = 4, n_actions: int = 2) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(obs_dim, hidden),
            nn.Tanh(),
            nn.Linear(hidden, hidden),
            nn.Tanh(),
            nn.Linear(hidden, n_actions),
        )

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).argmax(-1)


def make_policy(hidden: int = 64) -> MLPPolicy:
    torch.manual_seed(0)
    return MLPPolicy(hidden).eval()


def worker_env() -> GymEnv:
    return GymEnv(ENV_ID, num_envs=ENVS_PER_WORKER)


def single_env() -> GymEnv:
    return GymEnv(ENV_ID, num_envs=NUM_WORKERS * ENVS_PER_WORKER)


# -- the process tree: CPU, memory, leaks ----------------------------------------------------------
ME = psutil.Process()


def tree() -> list[psutil.Process]:
    return [ME, *ME.children(recursive=True)]


def tree_cpu() -> dict[int, float]:
    out = {}
    for p in tree():
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        out[p.pid] = t.user + t.system
    return out


def machine_busy() -> tuple[float, float]:
    """Busy CPU seconds of the whole machine (every core) and the seconds stolen by the hypervisor."""
    t = psutil.cpu_times()
    busy = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
    return busy, getattr(t, "steal", 0.0)


@dataclass
class CpuMark:
    wall: float
    ours: dict[int, float]
    busy: float
    steal: float

    @classmethod
    def now(cls) -> CpuMark:
        busy, steal = machine_busy()
        return cls(time.perf_counter(), tree_cpu(), busy, steal)

    def since(self, start: CpuMark) -> dict[str, float]:
        wall = self.wall - start.wall
        ours = sum(v - start.ours.get(pid, 0.0) for pid, v in self.ours.items())
        busy = self.busy - start.busy
        return {
            "our_cores": ours / wall,
            "other_cores": (busy - ours) / wall,
            "steal_cores": (self.steal - start.steal) / wall,
        }


@dataclass
class Memory:
    processes: int
    rss_mb: float
    pss_mb: float
    parent_rss_mb: float
    per_process: list[tuple[str, float, float]] = field(default_factory=list)  # role, RSS, PSS (MB)


def role(p: psutil.Process) -> str:
    """What ``p`` is to us. Workers are forked by the forkserver, so they share its command line."""
    if p.pid == ME.pid:
        return "this process"
    try:
        cmd = " ".join(p.cmdline())
        direct = p.ppid() == ME.pid
    except psutil.Error:
        return "gone"
    if direct and "multiprocessing.forkserver" in cmd:
        return "forkserver"
    if direct and "multiprocessing.resource_tracker" in cmd:
        return "resource tracker"
    return "worker"


def tree_memory() -> Memory:
    rss = pss = 0
    per_process = []
    for p in tree():
        try:
            info = p.memory_full_info()
        except psutil.Error:
            continue
        p_pss = getattr(info, "pss", info.rss)
        rss += info.rss
        pss += p_pss
        per_process.append((role(p), info.rss / 2**20, p_pss / 2**20))
    return Memory(len(per_process), rss / 2**20, pss / 2**20, ME.memory_info().rss / 2**20, per_process)


def leftovers() -> tuple[list[str], list[str]]:
    """Our ``/dev/shm`` segments and descendant processes other than multiprocessing's helpers."""
    segments = sorted(glob.glob(f"/dev/shm/aiocollect_{os.getpid()}_*"))
    procs = []
    for p in ME.children(recursive=True):
        # the forkserver and the resource tracker outlive collectors by design (one per process)
        if role(p) == "worker":
            try:
                procs.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
            except psutil.Error:
                pass
    return segments, procs


# -- the variants ----------------------------------------------------------------------------------
@dataclass
class Sample:
    frames: int
    batches: int
    wall_s: float
    startup_s: float
    shutdown_s: float
    cpu: dict[str, float]
    load1: float
    memory: Memory | None = None

    @property
    def fps(self) -> float:
        return self.frames / self.wall_s


@dataclass
class Variant:
    name: str
    make: Callable[[], Any]
    multi: bool
    samples: list[Sample] = field(default_factory=list)
    startups: list[float] = field(default_factory=list)  # every entry, in order


def variants(policy: nn.Module) -> list[Variant]:
    fns = [worker_env] * NUM_WORKERS
    return [
        Variant(
            "Collector (in-process, 64 envs)",
            lambda: Collector(single_env, policy, frames_per_batch=FRAMES_PER_BATCH, seed=0),
            multi=False,
        ),
        Variant(
            "MultiSyncCollector",
            lambda: MultiSyncCollector(fns, policy, frames_per_batch=FRAMES_PER_BATCH, seed=0),
            multi=True,
        ),
        Variant(
            "MultiAsyncCollector",
            lambda: MultiAsyncCollector(fns, policy, frames_per_batch=FRAMES_PER_BATCH, seed=0),
            multi=True,
        ),
        Variant(
            'MultiSyncCollector worker_backend="serial"',
            lambda: MultiSyncCollector(
                fns, policy, frames_per_batch=FRAMES_PER_BATCH, seed=0, worker_backend="serial"
            ),
            multi=False,
        ),
    ]


LEAKS: list[str] = []


def check_leaks(where: str) -> None:
    segments, procs = leftovers()
    if segments or procs:
        msg = f"after {where}: {len(segments)} segments {segments}, {len(procs)} processes {procs}"
        LEAKS.append(msg)
        print(f"LEAK {msg}", file=sys.stderr, flush=True)


async def measure(variant: Variant, seconds: float, with_memory: bool = True) -> Sample:
    """Build and enter a fresh collector, one warm-up batch, then collect for ``seconds``."""
    t0 = time.perf_counter()
    collector = variant.make()
    async with collector:
        startup = time.perf_counter() - t0
        variant.startups.append(startup)
        it = aiter(collector)
        await anext(it)  # warm-up
        frames = batches = 0
        start = CpuMark.now()
        while True:
            batch = await anext(it)
            frames += batch.numel()
            batches += 1
            if time.perf_counter() - start.wall >= seconds:
                break
        end = CpuMark.now()
        memory = tree_memory() if with_memory else None
        t1 = time.perf_counter()
    shutdown = time.perf_counter() - t1
    if variant.multi:
        check_leaks(variant.name)
    return Sample(
        frames=frames,
        batches=batches,
        wall_s=end.wall - start.wall,
        startup_s=startup,
        shutdown_s=shutdown,
        cpu=end.since(start),
        load1=os.getloadavg()[0],
        memory=memory,
    )


# -- the machine's ceiling: independent processes, no collector between them -------------------------
async def _child_collect(seconds: float) -> None:
    """In a child process: one worker's share (a Collector over ``worker_env``), warmed up, then frames/s
    over ``seconds``, printed."""
    async with Collector(worker_env, make_policy(), frames_per_batch=FRAMES_PER_BATCH // NUM_WORKERS) as c:
        it = aiter(c)
        await anext(it)
        frames, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            frames += (await anext(it)).numel()
        print(frames / (time.perf_counter() - t0), flush=True)


async def measure_ceiling(seconds: float) -> float:
    """Frames/s of ``NUM_WORKERS`` independent processes, each doing one worker's share in-process (its own
    Collector; nothing shared, nothing to wait for): what this machine gives that many processes now, the
    ceiling of any multi-process collector."""
    outs: list[float] = []

    async def one() -> None:
        cmd = [sys.executable, __file__, "--ceiling-child", str(seconds)]
        done = await anyio.run_process(cmd, check=True)
        outs.append(float(done.stdout.decode().split()[-1]))

    async with anyio.create_task_group() as tg:
        for _ in range(NUM_WORKERS):
            tg.start_soon(one)
    return sum(outs)


# -- event-loop lag --------------------------------------------------------------------------------
@dataclass
class Lag:
    name: str
    ticks: int = 0
    p50_ms: float = math.nan
    p99_ms: float = math.nan
    max_ms: float = math.nan
    fps: float = math.nan
    busy_p99_ms: float = math.nan
    lags_ms: list[float] = field(default_factory=list, repr=False)
    busy_ms: list[float] = field(default_factory=list, repr=False)
    fps_samples: list[float] = field(default_factory=list)

    def finish(self) -> None:
        a = np.asarray(self.lags_ms)
        self.ticks = len(a)
        if len(a):
            self.p50_ms = float(np.percentile(a, 50))
            self.p99_ms = float(np.percentile(a, 99))
            self.max_ms = float(a.max())
            self.busy_p99_ms = float(np.percentile(np.asarray(self.busy_ms), 99))
        if self.fps_samples:
            self.fps = statistics.median(self.fps_samples)


async def ticker(lags: list[float], busy: list[float], until: float) -> None:
    """Record how late a 1 ms sleep wakes up, and the loop thread's CPU time meanwhile: a late wake-up
    with little CPU time means the process was not scheduled (the machine is busy), one with as much
    CPU time means code running on the loop held it."""
    while time.perf_counter() < until:
        t0, c0 = time.perf_counter(), time.thread_time()
        await anyio.sleep(0.001)
        busy.append(1e3 * (time.thread_time() - c0))
        lags.append(1e3 * (time.perf_counter() - t0 - 0.001))


async def measure_lag(variant: Variant | None, seconds: float, out: Lag) -> None:
    if variant is None:
        await ticker(out.lags_ms, out.busy_ms, time.perf_counter() + seconds)
        return
    async with variant.make() as collector, anyio.create_task_group() as tg:
        it = aiter(collector)
        await anext(it)  # warm-up
        t0 = time.perf_counter()
        tg.start_soon(ticker, out.lags_ms, out.busy_ms, t0 + seconds)
        frames = 0
        while time.perf_counter() < t0 + seconds:
            frames += (await anext(it)).numel()
        out.fps_samples.append(frames / (time.perf_counter() - t0))
    if variant.multi:
        check_leaks(f"lag/{variant.name}")


# -- weight updates --------------------------------------------------------------------------------
@dataclass
class WeightTiming:
    name: str
    nowait_ms: float
    wait_ms: float
    nowait_p90_ms: float
    wait_p90_ms: float
    reps: int


def weight_timing(name: str, nowait: list[float], wait: list[float]) -> WeightTiming:
    return WeightTiming(
        name,
        nowait_ms=1e3 * statistics.median(nowait),
        wait_ms=1e3 * statistics.median(wait),
        nowait_p90_ms=1e3 * float(np.percentile(nowait, 90)),
        wait_p90_ms=1e3 * float(np.percentile(wait, 90)),
        reps=len(nowait),
    )


async def measure_weights(reps: int, log: Callable[[str], None]) -> dict[str, Any]:
    big = make_policy(BIG_HIDDEN)
    params = [p for p in big.parameters()]
    n_params = sum(p.numel() for p in params)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    fns = [worker_env] * NUM_WORKERS
    timings: list[WeightTiming] = []
    checks: list[str] = []

    def nudge() -> None:  # an optimizer step's worth of change, so every update carries new values
        with torch.no_grad():
            for p in params:
                p.mul_(1.0 + 1e-7)

    # the trainer's loop with a sync collector: batch, (train), publish; workers idle in between
    log("weights: MultiSyncCollector (between batches)")
    async with MultiSyncCollector(fns, big, frames_per_batch=512, seed=0) as c:
        it = aiter(c)
        await anext(it)
        nowait, wait = [], []
        for _ in range(reps):
            await anext(it)
            nudge()
            t = time.perf_counter()
            await c.update_weights()
            nowait.append(time.perf_counter() - t)
            await anext(it)
            nudge()
            t = time.perf_counter()
            await c.update_weights(wait=True)
            wait.append(time.perf_counter() - t)
        timings.append(weight_timing("MultiSyncCollector, between batches", nowait, wait))
        # the workers run what was published: make the action constant, 0 then 1
        last = big.net[-1]
        for action in (0, 1):
            with torch.no_grad():
                last.weight.zero_()
                last.bias.copy_(torch.tensor([1.0, 0.0] if action == 0 else [0.0, 1.0]))
            version = await c.update_weights(wait=True)
            versions = c.worker_policy_versions()
            batch = await anext(it)
            actions = batch["action"]
            ok = bool((actions == action).all()) and c.worker_policy_versions() == [version] * 2
            checks.append(
                f"sync: action forced to {action}: {'ok' if ok else 'FAILED'} "
                f"(version {version}, workers after wait=True {versions}, after the next batch "
                f"{c.worker_policy_versions()}, actions {actions.unique().tolist()})"
            )
    check_leaks("weights/MultiSyncCollector")

    # while the workers collect: wait=True waits for each worker's batch boundary (256 frames = 8 steps)
    log("weights: MultiAsyncCollector (workers collecting)")
    big = make_policy(BIG_HIDDEN)
    params = [p for p in big.parameters()]
    async with MultiAsyncCollector(fns, big, frames_per_batch=256, seed=0) as c:
        it = aiter(c)
        await anext(it)
        t = time.perf_counter()
        for _ in range(8):
            await anext(it)
        # the two workers deliver in turn: each one's batch takes about twice the interval
        worker_batch_s = (time.perf_counter() - t) * NUM_WORKERS / 8
        nowait, wait = [], []
        for _ in range(reps):
            await anext(it)
            nudge()
            t = time.perf_counter()
            await c.update_weights()
            nowait.append(time.perf_counter() - t)
            await anext(it)
            nudge()
            t = time.perf_counter()
            await c.update_weights(wait=True)
            wait.append(time.perf_counter() - t)
        timings.append(weight_timing("MultiAsyncCollector, workers collecting", nowait, wait))
        last = big.net[-1]
        with torch.no_grad():
            last.weight.zero_()
            last.bias.copy_(torch.tensor([0.0, 1.0]))
        version = await c.update_weights(wait=True)
        # batches already collected (or being collected) may predate the update: skip those
        seen = []
        for _ in range(8):
            batch = await anext(it)
            worker = int(batch["collector", "worker_id"].flatten()[0])
            seen.append((worker, batch["action"].unique().tolist()))
        ok = all(a == [1] for _, a in seen[-2:])
        checks.append(
            f"async: action forced to 1 (version {version}): {'ok' if ok else 'FAILED'} "
            f"(last batches: {seen[-4:]}; worker versions {c.worker_policy_versions()})"
        )
    check_leaks("weights/MultiAsyncCollector")

    # the reference: a plain copy of the same weights in this process
    src = [p.detach() for p in params]
    dst = [s.clone() for s in src]
    copies = []
    for _ in range(max(reps, 50)):
        t = time.perf_counter()
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)
        copies.append(time.perf_counter() - t)
    return {
        "params": n_params,
        "bytes": nbytes,
        "timings": [asdict(t) for t in timings],
        "async_worker_batch_ms": 1e3 * worker_batch_s,
        "memcpy_ms": 1e3 * statistics.median(copies),
        "checks": checks,
    }


# -- reporting -------------------------------------------------------------------------------------
def autogroup() -> bool | None:
    """Linux's autogroup shares the CPU between sessions, not threads: a session with 2 busy workers
    gets no more of a busy machine than a session with 1."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1"
    except OSError:
        return None


AUTOGROUP = {True: "on (the CPU is shared between sessions, not processes)", False: "off"}


def machine() -> dict[str, Any]:
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "memory_gb": psutil.virtual_memory().total / 2**30,
        "sched_autogroup": autogroup(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def versions() -> dict[str, str]:
    out = {}
    for dist in ("aiocollect", "torch", "tensordict", "gymnasium", "anyio", "numpy", "psutil"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "-"
    out["python"] = platform.python_version()
    import aiocollect

    out["aiocollect from"] = os.path.dirname(aiocollect.__file__)
    return out


def med(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def mark(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def render(results: dict[str, Any]) -> str:
    lines = [
        "## Throughput: frames/s ÷ in-process Collector's (median of per-round ratios, [min, max])",
        "",
        "| variant | ratio (frames/s) | target | frames/s | ratio (frames per CPU-s) | frames per CPU-s "
        "| our CPU (cores) | others' CPU (cores) | startup (s) | shutdown (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base_name = results["baseline"]
    for v in results["variants"]:
        r = results["ratios"].get(v["name"])
        if r is None:
            ratio = cpu_ratio = "1 (baseline)"
            target = ""
        else:
            ratio = f"**{r['median']:.2f}** [{r['min']:.2f}, {r['max']:.2f}]"
            cpu_ratio = f"{r['cpu_median']:.2f} [{r['cpu_min']:.2f}, {r['cpu_max']:.2f}]"
            target = f">= {TARGET_RATIO} {mark(r['median'] >= TARGET_RATIO)}" if r["target"] else "-"
        lines.append(
            f"| {v['name']} | {ratio} | {target} | {v['fps']:,.0f} | {cpu_ratio} "
            f"| {v['frames_per_cpu_s']:,.0f} "
            f"| {v['our_cores']:.2f} | {v['other_cores']:.2f} | {v['startup_s']:.2f} "
            f"| {v['shutdown_s']:.2f} |"
        )
    lines += [
        "",
        f"Baseline: {base_name}. {results['rounds']} rounds, ~{results['seconds']} s of collection per "
        f"measurement. Load average (1 min) over the run: {results['load']['min']:.2f} to "
        f"{results['load']['max']:.2f} (median {results['load']['median']:.2f}; "
        f"{results['load']['before']:.2f} before it started). Others' CPU: busy CPU time of the "
        "machine minus our process tree's, per second of measurement (the load average counts our "
        "own workers too). Frames per CPU-s: frames per CPU second of our process tree (this "
        "process and its workers): what a collector costs, whatever share of the machine it gets.",
        "",
        f"Ceiling: {NUM_WORKERS} independent processes, each a `Collector` over one worker's envs "
        f"({ENVS_PER_WORKER}), nothing shared: {results['ceiling']['fps']:,.0f} frames/s, "
        f"**{results['ceiling']['vs_baseline']:.2f}** [{results['ceiling']['vs_baseline_min']:.2f}, "
        f"{results['ceiling']['vs_baseline_max']:.2f}] times the baseline (what this machine gives "
        f"{NUM_WORKERS} processes now; {NUM_WORKERS}.0 on idle dedicated cores). Share of it reached: "
        + ", ".join(f"{name} **{r:.2f}**" for name, r in results["ceiling"]["reached"].items())
        + " (median of per-round ratios).",
        "",
        "## Event-loop lag while collecting (a task sleeping 1 ms in a loop; every tick of every round)",
        "",
        "| while | ticks | p50 (ms) | p99 (ms) | max (ms) | target p99 | p99 loop CPU per tick (ms) "
        "| frames/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for g in results["lag"]:
        target = (
            f"< {TARGET_LAG_P99_MS} {mark(g['p99_ms'] < TARGET_LAG_P99_MS)}"
            if g["name"] in ("MultiSyncCollector", "MultiAsyncCollector")
            else "-"
        )
        fps = f"{g['fps']:,.0f}" if not math.isnan(g["fps"]) else "-"
        lines.append(
            f"| {g['name']} | {g['ticks']} | {g['p50_ms']:.2f} | {g['p99_ms']:.2f} | {g['max_ms']:.2f} "
            f"| {target} | {g['busy_p99_ms']:.2f} | {fps} |"
        )
    w = results["weights"]
    lines += [
        "",
        f"## Weight update: {w['params']:,}-parameter MLP ({w['bytes'] / 2**20:.1f} MiB) to "
        f"{NUM_WORKERS} workers (median [p90] of {w['timings'][0]['reps']})",
        "",
        "| collector | `update_weights()` (ms) | `update_weights(wait=True)` (ms) | target (no wait) |",
        "|---|---|---|---|",
    ]
    for t in w["timings"]:
        lines.append(
            f"| {t['name']} | {t['nowait_ms']:.2f} [{t['nowait_p90_ms']:.2f}] "
            f"| {t['wait_ms']:.2f} [{t['wait_p90_ms']:.2f}] "
            f"| < {TARGET_UPDATE_MS} {mark(t['nowait_ms'] < TARGET_UPDATE_MS)} |"
        )
    lines += [
        f"| plain `copy_` of the same weights in this process (reference) | {w['memcpy_ms']:.2f} | - | - |",
        "",
        f"Each async worker collects a 256-frame batch (8 steps of 32 envs with this policy) in about "
        f"{w['async_worker_batch_ms']:.0f} ms: `wait=True` there waits for each worker's next batch "
        "boundary.",
        "Checks: " + "; ".join(w["checks"]),
        "",
        "## Start-up and memory (2 workers)",
        "",
        "| what | value | target | TorchRL (here) |",
        "|---|---|---|---|",
    ]
    s = results["startup"]
    lines.append(
        f"| start-up, first in the process (starts the forkserver) | {s['first_s']:.2f} s "
        f"| <= {TARGET_STARTUP_S} s {mark(s['first_s'] <= TARGET_STARTUP_S)} | {TORCHRL_STARTUP} |"
    )
    lines.append(
        f"| start-up, second time | {s['second_s']:.2f} s "
        f"| <= {TARGET_STARTUP_S} s {mark(s['second_s'] <= TARGET_STARTUP_S)} | |"
    )
    for name, value in s["later_median_s"].items():
        lines.append(f"| start-up, later ones, median: {name} | {value:.2f} s | | |")
    for name, m in results["memory"].items():
        lines.append(
            f"| process tree while collecting: {name} | RSS sum {m['rss_mb']:.0f} MB, PSS sum "
            f"{m['pss_mb']:.0f} MB ({m['processes']} processes; this one {m['parent_rss_mb']:.0f} MB RSS) "
            f"| <= {TARGET_MEMORY_MB:.0f} MB {mark(m['rss_mb'] <= TARGET_MEMORY_MB)} (RSS) "
            f"| {TORCHRL_MEMORY} |"
        )
    first_mem = results["memory"].get("first start, MultiSyncCollector")
    if first_mem:
        lines.append(
            "| per process at the first start (RSS / PSS MB) | "
            + ", ".join(f"{r} {a:.0f} / {b:.0f}" for r, a, b in first_mem["per_process"])
            + " | | |"
        )
    if results.get("import_s") is not None:
        lines.append(
            "| reference: `python -c 'import torch, tensordict, gymnasium, aiocollect...'` (what the "
            f"forkserver does first) | {results['import_s']:.2f} s | | |"
        )
    m, ver = results["machine"], results["versions"]
    lines += [
        "",
        "Leftovers after every multi-worker collector: "
        + (
            "none (no worker process, no /dev/shm segment)"
            if not results["leaks"]
            else "; ".join(results["leaks"])
        ),
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), {m['memory_gb']:.0f} GiB, "
        f"{m['platform']}, scheduler autogroup {AUTOGROUP.get(m['sched_autogroup'], '?')}.",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in ver.items()) + ".",
        f"Run: `{results['command']}`, {results['elapsed_s']:.0f} s in all.",
    ]
    return "\n".join(lines)


async def run(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    policy = make_policy()
    vs = variants(policy)
    base, msync, masync, serial = vs
    loads = [os.getloadavg()[0]]

    # 4. the first start-up in this process (it starts the forkserver), then the second
    log("start-up: first multi-process collector in this process")
    first = await measure(msync, args.seconds / 2)
    log(f"  {first.startup_s:.2f} s")
    second = await measure(masync, args.seconds / 2)
    log(f"  second: {second.startup_s:.2f} s")
    first_memory = first.memory
    msync.startups.clear()
    masync.startups.clear()

    # 1. throughput, interleaved (with the ceiling: independent processes)
    log(f"throughput: {len(vs)} variants and the ceiling x {args.rounds} rounds")
    ceiling: list[float] = []
    for r in range(args.rounds):
        order = vs if r % 2 == 0 else vs[::-1]
        for v in order:
            v.samples.append(await measure(v, args.seconds))
            loads.append(os.getloadavg()[0])
        ceiling.append(await measure_ceiling(args.seconds))
        log(
            f"  round {r + 1}/{args.rounds}: "
            + ", ".join(f"{v.name.split()[0]} {v.samples[-1].fps:,.0f}" for v in vs)
            + f", {NUM_WORKERS} independent processes {ceiling[-1]:,.0f} frames/s; "
            f"load {os.getloadavg()[0]:.2f}"
        )

    # 2. event-loop lag, interleaved
    log("event-loop lag")
    lag_variants: list[tuple[str, Variant | None]] = [
        ("idle loop (no collector)", None),
        ("MultiSyncCollector", msync),
        ("MultiAsyncCollector", masync),
        ('MultiSyncCollector worker_backend="serial"', serial),
        ("Collector (in-process, 64 envs)", base),
    ]
    lags = {name: Lag(name) for name, _ in lag_variants}
    for r in range(args.lag_rounds):
        order = lag_variants if r % 2 == 0 else lag_variants[::-1]
        for name, v in order:
            await measure_lag(v, args.lag_seconds if v is not None else args.lag_seconds / 2, lags[name])
        loads.append(os.getloadavg()[0])
    for g in lags.values():
        g.finish()

    # 3. weights
    weights = await measure_weights(args.weight_reps, log)
    loads.append(os.getloadavg()[0])

    # what the forkserver's start costs at least: a fresh interpreter importing what it preloads
    import_s = None
    if not args.quick:
        log("reference: a fresh interpreter importing the forkserver's preloads")
        t = time.perf_counter()
        await anyio.run_process(
            [sys.executable, "-c", "import torch, tensordict, gymnasium, aiocollect._workers._worker"]
        )
        import_s = time.perf_counter() - t
        loads.append(os.getloadavg()[0])

    # summaries
    summary = []
    for v in vs:
        summary.append(
            {
                "name": v.name,
                "fps": med([s.fps for s in v.samples]),
                "startup_s": med([s.startup_s for s in v.samples]),
                "shutdown_s": med([s.shutdown_s for s in v.samples]),
                "our_cores": med([s.cpu["our_cores"] for s in v.samples]),
                "frames_per_cpu_s": med([s.fps / s.cpu["our_cores"] for s in v.samples]),
                "other_cores": med([s.cpu["other_cores"] for s in v.samples]),
                "steal_cores": med([s.cpu["steal_cores"] for s in v.samples]),
                "samples": [asdict(s) for s in v.samples],
            }
        )
    ratios = {}
    for v in (msync, masync, serial):
        pairs = list(zip(v.samples, base.samples, strict=True))
        per_round = [a.fps / b.fps for a, b in pairs]
        per_cpu = [(a.fps / a.cpu["our_cores"]) / (b.fps / b.cpu["our_cores"]) for a, b in pairs]
        ratios[v.name] = {
            "median": statistics.median(per_round),
            "min": min(per_round),
            "max": max(per_round),
            "per_round": per_round,
            "cpu_median": statistics.median(per_cpu),
            "cpu_min": min(per_cpu),
            "cpu_max": max(per_cpu),
            "target": v.multi,
        }
    memory = {"first start, MultiSyncCollector": asdict(first_memory)} if first_memory else {}
    for v in (msync, masync):
        ms = [s.memory for s in v.samples if s.memory is not None]
        memory[f"{v.name}, median of rounds"] = {
            "processes": ms[0].processes,
            "rss_mb": med([m.rss_mb for m in ms]),
            "pss_mb": med([m.pss_mb for m in ms]),
            "parent_rss_mb": med([m.parent_rss_mb for m in ms]),
        }
    later = {v.name: med(v.startups) for v in (msync, masync, base)}
    per_round_ceiling = [c / b.fps for c, b in zip(ceiling, base.samples, strict=True)]
    ceiling_summary = {
        "fps": med(ceiling),
        "vs_baseline": statistics.median(per_round_ceiling),
        "vs_baseline_min": min(per_round_ceiling),
        "vs_baseline_max": max(per_round_ceiling),
        "reached": {
            v.name: statistics.median(s.fps / c for s, c in zip(v.samples, ceiling, strict=True))
            for v in (msync, masync)
        },
    }
    return {
        "ceiling": ceiling_summary,
        "baseline": base.name,
        "variants": summary,
        "ratios": ratios,
        "lag": [
            {k: val for k, val in asdict(g).items() if k not in ("lags_ms", "busy_ms")} for g in lags.values()
        ],
        "weights": weights,
        "startup": {
            "first_s": first.startup_s,
            "second_s": second.startup_s,
            "later_median_s": later,
        },
        "memory": memory,
        "import_s": import_s,
        "load": {
            "before": loads[0],
            "min": min(loads),
            "max": max(loads),
            "median": statistics.median(loads),
            "samples": loads,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run (~30 s)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--rounds", type=int, help="rounds of interleaved throughput measurements")
    parser.add_argument("--seconds", type=float, help="seconds of collection per measurement")
    parser.add_argument("--ceiling-child", type=float, help=argparse.SUPPRESS)  # measure_ceiling's children
    args = parser.parse_args(argv)
    if args.ceiling_child is not None:
        torch.set_num_threads(1)
        anyio.run(_child_collect, args.ceiling_child)
        return 0
    args.rounds = args.rounds or (2 if args.quick else 7)
    args.seconds = args.seconds or (0.4 if args.quick else 2.0)
    args.lag_rounds = 1 if args.quick else 3
    args.lag_seconds = 0.5 if args.quick else 2.0
    args.weight_reps = 6 if args.quick else 40

    torch.set_num_threads(1)
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {msg}", file=sys.stderr, flush=True)

    results = anyio.run(run, args, log)
    check_leaks("the run")
    results.update(
        command=" ".join(["python", "benchmarks/multi.py", *(argv if argv is not None else sys.argv[1:])]),
        rounds=args.rounds,
        seconds=args.seconds,
        elapsed_s=time.perf_counter() - start,
        machine=machine(),
        versions=versions(),
        leaks=LEAKS,
    )
    print(render(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        log(f"wrote {args.json}")
    failed_checks = [c for c in results["weights"]["checks"] if "FAILED" in c]
    return 1 if LEAKS or failed_checks else 0


if __name__ == "__main__":
    sys.exit(main())
