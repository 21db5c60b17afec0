"""Process groups and their clean-up, for every kind of worker process (the collectors' workers,
``ProcessVectorEnv``'s): a worker leads a process group of its own, the parent signals the whole group, a
worker whose parent dies kills its group, and the workers a parent never reaped are killed at exit.

The parent side: :func:`started` and :func:`reaped` keep the registry of live workers, which an
``atexit`` handler kills with their groups if they were never reaped (before ``multiprocessing``'s own
exit handler would wait for them: ``atexit`` runs last-in, first-out, and ``multiprocessing.util``
registers its handler on import, before ours); :func:`signal_group` signals a worker and its group.
The worker side: :func:`lead_group` and :func:`watch_parent`, both in :func:`become_worker`.

Example:
    >>> import multiprocessing as mp, signal
    >>> process = mp.get_context("spawn").Process(target=int)
    >>> signal_group(process, signal.SIGTERM)  # not started: nothing to signal
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import signal
import socket
import threading
import warnings
import weakref
from typing import Any

from ._malloc import keep_freed_memory

__all__ = ["become_worker", "lead_group", "reaped", "signal_group", "started", "watch_parent"]

#: worker processes started and not reaped yet (not daemonic: their envs may start processes of their own)
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def started(process: Any) -> None:
    """``process`` (a started ``multiprocessing`` process) is killed with its group at exit unless
    :func:`reaped` first."""
    _LIVE.add(process)


def reaped(process: Any) -> None:
    """``process`` was reaped: nothing is left to kill at exit."""
    _LIVE.discard(process)


def signal_group(process: Any, sig: int) -> None:
    """Send ``sig`` to a worker process and to its process group (the processes its env started: the
    worker leads a group of its own). Either may be gone already."""
    pid = process.pid
    if pid is None:
        return
    if hasattr(os, "killpg"):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
    with contextlib.suppress(ProcessLookupError, ValueError):
        if process.exitcode is None:
            os.kill(pid, sig)


@atexit.register
def _kill_leftovers() -> None:
    for process in list(_LIVE):
        with contextlib.suppress(Exception):
            signal_group(process, signal.SIGKILL)
            process.join(5)


def lead_group() -> None:
    """Lead a process group of our own (in a worker): the parent reaps the worker *and* every process its
    env started (a torchrl ``ParallelEnv``, a gymnasium ``AsyncVectorEnv``) with one ``killpg``, and a
    Ctrl-C at the terminal reaches the parent only, which then stops us."""
    if hasattr(os, "setpgid"):
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)


def _kill_own_group() -> None:
    if hasattr(os, "killpg") and os.getpgid(0) == os.getpid():
        os.killpg(0, signal.SIGKILL)
    os._exit(1)


def watch_parent(sock: socket.socket, name: str) -> None:
    """A thread (named ``name``) that kills this worker's process group when the parent's end of ``sock``
    closes without a goodbye (the parent was killed): the main thread may be stuck in ``env.step`` and
    never read the socket's end. It only polls the socket (never reads it), so it steals no message."""
    if not hasattr(select, "poll"):  # pragma: no cover - not Linux/macOS: the main thread's EOF still ends us
        return
    hangup = select.POLLHUP | getattr(select, "POLLRDHUP", 0)

    def watch() -> None:
        poller = select.poll()
        poller.register(sock.fileno(), getattr(select, "POLLRDHUP", 0))
        while True:
            try:
                events = poller.poll()
            except InterruptedError:  # pragma: no cover - retried by Python itself since 3.5
                continue
            if any(mask & select.POLLNVAL for _, mask in events):
                return  # the worker closed its own end: it is exiting
            if any(mask & hangup for _, mask in events):
                _kill_own_group()

    threading.Thread(target=watch, name=name, daemon=True).start()


def become_worker(sock: socket.socket, name: str, show_warnings: bool) -> None:
    """A worker process's start: it leads a group of its own, which it kills when the parent at the other
    end of ``sock`` is gone (watched by a thread ``name``), leaves Ctrl-C to the trainer (which stops it),
    keeps the memory it frees for its next step (:func:`~aiocollect._core._malloc.keep_freed_memory`)
    and, unless ``show_warnings``, silences its warnings."""
    lead_group()
    keep_freed_memory()
    watch_parent(sock, name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not show_warnings:
        warnings.simplefilter("ignore")
