"""Benchmark: weight updates through each weight-sync scheme, against a plain memcpy, in one run.

Run with ``python benchmarks/weights.py [--quick] [--json PATH]``.

Setting: CartPole-v1, ``MultiSyncCollector`` with 2 worker processes (one env each), an MLP policy
(obs -> h -> h -> 2 logits, tanh, argmax) of about 1M parameters (h=1000, 3.8 MiB) and about 10M
(h=3160, 38 MiB). Between updates the workers are idle (a sync collector between batches), so what is
measured is the transport. For each scheme (``SharedMemoryWeightSync``, ``PipeWeightSync``,
``DistributedWeightSync`` over gloo on 127.0.0.1) and size:

* ``await update_weights()``: until the call returns. Shared memory: the weights are in the shared
  block; pipe: pickled and sent to both workers; distributed: broadcast into both workers' receive
  buffers. Workers copy into their policy at their next batch boundary.
* ``await update_weights(wait=True)``: until both workers run the new version (they have loaded it).
* the reference: ``copy_`` of the same tensors into preallocated ones, in this process.

Every update carries new values (the weights are nudged in place before each one, untimed). All six
collectors are open at once and measured in rounds, the order rotated every round; in each round, the
reference copy is timed right before each scheme's updates and the ratios are medians of per-round
ratios, so that each compares numbers taken moments apart (this shared machine's speed drifts). A check
that the workers run the published weights (the action forced to 1) ends the run; the exit status is 1
if it failed or if a worker process or a ``/dev/shm/aiocollect_<pid>_*`` segment was left.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
import psutil
import torch
from torch import nn

from aiocollect import (
    DistributedWeightSync,
    GymEnv,
    MultiSyncCollector,
    PipeWeightSync,
    SharedMemoryWeightSync,
    WeightSync,
)

NUM_WORKERS = 2
SIZES = {"1M": 1000, "10M": 3160}  # hidden width -> about 1M and 10M parameters
SCHEMES: dict[str, Callable[[], WeightSync]] = {
    "SharedMemoryWeightSync": SharedMemoryWeightSync,
    "PipeWeightSync": PipeWeightSync,
    "DistributedWeightSync (gloo)": DistributedWeightSync,
}


class MLPPolicy(nn.Module):
    """obs -> hidden -> hidden -> 2 logits (tanh), argmax: returns CartPole's action."""

    def __init__(self, hidden: int, obs_dim: int = 4, n_actions: int = 2) -> None:
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


def make_policy(hidden: int) -> MLPPolicy:
    torch.manual_seed(0)
    return MLPPolicy(hidden).eval()


def cartpole() -> GymEnv:
    return GymEnv("CartPole-v1")


def nudge(params: list[torch.Tensor]) -> None:
    """An optimizer step's worth of change, so that every update carries new values."""
    with torch.no_grad():
        for p in params:
            p.mul_(1.0 + 1e-7)


def leftovers() -> list[str]:
    """Our ``/dev/shm`` segments and worker processes (multiprocessing's helpers excepted)."""
    from multiprocessing import forkserver, resource_tracker

    helpers = {
        getattr(forkserver._forkserver, "_forkserver_pid", None),
        getattr(resource_tracker._resource_tracker, "_pid", None),
    }
    left = sorted(glob.glob(f"/dev/shm/aiocollect_{os.getpid()}_*"))
    for p in psutil.Process().children(recursive=True):
        if p.pid not in helpers and p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
            left.append(f"process {p.pid}")
    return left


@dataclass
class Case:
    size: str
    scheme: str
    policy: MLPPolicy
    collector: Any = None
    nowait: list[float] = field(default_factory=list)
    wait: list[float] = field(default_factory=list)
    nowait_ratios: list[float] = field(default_factory=list)  # per round: median / memcpy median
    wait_ratios: list[float] = field(default_factory=list)
    memcpy: list[float] = field(default_factory=list)
    check: str = ""

    @property
    def params(self) -> list[torch.Tensor]:
        return [t for t in self.policy.parameters()]


