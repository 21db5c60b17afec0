"""A WebSocket over an anyio byte stream (wsproto does the protocol): binary messages only.

Runs under asyncio, uvloop and trio alike. :func:`connect` is the client side (the token travels in the
upgrade request's ``Authorization: Bearer`` header), :func:`accept` the server side: it reads the upgrade
request, checks the token in constant time and the path with ``route``, and answers ``101`` or an HTTP
error *before* any message is read. A peer that goes away (EOF, reset, close frame) makes ``receive`` and
``send`` raise :class:`RemoteConnectionError` (a ``ConnectionError``).
"""

from __future__ import annotations

import hmac
import socket
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.abc

try:
    from wsproto import ConnectionType, WSConnection
    from wsproto.events import (
        AcceptConnection,
        BytesMessage,
        CloseConnection,
        Ping,
        RejectConnection,
        RejectData,
        Request,
        TextMessage,
    )
    from wsproto.utilities import LocalProtocolError, RemoteProtocolError
except ImportError as exc:  # pragma: no cover - the serve extra is missing
    raise ImportError("serving envs and policies needs wsproto: pip install 'aiocollect[serve]'") from exc

from ._tcp import open_tcp
from ._wire import MAX_MESSAGE

__all__ = ["RemoteConnectionError", "TokenRefusedError", "WebSocket", "accept", "connect", "split_url"]

_CHUNK = 65536


class RemoteConnectionError(ConnectionError):
    """A serve connection could not be made, or was lost (server process killed, network down, closed)."""


class TokenRefusedError(PermissionError):
    """The server refused the connection's token (HTTP 403 during the WebSocket handshake)."""


class WebSocket:
    """One open WebSocket: :meth:`send` and :meth:`receive` whole binary messages; :meth:`aclose`."""

    def __init__(self, stream: anyio.abc.ByteStream, ws: WSConnection, peer: str) -> None:
        self._stream = stream
        self._ws = ws
        self.peer = peer
        self._pending: deque[bytes] = deque()
        self._parts: list[bytes] = []
        self._size = 0
        self.closed = False
        self._close_reason: str | None = None

    async def send(self, message: bytes) -> None:
        if self.closed:
            raise RemoteConnectionError(f"connection to {self.peer} is closed")
        try:
            await self._stream.send(self._ws.send(BytesMessage(data=message)))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError, LocalProtocolError) as exc:
            await self.abort()
            raise RemoteConnectionError(f"connection to {self.peer} lost: {exc!r}") from exc

    async def receive(self) -> bytes:
        """The next whole binary message."""
        while True:
            try:
                await self._handle_events()  # what arrived with the handshake or the last read, first
            except RemoteProtocolError as exc:
                await self.abort()
                raise RemoteConnectionError(f"bad WebSocket data from {self.peer}: {exc}") from None
            if self._pending:
                return self._pending.popleft()
            if self.closed:
                raise RemoteConnectionError(self._close_reason or f"connection to {self.peer} is closed")
            try:
                data = await self._stream.receive(_CHUNK)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                await self.abort()
                raise RemoteConnectionError(
                    f"connection to {self.peer} lost ({type(exc).__name__})"
                ) from None
            self._ws.receive_data(data)

    async def _handle_events(self) -> None:
        for event in self._ws.events():
            if isinstance(event, BytesMessage):
                self._size += len(event.data)
                if self._size > MAX_MESSAGE:
                    await self.aclose(1009, "message too big")
                    raise RemoteConnectionError(f"{self.peer} sent a message over {MAX_MESSAGE} bytes")
                self._parts.append(bytes(event.data))
                if event.message_finished:
                    self._pending.append(b"".join(self._parts))
                    self._parts, self._size = [], 0
            elif isinstance(event, TextMessage):
                await self.aclose(1003, "binary messages only")
                raise RemoteConnectionError(f"{self.peer} sent a text message (binary messages only)")
            elif isinstance(event, Ping):
                await self._stream.send(self._ws.send(event.response()))
            elif isinstance(event, CloseConnection):
                reason = (
                    f"closed by {self.peer} (code {event.code}{f': {event.reason}' if event.reason else ''})"
                )
                await self.aclose(event.code)
                self._close_reason = reason  # raised once the messages before the close are read
                return

    async def aclose(self, code: int = 1000, reason: str | None = None) -> None:
        """Send a close frame (best effort, at most 1 s) and close the socket."""
        if self.closed:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(1):
            try:
                await self._stream.send(self._ws.send(CloseConnection(code=code, reason=reason)))
            except Exception:
                pass
        await self.abort()

    async def abort(self) -> None:
        """Close the socket now (no close frame)."""
        self.closed = True
        with anyio.CancelScope(shield=True):
            await self._stream.aclose()


