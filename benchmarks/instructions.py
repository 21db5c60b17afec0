"""Instructions per frame, counted by valgrind's callgrind over every process (issue 42): a collector
against the raw gymnasium loop that stores every key a batch holds, as ``matrix.py`` builds them.

Timings of a few percent drown in a shared machine's drift; instruction counts do not. Each variant runs
twice under ``valgrind --tool=callgrind --trace-children=yes`` (so a multi-process collector's forkserver
and workers are counted too), once collecting ``--batches A`` batches and once ``B``; the difference of
the two runs' instructions, summed over all their processes, divided by the difference of their frames
is the cost of a frame with every start-up cost cancelled out. The report gives each variant's
instructions per frame, split into this process (the trainer) and the others (workers), and the
efficiency raw / collector (above 1: fewer instructions than the raw loop).

What it cannot see: the kernel's work (page faults, wake-ups), caches and memory traffic, and time a core
waits. ``perf stat`` over the process tree and ``matrix.py``'s timed rounds see those; this sees whether
the collector's own code adds work. Two things are left out because valgrind would count them many times
over: ``OPENBLAS_NUM_THREADS=1`` is set (an idle OpenBLAS thread's spin is counted at valgrind's whim), and
the collector's event-loop lag monitor does not tick (a timer 20 times a second,
which under valgrind ticks ~50x more often per frame than at native speed). Slow: valgrind runs about 50x
slower than the CPU, so a cell takes minutes (two runs at a time, one per core).

A cell is ``ENV:N:POLICY:COLLECTOR`` (``collector``, ``multisync`` or ``multiasync``; N envs per worker).
``multiasync`` workers run ahead of the batches taken, so its figure is only as good as ``B - A`` is large
against the 2 batches per worker collected ahead.

```bash
python benchmarks/instructions.py --cells ALE/Pong-v5:1:random:collector ALE/Pong-v5:8:cnn:multisync
```
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ab_matrix import parse_cell

ROOT = Path(__file__).resolve().parents[1]
_SUMMARY = re.compile(rb"^(?:summary|totals):\s*(\d+)", re.MULTILINE)


def child(cell: str, kind: str, batches: int) -> dict[str, int]:
    """Open the cell's raw loop or collector, collect ``batches`` batches after its warm-up one, and
    report the frames of those batches and this process's pid."""
    from contextlib import AsyncExitStack

    import anyio
    import matrix

    from aiocollect._observe import _events

    async def no_ticks(self: Any) -> None:  # the loop-lag monitor, left out (see the module's text)
        pass

    _events.LoopLag.run = no_ticks  # type: ignore[method-assign]
    env_id, num_envs, policy, collector, _ = parse_cell(cell)

    async def run() -> int:
        variants = matrix.build(env_id, int(num_envs), policy, [collector], False, raw="store")
        variant = variants[0] if kind == "raw" else variants[1]
        frames = 0
        async with AsyncExitStack() as stack:
            await variant.open(stack)  # builds, opens and collects one batch
            for _ in range(batches):
                frames += await variant.batch()
        return frames

    return {"frames": anyio.run(run), "pid": os.getpid()}


def counted(cell: str, kind: str, batches: int, folder: Path) -> dict[str, int]:
    """One run under callgrind: its frames, and the instructions of this run's main process and of all
    the others."""
    out = folder / f"{kind}-{batches}"
    out.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'benchmarks'}",
        "OPENBLAS_NUM_THREADS": "1",
    }
    args = [
        "valgrind", "--tool=callgrind", "--trace-children=yes", f"--callgrind-out-file={out}/cg.%p",
        "--log-file=/dev/null", sys.executable, __file__, "--child", cell, kind, str(batches),
    ]  # fmt: skip
    done = subprocess.run(args, env=env, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        sys.exit(f"{cell} ({kind}, {batches} batches) failed under valgrind:\n{done.stderr[-4000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    main = other = 0
    for path in out.glob("cg.*"):
        match = _SUMMARY.search(path.read_bytes())
        count = int(match.group(1)) if match else 0
        if path.name == f"cg.{report['pid']}":
            main += count
        else:
            other += count
    return {"frames": report["frames"], "main": main, "other": other}


def per_frame(
    cell: str, kind: str, a: int, b: int, folder: Path, pool: ThreadPoolExecutor
) -> dict[str, float]:
    """Instructions per frame of ``kind`` (``raw`` or ``ours``): the difference of a ``b``-batch run and
    an ``a``-batch one."""
    runs = list(pool.map(lambda n: counted(cell, kind, n, folder), (a, b)))
    frames = runs[1]["frames"] - runs[0]["frames"]
    main = (runs[1]["main"] - runs[0]["main"]) / frames
    other = (runs[1]["other"] - runs[0]["other"]) / frames
    return {"frames": frames, "main": main, "other": other, "total": main + other}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", nargs="+", default=["ALE/Pong-v5:1:random:collector"])
    parser.add_argument("--batches", type=int, nargs=2, default=(1, 6), metavar=("A", "B"))
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        cell, kind, batches = args.child
        print(json.dumps(child(cell, kind, int(batches))))
        return
    a, b = args.batches
    if not 0 <= a < b:
        parser.error("--batches A B needs 0 <= A < B")
    from matrix import COLLECTORS

    for cell in args.cells:  # checked before any run starts (ab_matrix's cell format, one collector named)
        try:
            collector = parse_cell(cell)[3]
        except ValueError as e:
            parser.error(str(e))
        if cell.count(":") != 3 or collector not in COLLECTORS:
            parser.error(
                f"a cell is ENV:N:POLICY:COLLECTOR, COLLECTOR one of {', '.join(COLLECTORS)}; got {cell!r}"
            )
    print("| cell | raw: instructions/frame | collector: trainer + workers | raw / collector |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(2) as pool:
        for i, cell in enumerate(args.cells):
            folder = Path(tmp) / str(i)
            folder.mkdir()
            raw = per_frame(cell, "raw", a, b, folder, pool)
            ours = per_frame(cell, "ours", a, b, folder, pool)
            print(
                f"| {cell} | {raw['total'] / 1e3:,.1f} k | {ours['main'] / 1e3:,.1f} k + "
                f"{ours['other'] / 1e3:,.1f} k = {ours['total'] / 1e3:,.1f} k | "
                f"{raw['total'] / ours['total']:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
