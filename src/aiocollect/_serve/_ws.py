"""A WebSocket over an anyio byte stream (wsproto does the protocol): binary messages only.

Runs under asyncio, uvloop and trio alike. :func:`connect` is the client side (the token travels in the
upgrade request's ``Authorization: Bearer`` header), :func:`accept` the server side: it reads the upgrade
request, checks the token in constant time and the path with ``route``, and answers ``101`` or an HTTP
error *before* any message is read. A peer that goes away (EOF, reset, close frame) makes ``receive`` and
``send`` raise :class:`RemoteConnectionError` (a ``ConnectionError``).

Liveness (:class:`Heartbeat`): whoever reads a WebSocket pings its peer once the connection has been
quiet for ``interval`` seconds, and gives up on it (:class:`RemoteConnectionError`, the socket closed)
once nothing at all (a message, a ping, a pong) has come back for ``timeout`` seconds. A peer's pings are
answered by the reading task as they arrive, so a long env step or forward pass on either side is never
taken for silence; a peer that vanished without a FIN or RST (machine gone, process stopped, network
cut) is. A reader that was itself held up (a blocked loop, a stopped process) reads what has arrived
before it decides.
"""

from __future__ import annotations

import hmac
import socket
import ssl
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
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
        Pong,
        RejectConnection,
        RejectData,
        Request,
        TextMessage,
    )
    from wsproto.utilities import LocalProtocolError, RemoteProtocolError
except ImportError as exc:  # pragma: no cover - the serve extra is missing
    raise ImportError("serving envs and policies needs wsproto: pip install 'aiocollect[serve]'") from exc

from ._tcp import RawStream, open_tcp
from ._wire import MAX_MESSAGE

__all__ = [
    "CLIENT_HEARTBEAT",
    "IDLE_CLOSE",
    "MAX_HANDSHAKE",
    "MAX_HEADERS",
    "BadHandshake",
    "SERVER_HEARTBEAT",
    "Heartbeat",
    "RemoteConnectionError",
    "TokenRefusedError",
    "UnreadError",
    "WebSocket",
    "accept",
    "ask",
    "check_client_tls",
    "connect",
    "heartbeat",
    "split_url",
]

_CHUNK = 65536

#: the largest upgrade request head a server reads (bytes), and the most headers it may have: a bigger
#: one is refused (HTTP 431) before it is parsed. A client's head is about 300 bytes
MAX_HANDSHAKE = 16 * 1024
MAX_HEADERS = 64

#: the close code of a server that drops a client silent while it had no request of the client's in hand
#: (an idle ``RemoteEnv`` or ``RemotePolicy`` connection whose loop did not read): the client's next call
#: knows that its request was never read, and may reconnect and send it again
IDLE_CLOSE = 4408

#: the clients' default heartbeat (seconds): ping a quiet server after 5, give up after 10 of silence.
#: A server's loop never steps an env nor runs a forward pass, so it answers within milliseconds even
#: while busy; 10 s leaves room for a loaded machine and is still far below TCP's own timeouts (minutes)
CLIENT_HEARTBEAT = (5.0, 10.0)

#: the servers' default heartbeat (seconds): ping a quiet client after 5, drop it after 60 of silence. Longer
#: than a client's (10): a client whose loop is held up (a training step run on it) still answers late,
#: and a dead client costs only its envs' claim, while a dead server stalls its clients
SERVER_HEARTBEAT = (5.0, 60.0)


@dataclass(frozen=True)
class Heartbeat:
    """Keep-alive settings of one side: ping after ``interval`` quiet seconds, give up after ``timeout``."""

    interval: float
    timeout: float


def heartbeat(interval: float | None, timeout: float | None) -> Heartbeat | None:
    """The :class:`Heartbeat` for ``heartbeat_interval``/``heartbeat_timeout`` (either ``None``: off),
    or ``ValueError`` naming the argument."""
    if interval is None or timeout is None:
        return None
    for name, value in (("heartbeat_interval", interval), ("heartbeat_timeout", timeout)):
        if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
            raise ValueError(f"{name} must be seconds > 0 (or None to turn the heartbeat off), got {value!r}")
    if timeout <= interval:
        raise ValueError(
            f"heartbeat_timeout ({timeout!r}) must be longer than heartbeat_interval ({interval!r}): "
            "the peer needs time to answer a ping (e.g. interval 5, timeout 10)"
        )
    return Heartbeat(float(interval), float(timeout))


class RemoteConnectionError(ConnectionError):
    """A serve connection could not be made, or was lost (server process killed, network down, closed)."""


class UnreadError(RemoteConnectionError):
    """The connection was lost before the peer read the request (see :func:`ask`): sending it again on a
    new connection cannot run it twice."""


