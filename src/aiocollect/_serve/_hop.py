"""``StepThread``: a vector client's own worker thread on the server, with a doorbell instead of a pool hop.

A vector client's message is one job of hundreds of microseconds (all its envs' steps); sending it to
``anyio.to_thread`` costs a pool hand-off, a limiter, a cancel scope and two extra loop turns per message.
Here the connection's thread takes jobs from a queue and rings a socket pair when one is done, which the
loop awaits with ``anyio.wait_readable``: one loop wake-up per message. The thread lives as long as the
connection (``async with``), and a job is never left half done: the wait for it is shielded.
"""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread

__all__ = ["StepThread"]

_STOP = object()


class StepThread:
    """``await thread.run(fn)`` runs ``fn()`` in this thread (one call at a time) and returns its result."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._rx, self._tx = socket.socketpair()
        self._rx.setblocking(False)
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._result: Any = None
        self._error: BaseException | None = None

    def _main(self) -> None:
        while (fn := self._jobs.get()) is not _STOP:
            try:
                self._result = fn()  # (a vector job answers its errors: this is for anything else)
            except BaseException as exc:
                self._error = exc
            finally:
                self._tx.send(b"\0")

    async def run(self, fn: Callable[[], Any]) -> Any:
        self._jobs.put(fn)
        with anyio.CancelScope(shield=True):  # a job is never left half done
            while True:
                try:
                    if self._rx.recv(1):
                        break
                except BlockingIOError:
                    await anyio.wait_readable(self._rx)
        result, error, self._result, self._error = self._result, self._error, None, None
        if error is not None:
            raise error
        return result

    async def __aenter__(self) -> StepThread:
        self._thread.start()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self._jobs.put(_STOP)
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._thread.join)
        self._rx.close()
        self._tx.close()
