"""Benchmark: aiocollect against torchrl's collectors on the same work, measured in one run, interleaved.

Run in the torchrl virtualenv: ``nox -s bench_torchrl`` or
``.venv-torchrl/bin/python benchmarks/vs_torchrl.py [--quick] [--json PATH]``.

The work: CartPole-v1 and Pendulum-v1; 1 env or 32 envs per collector (a gymnasium ``SyncVectorEnv``);
in process, 2 worker processes synchronous, 2 worker processes asynchronous. Both libraries run the same
policy object, a ``TensorDictModule`` around an MLP (obs -> 64 -> 64 -> actions, tanh; argmax for
CartPole, ``2 * tanh`` for Pendulum), with ``torch.set_num_threads(1)`` here (torchrl's and our workers
use one thread each by default). The envs are each library's own gymnasium adapter:

* aiocollect: ``aiocollect.GymEnv(id[, num_envs=32])`` (same-step autoreset);
* torchrl: ``torchrl.envs.GymEnv(id, categorical_action_encoding=True)`` for one env, and
  ``GymWrapper(gymnasium.make_vec(id, 32, "sync", autoreset_mode=DISABLED))`` for 32 (torchrl's preferred
  mode; its ``GymEnv(id, num_envs=32)`` would start 32 processes);
* the in-process rows also run aiocollect on torchrl's env (``aiocollect + torchrl env``: the interop
  adapter) and a raw gymnasium loop with the same policy (``raw``: the limit for one core).

Measured, per configuration: every collector is built once and warmed up with one batch, then the variants
are measured in ``--rounds`` interleaved rounds (order reversed every other round), each for at least
``--seconds`` of whole batches; tables give medians, and ratios are medians of per-round ratios, so that
each compares numbers taken seconds apart (this shared machine's speed drifts). CPU time is that of the
whole process tree (workers included). Then:

* event-loop lag while collecting (CartPole): a task asks to sleep 1 ms in a loop; aiocollect's
  ``async for`` against torchrl's collector iterated inside the coroutine (what a torchrl loop in an async
  app does: it blocks the loop for a whole batch) and torchrl moved to a thread (``to_thread``);
* weight-update latency for a ~1M-parameter policy (obs -> 1000 -> 1000 -> actions, CartPole, 32 envs),
  between batches, against each library's update call;
* peak memory of the process tree (RSS summed over processes, and PSS, which counts shared pages once),
  each library in a fresh subprocess (CartPole, 32 envs, every mode), sampled every 50 ms while collecting.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import gymnasium as gym
import numpy as np
import psutil
import torch
from gymnasium.vector import AutoresetMode
from tensordict.nn import TensorDictModule
from torch import nn

ENVS = ("CartPole-v1", "Pendulum-v1")
NUM_ENVS = (1, 32)
MODES = ("in-process", "sync x2", "async x2")
#: frames per batch (MultiSync: the total of both workers; MultiAsync: one worker's batch)
FRAMES_PER_BATCH = {1: 256, 32: 2048}
OBS_ACT = {"CartPole-v1": (4, 2, True), "Pendulum-v1": (3, 1, False)}  # obs dim, outputs, discrete
BIG_HIDDEN = 1000
ME = psutil.Process()


# -- the policy ------------------------------------------------------------------------------------
class MLP(nn.Module):
    """obs -> hidden -> hidden -> outputs (tanh); argmax for a discrete action, ``2 * tanh`` for Box."""

    def __init__(self, env_id: str, hidden: int = 64) -> None:
        super().__init__()
        obs_dim, n_out, self.discrete = OBS_ACT[env_id]
        self.net = nn.Sequential(
            nn.Linear(obs_dim, hidden),
            nn.Tanh(),
            nn.Linear(hidden, hidden),
            nn.Tanh(),
            nn.Linear(hidden, n_out),
        )

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        out = self.net(observation)
        return out.argmax(-1) if self.discrete else 2.0 * torch.tanh(out)


def make_policy(env_id: str, hidden: int = 64) -> TensorDictModule:
    torch.manual_seed(0)
    return TensorDictModule(MLP(env_id, hidden), in_keys=["observation"], out_keys=["action"]).eval()


# -- env factories (module level: the worker processes unpickle them) ------------------------------
def ours_env(env_id: str, num_envs: int) -> Any:
    from aiocollect import GymEnv

    return GymEnv(env_id, num_envs=None if num_envs == 1 else num_envs)


def torchrl_env(env_id: str, num_envs: int) -> Any:
    from torchrl.envs import GymEnv, GymWrapper

    if num_envs == 1:
        return GymEnv(env_id, categorical_action_encoding=True)
    vec = gym.make_vec(
        env_id,
        num_envs=num_envs,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": AutoresetMode.DISABLED},
    )
    return GymWrapper(vec, categorical_action_encoding=True)


# -- the process tree: CPU and memory --------------------------------------------------------------
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


def cpu_since(start: dict[int, float]) -> float:
    return sum(v - start.get(pid, 0.0) for pid, v in tree_cpu().items())


def tree_memory() -> tuple[float, float]:
    """(sum of RSS, sum of PSS) of the process tree, in MB."""
    rss = pss = 0
    for p in tree():
        try:
            info = p.memory_full_info()
        except psutil.Error:
            continue
        rss += info.rss
        pss += getattr(info, "pss", info.rss)
    return rss / 2**20, pss / 2**20


@dataclass
class Sample:
    frames: int
    wall_s: float
    cpu_s: float

    @property
    def fps(self) -> float:
        return self.frames / self.wall_s

    @property
    def cpu_us_per_frame(self) -> float:
        return 1e6 * self.cpu_s / self.frames


# -- the variants ----------------------------------------------------------------------------------
class Variant:
    """One way of collecting; ``await run(seconds)`` collects whole batches for at least ``seconds``."""

    lib = ""

    def __init__(self, label: str) -> None:
        self.label = label
        self.samples: list[Sample] = []
        self.startup_s = math.nan
        self.shutdown_s = math.nan

    async def open(self, stack: AsyncExitStack) -> None: ...

    async def batch(self) -> int:
        """Collect one batch; returns its frames."""
        raise NotImplementedError

    async def run(self, seconds: float) -> Sample:
        frames = 0
        cpu0, t0 = tree_cpu(), time.perf_counter()
        while True:
            frames += await self.batch()
            if time.perf_counter() - t0 >= seconds:
                break
        wall = time.perf_counter() - t0
        return Sample(frames, wall, cpu_since(cpu0))


class Raw(Variant):
    """gymnasium stepped in a plain loop with the same policy: ``make`` (1 env) or ``make_vec(sync)``."""

    lib = "raw"

    def __init__(self, env_id: str, num_envs: int, policy: TensorDictModule) -> None:
        super().__init__("raw gymnasium")
        self.env_id, self.num_envs, self.module = env_id, num_envs, policy.module
        self.steps = 256 if num_envs == 1 else 16

    async def open(self, stack: AsyncExitStack) -> None:
        if self.num_envs == 1:
            self.env = gym.make(self.env_id)
        else:
            self.env = gym.make_vec(
                self.env_id,
                num_envs=self.num_envs,
                vectorization_mode="sync",
                vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP},
            )
        stack.callback(self.env.close)
        self.obs, _ = self.env.reset(seed=0)
        self.startup_s = 0.0

    async def batch(self) -> int:
        env, module, obs = self.env, self.module, self.obs
        single = self.num_envs == 1
        with torch.no_grad():
            for _ in range(self.steps):
                action = module(torch.from_numpy(obs)).numpy()
                obs, _r, terminated, truncated, _i = env.step(
                    int(action) if module.discrete and single else action
                )
                if single and (terminated or truncated):
                    obs, _ = env.reset()
        self.obs = obs
        return self.steps * self.num_envs


class Ours(Variant):
    lib = "aiocollect"

    def __init__(self, label: str, make: Callable[[], Any]) -> None:
        super().__init__(label)
        self.make = make

    async def open(self, stack: AsyncExitStack) -> None:
        t0 = time.perf_counter()
        collector = self.make()
        await stack.enter_async_context(_Timed(collector, self))
        self.collector = collector
        self.it = aiter(collector)
        await self.batch()  # warm-up
        self.startup_s = time.perf_counter() - t0

    async def batch(self) -> int:
        return int((await anext(self.it)).numel())


class _Timed:
    """``async with`` a collector, recording how long leaving it takes."""

    def __init__(self, collector: Any, variant: Variant) -> None:
        self.collector, self.variant = collector, variant

    async def __aenter__(self) -> Any:
        return await self.collector.__aenter__()

    async def __aexit__(self, *exc: Any) -> None:
        t0 = time.perf_counter()
        await self.collector.__aexit__(*exc)
        self.variant.shutdown_s = time.perf_counter() - t0


class TorchRL(Variant):
    """torchrl's collector iterated synchronously (as torchrl is used); ``in_thread``: in a worker thread."""

    lib = "torchrl"

    def __init__(self, label: str, make: Callable[[], Any]) -> None:
        super().__init__(label)
        self.make = make
        self.in_thread = False

    async def open(self, stack: AsyncExitStack) -> None:
        t0 = time.perf_counter()
        self.collector = self.make()
        stack.callback(self._shutdown)
        self.it = iter(self.collector)
        await self.batch()  # warm-up
        self.startup_s = time.perf_counter() - t0

    def _shutdown(self) -> None:
        t0 = time.perf_counter()
        self.collector.shutdown()
        self.shutdown_s = time.perf_counter() - t0

    async def batch(self) -> int:
        if self.in_thread:
            return int((await anyio.to_thread.run_sync(next, self.it)).numel())
        return int(next(self.it).numel())