async def ask(ws: WebSocket, message: bytes) -> bytes:
    """Send a request on ``ws`` and receive its answer; :class:`UnreadError` when the connection turns out
    to have been gone before the peer read it (the send failed, or the server had closed the idle
    connection with :data:`IDLE_CLOSE`), :class:`RemoteConnectionError` otherwise."""
    try:
        await ws.send(message)
    except RemoteConnectionError as exc:
        raise UnreadError(str(exc)) from exc
    try:
        return await ws.receive()
    except RemoteConnectionError as exc:
        if ws.close_code == IDLE_CLOSE:
            raise UnreadError(str(exc)) from exc
        raise


class TokenRefusedError(PermissionError):
    """The server refused the connection's token (HTTP 403 during the WebSocket handshake)."""


class WebSocket:
    """One open WebSocket: :meth:`send` and :meth:`receive` whole binary messages; :meth:`aclose`.

    With a :class:`Heartbeat`, :meth:`receive` keeps the connection alive while it waits (see the module
    docs). Messages are sent by one task at a time; control frames (pong, ping) can be sent by the reading
    task meanwhile: when a message is being sent they follow it."""

    def __init__(
        self, stream: anyio.abc.ByteStream, ws: WSConnection, peer: str, beat: Heartbeat | None = None
    ) -> None:
        self._stream = stream
        self._ws = ws
        self.peer = peer
        self.heartbeat = beat
        self._pending: deque[bytes] = deque()
        self._parts: list[bytes] = []
        self._size = 0
        self.closed = False
        self._close_reason: str | None = None
        #: the code of the peer's close frame, once one arrived
        self.close_code: int | None = None
        self._lock = anyio.Lock(fast_acquire=True)
        self._owed: list[bytes] = []  # control frames waiting for the message being sent
        self._heard = anyio.current_time()  # when data last came from the peer
        self._pinged = 0.0  # when we last pinged it
        self._ping_out = False  # a ping of ours went out and nothing came back since
        #: set by a server while it holds none of the peer's requests: a silent peer is then closed with
        #: :data:`IDLE_CLOSE` (its next request, if it comes back, was never read) rather than dropped
        self.idle = False

    async def send(self, message: bytes) -> None:
        if self.closed:
            raise RemoteConnectionError(self._close_reason or f"connection to {self.peer} is closed")
        try:
            async with self._lock:
                await self._stream.send(self._ws.send(BytesMessage(data=message)))
                while self._owed:  # (no await between the last check and the release)
                    await self._stream.send(self._owed.pop(0))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError, LocalProtocolError) as exc:
            await self.abort()
            raise RemoteConnectionError(
                self._close_reason or f"connection to {self.peer} lost: {exc!r}"
            ) from exc

    async def _control(self, event: Ping | Pong) -> None:
        """Send a control frame now, or right after the message being sent. Best effort: a connection
        that is gone is reported by the next read (which may first find the peer's close frame)."""
        try:
            data = self._ws.send(event)
            if self._lock.locked():
                self._owed.append(data)
                return
            async with self._lock:
                await self._stream.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError, LocalProtocolError):
            pass

    async def receive(self) -> bytes:
        """The next whole binary message."""
        started = anyio.current_time() if self.heartbeat is not None else 0.0
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
                if self.heartbeat is None:
                    data = await self._stream.receive(_CHUNK)
                else:
                    data = await self._receive_alive(self.heartbeat, started)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                await self.abort()
                raise RemoteConnectionError(
                    self._close_reason or f"connection to {self.peer} lost ({type(exc).__name__})"
                ) from None
            self._ws.receive_data(data)

    async def _receive_alive(self, beat: Heartbeat, started: float) -> bytes:
        """The next bytes from the peer, pinging it when quiet; ``RemoteConnectionError`` once it has
        been silent for ``beat.timeout`` seconds (counted from the later of the last data heard and
        ``started``: while nobody read, the peer's pings could not be answered) and a ping of ours has
        been out for ``timeout - interval`` seconds (so that a stall of our own loop, a GC pause or a
        stopped process, is never taken for the peer's: the peer gets a fresh ping and time to answer)."""
        while True:
            now = anyio.current_time()
            quiet = max(self._heard, started)
            if not self._ping_out and now - quiet >= beat.interval:
                self._pinged, self._ping_out = now, True
                await self._control(Ping())
            if not self._ping_out:
                deadline = quiet + beat.interval
            else:
                deadline = max(quiet + beat.timeout, self._pinged + beat.timeout - beat.interval)
                if now >= deadline:
                    # our own loop may have been held up: what arrived meanwhile proves the peer alive
                    with anyio.move_on_after(min(0.5, beat.timeout / 10)):
                        return await self._heard_from(self._stream.receive(_CHUNK))
                    await self._give_up(beat, anyio.current_time() - quiet)
            with anyio.move_on_after(deadline - now):
                return await self._heard_from(self._stream.receive(_CHUNK))

    async def _heard_from(self, receiving: Awaitable[bytes]) -> bytes:
        data = await receiving
        self._heard, self._ping_out = anyio.current_time(), False
        return data

    async def _give_up(self, beat: Heartbeat, silent: float) -> None:
        self._close_reason = (
            f"{self.peer} did not answer for {silent:.1f} s (heartbeat_timeout={beat.timeout:g} s): "
            "the peer's machine, process or network is gone or stalled"
        )
        if self.idle:
            await self.aclose(IDLE_CLOSE, "no heartbeat answer while idle")
        else:
            await self.abort()
        raise RemoteConnectionError(self._close_reason)

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
                await self._control(event.response())
            elif isinstance(event, CloseConnection):
                self.close_code = event.code
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
                data = self._ws.send(CloseConnection(code=code, reason=reason))
                async with self._lock:
                    await self._stream.send(data)
            except Exception:
                pass
        await self.abort()

    def detach(self) -> tuple[socket.socket, WSConnection] | None:
        """Hand the plain socket and the protocol state (with what it has read ahead) over to the caller,
        who goes on with blocking I/O in a thread; this object is closed without closing the socket.
        ``None`` (nothing changes) when the stream is not a :class:`._tcp.RawStream` (TLS, or a stream
        whose event loop reads ahead) or messages were already read."""
        if not isinstance(self._stream, RawStream) or self._pending or self._parts or self.closed:
            return None
        sock = self._stream.detach()
        self.closed = True
        self._close_reason = f"connection to {self.peer} was handed over to a thread"
        return sock, self._ws

    async def adopt_event_loop(self) -> None:
        """Go on over an anyio socket stream (the event loop's own reading) where the stream is a
        :class:`._tcp.RawStream`: a long conversation on the loop."""
        if isinstance(self._stream, RawStream) and not self.closed:
            sock = self._stream.detach()
            try:
                self._stream = await anyio.abc.SocketStream.from_socket(sock)
            except (OSError, ValueError) as exc:  # the peer is gone already
                sock.close()
                self.closed = True
                raise RemoteConnectionError(f"connection to {self.peer} lost: {exc!r}") from exc
            except BaseException:
                sock.close()
                self.closed = True
                raise

    async def abort(self) -> None:
        """Close the socket now (no close frame)."""
        self.closed = True
        with anyio.CancelScope(shield=True):
            await self._stream.aclose()


