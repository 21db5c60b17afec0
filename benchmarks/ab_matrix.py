"""A/B of matrix cells: a collector's CPU-efficiency against the raw gymnasium loop (the issue 12 and 42
targets), in this working tree and in an earlier git revision, in one run.

Each measurement is a fresh child process whose ``PYTHONPATH`` points at one tree's ``src``; it builds the
cell as ``matrix.py`` does (the same policies, envs and batch sizes; this tree's ``matrix.py`` for both
trees) and measures the raw loop and the collector alternately, ``--pairs`` times each. Its figures are
the efficiency, raw CPU-µs per frame / the collector's (the collector's CPU counts its worker processes),
and the collector's frames/s / the raw loop's, in the same process, so that the load of a shared machine
cancels out. The trees alternate, the order flipping every round. The report gives, per cell, the median
efficiency of each tree and the median per-round ratio (this tree / base), with its range, and each
tree's median frames/s ratio.

A cell is ``ENV:N:POLICY`` (the ``Collector`` against the raw loop that stores nothing), or
``ENV:N:POLICY:COLLECTOR`` (``collector``, ``multisync`` or ``multiasync``: N envs per worker, 2 workers)
or ``ENV:N:POLICY:COLLECTOR:store`` (against the raw loop that stores every key a batch holds, issue 42).
``--busy``: every measurement beside the busy trainer thread (``matrix.py``'s, its CPU left out).

```bash
python benchmarks/ab_matrix.py --base HEAD~3 --cells Pendulum-v1:1:tdseq CartPole-v1:8:random
python benchmarks/ab_matrix.py --base 38dc21b --cells ALE/Pong-v5:8:cnn:collector:store \
    CartPole-v1:8:tdseq:multiasync:store
```
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from _trees import ab_rounds

DEFAULT_CELLS = [
    "Pendulum-v1:1:tdseq",
    "Pendulum-v1:1:module",
    "CartPole-v1:1:tdseq",
    "CartPole-v1:1:module",
    "CartPole-v1:1:random",
    "CartPole-v1:8:tdseq",
    "CartPole-v1:8:module",
    "CartPole-v1:8:random",
]


def parse_cell(cell: str) -> tuple[str, int, str, str, str]:
    """``ENV:N:POLICY[:COLLECTOR[:RAW]]`` -> (env id, envs, policy, collector, raw loop kind)."""
    parts = cell.split(":")
    if not 3 <= len(parts) <= 5:
        raise ValueError(f"a cell is ENV:N:POLICY[:COLLECTOR[:RAW]], got {cell!r}")
    env_id, num_envs, policy, *rest = parts
    collector = rest[0] if rest else "collector"
    raw = rest[1] if len(rest) > 1 else "bare"
    return env_id, int(num_envs), policy, collector, raw


def child(cell: str, seconds: float, pairs: int, busy: bool = False) -> dict[str, float]:
    """The raw loop and the collector measured alternately in this process: CPU-µs per frame each, and the
    median efficiency and frames/s ratio."""
    from contextlib import AsyncExitStack

    import anyio
    import matrix  # sets torch.set_num_threads(1), as a user's script does

    env_id, num_envs, policy, collector, raw = parse_cell(cell)
    variants = matrix.build(env_id, num_envs, policy, [collector], with_torchrl=False, raw=raw)
    variants = [variants[0], variants[-1]]  # the raw loop (EnvPool's cells have a second one) and ours

    async def run() -> dict[str, float]:
        samples: dict[str, list[Any]] = {"raw": [], "ours": []}
        async with AsyncExitStack() as stack:
            for v in variants:
                await v.open(stack)
            if busy:
                matrix.BUSY.start()
            try:
                for i in range(pairs):
                    for v in variants if i % 2 == 0 else variants[::-1]:
                        samples["raw" if v.lib == "raw" else "ours"].append(await v.measure(seconds))
            finally:
                if busy:
                    matrix.BUSY.stop()
        pairs_ = list(zip(samples["raw"], samples["ours"], strict=True))
        return {
            "raw": statistics.median(s.cpu_us for s in samples["raw"]),
            "ours": statistics.median(s.cpu_us for s in samples["ours"]),
            "eff": statistics.median(r.cpu_us / o.cpu_us for r, o in pairs_),
            "fps": statistics.median(o.fps / r.fps for r, o in pairs_),
        }

    return anyio.run(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", help="git revision to compare against")
    parser.add_argument("--cells", nargs="*", default=DEFAULT_CELLS, help="env:num_envs:policy")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--pairs", type=int, default=3, help="raw/Collector measurements per child")
    parser.add_argument("--busy", action="store_true", help="measure beside the busy trainer thread")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.seconds, args.pairs, args.busy)))
        return
    for cell in args.cells:
        parse_cell(cell)
    if not args.base:
        parser.error("--base is required: the git revision to compare against, e.g. --base HEAD~5")
    extra = ["--busy"] if args.busy else []
    results = ab_rounds(__file__, args.base, args.cells, args.rounds, args.seconds, args.pairs, extra)
    print(
        f"| cell (env:envs:policy[:collector[:raw]]) | raw / collector CPU, this tree | same, {args.base} "
        f"| this tree / {args.base} ({args.rounds} rounds) | raw CPU-µs/frame "
        f"| collector / raw frames/s, this tree | same, {args.base} |"
    )
    print("|---|---|---|---|---|---|---|")
    for cell, sides in results.items():
        new = [s["eff"] for s in sides["new"]]
        base = [s["eff"] for s in sides["base"]]
        ratio = [n / b for n, b in zip(new, base, strict=True)]
        raw = statistics.median(s["raw"] for s in sides["new"] + sides["base"])
        print(
            f"| {cell} | {statistics.median(new):.2f} | {statistics.median(base):.2f} "
            f"| {statistics.median(ratio):.3f} ({min(ratio):.2f} to {max(ratio):.2f}) | {raw:.1f} "
            f"| {fps(sides['new'])} | {fps(sides['base'])} |"
        )


def fps(side: list[dict[str, float]]) -> str:
    """The median frames/s ratio of a tree's rounds ("-" for results of a child without one)."""
    values = [s["fps"] for s in side if "fps" in s]
    return f"{statistics.median(values):.2f}" if values else "-"


if __name__ == "__main__":
    main()
