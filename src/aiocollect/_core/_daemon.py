"""Blocking calls that may have to be abandoned (a rendezvous whose peers died), run in daemon threads.

``anyio.to_thread.run_sync(..., abandon_on_cancel=True)`` leaves the call running in one of anyio's
worker threads, which the interpreter joins at exit: a rendezvous abandoned after a failed start-up then
keeps the process alive until torch's own timeout (minutes). A daemon thread does not hold the exit.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

T = TypeVar("T")

__all__ = ["run_abandonable"]


async def run_abandonable(fn: Callable[..., T], *args: Any, name: str = "aiocollect rendezvous") -> T:
    """``fn(*args)`` in a daemon thread; if the caller is cancelled, the thread is left to finish (or
    to die with the process). The result (or exception) is returned (raised) as with ``to_thread``."""
    wake_r, wake_w = socket.socketpair()
    box: list[tuple[bool, Any]] = []

    def target() -> None:
        try:
            box.append((True, fn(*args)))
        except BaseException as exc:
            box.append((False, exc))
        with contextlib.suppress(OSError):
            wake_w.send(b"x")
        wake_w.close()

    try:
        wake_r.setblocking(False)
        threading.Thread(target=target, name=name, daemon=True).start()
        while not box:
            await anyio.wait_readable(wake_r)
            with contextlib.suppress(BlockingIOError):
                wake_r.recv(1)
    finally:
        wake_r.close()
    ok, value = box[0]
    if not ok:
        raise value
    return value
