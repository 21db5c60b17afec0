"""Central batched inference over I/O-bound envs (issue 16): ``AsyncEnvCollector`` on one event loop
against a pool of threads stepping the same envs.

    python benchmarks/async_envs.py                  # 1,000 envs, 3 interleaved rounds
    python benchmarks/async_envs.py --quick          # smoke run
    python benchmarks/async_envs.py --profile        # cProfile of one asyncio run (the hot path)
    python benchmarks/async_envs.py --processes 0    # without MultiAsyncEnvCollector (default: 2)
    python benchmarks/async_envs.py --components     # the CPU cost of a step, piece by piece
    python benchmarks/async_envs.py --vector 16      # + the same envs as 16 async vector envs

Each env is a CartPole (gymnasium's ``CartPoleEnv``) whose step also waits 5 ms: ``await anyio.sleep``
for the async envs (1,000 of them on one loop: the limit is 1,000 / 5 ms = 200k steps/s), a blocking
``time.sleep`` in the thread baseline (``--threads`` threads, each stepping its share of the envs one
after another, its share's actions from one batched policy call). Every variant runs the same MLP
policy (4 -> 64 -> 64 -> 2, tanh, argmax) and stores full batches (``--frames-per-batch`` frames) in
preallocated tensors. Rounds interleave the variants; the table prints each variant's median frames/s
and its ratio to the thread pool measured in the same round, and the CPU time per frame of the whole
process (all its threads): on a loaded machine the loop gets a fraction of a core, so frames/s falls
while the CPU time per frame says what one free core would give (about 1e6 / µs frames/s for the
loop-bound async variants; the thread pool is bound by its sleeps, 64 / 5 ms = 12.8k). Also printed:
the event loop's lag (a task that sleeps 1 ms and records how late it wakes) while the 1,000 envs run,
and the distribution of the policy's batch sizes. ``MultiAsyncEnvCollector`` splits the same envs over
``--processes`` worker processes (uvloop in each), batches of ``frames_per_batch / processes`` frames per
worker; its ratio is to the one-loop uvloop variant of the same round. Each measurement runs in a fresh
(spawned) interpreter, so every variant starts from the same heap, as a user's script does. The one-loop
variants run with the collector's default ``freeze_gc=True`` (it freezes the heap once its envs are
built) and with ``freeze_gc=False`` (the garbage collector as it was; see docs/async-envs.md,
"Performance").

``--components`` measures what one step costs in CPU µs, piece by piece, on asyncio and uvloop (rounds
interleaved, medians; ``gc.freeze()`` on, so the garbage collector's share is its own line): the CartPole
physics alone; 1,000 tasks each looping on ``await anyio.sleep(5 ms)`` (a timer and a task wake-up);
the same with a wait for a wake-up before each sleep (a future per wait, woken 64 per loop iteration by
a dispatcher task every millisecond, as the collector hands out actions); the 1,000 ``SlowCartPole`` envs
stepped by 1,000 bare tasks (nothing stored, no policy); ``AsyncEnvCollector`` over ``NullEnv`` (the same
5 ms sleep, a constant observation: the collector's own cost is this minus the sleeping tasks'); the
benchmark's collector; and the same with ``freeze_gc=False`` (the difference is the garbage collector's).

``--vector V`` adds variants with the same 1,000 CartPoles as ``V`` async vector envs
(``SlowCartPoleVector``: ``1000 / V`` CartPoles whose step awaits **one** 5 ms sleep, then steps each
CartPole, the same physics as the per-env variants): ``AsyncEnvCollector`` runs one task per vector env,
one wait for its actions and one frame block per step. Their ratio is to the thread pool of the same
round, as the others'; the per-env variant of the same loop and ``freeze_gc`` is the one to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing
import statistics
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import sniffio
import torch
from gymnasium.envs.classic_control import CartPoleEnv
from torch import nn

from aiocollect import AsyncEnvCollector, MultiAsyncEnvCollector

STEP_DELAY = 0.005


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).argmax(-1)


class SlowCartPole:
    """An I/O-bound async env: a CartPole step plus a 5 ms wait (a network round trip)."""

    def __init__(self) -> None:
        self.env = CartPoleEnv()
        self.observation_space = self.env.observation_space
        self.action_space = self.env.action_space

    async def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        return self.env.reset(seed=seed)

    async def step(self, action: int) -> Any:
        await anyio.sleep(STEP_DELAY)
        return self.env.step(action)

    async def close(self) -> None:
        self.env.close()


class NullEnv:
    """``SlowCartPole``'s 5 ms wait without the physics: a constant observation, an episode every 200
    steps."""

    observation_space = CartPoleEnv().observation_space
    action_space = CartPoleEnv().action_space

    def __init__(self) -> None:
        self.t = 0
        self.obs = np.zeros(4, np.float32)

    async def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        return self.obs, {}

    async def step(self, action: int) -> Any:
        await anyio.sleep(STEP_DELAY)
        self.t += 1
        return self.obs, 1.0, False, self.t % 200 == 0, {}

    async def close(self) -> None:
        pass


class SlowCartPoleVector:
    """``n`` CartPoles behind the async vector env protocol: a step awaits one 5 ms wait (one network
    round trip for all of them), then steps each CartPole (the per-env variants' physics), resetting the
    ended ones at once (same-step autoreset, final observations in ``info["final_obs"]``)."""

    def __init__(self, n: int) -> None:
        self.envs = [CartPoleEnv() for _ in range(n)]
        self.num_envs = n
        self.single_observation_space = self.envs[0].observation_space
        self.single_action_space = self.envs[0].action_space

    async def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        obs = [env.reset(seed=None if seed is None else seed + k)[0] for k, env in enumerate(self.envs)]
        return np.stack(obs), {}

    async def step(self, actions: np.ndarray) -> Any:
        await anyio.sleep(STEP_DELAY)
        n = self.num_envs
        obs = np.empty((n, 4), np.float32)
        reward = np.ones(n)
        terminated = np.zeros(n, bool)
        final: np.ndarray | None = None
        for k, (env, action) in enumerate(zip(self.envs, actions.tolist(), strict=True)):
            o, _, term, _, _ = env.step(action)
            if term:
                if final is None:
                    final = np.empty(n, dtype=object)
                final[k] = o
                terminated[k] = True
                o = env.reset()[0]
            obs[k] = o
        info = {} if final is None else {"final_obs": final, "_final_obs": terminated}
        return obs, reward, terminated, np.zeros(n, bool), info

    async def close(self) -> None:
        for env in self.envs:
            env.close()


def env_fns(args: argparse.Namespace, vector: bool) -> list[Any]:
    """The benchmark's env fns: ``args.envs`` SlowCartPoles, or as ``args.vector`` vector envs."""
    if not vector:
        return [SlowCartPole] * args.envs
    shares = np.array_split(np.arange(args.envs), args.vector)
    return [partial(SlowCartPoleVector, len(share)) for share in shares]


# -- each measurement in a fresh process -------------------------------------------------------------
def _measured(fn: Any, *args: Any) -> Any:
    torch.set_num_threads(1)
    return fn(*args)


def fresh(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a new interpreter (spawned): every variant starts from the same heap, as a user's
    script does (in one process, the variants run later got slower as the heap grew)."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(_measured, fn, *args).result()


# -- the async collector ------------------------------------------------------------------------------
async def lag_ticker(lags: list[float], stop: anyio.Event) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        await anyio.sleep(0.001)
        lags.append(time.perf_counter() - start - 0.001)


async def run_async(
    args: argparse.Namespace, policy: nn.Module, out: dict[str, Any], vector: bool, freeze_gc: bool = True
) -> None:
    lags: list[float] = []
    stop = anyio.Event()
    collector = AsyncEnvCollector(
        env_fns(args, vector),
        policy,
        frames_per_batch=args.frames_per_batch,
        min_batch=args.min_batch,
        max_wait=args.max_wait,
        seed=0,
        freeze_gc=freeze_gc,
    )
    async with anyio.create_task_group() as tg, collector:
        it = aiter(collector)
        await anext(it)  # warm-up: every env reset, the policy thread up
        tg.start_soon(lag_ticker, lags, stop)
        warm_calls = len(collector.policy_batch_sizes)
        start, cpu, frames = time.perf_counter(), time.process_time(), 0
        while frames < args.frames:
            frames += (await anext(it)).numel()
        out["fps"] = frames / (time.perf_counter() - start)
        out["cpu_us"] = (time.process_time() - cpu) / frames * 1e6
        stop.set()
        out["lags"] = lags
        out["sizes"] = collector.policy_batch_sizes[warm_calls:]


def measure_async(
    args: argparse.Namespace, policy: nn.Module, uvloop: bool, freeze: bool, vector: bool = False
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    gc.collect()  # each variant starts from the same heap
    options = {"use_uvloop": uvloop}
    anyio.run(run_async, args, policy, out, vector, freeze, backend="asyncio", backend_options=options)
    return out


# -- the envs split over worker processes, an event loop in each ------------------------------------
async def run_processes(args: argparse.Namespace, policy: nn.Module, out: dict[str, Any]) -> None:
    shares = np.array_split(np.arange(args.envs), args.processes)
    collector = MultiAsyncEnvCollector(
        [[SlowCartPole] * len(share) for share in shares],
        policy,
        frames_per_batch=args.frames_per_batch // args.processes,
        min_batch=args.min_batch,
        max_wait=args.max_wait,
        seed=0,
        loop="uvloop",
    )
    async with collector:
        it = aiter(collector)
        for _ in range(args.processes):  # warm-up: a batch of each worker
            await anext(it)
        start, frames = time.perf_counter(), 0
        while frames < args.frames:
            frames += (await anext(it)).numel()
        out["fps"] = frames / (time.perf_counter() - start)


def measure_processes(args: argparse.Namespace, policy: nn.Module) -> dict[str, Any]:
    out: dict[str, Any] = {}
    anyio.run(run_processes, args, policy, out, backend="asyncio", backend_options={"use_uvloop": True})
    return out


# -- the thread-pool baseline -------------------------------------------------------------------------
def measure_threads(args: argparse.Namespace, policy: nn.Module) -> dict[str, Any]:
    """``--threads`` threads, each stepping ``envs / threads`` envs with blocking 5 ms steps; one policy
    call per thread per round over its envs; frames written into a shared preallocated buffer."""
    n_threads = args.threads
    shares = np.array_split(np.arange(args.envs), n_threads)
    fpb = args.frames_per_batch
    buf_obs = torch.empty(fpb, 4)
    buf_next = torch.empty(fpb, 4)
    buf_act = torch.empty(fpb, dtype=torch.int64)
    buf_rew = torch.empty(fpb, 1)
    buf_done = torch.empty(fpb, 1, dtype=torch.bool)
    views = [t.numpy() for t in (buf_obs, buf_next, buf_act, buf_rew, buf_done)]
    lock = threading.Lock()
    state = {"row": 0, "frames": 0}
    done_ev = threading.Event()
    started = threading.Barrier(n_threads + 1)
    target = args.frames + fpb  # one batch of warm-up

    def worker(ids: np.ndarray) -> None:
        envs = [CartPoleEnv() for _ in ids]
        obs = np.stack([env.reset(seed=int(i))[0] for env, i in zip(envs, ids, strict=True)])
        started.wait()
        while not done_ev.is_set():
            with torch.no_grad():
                actions = policy(torch.from_numpy(obs)).numpy()
            for j, env in enumerate(envs):
                time.sleep(STEP_DELAY)
                nxt, reward, term, trunc, _ = env.step(int(actions[j]))
                with lock:
                    row = state["row"]
                    state["row"] = (row + 1) % fpb
                    state["frames"] += 1
                    if state["frames"] >= target:
                        done_ev.set()
                o, nx, a, r, d = views
                o[row], nx[row], a[row], r[row], d[row] = obs[j], nxt, actions[j], reward, term or trunc
                obs[j] = env.reset()[0] if term or trunc else nxt

    threads = [threading.Thread(target=worker, args=(ids,), daemon=True) for ids in shares]
    for t in threads:
        t.start()
    started.wait()
    while state["frames"] < fpb:  # warm-up batch
        time.sleep(0.001)
    start, cpu, first = time.perf_counter(), time.process_time(), state["frames"]
    done_ev.wait()
    frames = state["frames"] - first
    fps = frames / (time.perf_counter() - start)
    cpu_us = (time.process_time() - cpu) / frames * 1e6
    for t in threads:
        t.join()
    return {"fps": fps, "cpu_us": cpu_us}


# -- what a step costs, piece by piece (--components) ------------------------------------------------
def cartpole_us(steps: int) -> float:
    env = CartPoleEnv()
    env.reset(seed=0)
    cpu = time.process_time()
    for _ in range(steps):
        _, _, terminated, truncated, _ = env.step(0)
        if terminated or truncated:
            env.reset()
    return (time.process_time() - cpu) / steps * 1e6


async def tasks_us(n: int, steps: int, woken: bool) -> float:
    """``n`` tasks looping on ``await anyio.sleep(STEP_DELAY)``; ``woken``: each first waits for a
    wake-up from a dispatcher task (a future each, 64 woken per loop iteration, every millisecond)."""
    count = 0
    waiting: list[Any] = []
    new_waiter, wake = (anyio.Event, anyio.Event.set)
    if woken and sniffio.current_async_library() == "asyncio":
        new_waiter, wake = asyncio.get_running_loop().create_future, lambda f: f.set_result(None)

    async def task() -> None:
        nonlocal count
        while count < steps:
            if woken:
                waiter = new_waiter()
                waiting.append(waiter)
                await (waiter if isinstance(waiter, asyncio.Future) else waiter.wait())
            await anyio.sleep(STEP_DELAY)
            count += 1

    async def dispatcher() -> None:
        while True:
            await anyio.sleep(0.001)
            ready = waiting[:]
            waiting.clear()
            for j, waiter in enumerate(ready):
                wake(waiter)
                if j % 64 == 63:
                    await anyio.lowlevel.checkpoint()

    cpu = time.process_time()
    async with anyio.create_task_group() as tg:
        if woken:
            tg.start_soon(dispatcher)
        async with anyio.create_task_group() as inner:
            for _ in range(n):
                inner.start_soon(task)
        tg.cancel_scope.cancel()
    return (time.process_time() - cpu) / count * 1e6


async def bare_envs_us(n: int, steps: int) -> float:
    """``n`` SlowCartPoles stepped by ``n`` bare tasks: nothing stored, no policy."""
    envs = [SlowCartPole() for _ in range(n)]
    count = 0

    async def task(env: SlowCartPole) -> None:
        nonlocal count
        await env.reset(seed=0)
        while count < steps:
            _, _, terminated, truncated, _ = await env.step(0)
            count += 1
            if terminated or truncated:
                await env.reset()

    cpu = time.process_time()
    async with anyio.create_task_group() as tg:
        for env in envs:
            tg.start_soon(task, env)
    return (time.process_time() - cpu) / count * 1e6


async def collector_us(
    env: Any, args: argparse.Namespace, policy: nn.Module, freeze_gc: bool = True
) -> float:
    collector = AsyncEnvCollector(
        [env] * args.envs, policy, frames_per_batch=args.frames_per_batch, freeze_gc=freeze_gc
    )
    async with collector as c:
        it = aiter(c)
        await anext(it)
        cpu, frames = time.process_time(), 0
        while frames < args.frames:
            frames += (await anext(it)).numel()
        return (time.process_time() - cpu) / frames * 1e6


def components(args: argparse.Namespace, policy: nn.Module) -> None:
    n, steps = args.envs, args.frames
    pieces: dict[str, Any] = {
        "CartPole physics (CartPoleEnv.step, no loop)": None,
        f"{n} tasks: await anyio.sleep(5 ms)": lambda: tasks_us(n, steps, False),
        f"{n} tasks: wait for a wake-up, then anyio.sleep(5 ms)": lambda: tasks_us(n, steps, True),
        f"{n} SlowCartPoles stepped by bare tasks (nothing stored)": lambda: bare_envs_us(n, steps),
        "AsyncEnvCollector, NullEnv (the sleep, no physics)": lambda: collector_us(NullEnv, args, policy),
        "AsyncEnvCollector, SlowCartPole (the benchmark)": lambda: collector_us(SlowCartPole, args, policy),
        "AsyncEnvCollector, SlowCartPole, no gc.freeze()": lambda: collector_us(
            SlowCartPole, args, policy, freeze_gc=False
        ),
    }
    loops = {"asyncio": False, "uvloop": True}
    us: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for loop, uv in loops.items():
            for name, run in pieces.items():
                freeze = "no gc.freeze" not in name
                gc.collect()
                if freeze:
                    gc.freeze()
                try:
                    if run is None:
                        value = cartpole_us(steps)
                    else:
                        value = anyio.run(run, backend="asyncio", backend_options={"use_uvloop": uv})
                finally:
                    gc.unfreeze()
                us.setdefault((name, loop), []).append(value)
    med = {key: statistics.median(values) for key, values in us.items()}
    print(f"\nCPU µs per step, median of {args.rounds} (gc.freeze() unless said)")
    print("| piece | " + " | ".join(loops) + " |")
    print("|---|" + "---|" * len(loops))
    for name in pieces:
        print(f"| {name} | " + " | ".join(f"{med[name, loop]:.1f}" for loop in loops) + " |")
    names = list(pieces)
    derived = {
        "the wake-up alone (3rd - 2nd)": (names[2], names[1]),
        "the collector's own cost (5th - 2nd)": (names[4], names[1]),
        "the garbage collector (7th - 6th)": (names[6], names[5]),
    }
    for label, (a, b) in derived.items():
        print(f"| {label} | " + " | ".join(f"{med[a, loop] - med[b, loop]:.1f}" for loop in loops) + " |")


# -- report -------------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--envs", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=64)
    parser.add_argument("--frames", type=int, default=200_000, help="frames measured per variant and round")
    parser.add_argument("--frames-per-batch", type=int, default=10_000)
    parser.add_argument("--min-batch", type=int, default=None)
    parser.add_argument("--max-wait", type=float, default=0.002)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--processes", type=int, default=2, help="worker processes of MultiAsyncEnvCollector (0: skip it)"
    )
    parser.add_argument(
        "--vector", type=int, default=0, help="also run the envs as this many async vector envs (0: no)"
    )
    parser.add_argument("--quick", action="store_true", help="100 envs, 20k frames, 1 round")
    parser.add_argument("--profile", action="store_true", help="cProfile one asyncio run and exit")
    parser.add_argument(
        "--components", action="store_true", help="the CPU µs of a step, piece by piece, and exit"
    )
    args = parser.parse_args()
    if args.quick:
        args.envs, args.frames, args.frames_per_batch, args.rounds, args.threads = 100, 20_000, 2_000, 1, 16
    torch.set_num_threads(1)
    policy = MLP()
    if args.profile:
        import cProfile
        import pstats

        cProfile.runctx(
            "measure_async(args, policy, False, True)", globals(), locals(), "/tmp/async_envs.prof"
        )
        pstats.Stats("/tmp/async_envs.prof").sort_stats("tottime").print_stats(25)
        return
    if args.components:
        components(args, policy)
        return
    variants = {
        "asyncio": (False, True, False),
        "uvloop": (True, True, False),
        "asyncio, freeze_gc=False": (False, False, False),
        "uvloop, freeze_gc=False": (True, False, False),
    }
    if args.vector:
        for name, (uv, freeze, _) in list(variants.items()):
            variants[f"{args.vector} vector envs, {name}"] = (uv, freeze, True)
    results: dict[str, list[float]] = {name: [] for name in [*variants, "threads"]}
    cpu: dict[str, list[float]] = {name: [] for name in [*variants, "threads"]}
    ratios: dict[str, list[float]] = {name: [] for name in variants}
    lags: dict[str, list[float]] = {name: [] for name in variants}
    sizes: list[int] = []
    procs: list[float] = []  # MultiAsyncEnvCollector's frames/s
    proc_ratios: list[float] = []  # ... / one loop's (uvloop, the default freeze_gc) in the same round
    for r in range(args.rounds):
        out = fresh(measure_threads, args, policy)
        base = out["fps"]
        results["threads"].append(base)
        cpu["threads"].append(out["cpu_us"])
        for name, (uv, freeze, vector) in variants.items():
            out = fresh(measure_async, args, policy, uv, freeze, vector)
            results[name].append(out["fps"])
            cpu[name].append(out["cpu_us"])
            ratios[name].append(out["fps"] / base)
            lags[name] += [x * 1e3 for x in out["lags"]]
            if name == "asyncio":
                sizes += out["sizes"]
        if args.processes:
            fps = fresh(measure_processes, args, policy)["fps"]
            procs.append(fps)
            proc_ratios.append(fps / results["uvloop"][-1])
        extra = f", {args.processes} processes {procs[-1]:,.0f}" if args.processes else ""
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in results.items()) + extra)
    fpb = args.frames_per_batch
    print(f"\n{args.envs} envs, {STEP_DELAY * 1e3:.0f} ms a step, MLP policy, batches of {fpb}")
    head = f"| variant | frames/s (median of {args.rounds}) | x threads (median of ratios) | CPU µs/frame |"
    print(head + " best round (x threads in it) | loop lag p50 / p99 |")
    print("|---|---|---|---|---|---|")
    for name in variants:
        fps, ratio = statistics.median(results[name]), statistics.median(ratios[name])
        lag = f"{percentile(lags[name], 50):.1f} / {percentile(lags[name], 99):.1f} ms"
        us = statistics.median(cpu[name])
        best = max(range(args.rounds), key=lambda r, name=name: results[name][r])
        top = f"{results[name][best]:,.0f} ({ratios[name][best]:.2f})"
        print(f"| AsyncEnvCollector, {name} | {fps:,.0f} | {ratio:.2f} | {us:.1f} | {top} | {lag} |")
    fps, us = statistics.median(results["threads"]), statistics.median(cpu["threads"])
    top = f"{max(results['threads']):,.0f}"
    print(f"| {args.threads} threads | {fps:,.0f} | 1.00 | {us:.1f} | {top} | |")
    if args.processes:
        fps, ratio = statistics.median(procs), statistics.median(proc_ratios)
        print(
            f"| MultiAsyncEnvCollector, {args.processes} processes (uvloop) | {fps:,.0f} | "
            f"{statistics.median(p / t for p, t in zip(procs, results['threads'], strict=True)):.2f} | | "
            f"{max(procs):,.0f} | x one loop (uvloop), median of rounds: {ratio:.2f} |"
        )
    qs = "/".join(f"{percentile([float(s) for s in sizes], q):.0f}" for q in (5, 25, 50, 75, 95))
    print(f"\npolicy batch sizes (asyncio): {len(sizes)} calls, p5/p25/p50/p75/p95 = {qs}")


if __name__ == "__main__":
    main()
