"""A vector client's connection served by a thread of its own with blocking I/O: the event loop is off its
hot path.

A :class:`aiocollect.RemoteVectorEnv` sends one message per step of all its envs and waits for the answer,
so its connection needs no concurrency: after the WebSocket handshake and the token check on the event
loop, the connection's plain socket (not TLS) is handed to a thread that receives a message, parses it
(wsproto), runs its job (decode, step, encode: :class:`._vector_jobs.VectorJob`) and sends the reply, in
a loop. That spares each message the loop's turns, a reader task, a hand-off to a worker thread and back.

The thread answers the client's pings between messages and keeps the server's heartbeat with socket
timeouts: a quiet client is pinged after ``interval`` seconds and dropped after ``timeout`` of silence
(closed with :data:`._ws.IDLE_CLOSE`, as the loop's side does: it held no request of the client's).
While a step runs longer than :data:`KEEPALIVE` seconds, a second thread of the connection answers a
client that spoke meanwhile (its ping, unread until the step ends) with an unsolicited pong, so that a
long step is never taken for silence; it never touches the socket otherwise.
:func:`serve_in_thread` owns both threads: cancelled (the server's ``async with`` ends), it shuts the
socket down, which ends the thread's ``recv``, waits for the threads (a step in progress finishes
first) and closes the socket.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from typing import Any

import anyio
import anyio.to_thread
from wsproto import WSConnection
from wsproto.events import BytesMessage, CloseConnection, Ping, TextMessage
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from ._vector_jobs import VectorJob
from ._wire import MAX_MESSAGE
from ._ws import IDLE_CLOSE, Heartbeat

__all__ = ["serve_in_thread"]

_CHUNK = 65536

#: seconds between the keep-alive thread's looks at a step in progress (and at most between its pongs)
KEEPALIVE = 0.05

#: an unsolicited pong frame from a server (FIN, opcode 0xA, no payload, no mask): RFC 6455 5.5.3
_PONG = b"\x8a\x00"


async def serve_in_thread(
    sock: socket.socket, ws: WSConnection, host: Any, hello: bytes, beat: Heartbeat | None, name: str
) -> None:
    """Serve the vector client on ``sock`` (its handshake done, ``ws`` its protocol state) in a new
    thread named ``name``: send ``hello``, then answer each message by stepping ``host``, until the client
    goes away, is silent past ``beat``, or this call is cancelled. The socket is closed on return."""
    rx, tx = socket.socketpair()
    try:
        rx.setblocking(False)
        conversation = _Conversation(sock, ws, host, beat)
        thread = threading.Thread(target=conversation.run, args=(hello, tx), name=name, daemon=True)
        keeper = threading.Thread(target=conversation.keep_alive, name=f"{name}-keepalive", daemon=True)
        thread.start()
        try:
            keeper.start()
            await anyio.wait_readable(rx)
        finally:
            with anyio.CancelScope(shield=True):
                if thread.is_alive():
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)  # ends the thread's recv (or its next send)
                    await anyio.wait_readable(rx)
                thread.join()
                conversation.over.set()
                if keeper.is_alive():
                    await anyio.to_thread.run_sync(keeper.join)  # at most KEEPALIVE seconds
    finally:
        for s in (rx, tx, sock):
            s.close()


class _Conversation:
    """The thread's side: blocking ``recv`` (with the heartbeat's timeouts), a job, ``sendall``."""

    def __init__(self, sock: socket.socket, ws: WSConnection, host: Any, beat: Heartbeat | None) -> None:
        self.sock, self.ws, self.host, self.beat = sock, ws, host, beat
        self._parts: list[bytes] = []
        self._size = 0
        self._heard = time.monotonic()
        self._pinged = 0.0
        self._ping_out = False
        self._lock = threading.Lock()  # one frame at a time on the socket (the keep-alive thread's too)
        self._job_since: float | None = None  # when the step in progress began
        #: set once the conversation is over: the keep-alive thread ends
        self.over = threading.Event()

    def keep_alive(self) -> None:
        """While a step runs, answer a client that spoke (a ping) with an unsolicited pong."""
        while not self.over.wait(KEEPALIVE):
            since = self._job_since
            if since is None or time.monotonic() - since < KEEPALIVE:
                continue
            try:
                if _readable(self.sock):
                    with self._lock:
                        if self._job_since == since:
                            self.sock.sendall(_PONG)
            except (OSError, ValueError):
                return  # the connection is over

    def run(self, hello: bytes, doorbell: socket.socket) -> None:
        try:
            self.sock.setblocking(True)
            self._send(self.ws.send(BytesMessage(data=hello)))
            while self._answer_events():
                data = self._receive()
                if data is None:
                    return
                self.ws.receive_data(data)
        except (OSError, LocalProtocolError, RemoteProtocolError):
            pass  # the client went away, or spoke garbage: the connection ends
        finally:
            self.over.set()
            doorbell.send(b"\0")

    def _answer_events(self) -> bool:
        """Answer what has arrived; ``False`` once the connection is over."""
        for event in self.ws.events():
            if isinstance(event, BytesMessage):
                self._size += len(event.data)
                if self._size > MAX_MESSAGE:
                    self._close(1009, "message too big")
                    return False
                self._parts.append(bytes(event.data))
                if event.message_finished:
                    message = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
                    self._parts, self._size = [], 0
                    job = VectorJob(self.host, message)
                    self._job_since = time.monotonic()
                    job.run()
                    self._job_since = None
                    self._send(self.ws.send(BytesMessage(data=job.reply)))
            elif isinstance(event, Ping):
                self._send(self.ws.send(event.response()))
            elif isinstance(event, TextMessage):
                self._close(1003, "binary messages only")
                return False
            elif isinstance(event, CloseConnection):
                with contextlib.suppress(OSError, LocalProtocolError):
                    self._send(self.ws.send(event.response()))
                return False
        return True

    def _receive(self) -> bytes | None:
        """The next bytes from the client (``None``: it closed), pinging it when quiet and giving up on it
        (``None``) once silent for the heartbeat's timeout with a ping of ours out for
        ``timeout - interval``."""
        beat = self.beat
        while True:
            if beat is None:
                self.sock.settimeout(None)
            else:
                now = time.monotonic()
                if not self._ping_out and now - self._heard >= beat.interval:
                    self._pinged, self._ping_out = now, True
                    self._send(self.ws.send(Ping()))
                if not self._ping_out:
                    deadline = self._heard + beat.interval
                else:
                    deadline = max(self._heard + beat.timeout, self._pinged + beat.timeout - beat.interval)
                    if now >= deadline:
                        # held no request of the client's: it may send its next one again elsewhere
                        self._close(IDLE_CLOSE if not self._parts else 1001, "no heartbeat answer")
                        return None
                self.sock.settimeout(max(deadline - now, 0.001))
            try:
                data = self.sock.recv(_CHUNK)
            except TimeoutError:
                continue
            if not data:
                return None
            self._heard, self._ping_out = time.monotonic(), False
            return data

    def _send(self, data: bytes) -> None:
        beat = self.beat
        self.sock.settimeout(None if beat is None else beat.timeout)
        with self._lock:
            self.sock.sendall(data)

    def _close(self, code: int, reason: str) -> None:
        """A close frame, best effort (the socket is closed by the owner)."""
        with contextlib.suppress(OSError, LocalProtocolError):
            self.sock.settimeout(1.0)
            with self._lock:
                self.sock.sendall(self.ws.send(CloseConnection(code=code, reason=reason)))


def _readable(sock: socket.socket) -> bool:
    """Whether ``sock`` has something to read (now; ``poll``: any fd number, unlike ``select``)."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))
    return bool(select.select([sock], [], [], 0)[0])
