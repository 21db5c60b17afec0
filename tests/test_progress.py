"""Progress bars: built-in line, tqdm-like and rich-like objects, off when asked."""

from __future__ import annotations

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