def time_memcpy(params: list[torch.Tensor], dst: list[torch.Tensor], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for d, s in zip(dst, params, strict=True):
            d.copy_(s)
        out.append(time.perf_counter() - t)
    return out


async def run(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    cases = [Case(size, scheme, make_policy(hidden)) for size, hidden in SIZES.items() for scheme in SCHEMES]
    copies = {
        size: [p.detach().clone() for p in make_policy(hidden).parameters()] for size, hidden in SIZES.items()
    }
    async with contextlib.AsyncExitStack() as stack:
        for case in cases:
            log(f"open {case.size} {case.scheme}")
            case.collector = await stack.enter_async_context(
                MultiSyncCollector(
                    [cartpole] * NUM_WORKERS,
                    case.policy,
                    frames_per_batch=8 * NUM_WORKERS,
                    weight_sync=SCHEMES[case.scheme](),
                    seed=0,
                )
            )
            await case.collector.__anext__()
            for _ in range(2):  # warm-up: first-time costs (threads, buffers, pickling)
                await case.collector.update_weights(wait=True)
        for r in range(args.rounds):
            log(f"round {r + 1}/{args.rounds}")
            shift = r % len(cases)
            for case in cases[shift:] + cases[:shift]:
                params = [p.detach() for p in case.params]
                ref = statistics.median(time_memcpy(params, copies[case.size], args.reps))
                case.memcpy.append(ref)
                nowait, wait = [], []
                for _ in range(args.reps):
                    nudge(case.params)
                    t = time.perf_counter()
                    await case.collector.update_weights()
                    nowait.append(time.perf_counter() - t)
                    nudge(case.params)
                    t = time.perf_counter()
                    await case.collector.update_weights(wait=True)
                    wait.append(time.perf_counter() - t)
                case.nowait += nowait
                case.wait += wait
                case.nowait_ratios.append(statistics.median(nowait) / ref)
                case.wait_ratios.append(statistics.median(wait) / ref)
        log("check: the workers run the published weights")
        for case in cases:
            last = case.policy.net[-1]
            with torch.no_grad():
                last.weight.zero_()
                last.bias.copy_(torch.tensor([0.0, 1.0]))
            version = await case.collector.update_weights(wait=True)
            batch = await case.collector.__anext__()
            ok = (
                bool((batch["action"] == 1).all())
                and case.collector.worker_policy_versions() == [version] * 2
            )
            case.check = "ok" if ok else f"FAILED (actions {batch['action'].unique().tolist()})"
    left = leftovers()
    sizes = {}
    for size, hidden in SIZES.items():
        params = list(make_policy(hidden).parameters())
        sizes[size] = {
            "params": sum(p.numel() for p in params),
            "bytes": sum(p.numel() * p.element_size() for p in params),
        }
    return {
        "sizes": sizes,
        "cases": [
            {
                "size": c.size,
                "scheme": c.scheme,
                "nowait_ms": 1e3 * statistics.median(c.nowait),
                "nowait_p90_ms": 1e3 * float(np.percentile(c.nowait, 90)),
                "wait_ms": 1e3 * statistics.median(c.wait),
                "wait_p90_ms": 1e3 * float(np.percentile(c.wait, 90)),
                "nowait_x_memcpy": statistics.median(c.nowait_ratios),
                "wait_x_memcpy": statistics.median(c.wait_ratios),
                "memcpy_ms": 1e3 * statistics.median(c.memcpy),
                "updates": len(c.nowait) + len(c.wait),
                "check": c.check,
            }
            for c in cases
        ],
        "leftovers": left,
    }


def render(results: dict[str, Any]) -> str:
    lines = [
        "| weights | scheme | `update_weights()` ms (p90) | x memcpy | `update_weights(wait=True)` ms (p90) "
        "| x memcpy | check |",
        "|---|---|---|---|---|---|---|",
    ]
    for size, info in results["sizes"].items():
        cases = [c for c in results["cases"] if c["size"] == size]
        label = f"{info['params'] / 1e6:.2f}M ({info['bytes'] / 2**20:.1f} MiB)"
        memcpy = statistics.median(c["memcpy_ms"] for c in cases)
        lines.append(f"| {label} | memcpy (reference) | {memcpy:.2f} | 1.0 | | | |")
        for c in cases:
            lines.append(
                f"| {label} | {c['scheme']} | {c['nowait_ms']:.2f} ({c['nowait_p90_ms']:.2f}) "
                f"| {c['nowait_x_memcpy']:.1f} | {c['wait_ms']:.2f} ({c['wait_p90_ms']:.2f}) "
                f"| {c['wait_x_memcpy']:.1f} | {c['check']} |"
            )
    m = results["machine"]
    lines += [
        "",
        f"{m['cpus']} CPUs, load average {m['load_before']:.1f} before and {m['load_after']:.1f} after; "
        f"torch {m['torch']}, Python {m['python']}; {results['rounds']} rounds x {results['reps']} updates "
        f"of each kind per case; {results['elapsed_s']:.0f} s.",
    ]
    if results["leftovers"]:
        lines.append(f"LEFT OVER: {results['leftovers']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--rounds", type=int, help="rounds over all cases (default 5, --quick 2)")
    parser.add_argument(
        "--reps", type=int, help="updates of each kind per case and round (default 8, --quick 3)"
    )
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.reps = args.reps or (3 if args.quick else 8)
    torch.set_num_threads(1)
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {msg}", file=sys.stderr, flush=True)

    load_before = os.getloadavg()[0]
    results = anyio.run(run, args, log)
    results.update(
        rounds=args.rounds,
        reps=args.reps,
        elapsed_s=time.perf_counter() - start,
        machine={
            "cpus": len(os.sched_getaffinity(0)),
            "load_before": load_before,
            "load_after": os.getloadavg()[0],
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
    )
    print(render(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        log(f"wrote {args.json}")
    failed = [c for c in results["cases"] if c["check"] != "ok"]
    return 1 if failed or results["leftovers"] else 0


if __name__ == "__main__":
    sys.exit(main())
