"""TCP sockets for the serve servers and clients, made here so that an IP address never goes through
``getaddrinfo`` (which asyncio runs in its default executor, a thread that outlives the call)."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from typing import Any

import anyio
import anyio.abc

__all__ = ["listen", "open_tcp"]


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
        return await anyio.abc.SocketStream.from_socket(sock)
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