def split_url(url: str) -> tuple[str, int, str]:
    """``ws://host:port/path`` -> (host, port, path); ``ValueError`` naming the URL otherwise."""
    parts = urlsplit(url)
    if parts.scheme != "ws" or not parts.hostname or parts.port is None:
        raise ValueError(f"url must look like 'ws://127.0.0.1:8765', got {url!r}")
    return parts.hostname, parts.port, parts.path.rstrip("/")


async def connect(url: str, path: str, token: str, *, connect_timeout: float = 10.0) -> WebSocket:
    """A client WebSocket to ``url`` + ``path``; ``PermissionError`` (token), ``ConnectionError``."""
    host, port, base = split_url(url)
    try:
        with anyio.fail_after(connect_timeout):
            stream = await open_tcp(host, port)
    except (OSError, TimeoutError) as exc:
        raise RemoteConnectionError(f"cannot connect to {url}: {exc}") from exc
    try:
        _nodelay(stream)
        ws = WSConnection(ConnectionType.CLIENT)
        request = Request(
            host=f"{host}:{port}",
            target=base + path,
            extra_headers=[(b"authorization", f"Bearer {token}".encode())],
        )
        with anyio.fail_after(connect_timeout):
            await stream.send(ws.send(request))
            status, body = await _handshake_answer(stream, ws, url)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await stream.aclose()
        raise
    if status == 403:
        await stream.aclose()
        raise TokenRefusedError(f"{url} refused the token (HTTP 403): pass the server's token= to the client")
    if status != 101:
        await stream.aclose()
        raise ConnectionRefusedError(f"{url}{path} refused the connection (HTTP {status}: {body})")
    return WebSocket(stream, ws, url)


async def _handshake_answer(stream: anyio.abc.ByteStream, ws: WSConnection, url: str) -> tuple[int, str]:
    status, body = 0, b""
    while True:
        try:
            data = await stream.receive(_CHUNK)
        except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
            raise RemoteConnectionError(f"{url} closed the connection during the handshake") from None
        ws.receive_data(data)
        for event in ws.events():
            if isinstance(event, AcceptConnection):
                return 101, ""
            if isinstance(event, RejectConnection):
                status = event.status_code
                if not event.has_body:
                    return status, ""
            elif isinstance(event, RejectData):
                body += event.data
                if event.body_finished:
                    return status, body.decode(errors="replace")


Route = Callable[[str], Awaitable["int | None"]]


async def accept(
    stream: anyio.abc.ByteStream, token: str, route: Route, *, handshake_timeout: float = 10.0
) -> tuple[WebSocket, str] | None:
    """The server side of the handshake: ``(websocket, path)``, or ``None`` when refused (and closed).

    ``await route(path)`` returns ``None`` to accept or an HTTP status to refuse with; it is only called
    once the token has been checked, so a client without the token learns nothing about the paths.
    The stream is closed on every way out but success (refusal, error, cancellation)."""
    try:
        return await _accept(stream, token, route, handshake_timeout)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await stream.aclose()
        raise


async def _accept(
    stream: anyio.abc.ByteStream, token: str, route: Route, handshake_timeout: float
) -> tuple[WebSocket, str] | None:
    _nodelay(stream)
    ws = WSConnection(ConnectionType.SERVER)
    request = None
    with anyio.move_on_after(handshake_timeout):
        while request is None:
            try:
                ws.receive_data(await stream.receive(_CHUNK))
                request = next((e for e in ws.events() if isinstance(e, Request)), None)
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError, RemoteProtocolError):
                break
    if request is None:
        await stream.aclose()
        return None
    status = 403 if not _token_ok(request.extra_headers, token) else await route(request.target)
    if status is not None:
        await _refuse(stream, ws, status)
        return None
    try:
        await stream.send(ws.send(AcceptConnection()))
    except (anyio.BrokenResourceError, OSError):
        await stream.aclose()
        return None
    return WebSocket(stream, ws, "client"), request.target


def _token_ok(headers: Any, token: str) -> bool:
    expected = f"Bearer {token}".encode()
    given = next((value for name, value in headers if name.lower() == b"authorization"), b"")
    return hmac.compare_digest(bytes(given), expected)


async def _refuse(stream: anyio.abc.ByteStream, ws: WSConnection, status: int) -> None:
    body = {403: b"bad token", 404: b"no such path", 409: b"in use"}.get(status, b"refused")
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
    try:
        with anyio.move_on_after(1):
            await stream.send(ws.send(RejectConnection(status_code=status, headers=headers, has_body=True)))
            await stream.send(ws.send(RejectData(data=body)))
    except (anyio.BrokenResourceError, OSError):
        pass
    finally:
        await stream.aclose()


def _nodelay(stream: anyio.abc.ByteStream) -> None:
    raw = stream.extra(anyio.abc.SocketAttribute.raw_socket, None)
    if raw is not None and raw.family in (socket.AF_INET, socket.AF_INET6):
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
