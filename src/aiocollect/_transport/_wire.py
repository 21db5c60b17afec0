"""The control channel: messages (:mod:`._messages`) as length-prefixed pickle frames over a stream socket.

The parent side never blocks: it waits for readability with ``anyio.wait_readable`` (the socket is also
the worker's doorbell: one small frame per batch) and reads what is there without blocking. The worker
side is plain blocking code.
"""

from __future__ import annotations

import collections
import pickle
import socket
import struct
import time
from typing import Any

import anyio

__all__ = ["AsyncChannel", "BlockingChannel", "FrameReader", "connect_retrying", "encode"]

_HEADER = struct.Struct("!Q")


def encode(msg: Any) -> bytes:
    payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


class FrameReader:
    """Accumulates bytes and yields complete messages."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self._buf += data
        out = []
        while len(self._buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self._buf)
            end = _HEADER.size + n
            if len(self._buf) < end:
                break
            out.append(pickle.loads(bytes(self._buf[_HEADER.size : end])))
            del self._buf[:end]
        return out


# -- worker side: blocking -------------------------------------------------------------------------
class BlockingChannel:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.setblocking(True)
        self._reader = FrameReader()
        self._pending: list[Any] = []

    def send(self, msg: Any) -> None:
        self.sock.sendall(encode(msg))

    def recv(self, timeout: float | None = None) -> Any | None:
        """The next message; ``None`` on timeout. Raises ``EOFError`` when the parent is gone."""
        while not self._pending:
            self.sock.settimeout(timeout)
            try:
                data = self.sock.recv(1 << 16)
            except (TimeoutError, BlockingIOError):
                return None
            finally:
                self.sock.settimeout(None)
            if not data:
                raise EOFError("the parent closed the channel")
            self._pending.extend(self._reader.feed(data))
        return self._pending.pop(0)

    def poll(self) -> Any | None:
        """A message if one is waiting, else ``None`` (never blocks)."""
        if self._pending:
            return self._pending.pop(0)
        return self.recv(timeout=0.0)


# -- parent side: async ----------------------------------------------------------------------------
class AsyncChannel:
    """Parent end: ``receive()`` waits with ``anyio.wait_readable``; ``send()`` never blocks the loop."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.setblocking(False)
        self._reader = FrameReader()
        self._pending: list[Any] = []
        self._send_lock = anyio.Lock()
        #: frames (or their rests) not sent yet: a send cancelled midway leaves the rest of its frame here
        self._outbox: collections.deque[memoryview] = collections.deque()

    async def receive(self) -> Any:
        """The next message. Raises ``EOFError`` when the worker's end closed (it exited or died)."""
        while not self._pending:
            await anyio.wait_readable(self.sock)
            try:
                data = self.sock.recv(1 << 20)
            except BlockingIOError:
                continue
            except ConnectionResetError:
                data = b""
            if not data:
                raise EOFError("the worker closed the channel")
            self._pending.extend(self._reader.feed(data))
        return self._pending.pop(0)

    def receive_left(self) -> list[Any]:
        """The messages already received or waiting in the socket (never blocks): what a worker that has
        exited sent before it did."""
        out, self._pending = self._pending, []
        while True:
            try:
                data = self.sock.recv(1 << 20)
            except OSError:  # BlockingIOError: nothing more; or the socket is closed
                break
            if not data:
                break
            out.extend(self._reader.feed(data))
        return out

    async def send(self, msg: Any, *, encode_in_thread: bool = False) -> None:
        """Send one frame, whole. A send cancelled while waiting for the socket keeps the rest of its frame
        queued, and the next send completes it first: a partial frame would desynchronise the worker's
        reader (a cancelled ``update_weights`` with large weights on the socket did that).

        ``encode_in_thread``: pickle the message in a worker thread (a large one, e.g. a set-up message
        carrying a pickled policy, would hold the loop). The frame is sent in place, never copied."""
        frame = await anyio.to_thread.run_sync(encode, msg) if encode_in_thread else encode(msg)
        async with self._send_lock:
            self._outbox.append(memoryview(frame))
            while self._outbox:
                head = self._outbox[0]
                try:
                    n = self.sock.send(head)
                except BlockingIOError:
                    await anyio.wait_writable(self.sock)
                    continue
                if n == len(head):
                    self._outbox.popleft()
                else:
                    self._outbox[0] = head[n:]

    def close(self) -> None:
        self.sock.close()


def connect_retrying(host: str, port: int, timeout: float, retry_every: float) -> socket.socket:
    """A TCP connection to ``host:port`` with ``TCP_NODELAY``, tried again every ``retry_every`` seconds
    while nothing listens there yet, for up to ``timeout`` seconds (then the last ``OSError``)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=10.0)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(retry_every)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
