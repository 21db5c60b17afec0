"""An earlier revision of this repository checked out beside it, for the A/B benchmarks (``ab.py``,
``startup.py``, ``ab_matrix.py``, ``envpool_ab.py``), and the rounds that measure a cell in each tree in
turn: imports nothing heavy, so a benchmark that times its own imports can use it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def base_tree(rev: str) -> Path:
    """A detached worktree of ``rev`` under the system temp folder (made once, reused after)."""
    sha = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, check=True, capture_output=True, text=True)
    path = Path(tempfile.gettempdir()) / f"aiocollect-ab-{sha.stdout.strip()[:12]}"
    if not (path / "src").exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=ROOT, check=True)
    return path


def run_child(
    script: str, tree: Path, cell: str, seconds: float, pairs: int, extra: Sequence[str] = ()
) -> dict[str, float]:
    """``script --child cell [extra]`` with ``tree``'s ``src`` first on the path; the JSON its last line
    prints."""
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{ROOT / 'benchmarks'}"}
    args = [sys.executable, script, "--child", cell, "--seconds", str(seconds), "--pairs", str(pairs), *extra]
    out = subprocess.run(args, env=env, check=True, capture_output=True, text=True, cwd=ROOT)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def ab_rounds(
    script: str,
    base: str,
    cells: list[str],
    rounds: int,
    seconds: float,
    pairs: int,
    extra: Sequence[str] = (),
) -> dict[str, dict[str, list[dict[str, float]]]]:
    """Each cell measured by ``script``'s child in this tree ("new") and in ``base``'s, in turn (the order
    alternating from round to round): ``{cell: {"new": [...], "base": [...]}}``, one result per round."""
    trees = {"new": ROOT, "base": base_tree(base)}
    results: dict[str, dict[str, list[dict[str, float]]]] = {c: {"new": [], "base": []} for c in cells}
    for r in range(rounds):
        for cell in cells:
            for side in ["new", "base"] if r % 2 == 0 else ["base", "new"]:
                results[cell][side].append(run_child(script, trees[side], cell, seconds, pairs, extra))
        print(f"round {r + 1}/{rounds} done", file=sys.stderr)
    return results
