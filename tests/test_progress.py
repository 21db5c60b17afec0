"""Progress bars: built-in line, tqdm-like and rich-like objects, off when asked; the built-in bar and the
user's prints on one terminal."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest

from aiocollect import Collector, MultiSyncCollector
from support import cartpole

pytestmark = pytest.mark.anyio


class FakeTqdm:
    def __init__(self):
        self.n = 0
        self.postfix = None

    def update(self, n):
        self.n += n

    def set_postfix(self, postfix, refresh=True):
        self.postfix = postfix


class FakeRich:
    def __init__(self):
        self.tasks = {}

    def add_task(self, description, total=None):
        self.tasks[0] = {"total": total, "completed": 0}
        return 0

    def update(self, task_id, advance=0):
        self.tasks[task_id]["completed"] += advance


async def test_tqdm_like_and_rich_like_objects():
    bar = FakeTqdm()
    async with Collector(cartpole, frames_per_batch=50, total_frames=200, progress=bar) as c:
        [_ async for _ in c]
    assert bar.n == 200
    assert "frames/s" in bar.postfix
    rich = FakeRich()
    async with MultiSyncCollector(
        [cartpole, cartpole], frames_per_batch=50, total_frames=100, progress=rich, worker_backend="serial"
    ) as c:
        [_ async for _ in c]
    assert rich.tasks[0] == {"total": 100, "completed": 100}


async def test_builtin_bar_and_off(capsys):
    async with Collector(cartpole, frames_per_batch=50, total_frames=100, progress=True) as c:
        [_ async for _ in c]
    err = capsys.readouterr().err
    assert "100/100 frames" in err
    assert "frames/s" in err
    async with Collector(cartpole, frames_per_batch=50, total_frames=100) as c:  # stderr is no tty: off
        [_ async for _ in c]
    assert capsys.readouterr().err == ""


def test_bad_progress_argument():
    with pytest.raises(TypeError, match="progress"):
        Collector(cartpole, frames_per_batch=10, progress="yes")


# -- the bar and the user's prints on a terminal (a pseudo-terminal) -----------------------------------
SCRIPT = """
import sys, anyio
from aiocollect import Collector, GymEnv

async def main():
    async with Collector(lambda: GymEnv("CartPole-v1", num_envs=4), frames_per_batch=100,
                         total_frames=3000) as c:
        assert sys.stderr.isatty()  # the bar is on by default
        async for _ in c:
            s = c.statistics()
            if s.batches % 3 == 0:
                print(f"batch {s.batches:4d} frames {s.frames:7d} and some more words")
            if s.batches == 10:
                print("partial line ", end="", flush=True)  # the bar waits for it to end
                print("then its end")
                print("a warning on stderr", file=sys.stderr)
    print("finished")

anyio.run(main)
"""


def render(raw: str) -> list[str]:
    """The screen a terminal shows for ``raw``: carriage returns, ``ESC[2K`` (erase the line), newlines."""
    lines, row, col = [[]], 0, 0
    i = 0
    while i < len(raw):
        if raw.startswith("\x1b[2K", i):
            lines[row] = []
            i += 4
            continue
        ch = raw[i]
        i += 1
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row, col = row + 1, 0
            if row == len(lines):
                lines.append([])
        else:
            line = lines[row]
            line.extend(" " * (col - len(line)))
            if col < len(line):
                line[col] = ch
            else:
                line.append(ch)
            col += 1
    return ["".join(line).rstrip() for line in lines]


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_bar_and_prints_share_a_terminal_cleanly(tmp_path: Path) -> None:
    master, slave = os.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        cwd=tmp_path,
        env={**os.environ, "COLUMNS": "120"},
    )
    os.close(slave)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 60)
            assert ready, "the script printed nothing for 60 s"
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(master)
        assert proc.wait(timeout=60) == 0, b"".join(chunks).decode(errors="replace")
    screen = [line for line in render(b"".join(chunks).decode()) if line]
    printed = [line for line in screen if "batch" in line]
    assert len(printed) == 10
    for line in printed:  # whole lines, never split by the bar nor sharing a line with it
        assert re.fullmatch(r"batch +\d+ frames +\d+ and some more words", line), screen
    assert "partial line then its end" in screen and "a warning on stderr" in screen
    bars = [line for line in screen if "frames/s" in line]
    assert len(bars) == 1 and "3000/3000 frames" in bars[0], screen  # the final bar, once
    assert screen[-2:] == [bars[0], "finished"]
