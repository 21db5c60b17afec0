"""Start-up and memory of a 2-worker collector: the first one in a fresh process, a later one, the tree's PSS.

Every measurement runs in a fresh interpreter (a child of this script), so the first collector of that
process is cold: multiprocessing's forkserver is started by it and imports what workers need. Measured per
child, on CartPole-v1 with one env per worker and an MLP policy (obs -> 64 -> 64 -> 2, argmax):

* ``import``: the child's imports (torch and aiocollect; torchrl: torch and torchrl's collectors);
* ``first``: from building the collector to its first batch (``MultiSyncCollector`` by default,
  ``--collector async`` for ``MultiAsyncCollector``), and the part of it from entering ``async with``
  (TorchRL's collectors start their workers when built: from the first ``next``); ``--setup S`` puts S
  seconds of CPU work in between, as a trainer's own set-up (models, buffers, loggers);
* ``warm``: the same for a second collector in the same process, after the first was closed;
* ``pss``: PSS (shared pages split between the processes that map them) summed over the child and all its
  descendants (the forkserver, the resource tracker, the workers) after 10 batches of the first collector,
  and (ours) again after a ``gc.collect()`` in each worker (what a long run comes to);
* ``torch``: a reference, ``python -c "import torch"`` timed from outside (interpreter start included):
  the floor of a first start that imports torch in a fresh process.

Variants: this tree (``new``); with ``--base REV``, the same code of an earlier revision (checked out as a
detached worktree under the system temp folder); with ``--torchrl-python PATH``, TorchRL's collector of the
same kind in the interpreter at PATH (a virtualenv with torchrl). Rounds run every variant once, the order
rotated each round, so that the machine's drift hits all alike; the report gives medians over rounds, and
ratios as medians of per-round ratios with their range, and the load average.

```bash
python benchmarks/startup.py --rounds 7                                   # this tree, and import torch
python benchmarks/startup.py --rounds 7 --base 4d51c64 --torchrl-python /work/venv-trl/bin/python
```
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

T_START = time.perf_counter()  # a child's import time starts here, before torch

import torch  # noqa: E402
from _trees import base_tree  # noqa: E402
from torch import nn  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKERS = 2
FRAMES_PER_BATCH = 256
BATCHES_BEFORE_PSS = 10


# -- in the child -------------------------------------------------------------------------------------
class Argmax(nn.Module):
    """obs -> 64 -> 64 -> 2 logits, argmax: CartPole's action."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).argmax(-1)


def torchrl_env() -> Any:
    from torchrl.envs import GymEnv

    return GymEnv("CartPole-v1", categorical_action_encoding=True)


def tree_pss_mb() -> tuple[float, dict[str, float]]:
    """PSS (MB) summed over this process and its descendants, and per role."""
    import psutil

    me = psutil.Process()
    total = 0.0
    roles: dict[str, float] = {}
    for p in [me, *me.children(recursive=True)]:
        try:
            pss = p.memory_full_info().pss / 2**20
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        total += pss
        role = (
            "trainer"
            if p.pid == me.pid
            else "resource tracker"
            if "resource_tracker" in cmd
            else "forkserver"
            if "forkserver" in cmd and p.ppid() == me.pid
            else "worker"
        )
        roles[role] = roles.get(role, 0.0) + pss
    return total, roles


