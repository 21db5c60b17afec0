"""A/B of the EnvPool cells (issue 34): the in-process ``Collector``'s frames/s and CPU against the raw
EnvPool loops, in this working tree and in an earlier git revision, in one run.

Each measurement is a fresh child process whose ``PYTHONPATH`` points at one tree's ``src``; it builds the
cell as ``matrix.py`` does (this tree's ``matrix.py`` for both trees) and measures its variants (the raw
EnvPool loop, the raw loop with same-step resets, the ``Collector``) in turn, ``--pairs`` times each,
the order reversed every other time. Its figures are the Collector's frames/s and CPU-efficiency over the
raw loop's (medians of the child's interleaved ratios): the load of a shared machine cancels out. The trees
alternate, the order flipping every round; the report gives each tree's median ratios and the median
per-round ratio of the two trees' frames/s ratios.

```bash
python benchmarks/envpool_ab.py --base b49a9cb --rounds 5 \\
    --cells EnvPool/CartPole-v1:256:random EnvPool/CartPole-v1:1024:random EnvPool/CartPole-v1:256:tdseq
```
"""

from __future__ import annotations

import argparse
import json
import statistics

from _trees import ab_rounds

CELLS = ["EnvPool/CartPole-v1:256:random", "EnvPool/CartPole-v1:1024:random", "EnvPool/CartPole-v1:256:tdseq"]


def child(cell: str, seconds: float, pairs: int) -> dict[str, float]:
    """The cell's variants measured in turn in this process: the Collector's ratios to each raw loop."""
    from contextlib import AsyncExitStack

    import anyio
    import matrix  # sets torch.set_num_threads(1), as a user's script does

    env_id, num_envs, policy = cell.split(":")
    variants = matrix.build(env_id, int(num_envs), policy, ["collector"], with_torchrl=False)

    async def run() -> dict[str, float]:
        samples: list[list[object]] = [[] for _ in variants]
        async with AsyncExitStack() as stack:
            for v in variants:
                await v.open(stack)
            for i in range(pairs):
                order = list(range(len(variants)))
                for k in order if i % 2 == 0 else order[::-1]:
                    samples[k].append(await variants[k].measure(seconds))
        raw, same, ours = samples
        return {
            "fps": statistics.median(o.fps / r.fps for o, r in zip(ours, raw, strict=True)),  # type: ignore[attr-defined]
            "cpu": statistics.median(r.cpu_us / o.cpu_us for o, r in zip(ours, raw, strict=True)),  # type: ignore[attr-defined]
            "fps_same": statistics.median(o.fps / r.fps for o, r in zip(ours, same, strict=True)),  # type: ignore[attr-defined]
            "raw_fps": statistics.median(r.fps for r in raw),  # type: ignore[attr-defined]
        }

    return anyio.run(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", help="git revision to compare against (required)")
    parser.add_argument("--cells", nargs="*", default=CELLS, help="env:num_envs:policy")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--pairs", type=int, default=3, help="measurements of each variant per child")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.seconds, args.pairs)))
        return
    if not args.base:
        parser.error("--base is required: the git revision to compare against, e.g. --base HEAD~5")
    results = ab_rounds(__file__, args.base, args.cells, args.rounds, args.seconds, args.pairs)
    b = args.base
    print(
        f"| cell | Collector / raw frames/s, this tree | same, {b} | this tree / {b} ({args.rounds} rounds) "
        f"| Collector / raw CPU-eff., this tree | same, {b} | Collector / same-step raw frames/s, this tree "
        f"| same, {b} | raw frames/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")

    def med(side: list[dict[str, float]], key: str) -> float:
        return statistics.median(s[key] for s in side)

    for cell, sides in results.items():
        new, base = sides["new"], sides["base"]
        ratio = [n["fps"] / o["fps"] for n, o in zip(new, base, strict=True)]
        print(
            f"| {cell} | {med(new, 'fps'):.2f} | {med(base, 'fps'):.2f} | {statistics.median(ratio):.3f} "
            f"({min(ratio):.2f} to {max(ratio):.2f}) | {med(new, 'cpu'):.2f} | {med(base, 'cpu'):.2f} "
            f"| {med(new, 'fps_same'):.2f} | {med(base, 'fps_same'):.2f} "
            f"| {med(new + base, 'raw_fps'):,.0f} |"
        )


if __name__ == "__main__":
    main()
