"""TCP sockets for the serve servers and clients, made here so that an IP address never goes through
``getaddrinfo`` (which asyncio runs in its default executor, a thread that outlives the call)."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import anyio
import anyio.abc

__all__ = ["RawStream", "listen", "listen_socket", "open_tcp", "serve_sockets"]


async def _address(host: str, port: int) -> tuple[socket.AddressFamily, tuple[Any, ...]]:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        family, _, _, _, sockaddr = (await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM))[0]
        return family, sockaddr
    return (socket.AF_INET6, (host, port, 0, 0)) if ip.version == 6 else (socket.AF_INET, (host, port))


async def open_tcp(host: str, port: int) -> anyio.abc.SocketStream:
    """A connected TCP stream to ``host``:``port`` (``TCP_NODELAY`` set); ``OSError`` if refused."""
    family, sockaddr = await _address(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        code = sock.connect_ex(sockaddr)
        if code in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
            await anyio.wait_writable(sock)
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            raise OSError(code, f"{os.strerror(code)} ({host}:{port})")
        try:
            return await anyio.abc.SocketStream.from_socket(sock)
        except ValueError as exc:  # anyio's getpeername check: the peer reset the connection already
            raise OSError(errno.ENOTCONN, f"the connection was reset at once ({host}:{port})") from exc
    except BaseException:
        sock.close()
        raise


async def listen(host: str, port: int) -> tuple[anyio.abc.SocketListener, int]:
    """A TCP listener on ``host``:``port`` and the port it got (``port=0``: a free one)."""
    family, sockaddr = await _address(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(1024)
        sock.setblocking(False)
        listener = await anyio.abc.SocketListener.from_socket(sock)
    except BaseException:
        sock.close()
        raise
    return listener, sock.getsockname()[1]


async def listen_socket(host: str, port: int) -> tuple[socket.socket, int]:
    """A plain listening socket (non-blocking) on ``host``:``port`` and the port it got, for
    :func:`serve_sockets`: its connections stay plain sockets, which a thread can take over."""
    family, sockaddr = await _address(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(1024)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock, sock.getsockname()[1]


#: accept() errors that say "no connection this time" (or "out of fds for now"), never "stop listening"
_TRANSIENT = {errno.ECONNABORTED, errno.EPROTO, errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


async def serve_sockets(
    listener: socket.socket,
    handle: Callable[[RawStream], Coroutine[Any, Any, None]],
    tg: anyio.abc.TaskGroup,
) -> None:
    """Accept connections on ``listener`` forever, each served by ``handle(RawStream(conn))`` in ``tg``."""
    while True:
        await anyio.wait_readable(listener)
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            continue
        except OSError as exc:
            if exc.errno not in _TRANSIENT:
                raise
            await anyio.sleep(0.05)
            continue
        conn.setblocking(False)
        tg.start_soon(handle, RawStream(conn))


class RawStream(anyio.abc.ByteStream):
    """An anyio byte stream over a plain non-blocking socket that reads only when asked (``receive``):
    unlike anyio's own socket streams (an asyncio transport reads ahead), it can be handed over to a
    thread at any point between calls with :meth:`detach`."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock: socket.socket | None = sock

    def _socket(self) -> socket.socket:
        if self._sock is None:
            raise anyio.ClosedResourceError
        return self._sock

    async def receive(self, max_bytes: int = 65536) -> bytes:
        sock = self._socket()
        while True:
            try:
                data = sock.recv(max_bytes)
            except (BlockingIOError, InterruptedError):
                await anyio.wait_readable(sock)
                continue
            except OSError as exc:
                raise anyio.BrokenResourceError from exc
            if not data:
                raise anyio.EndOfStream
            return data

    async def send(self, item: bytes) -> None:
        sock = self._socket()
        view = memoryview(item)
        while view:
            try:
                sent = sock.send(view)
            except (BlockingIOError, InterruptedError):
                await anyio.wait_writable(sock)
                continue
            except OSError as exc:
                raise anyio.BrokenResourceError from exc
            view = view[sent:]

    async def send_eof(self) -> None:
        self._socket().shutdown(socket.SHUT_WR)

    async def aclose(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            anyio.notify_closing(sock)
            sock.close()

    def detach(self) -> socket.socket:
        """The socket, now the caller's (this stream is closed without closing it)."""
        sock = self._socket()
        self._sock = None
        return sock

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        sock = self._sock
        if sock is None:
            return {}
        return {
            anyio.abc.SocketAttribute.raw_socket: lambda: sock,
            anyio.abc.SocketAttribute.family: lambda: sock.family,
        }