def busy(seconds: float) -> None:
    """A trainer's own set-up between building the collector and entering it: ``seconds`` of CPU."""
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def ours(collector: str, setup: float) -> dict[str, Any]:
    import anyio

    import aiocollect

    import_s = time.perf_counter() - T_START

    class Env(aiocollect.GymEnv):
        @property
        def gc_collect(self) -> int:
            import gc

            return gc.collect()

    def make_env() -> Any:
        return Env("CartPole-v1")

    cls = aiocollect.MultiSyncCollector if collector == "sync" else aiocollect.MultiAsyncCollector

    async def start(measure_memory: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        t0 = time.perf_counter()
        c = cls([make_env] * WORKERS, Argmax(), frames_per_batch=FRAMES_PER_BATCH, total_frames=-1)
        busy(setup if measure_memory else 0.0)
        t_enter = time.perf_counter()
        async with c:
            out["entered_s"] = time.perf_counter() - t0
            n = 0
            async for _ in c:
                if n == 0:
                    out["first_s"] = time.perf_counter() - t0
                    out["from_enter_s"] = time.perf_counter() - t_enter
                n += 1
                if not measure_memory or n == BATCHES_BEFORE_PSS:
                    break
            if measure_memory:
                out["pss_mb"], out["pss_roles"] = tree_pss_mb()
                await c.get_distant_attr("env.gc_collect")
                out["pss_after_gc_mb"], _ = tree_pss_mb()
        return out

    async def main() -> dict[str, Any]:
        first = await start(measure_memory=True)
        warm = await start(measure_memory=False)
        return {**first, "warm_s": warm["first_s"], "import_s": import_s}

    return anyio.run(main)


def torchrl(collector: str, setup: float) -> dict[str, Any]:
    from tensordict.nn import TensorDictModule
    from torchrl.collectors import MultiAsyncCollector, MultiSyncCollector

    import_s = time.perf_counter() - T_START

    cls = MultiSyncCollector if collector == "sync" else MultiAsyncCollector

    def start(measure_memory: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        t0 = time.perf_counter()
        policy = TensorDictModule(Argmax(), in_keys=["observation"], out_keys=["action"])
        c = cls([torchrl_env] * WORKERS, policy, frames_per_batch=FRAMES_PER_BATCH, total_frames=-1)
        busy(setup if measure_memory else 0.0)
        t_enter = time.perf_counter()
        out["entered_s"] = t_enter - t0
        try:
            for n, _ in enumerate(c, 1):
                if n == 1:
                    out["first_s"] = time.perf_counter() - t0
                    out["from_enter_s"] = time.perf_counter() - t_enter
                if not measure_memory or n == BATCHES_BEFORE_PSS:
                    break
            if measure_memory:
                out["pss_mb"], out["pss_roles"] = tree_pss_mb()
        finally:
            c.shutdown()
        return out

    first = start(measure_memory=True)
    warm = start(measure_memory=False)
    return {**first, "warm_s": warm["first_s"], "import_s": import_s}


# -- in the parent ------------------------------------------------------------------------------------
def run_child(python: str, kind: str, collector: str, setup: float, src: Path | None) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if src is not None:
        env["PYTHONPATH"] = str(src)
    if kind == "torch":
        t0 = time.perf_counter()
        subprocess.run([python, "-c", "import torch"], env=env, check=True)
        return {"first_s": time.perf_counter() - t0}
    done = subprocess.run(
        [
            python,
            str(Path(__file__).resolve()),
            "--child",
            kind,
            "--collector",
            collector,
            "--setup",
            str(setup),
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),  # no stray aiocollect on the path
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{kind} child failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def ratio(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str) -> str:
    values = [x[key] / y[key] for x, y in zip(a, b, strict=True) if key in x and key in y]
    if not values:
        return "-"
    return f"{median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--collector", choices=["sync", "async"], default="sync")
    parser.add_argument(
        "--setup",
        type=float,
        default=0.0,
        help="seconds of CPU work between building the first collector and entering it (a trainer's set-up)",
    )
    parser.add_argument("--base", help="an earlier git revision to compare against (e.g. main)")
    parser.add_argument(
        "--torchrl-python", help="an interpreter with torchrl installed, e.g. venv/bin/python"
    )
    parser.add_argument("--json", help="write every measurement to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = (ours if args.child == "ours" else torchrl)(args.collector, args.setup)
        print(json.dumps(result))
        return

    variants: dict[str, tuple[str, str, Path | None]] = {"new": (sys.executable, "ours", ROOT / "src")}
    if args.base:
        variants["base"] = (sys.executable, "ours", base_tree(args.base) / "src")
    if args.torchrl_python:
        variants["torchrl"] = (args.torchrl_python, "torchrl", None)
    variants["torch"] = (sys.executable, "torch", None)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    loads = [os.getloadavg()[0]]
    names = list(variants)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        if r % 2:
            order.reverse()
        for name in order:
            python, kind, src = variants[name]
            results[name].append(run_child(python, kind, args.collector, args.setup, src))
        loads.append(os.getloadavg()[0])
        print(
            f"round {r + 1}/{args.rounds}: "
            + ", ".join(f"{n} {results[n][-1]['first_s']:.2f} s" for n in names)
            + f" (load {loads[-1]:.1f})",
            file=sys.stderr,
        )

    label = "MultiSyncCollector" if args.collector == "sync" else "MultiAsyncCollector"
    print(
        f"\n{label}, {WORKERS} workers x CartPole-v1, {args.rounds} rounds, a fresh interpreter each; "
        f"1-min load average {min(loads):.1f}-{max(loads):.1f} (median {median(loads):.1f}), "
        f"{os.cpu_count()} cores; {args.setup:.1f} s of the trainer's CPU work between building the first "
        "collector and entering it\n"
    )
    print(
        "| variant | first start (s) | from `async with` (s) | warm start (s) | import (s) | tree PSS (MB) "
        "| PSS after gc in workers (MB) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, rows in results.items():

        def col(key: str, fmt: str, rows: list[dict[str, Any]] = rows) -> str:
            values = [row[key] for row in rows if key in row]
            return format(median(values), fmt) if values else "-"

        print(
            f"| {name} | {col('first_s', '.2f')} | {col('from_enter_s', '.2f')} | {col('warm_s', '.2f')} "
            f"| {col('import_s', '.2f')} | {col('pss_mb', '.0f')} | {col('pss_after_gc_mb', '.0f')} |"
        )
    roles = results["new"][0].get("pss_roles", {})
    if roles:
        per_role = {k: median([r["pss_roles"].get(k, 0.0) for r in results["new"]]) for k in roles}
        print("\nnew, PSS per role (MB, median): " + ", ".join(f"{k} {v:.0f}" for k, v in per_role.items()))
    print(
        "\n| ratio (median of per-round ratios, range) | first start | from `async with` | warm start "
        "| tree PSS |"
    )
    print("|---|---|---|---|---|")
    for other in [n for n in names if n not in ("new",)]:
        print(
            f"| new / {other} | {ratio(results['new'], results[other], 'first_s')} "
            f"| {ratio(results['new'], results[other], 'from_enter_s')} "
            f"| {ratio(results['new'], results[other], 'warm_s')} "
            f"| {ratio(results['new'], results[other], 'pss_mb')} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"loads": loads, "results": results}, indent=1))


if __name__ == "__main__":
    main()