def build(env_id: str, num_envs: int, mode: str, policy: TensorDictModule) -> list[Variant]:
    from torchrl import collectors as trc

    import aiocollect

    fpb = FRAMES_PER_BATCH[num_envs]
    ours_fn = functools.partial(ours_env, env_id, num_envs)
    trl_fn = functools.partial(torchrl_env, env_id, num_envs)
    trl_kw = {"frames_per_batch": fpb, "total_frames": -1, "auto_register_policy_transforms": False}
    if mode == "in-process":
        return [
            Raw(env_id, num_envs, policy),
            Ours("aiocollect", lambda: aiocollect.Collector(ours_fn, policy, frames_per_batch=fpb, seed=0)),
            Ours(
                "aiocollect + torchrl env",
                lambda: aiocollect.Collector(trl_fn, policy, frames_per_batch=fpb, seed=0),
            ),
            TorchRL("torchrl", lambda: trc.Collector(trl_fn, policy, **trl_kw)),
        ]
    ours_cls, trl_cls = (
        (aiocollect.MultiSyncCollector, trc.MultiSyncCollector)
        if mode.startswith("sync")
        else (aiocollect.MultiAsyncCollector, trc.MultiAsyncCollector)
    )
    return [
        Ours("aiocollect", lambda: ours_cls([ours_fn] * 2, policy, frames_per_batch=fpb, seed=0)),
        TorchRL("torchrl", lambda: trl_cls([trl_fn] * 2, policy, **trl_kw)),
    ]