def split_url(url: str) -> tuple[str, int, str]:
    """``ws://host:port/path`` (or ``wss://``) -> (host, port, path); ``ValueError`` naming the URL
    otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname or parts.port is None:
        raise ValueError(f"url must look like 'ws://127.0.0.1:8765' (or 'wss://' for TLS), got {url!r}")
    return parts.hostname, parts.port, parts.path.rstrip("/")


def check_client_tls(url: str, ssl_context: ssl.SSLContext | None) -> None:
    """``ValueError`` unless ``url`` and ``ssl_context`` agree (a context is for ``wss://`` urls)."""
    split_url(url)
    if ssl_context is not None and not isinstance(ssl_context, ssl.SSLContext):
        raise TypeError(f"ssl_context must be an ssl.SSLContext or None, got {type(ssl_context).__name__}")
    if ssl_context is not None and not url.startswith("wss://"):
        raise ValueError(
            f"ssl_context is given but {url!r} is not a 'wss://' url: use the server's url (server.url)"
        )


async def _tls(
    stream: anyio.abc.ByteStream, ssl_context: ssl.SSLContext, hostname: str | None
) -> anyio.abc.ByteStream:
    """``stream`` with TLS on it (the handshake done); the server side when ``hostname`` is None."""
    from anyio.streams.tls import TLSStream

    return await TLSStream.wrap(
        stream,
        server_side=hostname is None,
        hostname=hostname,
        ssl_context=ssl_context,
        standard_compatible=False,
    )


async def connect(
    url: str,
    path: str,
    token: str,
    *,
    connect_timeout: float = 10.0,
    beat: Heartbeat | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> WebSocket:
    """A client WebSocket to ``url`` + ``path``; ``PermissionError`` (token), ``ConnectionError``.

    A ``wss://`` url speaks TLS, checking the server's certificate with ``ssl_context`` (default: the
    system's certificate authorities)."""
    host, port, base = split_url(url)
    stream: anyio.abc.ByteStream
    try:
        with anyio.fail_after(connect_timeout):
            stream = await open_tcp(host, port)
    except (OSError, TimeoutError) as exc:
        raise RemoteConnectionError(f"cannot connect to {url}: {exc}") from exc
    if url.startswith("wss://"):
        try:
            with anyio.fail_after(connect_timeout):
                stream = await _tls(stream, ssl_context or ssl.create_default_context(), host)
        except (OSError, TimeoutError, anyio.BrokenResourceError, anyio.EndOfStream) as exc:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
            raise RemoteConnectionError(f"TLS handshake with {url} failed: {exc!r}") from exc
        except BaseException:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
            raise
    try:
        _nodelay(stream)
        ws = WSConnection(ConnectionType.CLIENT)
        request = Request(
            host=f"{host}:{port}",
            target=base + path,
            extra_headers=[(b"authorization", f"Bearer {token}".encode())],
        )
        with anyio.fail_after(connect_timeout):
            try:
                await stream.send(ws.send(request))
            except (anyio.BrokenResourceError, OSError):  # reset at once (a server going down)
                raise RemoteConnectionError(f"{url} closed the connection during the handshake") from None
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
    return WebSocket(stream, ws, url, beat)


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
    stream: anyio.abc.ByteStream,
    token: str,
    route: Route,
    *,
    handshake_timeout: float = 10.0,
    beat: Heartbeat | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> tuple[WebSocket, str] | None:
    """The server side of the handshake: ``(websocket, path)``, or ``None`` when refused (and closed).

    With ``ssl_context``, the TLS handshake comes first (a client that fails it is closed).

    ``await route(path)`` returns ``None`` to accept or an HTTP status to refuse with; it is only called
    once the token has been checked, so a client without the token learns nothing about the paths.
    The stream is closed on every way out but success (refusal, error, cancellation)."""
    try:
        if ssl_context is not None:
            secured = None
            with anyio.move_on_after(handshake_timeout):
                try:
                    secured = await _tls(stream, ssl_context, None)
                except (OSError, anyio.BrokenResourceError, anyio.EndOfStream):
                    pass  # not TLS, or a certificate the client refused
            if secured is None:
                await stream.aclose()
                return None
            stream = secured
        return await _accept(stream, token, route, handshake_timeout, beat)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await stream.aclose()
        raise


async def _accept(
    stream: anyio.abc.ByteStream, token: str, route: Route, handshake_timeout: float, beat: Heartbeat | None
) -> tuple[WebSocket, str] | None:
    _nodelay(stream)
    ws = WSConnection(ConnectionType.SERVER)
    request, problem, size = None, None, 0
    with anyio.move_on_after(handshake_timeout):
        while request is None and problem is None:
            try:
                data = await stream.receive(_CHUNK)
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                break
            size += len(data)
            if size > MAX_HANDSHAKE:
                problem = 431, f"request head over {MAX_HANDSHAKE} bytes"
                break
            try:  # wsproto (h11) parses the head: any error of its is this client's, and ends it only
                ws.receive_data(data)
                request = next((e for e in ws.events() if isinstance(e, Request)), None)
            except Exception as exc:
                problem = 400, f"bad upgrade request ({type(exc).__name__}: {exc})"
    if request is not None and len(request.extra_headers) > MAX_HEADERS:
        problem = 431, f"more than {MAX_HEADERS} headers"
    if problem is not None:
        await _bad_request(stream, *problem)
        raise BadHandshake(problem[1])
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
    return WebSocket(stream, ws, _peer(stream), beat), request.target


class BadHandshake(RemoteConnectionError):
    """A client's upgrade request could not be parsed (answered with HTTP 400 or 431, then closed)."""


async def _bad_request(stream: anyio.abc.ByteStream, status: int, reason: str) -> None:
    """A plain HTTP error (the head may not have parsed: no wsproto state to answer with), then close."""
    body = reason.encode("ascii", "replace")
    phrase = {400: "Bad Request", 431: "Request Header Fields Too Large"}[status]
    head = f"HTTP/1.1 {status} {phrase}\r\ncontent-type: text/plain\r\ncontent-length: {len(body)}\r\n"
    try:
        with anyio.move_on_after(1):
            await stream.send(head.encode() + b"connection: close\r\n\r\n" + body)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        pass
    finally:
        await stream.aclose()


def _peer(stream: anyio.abc.ByteStream) -> str:
    try:
        host, port = stream.extra(anyio.abc.SocketAttribute.raw_socket).getpeername()[:2]
    except (OSError, anyio.TypedAttributeLookupError, ValueError, TypeError):
        return "client"
    return f"client {host}:{port}"


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
