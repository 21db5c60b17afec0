"""A ``ProcessVectorEnv`` worker's reply byte, awaited.

``anyio.wait_readable`` registers the socket with the loop and unregisters it at every wait (on asyncio:
two ``epoll_ctl`` calls, a future and the selector's bookkeeping per step). On asyncio (uvloop included)
the socket is instead registered once, on first use, with a reader that takes the reply byte itself and
hands it to the waiting task's future; it is unregistered when nobody waits for a reply (a cancelled
call: level-triggered readiness must not call it at every loop iteration), when the reply is not ``D``
(an error frame follows, read with ``wait_readable``) and when the env closes. Under trio, or from a loop
other than the one that registered it, a wait is ``anyio.wait_readable``.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from typing import Any

import anyio

__all__ = ["ReplyReader", "running_asyncio_loop"]


class ReplyReader:
    """Reads one worker's reply bytes (one waiter at a time)."""

    __slots__ = ("_fd", "_loop", "_sock", "_waiter")

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._fd = sock.fileno()
        self._loop: asyncio.AbstractEventLoop | None = None  # where the reader is registered
        self._waiter: asyncio.Future[bytes] | None = None

    async def reply(self) -> bytes:
        """The next reply byte (``b""``: the worker hung up)."""
        while True:
            try:
                reply = self._sock.recv(1)
            except BlockingIOError:
                if self._registered_here():
                    reply = await self._await_reader()
                else:
                    await anyio.wait_readable(self._sock)
                    continue
            except OSError:
                reply = b""
            if reply != b"D":
                self.unwatch()  # an error frame follows, read with wait_readable (or the socket is gone)
            return reply

    def _registered_here(self) -> bool:
        loop = running_asyncio_loop()
        if loop is None:
            return False
        if self._loop is not None and self._loop.is_closed():
            self._loop = None
        if self._loop is None:
            loop.add_reader(self._fd, self._readable)
            self._loop = loop
        return self._loop is loop

    async def _await_reader(self) -> bytes:
        assert self._loop is not None
        waiter = self._waiter = self._loop.create_future()
        try:
            return await waiter
        finally:
            self._waiter = None

    def _readable(self) -> None:  # the loop's reader callback
        waiter = self._waiter
        if waiter is None or waiter.done():  # nobody waits (a cancelled call): stop watching
            self.unwatch()
            return
        try:
            reply = self._sock.recv(1)
        except BlockingIOError:
            return
        except OSError:
            reply = b""
        self._waiter = None
        waiter.set_result(reply)

    def unwatch(self) -> None:
        """Unregister the reader (from the loop's thread; a closed loop dropped it already)."""
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._fd)


def running_asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The running asyncio loop, ``None`` in a trio task (trio's guest mode runs on an asyncio loop)."""
    trio: Any = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_task()
            return None
        except RuntimeError:
            pass
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
