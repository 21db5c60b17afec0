"""A/B of matrix cells: the in-process ``Collector``'s CPU-efficiency against the raw gymnasium loop (the
issue 12 target), in this working tree and in an earlier git revision, in one run.

Each measurement is a fresh child process whose ``PYTHONPATH`` points at one tree's ``src``; it builds the
cell as ``matrix.py`` does (the same policies, envs and batch sizes; this tree's ``matrix.py`` for both
trees) and measures the raw loop and the ``Collector`` alternately, ``--pairs`` times each. Its figure is
the efficiency: raw CPU-µs per frame / the Collector's, in the same process, so that the load of a shared
machine cancels out. The trees alternate, the order flipping every round. The report gives, per cell, the
median efficiency of each tree and the median per-round ratio (this tree / base), with its range.

```bash
python benchmarks/ab_matrix.py --base HEAD~3 --cells Pendulum-v1:1:tdseq CartPole-v1:8:random
```
"""

from __future__ import annotations

import argparse
import json
import statistics

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


def child(cell: str, seconds: float, pairs: int) -> dict[str, float]:
    """The raw loop and the Collector measured alternately in this process: CPU-µs per frame each."""
    from contextlib import AsyncExitStack

    import anyio
    import matrix  # sets torch.set_num_threads(1), as a user's script does

    env_id, num_envs, policy = cell.split(":")
    variants = matrix.build(env_id, int(num_envs), policy, ["collector"], with_torchrl=False)
    variants = [variants[0], variants[-1]]  # the raw loop (EnvPool's cells have a second one) and ours

    async def run() -> dict[str, float]:
        async with AsyncExitStack() as stack:
            for v in variants:
                await v.open(stack)
            cpu: dict[str, list[float]] = {"raw": [], "ours": []}
            for i in range(pairs):
                for v in variants if i % 2 == 0 else variants[::-1]:
                    cpu["raw" if v.lib == "raw" else "ours"].append((await v.measure(seconds)).cpu_us)
        eff = [r / o for r, o in zip(cpu["raw"], cpu["ours"], strict=True)]
        return {
            "raw": statistics.median(cpu["raw"]),
            "ours": statistics.median(cpu["ours"]),
            "eff": statistics.median(eff),
        }

    return anyio.run(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", help="git revision to compare against")
    parser.add_argument("--cells", nargs="*", default=DEFAULT_CELLS, help="env:num_envs:policy")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--pairs", type=int, default=3, help="raw/Collector measurements per child")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.seconds, args.pairs)))
        return
    if not args.base:
        parser.error("--base is required: the git revision to compare against, e.g. --base HEAD~5")
    results = ab_rounds(__file__, args.base, args.cells, args.rounds, args.seconds, args.pairs)
    print(
        f"| cell (env:envs:policy) | raw / Collector CPU, this tree | same, {args.base} "
        f"| this tree / {args.base} ({args.rounds} rounds) | raw CPU-µs/frame |"
    )
    print("|---|---|---|---|---|")
    for cell, sides in results.items():
        new = [s["eff"] for s in sides["new"]]
        base = [s["eff"] for s in sides["base"]]
        ratio = [n / b for n, b in zip(new, base, strict=True)]
        raw = statistics.median(s["raw"] for s in sides["new"] + sides["base"])
        print(
            f"| {cell} | {statistics.median(new):.2f} | {statistics.median(base):.2f} "
            f"| {statistics.median(ratio):.3f} ({min(ratio):.2f} to {max(ratio):.2f}) | {raw:.1f} |"
        )


if __name__ == "__main__":
    main()
