"""Per-process event loops (issue 16): aiomultiprocess's worker loops against aiocollect's own worker
bootstrap, on the same I/O-bound load: 2 processes x 500 envs whose step awaits a 5 ms sleep.

    pip install aiomultiprocess==0.9.1     # not a dependency of aiocollect: only this measurement
    python benchmarks/worker_loops.py [--seconds 3] [--rounds 2]

Variants (rounds interleave them):

* ``aiomultiprocess`` — ``aiomultiprocess.Pool(processes=2, childconcurrency=500)``: each env's step loop
  is one pool task (a coroutine run on the child's loop), its count returned through the pool's queues
  (its default ``spawn`` start method, and ``forkserver`` as aiocollect's workers use; and with an
  initializer importing aiocollect, as a collector's worker must: torch and its objects);
* ``bootstrap`` — two processes from aiocollect's worker context (``forkserver``, the collectors' preload),
  each running ``anyio.run`` over its 500 step loops, their counts sent back on a pipe: the loop setup of
  ``MultiAsyncEnvCollector``'s workers without the collector;
* ``MultiAsyncEnvCollector`` — the collector itself, the envs' frames stored in batches of 1,000 and
  delivered through shared memory, a random policy called on batches of ready envs.

Each variant runs in a fresh interpreter (a cold start: its forkserver, its children's imports).
Start-up: from the start of the variant until every env's first step began (the collector: until
``async with`` returned, i.e. its first batch is in). Steps/s: every env's steps over the span from the
first start to the last end (bare loops), or frames delivered / seconds (the collector).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import anyio
import numpy as np
from gymnasium import spaces

STEP = 0.005
PROCS = 2
ENVS = 500


async def env_loop(deadline: float) -> tuple[float, float, int]:
    """One env's step loop until ``deadline`` (wall clock): (start, end, steps)."""
    start = time.time()
    n = 0
    while time.time() < deadline:
        await asyncio.sleep(STEP)
        n += 1
    return start, time.time(), n


def import_aiocollect() -> None:
    """A pool child's initializer: the imports a collector's worker needs (torch, tensordict, ...)."""
    import aiocollect  # noqa: F401


async def pool_variant(seconds: float, method: str, initializer: Any = None) -> tuple[float, float]:
    import aiomultiprocess

    aiomultiprocess.set_start_method(method)
    t0 = time.time()
    async with aiomultiprocess.Pool(processes=PROCS, childconcurrency=ENVS, initializer=initializer) as pool:
        # the deadline leaves the pool time to start (start-up is measured, not counted in the rate)
        results = await pool.map(env_loop, [t0 + 2.0 + seconds] * (PROCS * ENVS))
    return summary(t0, results)


def summary(t0: float, results: list[tuple[float, float, int]]) -> tuple[float, float]:
    starts, ends, steps = zip(*results, strict=True)
    return max(starts) - t0, sum(steps) / (max(ends) - min(starts))


def bootstrap_child(conn: Any, deadline: float) -> None:
    async def main() -> list[tuple[float, float, int]]:
        async with anyio.create_task_group() as tg:
            out: list[tuple[float, float, int]] = []

            async def one() -> None:
                out.append(await env_loop(deadline))

            for _ in range(ENVS):
                tg.start_soon(one)
        return out

    conn.send(anyio.run(main))
    conn.close()


async def bootstrap_variant(seconds: float) -> tuple[float, float]:
    from aiocollect._workers._forkserver import context

    ctx = context("forkserver")
    t0 = time.time()
    pipes, procs = [], []
    for _ in range(PROCS):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=bootstrap_child, args=(child, t0 + 2.0 + seconds))
        await anyio.to_thread.run_sync(proc.start)
        child.close()
        pipes.append(parent)
        procs.append(proc)
    results: list[tuple[float, float, int]] = []
    for parent, proc in zip(pipes, procs, strict=True):
        results += await anyio.to_thread.run_sync(parent.recv)
        await anyio.to_thread.run_sync(proc.join)
    return summary(t0, results)


class SleepEnv:
    observation_space = spaces.Box(-1, 1, (4,), np.float32)
    action_space = spaces.Discrete(2)

    async def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
        return np.zeros(4, np.float32), {}

    async def step(self, action: int) -> Any:
        await anyio.sleep(STEP)
        return np.zeros(4, np.float32), 1.0, False, False, {}

    async def close(self) -> None:
        pass


async def collector_variant(seconds: float) -> tuple[float, float]:
    from aiocollect import MultiAsyncEnvCollector

    t0 = time.time()
    async with MultiAsyncEnvCollector([[SleepEnv] * ENVS] * PROCS, frames_per_batch=1000) as c:
        startup = time.time() - t0
        frames, t1 = 0, time.perf_counter()
        async for batch in c:
            frames += batch.shape[0]
            if time.perf_counter() - t1 >= seconds:
                break
        rate = frames / (time.perf_counter() - t1)
    return startup, rate


VARIANTS = {
    "aiomultiprocess Pool (spawn)": lambda s: pool_variant(s, "spawn"),
    "aiomultiprocess Pool (forkserver)": lambda s: pool_variant(s, "forkserver"),
    "aiomultiprocess Pool (forkserver), children import aiocollect": lambda s: pool_variant(
        s, "forkserver", import_aiocollect
    ),
    "bootstrap (forkserver + anyio.run)": bootstrap_variant,
    "MultiAsyncEnvCollector": collector_variant,
}


def run_fresh(name: str, seconds: float) -> tuple[float, float]:
    """One variant in a fresh interpreter: a cold start (its own forkserver, its children's imports)."""
    out = subprocess.run(
        [sys.executable, __file__, "--variant", name, "--seconds", str(seconds)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    startup, rate = json.loads(out.strip().splitlines()[-1])
    return startup, rate


async def main(args: argparse.Namespace) -> None:
    if args.variant is not None:
        print(json.dumps(await VARIANTS[args.variant](args.seconds)))
        return
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        for name in VARIANTS:
            runs[name].append(await anyio.to_thread.run_sync(run_fresh, name, args.seconds))
            print(f"round {r}: {name}: start-up {runs[name][-1][0]:.2f} s, {runs[name][-1][1]:,.0f} steps/s")
    base = "bootstrap (forkserver + anyio.run)"
    print("\n| variant | start-up s (median) | steps/s (median) | x bootstrap (per round, median) |")
    print("|---|---|---|---|")
    for name, values in runs.items():
        ratio = statistics.median(v[1] / b[1] for v, b in zip(values, runs[base], strict=True))
        print(
            f"| {name} | {statistics.median(v[0] for v in values):.2f} | "
            f"{statistics.median(v[1] for v in values):,.0f} | {ratio:.2f} |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variant", choices=list(VARIANTS), help="run one variant here (internal)")
    anyio.run(main, parser.parse_args())
