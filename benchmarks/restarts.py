"""A restart policy costs nothing while no env fails: the rollout's speed with ``restart=RestartPolicy()``
against without.

One ``Collector``'s rollout is driven directly (in this thread, no hand-off), batches of 1024 frames
alternating ABBA between the two variants (the rollout's ``restarts`` set or ``None``: the same env, policy
and buffers), so that drift on a shared machine hits both alike; each batch's CPU time is measured
(``time.thread_time``). The report is the median over neighbouring pairs of batches of the speed ratio
(with a policy / without), with its quartiles. Issue 28 asks for >= 0.98.

```bash
python benchmarks/restarts.py                       # ~1 min: 3 workloads x 2 x 60 batches
python benchmarks/restarts.py --batches 200 --workloads random1
```
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

import anyio
import torch
from torch import nn

from aiocollect import Collector, GymEnv, RestartPolicy

#: name -> (number of envs, policy kind): "random" (the random batches' fused loop), "module" (a plain
#: nn.Module called at every step)
WORKLOADS: dict[str, tuple[int | None, str]] = {
    "random1": (None, "random"),
    "module1": (None, "module"),
    "module8": (8, "module"),
}


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).argmax(-1)


def make_env(num_envs: int | None) -> Any:
    return lambda: GymEnv("CartPole-v1", num_envs=num_envs)


def alternate(workload: str, batches: int, restart: RestartPolicy) -> tuple[list[float], list[float]]:
    """CPU seconds of each batch of one rollout, ``batches`` with ``restart`` and as many without,
    alternating ABBA (the rollout's env, policy and buffers are the same for both)."""
    num_envs, kind = WORKLOADS[workload]
    policy = Mlp() if kind == "module" else None
    collector = Collector(make_env(num_envs), policy, frames_per_batch=1024, seed=0, restart=restart)
    rollout = collector._rollout  # driven directly, in this thread: no hand-off in the measure
    rebuilder = rollout.restarts
    stop = threading.Event()
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        rollout.collect(random=kind == "random", stop=stop)  # warm-up
        for i in range(2 * batches):
            use = (i % 2 == 0) != (i // 2 % 2 == 1)  # ABBA: with, without, without, with, ...
            rollout.restarts = rebuilder if use else None
            start = time.thread_time()
            rollout.collect(random=kind == "random", stop=stop)
            times[use].append(time.thread_time() - start)
    finally:
        rollout.restarts = rebuilder
        anyio.run(collector.aclose)
    return times[True], times[False]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, default=60, help="batches of 1024 frames per variant")
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    policy = RestartPolicy(max_restarts=10, window=600.0, backoff=0.5, max_backoff=30.0)
    report: dict[str, Any] = {}
    for workload in args.workloads:
        with_policy, without = alternate(workload, args.batches, policy)
        # pairs of neighbouring batches (ABBA): their ratio, then the median over pairs
        ratios = [b / a for a, b in zip(with_policy, without, strict=True)]
        w = report[workload] = {
            "ratio": round(statistics.median(ratios), 4),
            "quartiles": [round(q, 4) for q in statistics.quantiles(ratios, n=4)],
            "cpu_us_per_frame_without": round(statistics.median(without) / 1024 * 1e6, 2),
            "cpu_us_per_frame_with": round(statistics.median(with_policy) / 1024 * 1e6, 2),
        }
        print(
            f"{workload:8} speed with/without a RestartPolicy {w['ratio']:.4f} (quartiles {w['quartiles']}); "
            f"CPU-us per frame {w['cpu_us_per_frame_without']} without, {w['cpu_us_per_frame_with']} with",
            flush=True,
        )
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
