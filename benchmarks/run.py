"""Benchmark: ``aiocollect.Collector`` against raw gymnasium loops, measured in one run, interleaved.

Run with ``nox -s bench`` or ``python benchmarks/run.py [--quick] [--json PATH]``.

Every variant drives the same torch MLP (obs -> 64 -> 64 -> actions, tanh; argmax for a Discrete action,
``high * tanh`` for a Box one) with ``torch.set_num_threads(1)``:

* ``raw``: ``gymnasium.make(id)`` stepped in a plain Python loop, the policy called per step (the limit);
* ``raw-vec32``: ``gymnasium.make_vec(id, 32, "sync")`` (same-step autoreset, like ``GymEnv``) with the
  policy called on the whole batch;
* ``collector``: ``aiocollect.Collector(GymEnv(id), policy)`` driven by ``anyio.run``;
* ``collector-vec32``: the same with ``GymEnv(id, num_envs=32)``.

The machine's speed drifts, so the variants are alternated over several rounds (the order reversed every
other round) and the table gives medians; ratios are medians of per-round ratios, so that each one
compares measurements taken seconds apart. CPU time is ``time.process_time()`` (every thread of the
process: the collector's rollout runs in a worker thread).

A second part measures the event loop's lag while a ``Collector`` collects: a task asks to sleep 1 ms
in a loop and records how late it wakes up.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, field
from math import ceil
from typing import Any

import anyio
import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import AutoresetMode
from torch import nn

from aiocollect import Collector, GymEnv

ENVS = ("CartPole-v1", "Pendulum-v1")
NUM_ENVS = 32
FRAMES_PER_BATCH = {1: 2048, NUM_ENVS: 4096}
TARGET = 0.8  # the least Collector / raw loop, in frames per CPU-second (issue 2)


# -- the policy ------------------------------------------------------------------------------------
class MLPPolicy(nn.Module):
    """obs -> 64 -> 64 -> actions (tanh); argmax for Discrete, ``high * tanh`` for Box; returns the action."""

    def __init__(self, observation_space: gym.Space[Any], action_space: gym.Space[Any]) -> None:
        super().__init__()
        obs_dim = int(np.prod(observation_space.shape))
        self.discrete = isinstance(action_space, gym.spaces.Discrete)
        n_out = int(action_space.n) if self.discrete else int(np.prod(action_space.shape))
        self.net = nn.Sequential(
            nn.Linear(obs_dim, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, n_out)
        )
        high = 1.0 if self.discrete else np.asarray(action_space.high, dtype=np.float32)
        self.register_buffer("scale", torch.as_tensor(high, dtype=torch.float32))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        out = self.net(observation)
        if self.discrete:
            return out.argmax(-1)
        return torch.tanh(out) * self.scale


def make_policy(env_id: str) -> MLPPolicy:
    env = gym.make(env_id)
    try:
        torch.manual_seed(0)
        return MLPPolicy(env.observation_space, env.action_space).eval()
    finally:
        env.close()


# -- the variants ----------------------------------------------------------------------------------
@dataclass
class Sample:
    frames: int
    wall_s: float
    cpu_s: float  # the whole process
    #: the event loop's thread alone (the rest is the collector's worker thread); raw loops: all of it
    loop_cpu_s: float

    @property
    def fps(self) -> float:
        return self.frames / self.wall_s

    @property
    def frames_per_cpu_s(self) -> float:
        return self.frames / self.cpu_s

    @property
    def cpu_us_per_frame(self) -> float:
        return 1e6 * self.cpu_s / self.frames


class Variant:
    """One measured loop: ``await run(frames)`` times at least ``frames`` frames."""

    kind: str
    num_envs: int
    #: frames per measurement are a multiple of this
    granularity: int = 1

    def __init__(self, env_id: str) -> None:
        self.env_id = env_id
        self.policy = make_policy(env_id)
        self.samples: list[Sample] = []
        self.frames = 0  # frames per measurement (set by calibration)

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.env_id}"

    async def open(self, stack: AsyncExitStack) -> None:
        """Build what the loop needs and warm it up."""

    async def run(self, frames: int) -> Sample:
        raise NotImplementedError


def timed(frames: int, fn: Callable[[], Any]) -> Sample:
    wall, cpu, loop_cpu = time.perf_counter(), time.process_time(), time.thread_time()
    fn()
    return Sample(
        frames,
        time.perf_counter() - wall,
        time.process_time() - cpu,
        time.thread_time() - loop_cpu,
    )


class RawLoop(Variant):
    """``gymnasium.make(id)`` and the policy, per step, in a plain loop (it blocks the event loop, which
    has nothing else to do)."""

    kind = "raw"
    num_envs = 1
    granularity = 256

    async def open(self, stack: AsyncExitStack) -> None:
        self.env = gym.make(self.env_id)
        stack.callback(self.env.close)
        self.obs, _ = self.env.reset(seed=0)
        self.loop(256)

    def loop(self, n: int) -> None:
        env, policy, obs = self.env, self.policy, self.obs
        discrete = policy.discrete
        with torch.no_grad():
            for _ in range(n):
                action = policy(torch.from_numpy(obs))
                obs, _reward, terminated, truncated, _info = env.step(
                    int(action) if discrete else action.numpy()
                )
                if terminated or truncated:
                    obs, _ = env.reset()
        self.obs = obs

    async def run(self, frames: int) -> Sample:
        return timed(frames, lambda: self.loop(frames))


class RawVectorLoop(Variant):
    """``gymnasium.make_vec(id, 32, "sync")`` with same-step autoreset (as ``GymEnv`` makes it) and the
    policy called on the whole batch."""

    kind = f"raw-vec{NUM_ENVS}"
    num_envs = NUM_ENVS
    granularity = NUM_ENVS * 8

    async def open(self, stack: AsyncExitStack) -> None:
        self.env = gym.make_vec(
            self.env_id,
            num_envs=NUM_ENVS,
            vectorization_mode="sync",
            vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP},
        )
        stack.callback(self.env.close)
        self.obs, _ = self.env.reset(seed=0)
        self.loop(8)

    def loop(self, steps: int) -> None:
        env, policy, obs = self.env, self.policy, self.obs
        with torch.no_grad():
            for _ in range(steps):
                action = policy(torch.from_numpy(obs)).numpy()
                obs, _reward, _terminated, _truncated, _info = env.step(action)
        self.obs = obs

    async def run(self, frames: int) -> Sample:
        return timed(frames, lambda: self.loop(frames // NUM_ENVS))


class CollectorLoop(Variant):
    """``Collector(GymEnv(id[, num_envs]), policy)``: one collector for the whole run, batches awaited
    with ``async for`` (the rollout runs in the collector's worker thread)."""

    def __init__(self, env_id: str, num_envs: int) -> None:
        super().__init__(env_id)
        self.num_envs = num_envs
        self.kind = "collector" if num_envs == 1 else f"collector-vec{num_envs}"
        self.granularity = FRAMES_PER_BATCH[num_envs]

    async def open(self, stack: AsyncExitStack) -> None:
        num_envs = None if self.num_envs == 1 else self.num_envs
        collector = Collector(
            lambda: GymEnv(self.env_id, num_envs=num_envs),
            self.policy,
            frames_per_batch=self.granularity,
            seed=0,
        )
        await stack.enter_async_context(collector)
        self.batches = aiter(collector)
        await anext(self.batches)  # warm-up

    async def run(self, frames: int) -> Sample:
        n = 0
        wall, cpu, loop_cpu = time.perf_counter(), time.process_time(), time.thread_time()
        while n < frames:
            n += (await anext(self.batches)).numel()
        return Sample(
            n,
            time.perf_counter() - wall,
            time.process_time() - cpu,
            time.thread_time() - loop_cpu,
        )


# -- measuring -------------------------------------------------------------------------------------
def rounded(frames: float, granularity: int) -> int:
    return max(granularity, ceil(frames / granularity) * granularity)


async def calibrate(raw: Variant, coll: Variant, target_s: float) -> None:
    """Frames per measurement: about ``target_s`` of the raw loop, in pairs of the collector's batches;
    the collector does as many."""
    trial = await raw.run(rounded(0.1 * 1e4, raw.granularity))
    trial = await raw.run(rounded(0.1 * trial.fps, raw.granularity))
    raw.frames = coll.frames = rounded(target_s * trial.fps, 2 * coll.granularity)


def add(a: Sample | None, b: Sample) -> Sample:
    if a is None:
        return b
    return Sample(
        a.frames + b.frames,
        a.wall_s + b.wall_s,
        a.cpu_s + b.cpu_s,
        a.loop_cpu_s + b.loop_cpu_s,
    )


async def measure_pair(raw: Variant, coll: Variant) -> None:
    """One measurement of each, interleaved batch by batch (raw, coll, coll, raw, raw, coll, ...), so
    that both see the same machine even when its load changes within the measurement."""
    chunk = coll.granularity
    totals: dict[Variant, Sample | None] = {raw: None, coll: None}
    for j in range(raw.frames // chunk):
        for v in (raw, coll) if j % 2 == 0 else (coll, raw):
            totals[v] = add(totals[v], await v.run(chunk))
    for v, total in totals.items():
        assert total is not None
        v.samples.append(total)


async def measure(
    pairs: list[tuple[Variant, Variant]], rounds: int, target_s: float, log: Callable[[str], None]
) -> None:
    """``rounds`` measurements of each pair. One pair at a time: an open collector has tasks on the
    loop (its lag monitor), which would otherwise run during the other collectors' batches too."""
    for raw, coll in pairs:
        async with AsyncExitStack() as stack:
            await raw.open(stack)
            await coll.open(stack)
            await calibrate(raw, coll, target_s)
            for _ in range(rounds):
                await measure_pair(raw, coll)
        log(f"{coll.name}: {rounds} rounds of {coll.frames:,} frames each")


@dataclass
class Summary:
    name: str
    frames_per_measurement: int
    fps: float
    frames_per_cpu_s: float
    cpu_us_per_frame: float
    loop_cpu_us_per_frame: float
    samples: list[dict[str, float]] = field(default_factory=list)


def summarise(v: Variant) -> Summary:
    return Summary(
        name=v.name,
        frames_per_measurement=v.frames,
        fps=statistics.median(s.fps for s in v.samples),
        frames_per_cpu_s=statistics.median(s.frames_per_cpu_s for s in v.samples),
        cpu_us_per_frame=statistics.median(s.cpu_us_per_frame for s in v.samples),
        loop_cpu_us_per_frame=statistics.median(1e6 * s.loop_cpu_s / s.frames for s in v.samples),
        samples=[asdict(s) for s in v.samples],
    )


@dataclass
class Ratio:
    name: str
    baseline: str
    cpu: float  # median over rounds of (frames per CPU-s) / (baseline's)
    cpu_range: tuple[float, float]
    wall: float  # the same with frames/s
    wall_range: tuple[float, float]
    #: best (least CPU per frame) measurement over the baseline's best: the figure least disturbed by
    #: other processes, which only ever slow a measurement down
    best: float
    target: float

    @property
    def ok(self) -> bool:
        return self.cpu >= self.target


def ratio(v: Variant, base: Variant) -> Ratio:
    cpu = [a.frames_per_cpu_s / b.frames_per_cpu_s for a, b in zip(v.samples, base.samples, strict=True)]
    wall = [a.fps / b.fps for a, b in zip(v.samples, base.samples, strict=True)]
    return Ratio(
        name=v.name,
        baseline=base.name,
        cpu=statistics.median(cpu),
        cpu_range=(min(cpu), max(cpu)),
        wall=statistics.median(wall),
        wall_range=(min(wall), max(wall)),
        best=max(s.frames_per_cpu_s for s in v.samples) / max(s.frames_per_cpu_s for s in base.samples),
        target=TARGET,
    )


# -- event-loop lag --------------------------------------------------------------------------------
@dataclass
class Lag:
    name: str
    backend: str
    ticks: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    fps: float


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def measure_lag(
    env_id: str | None, num_envs: int | None, duration: float, backend: str, options: dict[str, Any]
) -> Lag:
    """How late a task asking to sleep 1 ms wakes up, while a Collector collects (``env_id=None``: on
    an idle loop)."""

    async def ticker(lags: list[float], until: float) -> None:
        while time.perf_counter() < until:
            t0 = time.perf_counter()
            await anyio.sleep(0.001)
            lags.append(time.perf_counter() - t0 - 0.001)

    async def main() -> Lag:
        lags: list[float] = []
        frames = 0
        t0 = time.perf_counter()
        if env_id is None:
            await ticker(lags, t0 + duration)
            name = "idle loop (no collector)"
        else:
            collector = Collector(
                lambda: GymEnv(env_id, num_envs=num_envs),
                make_policy(env_id),
                frames_per_batch=FRAMES_PER_BATCH[num_envs or 1],
                seed=0,
            )
            async with collector, anyio.create_task_group() as tg:
                await anext(aiter(collector))  # warm-up
                t0 = time.perf_counter()
                tg.start_soon(ticker, lags, t0 + duration)
                async for batch in collector:
                    frames += batch.numel()
                    if time.perf_counter() > t0 + duration:
                        break
            name = f"collector/{env_id}" + (f" x{num_envs}" if num_envs else "")
        ms = [1e3 * lag for lag in lags]
        return Lag(
            name=name,
            backend=backend,
            ticks=len(ms),
            p50_ms=percentile(ms, 50),
            p99_ms=percentile(ms, 99),
            max_ms=max(ms, default=float("nan")),
            fps=frames / (time.perf_counter() - t0),
        )

    return anyio.run(main, backend="asyncio", backend_options=options)


def lag_backends() -> list[tuple[str, dict[str, Any]]]:
    backends: list[tuple[str, dict[str, Any]]] = [("asyncio", {})]
    try:
        import uvloop  # noqa: F401
    except ImportError:
        pass
    else:
        backends.append(("asyncio+uvloop", {"use_uvloop": True}))
    return backends


# -- reporting -------------------------------------------------------------------------------------
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
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
    }


def versions() -> dict[str, str]:
    out = {}
    for dist in ("aiocollect", "torch", "tensordict", "gymnasium", "numpy", "anyio", "uvloop"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "-"
    return out


def render(summaries: list[Summary], ratios: list[Ratio], lags: list[Lag], info: dict[str, Any]) -> str:
    lines = ["## Collector / raw loop (median of per-round ratios, [min, max] over rounds)", ""]
    lines += [
        "| variant | baseline | frames per CPU-s | frames/s | best / best (CPU) | target (CPU) |",
        "|---|---|---|---|---|---|",
    ]
    for r in ratios:
        mark = "ok" if r.ok else "MISSED"
        lines.append(
            f"| {r.name} | {r.baseline} | **{r.cpu:.3f}** [{r.cpu_range[0]:.2f}, {r.cpu_range[1]:.2f}] "
            f"| {r.wall:.2f} [{r.wall_range[0]:.2f}, {r.wall_range[1]:.2f}] | {r.best:.2f} "
            f"| >= {r.target:.2f} {mark} |"
        )
    lines += ["", "## Absolute numbers (medians over rounds)", ""]
    lines += [
        "| variant | frames/s | frames per CPU-s | CPU-us / frame | of which event-loop thread "
        "| frames / measurement |",
        "|---|---|---|---|---|---|",
    ]
    for s in summaries:
        loop = f"{s.loop_cpu_us_per_frame:.2f}" if s.name.startswith("collector") else "(all)"
        lines.append(
            f"| {s.name} | {s.fps:,.0f} | {s.frames_per_cpu_s:,.0f} | {s.cpu_us_per_frame:.1f} "
            f"| {loop} | {s.frames_per_measurement:,} |"
        )
    if lags:
        lines += ["", "## Event-loop lag (a task sleeping 1 ms in a loop)", ""]
        lines += [
            "| while | backend | ticks | p50 lag (ms) | p99 lag (ms) | max (ms) | frames/s |",
            "|---|---|---|---|---|---|---|",
        ]
        for g in lags:
            lines.append(
                f"| {g.name} | {g.backend} | {g.ticks} | {g.p50_ms:.2f} | {g.p99_ms:.2f} "
                f"| {g.max_ms:.2f} | {g.fps:,.0f} |"
            )
    m, ver = info["machine"], info["versions"]
    lines += [
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), {m['platform']}, "
        f"Python {m['python']}, torch threads {m['torch_threads']}.",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in ver.items()) + ".",
        f"Run: `{info['command']}`: {info['rounds']} rounds, ~{info['target_s']} s per measurement, "
        f"{info['elapsed_s']:.0f} s in all; 1-min load average {info['load'][0]:.1f} before, "
        f"{info['load'][1]:.1f} after (other processes share these cores).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run (~30 s)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--rounds", type=int, help="rounds of interleaved measurements")
    parser.add_argument("--seconds", type=float, help="target duration of one measurement")
    parser.add_argument("--no-lag", action="store_true", help="skip the event-loop lag measurement")
    parser.add_argument("--check", action="store_true", help="exit 1 when a ratio misses its target")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 15)
    target_s = args.seconds or (0.3 if args.quick else 0.5)
    lag_s = 0.5 if args.quick else 2.0

    torch.set_num_threads(1)
    start = time.perf_counter()
    load_before = os.getloadavg()[0]

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {msg}", file=sys.stderr, flush=True)

    pairs: list[tuple[Variant, Variant]] = []
    for env_id in ENVS:
        pairs.append((RawLoop(env_id), CollectorLoop(env_id, 1)))
        pairs.append((RawVectorLoop(env_id), CollectorLoop(env_id, NUM_ENVS)))
    anyio.run(measure, pairs, rounds, target_s, log)
    summaries = [summarise(v) for pair in pairs for v in pair]
    ratios = [ratio(coll, raw) for raw, coll in pairs]

    lags: list[Lag] = []
    if not args.no_lag:
        log("event-loop lag")
        for backend, options in lag_backends():
            lags.append(measure_lag(None, None, lag_s / 2, backend, options))
            for env_id in ENVS:
                for num_envs in (None, NUM_ENVS):
                    lags.append(measure_lag(env_id, num_envs, lag_s, backend, options))

    command = ["python", "benchmarks/run.py", *(sys.argv[1:] if argv is None else argv)]
    info = {
        "command": " ".join(command),
        "rounds": rounds,
        "target_s": target_s,
        "elapsed_s": time.perf_counter() - start,
        "load": (load_before, os.getloadavg()[0]),
        "machine": machine(),
        "versions": versions(),
    }
    print(render(summaries, ratios, lags, info))
    if args.json:
        payload = {
            **info,
            "ratios": [{**asdict(r), "ok": r.ok} for r in ratios],
            "variants": [asdict(s) for s in summaries],
            "lag": [asdict(g) for g in lags],
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        log(f"wrote {args.json}")
    return 1 if args.check and not all(r.ok for r in ratios) else 0


if __name__ == "__main__":
    sys.exit(main())
