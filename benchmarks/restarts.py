"""A restart policy costs nothing while no env fails: frames/s with ``restart=RestartPolicy()`` against
without, in one run.

Each round runs both variants (the order flipping every round, so drift on a shared machine hits both
alike) on the same workload for ``--frames`` frames after a warm-up batch; the report is the median over
rounds of the per-round ratio (with a policy / without), with its range. Issue 28 asks for >= 0.98.

```bash
python benchmarks/restarts.py                       # ~1 min: 3 workloads x 2 variants x 7 rounds
python benchmarks/restarts.py --rounds 3 --frames 20000 --workloads module1
```
"""

from __future__ import annotations

import argparse
import json
import statistics
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


async def measure(workload: str, frames: int, restart: RestartPolicy | None) -> float:
    """Frames/s of one run of ``frames`` frames (after one warm-up batch)."""
    num_envs, kind = WORKLOADS[workload]
    policy = Mlp() if kind == "module" else None
    fpb = 1024
    async with Collector(
        make_env(num_envs), policy, frames_per_batch=fpb, total_frames=frames + fpb, seed=0, restart=restart
    ) as collector:
        start = None
        async for _ in collector:
            if start is None:
                start = time.perf_counter()
        assert start is not None
        return frames / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--frames", type=int, default=40_960)
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    policy = RestartPolicy(max_restarts=10, window=600.0, backoff=0.5, max_backoff=30.0)
    report: dict[str, Any] = {}
    for workload in args.workloads:
        ratios, plain, with_policy = [], [], []
        for r in range(args.rounds):
            order = [None, policy] if r % 2 == 0 else [policy, None]
            rates = {}
            for restart in order:
                rates[restart is not None] = anyio.run(measure, workload, args.frames, restart)
            plain.append(rates[False])
            with_policy.append(rates[True])
            ratios.append(rates[True] / rates[False])
        report[workload] = {
            "ratio_median": round(statistics.median(ratios), 3),
            "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
            "frames_per_s_without": round(statistics.median(plain)),
            "frames_per_s_with": round(statistics.median(with_policy)),
        }
        print(
            f"{workload:10} ratio {report[workload]['ratio_median']:.3f} "
            f"(range {report[workload]['ratio_range']}), frames/s {report[workload]['frames_per_s_without']} "
            f"without, {report[workload]['frames_per_s_with']} with a RestartPolicy",
            flush=True,
        )
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
