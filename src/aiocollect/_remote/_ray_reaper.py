"""A watchdog for the local Ray cluster a :class:`~aiocollect.RayCollector` starts itself.

When the trainer dies without shutting the cluster down (``SIGKILL``, an OOM kill), Ray's own reaper
ends its GCS and raylet at once and the actors follow in about 1.5 s, but its dashboard and runtime-env
agents wait for about 60 s on the dead GCS before they exit. The watchdog is a small process in a session
of its own (a kill of the trainer's process group does not reach it) that reads the cluster's pids from a
pipe; at the pipe's EOF without a goodbye (the trainer died) it kills those of them still running, each
checked by its start time (a pid reused meanwhile is left alone). Linux only (``/proc``); elsewhere
:func:`start_watchdog` returns ``None``.

Example:
    >>> watchdog = start_watchdog()  # doctest: +SKIP
    >>> watchdog.watch(descendants(os.getpid()))  # doctest: +SKIP
    >>> watchdog.close()  # the cluster was shut down: nothing to kill  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable

from .._core._pids import pid_alive

__all__ = ["Watchdog", "descendants", "end_processes", "start_watchdog", "start_time"]

_CODE = r"""
import os, signal, sys

def start_time(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None

watched = {}
for line in sys.stdin:
    line = line.strip()
    if line == "done":
        sys.exit(0)
    pid, started = line.split()
    watched[int(pid)] = started
for pid, started in watched.items():  # the trainer died: so does what it started
    if start_time(pid) == started:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
"""


def start_time(pid: int) -> str | None:
    """``pid``'s start time (clock ticks after boot, from ``/proc``), or ``None`` if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def descendants(root: int) -> list[int]:
    """Every process under ``root`` (children, theirs...), from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def end_processes(pids: Iterable[int], grace: float) -> None:
    """Wait up to ``grace`` seconds for ``pids`` (killed actors and what ran under them, on this machine)
    to end, then ``SIGKILL`` those still running (each checked by its start time, so that a pid reused
    meanwhile is left alone) and wait for them, 1 s at most."""
    started = {pid: t for pid in pids if (t := start_time(pid)) is not None}

    def running() -> list[int]:
        return [pid for pid, t in started.items() if start_time(pid) == t and pid_alive(pid)]

    for wait, kill in ((grace, True), (1.0, False)):
        deadline = time.monotonic() + wait
        while (left := running()) and time.monotonic() < deadline:
            time.sleep(0.01)
        if not (kill and left):
            return
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


class Watchdog:
    """The trainer's end of the watchdog: :meth:`watch` adds pids, :meth:`close` says goodbye."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self._process = process
        self.pid = process.pid

    def watch(self, pids: Iterable[int]) -> None:
        """Kill ``pids`` if the trainer dies before :meth:`close`."""
        stdin = self._process.stdin
        if stdin is None or stdin.closed:
            return
        lines = [f"{pid} {started}\n" for pid in pids if pid != self.pid and (started := start_time(pid))]
        with contextlib.suppress(OSError):
            stdin.write("".join(lines))
            stdin.flush()

    def close(self) -> None:
        """The cluster was shut down: the watchdog exits without killing anything (idempotent)."""
        stdin = self._process.stdin
        if stdin is not None and not stdin.closed:
            with contextlib.suppress(OSError):
                stdin.write("done\n")
                stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(5.0)
        if self._process.poll() is None:  # pragma: no cover - it exits at "done"
            self._process.kill()
            self._process.wait()


def start_watchdog() -> Watchdog | None:
    """A running watchdog (``None`` without ``/proc``)."""
    if not os.path.isdir("/proc/self"):  # pragma: no cover - not Linux
        return None
    process = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _CODE],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        close_fds=True,
    )
    return Watchdog(process)
