"""The forkserver every worker process is forked from: its context, with what it imports first
(``_preload.py``), and its early start, so that its imports overlap the trainer's own start-up."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from typing import Any

from .._core._mistakes import check_main_guard
from ._preload import PRELOAD

__all__ = ["context", "start_forkserver"]


def context(start_method: str) -> Any:
    """multiprocessing's context for ``start_method`` (the forkserver's with aiocollect's preload)."""
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_forkserver(backend: str, start_method: str, caller: str) -> None:
    """Start multiprocessing's forkserver now if ``backend`` workers will start through it (it is shared by
    the whole process and lives as long as it). Called when a collector (``caller``, for messages) is
    built: the forkserver's imports (most of a first start-up, ~1-2 s) then overlap whatever the trainer
    does before it enters the collector. Spawning it takes a few milliseconds and waits for nothing; if it
    fails, the start-up fails the same way later. First, before any process starts, a script that would
    start collection again in every worker (no main guard) is refused.
    """
    if backend != "process":
        return
    check_main_guard(caller, start_method)
    if start_method != "forkserver":
        return
    from multiprocessing import forkserver

    context(start_method)
    with contextlib.suppress(OSError):
        forkserver.ensure_running()