# -- event-loop lag --------------------------------------------------------------------------------
@dataclass
class Lag:
    config: str
    variant: str
    ticks: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    fps: float


async def measure_lag(config: str, variant: Variant, label: str, seconds: float) -> Lag:
    lags: list[float] = []
    frames = 0
    t0 = time.perf_counter()

    async def ticker() -> None:
        while True:
            t = time.perf_counter()
            await anyio.sleep(0.001)
            lags.append(1e3 * (time.perf_counter() - t - 0.001))

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(0.01)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            frames += await variant.batch()
            # a torchrl loop in a coroutine would at least yield between batches
            await anyio.lowlevel.checkpoint()
        tg.cancel_scope.cancel()
    a = np.asarray(lags) if lags else np.asarray([math.nan])
    return Lag(
        config,
        label,
        len(lags),
        float(np.percentile(a, 50)),
        float(np.percentile(a, 99)),
        float(a.max()),
        frames / (time.perf_counter() - t0),
    )


# -- weight updates --------------------------------------------------------------------------------
@dataclass
class WeightResult:
    mode: str
    variant: str
    params: int
    median_ms: float
    min_ms: float
    max_ms: float


async def measure_weights(mode: str, reps: int, log: Callable[[str], None]) -> list[WeightResult]:
    """Latency of each library's update call for a ~1M-parameter policy, between batches."""
    from torchrl import collectors as trc

    import aiocollect

    env_id, num_envs = "CartPole-v1", 32
    policy = make_policy(env_id, BIG_HIDDEN)
    params = sum(p.numel() for p in policy.parameters())
    fpb = 1024
    ours_fn = functools.partial(ours_env, env_id, num_envs)
    trl_fn = functools.partial(torchrl_env, env_id, num_envs)
    trl_kw = {"frames_per_batch": fpb, "total_frames": -1, "auto_register_policy_transforms": False}

    def nudge() -> None:  # an optimizer step's worth of change, so that every update carries new values
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(1e-6)

    out = []
    if mode == "in-process":
        ours = aiocollect.Collector(ours_fn, policy, frames_per_batch=fpb, seed=0)
        trl = trc.Collector(trl_fn, policy, **trl_kw)
        variants = {"aiocollect update_weights()": {}}
    else:
        cls = aiocollect.MultiSyncCollector if mode.startswith("sync") else aiocollect.MultiAsyncCollector
        tcls = trc.MultiSyncCollector if mode.startswith("sync") else trc.MultiAsyncCollector
        ours = cls([ours_fn] * 2, policy, frames_per_batch=fpb, seed=0)
        trl = tcls([trl_fn] * 2, policy, **trl_kw)
        variants = {
            "aiocollect update_weights() (published)": {"wait": False},
            "aiocollect update_weights(wait=True) (loaded by every worker)": {"wait": True},
        }
    times: dict[str, list[float]] = {name: [] for name in [*variants, "torchrl update_policy_weights_()"]}
    try:
        async with ours:
            it = aiter(ours)
            await anext(it)
            titer = iter(trl)
            next(titer)
            for _ in range(reps):
                for name, kw in variants.items():
                    await anext(it)
                    nudge()
                    t0 = time.perf_counter()
                    await ours.update_weights(**kw)
                    times[name].append(1e3 * (time.perf_counter() - t0))
                next(titer)
                nudge()
                t0 = time.perf_counter()
                trl.update_policy_weights_()
                times["torchrl update_policy_weights_()"].append(1e3 * (time.perf_counter() - t0))
    finally:
        trl.shutdown()
    for name, ms in times.items():
        out.append(WeightResult(mode, name, params, statistics.median(ms), min(ms), max(ms)))
    log(f"  weights {mode}: " + ", ".join(f"{r.variant.split(' ')[0]} {r.median_ms:.2f} ms" for r in out))
    return out


