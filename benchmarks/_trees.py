"""An earlier revision of this repository checked out beside it, for the A/B benchmarks (``ab.py``,
``startup.py``): imports nothing heavy, so a benchmark that times its own imports can use it."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def base_tree(rev: str) -> Path:
    """A detached worktree of ``rev`` under the system temp folder (made once, reused after)."""
    sha = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, check=True, capture_output=True, text=True)
    path = Path(tempfile.gettempdir()) / f"aiocollect-ab-{sha.stdout.strip()[:12]}"
    if not (path / "src").exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=ROOT, check=True)
    return path
