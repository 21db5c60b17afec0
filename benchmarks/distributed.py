"""Throughput and weight-update latency of DistributedCollector (gloo) and RPCCollector (TensorPipe) on
this machine, against an in-process Collector as the baseline.

    python benchmarks/distributed.py --quick     # ~1 minute on 2 cores
    python benchmarks/distributed.py             # more frames, a bigger policy

Every number is measured here, in this run: frames/s over the timed batches (after warm-up) and its
ratio to the in-process Collector's frames/s (the cases are interleaved over ``--rounds`` rounds; medians),
the median time of ``await update_weights(wait=True)`` (trainer -> every node's collector runs the
weights), and the bytes one batch carries.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import anyio
import torch

from aiocollect import Collector, DistributedCollector, GymEnv, RPCCollector

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("TP_SOCKET_IFNAME", "lo")


def make_env():
    return GymEnv("Pendulum-v1", num_envs=8)


def make_policy(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(3, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, 1),
    )


def weight_bytes(policy: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in policy.state_dict().values())


async def run(name: str, factory, policy, batches: int, updates: int) -> dict:
    out: dict = {"name": name}
    t0 = time.perf_counter()
    async with factory() as c:
        out["startup_s"] = time.perf_counter() - t0
        it = c.__aiter__()
        first = await it.__anext__()  # warm-up
        out["batch_bytes"] = sum(v.numel() * v.element_size() for v in first.values(True, True))
        frames = 0
        t0 = time.perf_counter()
        for _ in range(batches):
            batch = await it.__anext__()
            frames += batch.numel()
        out["frames_per_s"] = frames / (time.perf_counter() - t0)
        lat = []
        for _ in range(updates):
            t0 = time.perf_counter()
            await c.update_weights(policy, wait=True)
            lat.append(time.perf_counter() - t0)
            await it.__anext__()
        out["update_ms_median"] = statistics.median(lat) * 1e3
    return out


async def main(quick: bool, rounds: int) -> None:
    hidden = 64 if quick else 256
    fpb = 1024 if quick else 4096
    batches = 12 if quick else 40
    updates = 5 if quick else 20
    nodes = 2
    policy = make_policy(hidden)
    wbytes = weight_bytes(policy)
    print(
        f"torch {torch.__version__}, {os.cpu_count()} cores; Pendulum x8 per collector, MLP {hidden} hidden "
        f"({wbytes / 1e3:.1f} kB of weights), frames_per_batch={fpb}, {nodes} nodes"
    )
    cases = [
        ("Collector (in process)", lambda: Collector(make_env, policy, frames_per_batch=fpb, progress=False)),
        (
            "DistributedCollector gloo async",
            lambda: DistributedCollector(
                make_env, policy, frames_per_batch=fpb, num_collectors=nodes, progress=False
            ),
        ),
        (
            "DistributedCollector gloo sync",
            lambda: DistributedCollector(
                make_env, policy, frames_per_batch=fpb, num_collectors=nodes, sync=True, progress=False
            ),
        ),
        (
            "RPCCollector async",
            lambda: RPCCollector(
                make_env, policy, frames_per_batch=fpb, num_collectors=nodes, progress=False
            ),
        ),
    ]
    results: dict[str, list[dict]] = {name: [] for name, _ in cases}
    for _ in range(rounds):  # interleaved: drift on a shared machine hits every case alike
        for name, factory in cases:
            results[name].append(await run(name, factory, policy, batches, updates))
    base = statistics.median(r["frames_per_s"] for r in results[cases[0][0]])
    print(f"medians of {rounds} interleaved rounds")
    print(
        "| collector | frames/s | ÷ in-process | update_weights(wait=True) median | batch bytes | start-up |"
    )
    print("|---|---|---|---|---|---|")
    for name, rs in results.items():
        fps = statistics.median(r["frames_per_s"] for r in rs)
        upd = statistics.median(r["update_ms_median"] for r in rs)
        first_start = rs[0]["startup_s"]
        print(
            f"| {name} | {fps:,.0f} | {fps / base:.2f} | {upd:.1f} ms | "
            f"{rs[0]['batch_bytes'] / 1e3:.0f} kB | {first_start:.1f} s |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small run (~1 minute)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the in-process baseline: one intra-op thread, as our worker processes use
    anyio.run(main, args.quick, args.rounds)