# -- memory, each library in its own process -------------------------------------------------------
def probe_memory(lib: str, mode: str, seconds: float) -> dict[str, float]:
    """Run in a fresh process: collect CartPole x32 for ``seconds``, sampling the tree's memory."""
    torch.set_num_threads(1)
    env_id, num_envs = "CartPole-v1", 32
    policy = make_policy(env_id)
    fpb = FRAMES_PER_BATCH[num_envs]
    peak = [0.0, 0.0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            rss, pss = tree_memory()
            peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)
            stop.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    if lib == "torchrl":
        from torchrl import collectors as trc

        cls = {
            "in-process": trc.Collector,
            "sync x2": trc.MultiSyncCollector,
            "async x2": trc.MultiAsyncCollector,
        }
        fn = functools.partial(torchrl_env, env_id, num_envs)
        arg = fn if mode == "in-process" else [fn] * 2
        collector = cls[mode](
            arg, policy, frames_per_batch=fpb, total_frames=-1, auto_register_policy_transforms=False
        )
        sampler.start()
        t0 = time.perf_counter()
        for _ in collector:
            if time.perf_counter() - t0 > seconds:
                break
        collector.shutdown()
    else:
        import aiocollect

        fn = functools.partial(ours_env, env_id, num_envs)

        async def main() -> None:
            if mode == "in-process":
                collector = aiocollect.Collector(fn, policy, frames_per_batch=fpb)
            elif mode.startswith("sync"):
                collector = aiocollect.MultiSyncCollector([fn] * 2, policy, frames_per_batch=fpb)
            else:
                collector = aiocollect.MultiAsyncCollector([fn] * 2, policy, frames_per_batch=fpb)
            async with collector:
                sampler.start()
                t0 = time.perf_counter()
                async for _ in collector:
                    if time.perf_counter() - t0 > seconds:
                        break

        anyio.run(main)
    stop.set()
    sampler.join()
    return {"rss_mb": peak[0], "pss_mb": peak[1], "torchrl_imported": float("torchrl" in sys.modules)}


