"""What the env and policy servers share: argument checks, the listener and its tasks, error replies.

Each connection is served in isolation (:func:`isolated`): whatever its handshake, parsing or handler
raises closes that connection only, is logged once (logger ``aiocollect.serve``, with the peer's
address) and never reaches the server's task group, so that no client, with or without the token, can
end the server or the user's code around it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import secrets
import ssl
import string
import traceback
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import anyio
import anyio.abc

from ._tcp import listen, listen_socket, serve_sockets
from ._wire import encode
from ._ws import Heartbeat, RemoteConnectionError, WebSocket

__all__ = [
    "Server",
    "isolated",
    "peer_name",
    "check_host_port",
    "check_server_tls",
    "check_token",
    "error_header",
    "error_message",
    "remote_error",
]


logger = logging.getLogger("aiocollect.serve")

#: the most messages a connection may have waiting for their answers (a client sends one per call)
_MAX_QUEUED = 4096

_TOKEN_CHARS = set(string.ascii_letters + string.digits + "-._~+/=")


def check_token(token: str | None) -> str:
    """The token to use: ``token`` checked, or a fresh random one when ``None``."""
    if token is None:
        return secrets.token_urlsafe(24)
    if not isinstance(token, str) or len(token) < 16 or not set(token) <= _TOKEN_CHARS:
        raise ValueError(
            "token must be a string of at least 16 URL-safe characters (letters, digits, '-._~+/='), "
            "e.g. secrets.token_urlsafe(24); or None for a random one (read it back as server.token)"
        )
    return token


def check_server_tls(ssl_context: ssl.SSLContext | None) -> ssl.SSLContext | None:
    """``ssl_context`` checked: ``None`` or a server-side ``ssl.SSLContext``."""
    if ssl_context is not None and not isinstance(ssl_context, ssl.SSLContext):
        raise TypeError(
            "ssl_context must be an ssl.SSLContext with the server's certificate loaded "
            "(ssl.create_default_context(ssl.Purpose.CLIENT_AUTH), then load_cert_chain(cert, key)), "
            f"got {type(ssl_context).__name__}"
        )
    return ssl_context


def check_host_port(host: str, port: int) -> None:
    if not isinstance(host, str) or not host:
        raise ValueError(f"host must be an address to listen on such as '127.0.0.1', got {host!r}")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536:
        raise ValueError(f"port must be an int in [0, 65535] (0: any free port), got {port!r}")


def error_header(exc: BaseException) -> dict[str, Any]:
    """The answer telling a client its call raised ``exc`` (type name, message, traceback text)."""
    kind = type(exc)
    return {
        "op": "error",
        "type": f"{kind.__module__}.{kind.__qualname__}",
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }


def error_message(exc: BaseException) -> bytes:
    """:func:`error_header` as a whole message."""
    return encode(error_header(exc))


def remote_error(header: dict[str, Any], where: str) -> BaseException:
    """The exception an ``error`` reply stands for: a builtin exception type is raised as itself
    (``ValueError``, ``KeyError``...), any other as a :class:`aiocollect.WorkerError` with its fields."""
    import builtins

    from .._core._errors import worker_error

    type_name, message = str(header.get("type", "")), str(header.get("message", ""))
    tb = str(header.get("traceback", ""))
    module, _, name = type_name.rpartition(".")
    kind = getattr(builtins, name, None) if module == "builtins" else None
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            exc = kind(message)
        except Exception:
            pass
        else:
            exc.add_note(f"--- raised in {where}; remote traceback ---\n{tb}")
            return exc
    return worker_error(type_name, message, tb, where)


def peer_name(stream: anyio.abc.ByteStream) -> str:
    """``host:port`` of the peer of ``stream`` (``"unknown peer"`` when the socket is gone)."""
    try:
        sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)
        host, port = sock.getpeername()[:2]
    except (OSError, anyio.TypedAttributeLookupError, ValueError, TypeError):
        return "unknown peer"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def isolated(
    handle: Callable[[anyio.abc.ByteStream], Coroutine[Any, Any, None]], server: str
) -> Callable[[anyio.abc.ByteStream], Coroutine[Any, Any, None]]:
    """``handle`` that never raises an ``Exception``: one is logged once (with the peer's address) and
    ends that connection only (the stream closed); cancellation goes through."""

    @functools.wraps(handle)
    async def serve_one(stream: anyio.abc.ByteStream) -> None:
        peer = peer_name(stream)
        try:
            await handle(stream)
        except Exception as exc:
            leaf: BaseException = exc
            while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
                leaf = leaf.exceptions[0]  # what a connection's task group wrapped
            logger.warning(
                "%s: connection from %s closed on %s: %s",
                server,
                peer,
                type(leaf).__name__,
                leaf,
                exc_info=exc,
            )
        finally:
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(Exception):
                    await stream.aclose()

    return serve_one


class Server:
    """The part of :class:`EnvServer` and :class:`PolicyServer` that is the same: the address, and the
    listener with the server's tasks, owned by one exit stack that ``async with`` leaves."""

    host: str
    port: int
    token: str
    heartbeat: Heartbeat | None
    ssl_context: ssl.SSLContext | None
    _stack: contextlib.AsyncExitStack | None

    @property
    def url(self) -> str:
        """``ws://host:port`` (``wss://`` with TLS): the address its clients (:class:`aiocollect.RemoteEnv`,
        :class:`aiocollect.RemotePolicy`) connect to."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'wss' if self.ssl_context is not None else 'ws'}://{host}:{self.port}"

    async def _listen(
        self,
        stack: contextlib.AsyncExitStack,
        handle: Callable[[anyio.abc.ByteStream], Coroutine[Any, Any, None]],
        *tasks: Callable[[], Coroutine[Any, Any, None]],
        raw: bool = False,
    ) -> None:
        """Listen (``self.port`` becomes the bound port), serve each connection with ``handle`` and run
        ``tasks``, all in a task group that ``stack`` cancels and closes. With ``raw``, each connection
        comes as a :class:`._tcp.RawStream` (a plain socket that a thread can take over)."""
        if raw:
            sock, self.port = await listen_socket(self.host, self.port)
            stack.callback(sock.close)
        else:
            listener, self.port = await listen(self.host, self.port)
            stack.push_async_callback(listener.aclose)
        handle = isolated(handle, f"{type(self).__name__} at {self.url}")
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)
        if raw:
            tg.start_soon(serve_sockets, sock, handle, tg)
        else:
            tg.start_soon(listener.serve, handle)
        for task in tasks:
            tg.start_soon(task)

    async def _answer_in_order(self, ws: WebSocket, answer: Callable[[bytes], Awaitable[bytes]]) -> None:
        """Answer each message of ``ws`` with ``await answer(message)``, in order, until the connection
        ends. A reader task takes the messages in as they come (answering pings meanwhile, so that a long
        step or forward pass never passes for silence) while this task answers them."""
        queue: deque[bytes] = deque()
        arrived = anyio.Event()

        async def read() -> None:
            nonlocal arrived
            try:
                while True:
                    ws.idle = not queue and not answering
                    message = await ws.receive()
                    if len(queue) >= _MAX_QUEUED:
                        await ws.aclose(1008, f"more than {_MAX_QUEUED} requests waiting")
                        break
                    queue.append(message)
                    arrived.set()
            except RemoteConnectionError:
                pass
            tg.cancel_scope.cancel()

        answering = False
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            try:
                while True:
                    while not queue:
                        await arrived.wait()
                        arrived = anyio.Event()
                    answering, ws.idle = True, False
                    reply = await answer(queue.popleft())
                    await ws.send(reply)
                    answering = False
                    ws.idle = not queue
            except RemoteConnectionError:
                pass
            tg.cancel_scope.cancel()

    async def __aexit__(self, *exc_info: Any) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.__aexit__(*exc_info)

    async def serve_forever(self) -> None:
        """Wait until cancelled (the server runs meanwhile): for a script that only serves."""
        await anyio.sleep_forever()
