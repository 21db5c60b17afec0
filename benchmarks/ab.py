"""A/B benchmark: this working tree against an earlier git revision, on users' workloads, in one run.

Each measurement runs in a fresh child process whose ``PYTHONPATH`` points at one tree's ``src``; the
two trees alternate, the order flipping every round, so drift on a shared machine hits both alike. The
report is the median over rounds of the per-round ratio (this tree / the base), with its range:
frames/s (higher is better) and CPU-µs per frame over the collector's whole process tree (lower is
better). A refactor should show ratios of 1 within the noise band.

```bash
python benchmarks/ab.py --base 490f57b                # ~4 min: 5 workloads x 2 trees x 5 rounds
python benchmarks/ab.py --base HEAD~3 --rounds 3 --seconds 2 --workloads collector-td8
```

The base revision is checked out once as a detached worktree under the system temp folder.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _trees import base_tree
from torch import nn

ROOT = Path(__file__).resolve().parents[1]

#: name -> (collector, env id, number of envs, policy kind)
WORKLOADS: dict[str, tuple[str, str, int, str]] = {
    "collector-module1": ("Collector", "CartPole-v1", 1, "module"),
    "collector-td8": ("Collector", "CartPole-v1", 8, "tdseq"),
    "collector-random32": ("Collector", "CartPole-v1", 32, "random"),
    "multisync-td8": ("MultiSyncCollector", "CartPole-v1", 8, "tdseq"),
    "multiasync-td8": ("MultiAsyncCollector", "CartPole-v1", 8, "tdseq"),
    # pixels (210x160x3 uint8) and MuJoCo: need the bench extra (ale-py, mujoco); not in the default set
    "collector-pong1": ("Collector", "ALE/Pong-v5", 1, "random"),
    "multisync-halfcheetah4": ("MultiSyncCollector", "HalfCheetah-v5", 4, "random"),
}
DEFAULT_WORKLOADS = [w for w, (_, env_id, _, _) in WORKLOADS.items() if env_id == "CartPole-v1"]


def child(workload: str, seconds: float) -> dict[str, float]:
    """Run one workload for ``seconds`` after a warm-up batch; frames/s and CPU-µs per frame."""
    import anyio
    import psutil
    from tensordict.nn import TensorDictModule, TensorDictSequential

    import aiocollect

    torch.set_num_threads(1)
    kind, env_id, num_envs, policy_kind = WORKLOADS[workload]
    if env_id.startswith("ALE/"):
        import ale_py
        import gymnasium as gym

        gym.register_envs(ale_py)
    env_fn = make_env_fn(env_id, num_envs)
    policy: Any
    if policy_kind == "random":
        policy = None
    else:
        net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))
        if policy_kind == "module":
            policy = nn.Sequential(net, Argmax())
        else:
            policy = TensorDictSequential(
                TensorDictModule(net, in_keys=["observation"], out_keys=["logits"]),
                TensorDictModule(Argmax(), in_keys=["logits"], out_keys=["action"]),
            )
    steps = 128 if num_envs > 1 else 256
    frames_per_batch = steps * num_envs
    me = psutil.Process()

    def cpu() -> float:
        total = sum(me.cpu_times()[:2])
        for c in me.children(recursive=True):
            try:
                total += sum(c.cpu_times()[:2])
            except psutil.Error:
                pass
        return total

    async def run() -> dict[str, float]:
        cls = getattr(aiocollect, kind)
        if kind == "Collector":
            collector = cls(env_fn, policy, frames_per_batch=frames_per_batch)
        else:
            collector = cls([env_fn, env_fn], policy, frames_per_batch=frames_per_batch * 2)
        async with collector:
            it = collector.__aiter__()
            await it.__anext__()
            frames, c0, t0 = 0, cpu(), time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                batch = await it.__anext__()
                frames += batch.numel()
            elapsed, used = time.perf_counter() - t0, cpu() - c0
        return {"fps": frames / elapsed, "cpu_us": used / frames * 1e6}

    return anyio.run(run)


class Argmax(nn.Module):
    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(-1)


def make_env_fn(env_id: str, num_envs: int) -> Any:
    import functools

    import aiocollect

    if num_envs == 1:
        return functools.partial(aiocollect.GymEnv, env_id)
    return functools.partial(aiocollect.GymEnv, env_id, num_envs=num_envs)


def measure(tree: Path, workload: str, seconds: float) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    out = subprocess.run(
        [sys.executable, __file__, "--child", workload, "--seconds", str(seconds)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        cwd=tree,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", help="git revision to compare against (e.g. a commit before a refactor)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--workloads", nargs="*", default=DEFAULT_WORKLOADS, choices=list(WORKLOADS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.seconds)))
        return
    if not args.base:
        parser.error("--base is required: the git revision to compare against, e.g. --base HEAD~5")
    trees = {"new": ROOT, "base": base_tree(args.base)}
    results: dict[str, dict[str, list[dict[str, float]]]] = {
        w: {"new": [], "base": []} for w in args.workloads
    }
    for r in range(args.rounds):
        order = ["new", "base"] if r % 2 == 0 else ["base", "new"]
        for w in args.workloads:
            for side in order:
                results[w][side].append(measure(trees[side], w, args.seconds))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    print(
        f"| workload (this tree / {args.base}, {args.rounds} rounds) | frames/s ratio | CPU-µs/frame ratio |"
    )
    print("|---|---|---|")
    for w, sides in results.items():
        fps = [n["fps"] / b["fps"] for n, b in zip(sides["new"], sides["base"], strict=True)]
        cpu = [n["cpu_us"] / b["cpu_us"] for n, b in zip(sides["new"], sides["base"], strict=True)]
        print(
            f"| {w} | {statistics.median(fps):.2f} ({min(fps):.2f} to {max(fps):.2f}) "
            f"| {statistics.median(cpu):.2f} ({min(cpu):.2f} to {max(cpu):.2f}) |"
        )


if __name__ == "__main__":
    main()