def memory_in_subprocess(lib: str, mode: str, seconds: float) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--probe-memory", lib, mode, "--seconds", str(seconds)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=180)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


# -- the run ---------------------------------------------------------------------------------------
@dataclass
class ConfigResult:
    env_id: str
    num_envs: int
    mode: str
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    ratios: dict[str, dict[str, Any]] = field(default_factory=dict)


def per_round_ratio(a: Variant, b: Variant, attr: str) -> tuple[float, float, float]:
    values = [getattr(x, attr) / getattr(y, attr) for x, y in zip(a.samples, b.samples, strict=True)]
    return statistics.median(values), min(values), max(values)


async def run_config(
    env_id: str,
    num_envs: int,
    mode: str,
    rounds: int,
    seconds: float,
    lag_s: float,
    log: Callable[[str], None],
) -> tuple[ConfigResult, list[Lag]]:
    policy = make_policy(env_id)
    variants = build(env_id, num_envs, mode, policy)
    lags: list[Lag] = []
    name = f"{env_id} x{num_envs} {mode}"
    async with AsyncExitStack() as stack:
        for v in variants:
            await v.open(stack)
        for r in range(rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for v in order if r % 2 == 0 else reversed(order):
                v.samples.append(await v.run(seconds))
        if lag_s > 0:
            for v in variants:
                if isinstance(v, Ours):
                    if v.label == "aiocollect":
                        lags.append(await measure_lag(name, v, "aiocollect: async for", lag_s))
                elif isinstance(v, TorchRL):
                    lags.append(await measure_lag(name, v, "torchrl: iterated in the coroutine", lag_s))
                    v.in_thread = True
                    lags.append(await measure_lag(name, v, "torchrl: next() in to_thread", lag_s))
    result = ConfigResult(env_id, num_envs, mode)
    for v in variants:
        result.variants[v.label] = {
            "fps": statistics.median(s.fps for s in v.samples),
            "cpu_us_per_frame": statistics.median(s.cpu_us_per_frame for s in v.samples),
            "startup_s": v.startup_s,
            "shutdown_s": v.shutdown_s,
            "samples": [asdict(s) for s in v.samples],
        }
    by = {v.label: v for v in variants}
    for label in ("aiocollect", "aiocollect + torchrl env"):
        if label in by:
            fps = per_round_ratio(by[label], by["torchrl"], "fps")
            cpu = per_round_ratio(by[label], by["torchrl"], "cpu_us_per_frame")
            result.ratios[label] = {"fps": fps, "cpu_us_per_frame": cpu}
    if "raw gymnasium" in by:
        for label in ("aiocollect", "torchrl"):
            result.ratios[f"{label} / raw"] = {"fps": per_round_ratio(by[label], by["raw gymnasium"], "fps")}
    ours = result.variants["aiocollect"]
    theirs = result.variants["torchrl"]
    log(
        f"  {name}: aiocollect {ours['fps']:,.0f} f/s, torchrl {theirs['fps']:,.0f} f/s, "
        f"ratio {result.ratios['aiocollect']['fps'][0]:.2f}"
    )
    return result, lags


def configs(quick: bool) -> list[tuple[str, int, str]]:
    if quick:  # a smoke run: the two most used collectors
        return [("CartPole-v1", 32, mode) for mode in MODES[:2]]
    return [(env_id, n, mode) for env_id in ENVS for n in NUM_ENVS for mode in MODES]


async def run(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    results: list[ConfigResult] = []
    lags: list[Lag] = []
    for env_id, n, mode in configs(args.quick):
        log(f"{env_id} x{n} {mode}")
        lag_s = (
            args.lag_seconds if env_id == "CartPole-v1" and (not args.quick or mode == "in-process") else 0
        )
        result, config_lags = await run_config(env_id, n, mode, args.rounds, args.seconds, lag_s, log)
        results.append(result)
        lags.extend(config_lags)
    weights: list[WeightResult] = []
    for mode in MODES[:1] if args.quick else MODES:
        log(f"weight updates, {mode}")
        weights.extend(await measure_weights(mode, args.weight_reps, log))
    memory: list[dict[str, Any]] = []
    if not args.quick:
        for mode in MODES:
            for lib in ("aiocollect", "torchrl"):
                log(f"memory: {lib} {mode} (own process)")
                memory.append(
                    {"lib": lib, "mode": mode, **memory_in_subprocess(lib, mode, args.memory_seconds)}
                )
    return {
        "configs": [asdict(r) for r in results],
        "lag": [asdict(g) for g in lags],
        "weights": [asdict(w) for w in weights],
        "memory": memory,
    }


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
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def versions() -> dict[str, str]:
    out = {}
    for dist in ("aiocollect", "torchrl", "torch", "tensordict", "gymnasium", "numpy", "anyio"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "-"
    return out


def fmt_ratio(r: tuple[float, float, float]) -> str:
    return f"**{r[0]:.2f}** [{r[1]:.2f}, {r[2]:.2f}]"


def render(res: dict[str, Any], info: dict[str, Any]) -> str:
    lines = [
        "## Throughput: aiocollect ÷ torchrl (median of per-round ratios, [min, max] over rounds)",
        "",
        "frames/s: higher is better for aiocollect; CPU-µs per frame (whole process tree): lower is better.",
        "",
        "| env | envs | mode | frames/s ratio | CPU-µs/frame ratio | aiocollect frames/s | torchrl frames/s "
        "| aiocollect CPU-µs/f | torchrl CPU-µs/f | raw gymnasium frames/s (limit) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in res["configs"]:
        ours, theirs = c["variants"]["aiocollect"], c["variants"]["torchrl"]
        raw = c["variants"].get("raw gymnasium")
        raw_fps = f"{raw['fps']:,.0f}" if raw else "-"
        ratio = c["ratios"]["aiocollect"]
        lines.append(
            f"| {c['env_id']} | {c['num_envs']} | {c['mode']} | {fmt_ratio(ratio['fps'])} "
            f"| {fmt_ratio(ratio['cpu_us_per_frame'])} | {ours['fps']:,.0f} | {theirs['fps']:,.0f} "
            f"| {ours['cpu_us_per_frame']:.1f} | {theirs['cpu_us_per_frame']:.1f} "
            f"| {raw_fps} |"
        )
    inproc = [c for c in res["configs"] if c["mode"] == "in-process"]
    if inproc:
        lines += [
            "",
            "## In process: against the raw gymnasium loop, and aiocollect on torchrl's env",
            "",
            "| env | envs | aiocollect ÷ raw | torchrl ÷ raw | aiocollect + torchrl env ÷ torchrl (frames/s) "
            "| aiocollect + torchrl env frames/s |",
            "|---|---|---|---|---|---|",
        ]
        for c in inproc:
            r = c["ratios"]
            interop = fmt_ratio(r["aiocollect + torchrl env"]["fps"])
            lines.append(
                f"| {c['env_id']} | {c['num_envs']} | {fmt_ratio(r['aiocollect / raw']['fps'])} "
                f"| {fmt_ratio(r['torchrl / raw']['fps'])} | {interop} "
                f"| {c['variants']['aiocollect + torchrl env']['fps']:,.0f} |"
            )
    lines += [
        "",
        "## Start-up and shutdown (s; start-up includes the first batch)",
        "",
        "| env | envs | mode | aiocollect start | torchrl start | aiocollect shutdown | torchrl shutdown |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in res["configs"]:
        o, t = c["variants"]["aiocollect"], c["variants"]["torchrl"]
        lines.append(
            f"| {c['env_id']} | {c['num_envs']} | {c['mode']} | {o['startup_s']:.2f} | {t['startup_s']:.2f} "
            f"| {o['shutdown_s']:.2f} | {t['shutdown_s']:.2f} |"
        )
    if res["lag"]:
        lines += [
            "",
            "## Event-loop lag while collecting (a task sleeping 1 ms in a loop; lateness in ms)",
            "",
            "| configuration | collector | ticks | p50 | p99 | max | frames/s |",
            "|---|---|---|---|---|---|---|",
        ]
        for g in res["lag"]:
            lines.append(
                f"| {g['config']} | {g['variant']} | {g['ticks']} | {g['p50_ms']:.2f} | {g['p99_ms']:.2f} "
                f"| {g['max_ms']:.1f} | {g['fps']:,.0f} |"
            )
    if res["weights"]:
        params = res["weights"][0]["params"]
        lines += [
            "",
            f"## Weight-update latency ({params / 1e6:.2f}M parameters, CartPole x32, between batches; ms)",
            "",
            "| mode | call | median | min | max |",
            "|---|---|---|---|---|",
        ]
        for w in res["weights"]:
            lines.append(
                f"| {w['mode']} | {w['variant']} | {w['median_ms']:.2f} | {w['min_ms']:.2f} "
                f"| {w['max_ms']:.2f} |"
            )
    if res["memory"]:
        lines += [
            "",
            "## Peak memory of the process tree (CartPole x32; each library in a fresh process; MB)",
            "",
            "| mode | aiocollect RSS | torchrl RSS | RSS ratio | aiocollect PSS | torchrl PSS | PSS ratio |",
            "|---|---|---|---|---|---|---|",
        ]
        mem = {(m["lib"], m["mode"]): m for m in res["memory"]}
        for mode in MODES:
            o, t = mem.get(("aiocollect", mode)), mem.get(("torchrl", mode))
            if o and t:
                lines.append(
                    f"| {mode} | {o['rss_mb']:,.0f} | {t['rss_mb']:,.0f} "
                    f"| **{o['rss_mb'] / t['rss_mb']:.2f}** "
                    f"| {o['pss_mb']:,.0f} | {t['pss_mb']:,.0f} | **{o['pss_mb'] / t['pss_mb']:.2f}** |"
                )
    m, ver = info["machine"], info["versions"]
    lines += [
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB, {m['platform']}, "
        f"Python {m['python']}; "
        f"load average {info['load_before']:.1f} before, {info['load_after']:.1f} after.",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in ver.items()) + ".",
        f"Run: `{info['command']}`: {info['rounds']} rounds of >= {info['seconds']} s per variant, "
        f"{info['elapsed_s']:.0f} s in all.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="CartPole x32 in process and sync only, no memory probes (< 1 min)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--rounds", type=int, help="interleaved rounds per configuration")
    parser.add_argument("--seconds", type=float, help="least duration of one measurement")
    parser.add_argument("--probe-memory", nargs=2, metavar=("LIB", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        import torchrl  # noqa: F401
    except ImportError:
        parser.error("torchrl is not installed here: run `nox -s bench_torchrl` (or use .venv-torchrl)")
    torch.set_num_threads(1)
    if args.probe_memory:
        print(json.dumps(probe_memory(*args.probe_memory, args.seconds or 3.0)))
        return 0
    args.rounds = args.rounds or (2 if args.quick else 4)
    args.seconds = args.seconds or (0.3 if args.quick else 0.5)
    args.lag_seconds = 0.6 if args.quick else 1.5
    args.weight_reps = 3 if args.quick else 6
    args.memory_seconds = 2.0
    start = time.perf_counter()
    load_before = os.getloadavg()[0]

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {msg}", file=sys.stderr, flush=True)

    results = anyio.run(run, args, log)
    command = ["python", "benchmarks/vs_torchrl.py", *(sys.argv[1:] if argv is None else argv)]
    info = {
        "command": " ".join(command),
        "rounds": args.rounds,
        "seconds": args.seconds,
        "elapsed_s": time.perf_counter() - start,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "machine": machine(),
        "versions": versions(),
    }
    print(render(results, info))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**info, **results}, f, indent=2)
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
