"""The one connection of a client that makes one call at a time (:class:`aiocollect.RemoteEnv`,
:class:`aiocollect.RemoteVectorEnv`): opened at the first call, closed by ``close()``.

A call cancelled or failed mid-way closes the connection (its answer would arrive out of turn); the next
call reconnects. A connection that turns out to have been gone before the server read the call (the
server dropped it while idle, see :data:`._ws.IDLE_CLOSE`) is reconnected to, and the call sent again.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Self, TypeVar

import anyio
from gymnasium import spaces

from ._common import remote_error
from ._spaces import rebuild_space
from ._wire import ProtocolError, decode, unpack_tree
from ._ws import Heartbeat, UnreadError, WebSocket, ask, connect, split_url

__all__ = ["OneConnection", "check_env_range", "is_local", "read_hello", "run_blocking"]

T = TypeVar("T")


def run_blocking(fn: Callable[[], Awaitable[T]]) -> T:
    """``fn()`` run to completion on a fresh event loop in a new thread (never on the caller's loop)."""
    box: dict[str, Any] = {}

    def main() -> None:
        try:
            box["value"] = anyio.run(fn)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=main, name="aiocollect-serve-probe")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


def check_env_range(start: Any, stop: Any) -> None:
    """``ValueError`` unless ``start``/``stop`` name envs ``start`` to ``stop - 1`` of a server (``stop``
    ``None``: to its last env)."""
    if (
        not isinstance(start, int)
        or isinstance(start, bool)
        or start < 0
        or (stop is not None and (not isinstance(stop, int) or stop <= start))
    ):
        raise ValueError(
            f"start and stop must be env indices with 0 <= start < stop, got {start!r}, {stop!r}"
        )


def is_local(url: str) -> bool:
    return split_url(url)[0] in ("127.0.0.1", "localhost", "::1")


async def read_hello(
    ws: WebSocket, where: str
) -> tuple[spaces.Space[Any], spaces.Space[Any], dict[str, Any]]:
    """The spaces message a server starts a connection with: (observation space, action space, header)."""
    header, arrays = decode(await ws.receive())
    if header["op"] == "error":
        raise remote_error(header, where)
    if header["op"] != "spaces" or not isinstance(header.get("num_envs"), int):
        raise ProtocolError(f"{where} did not start with its spaces (got {header['op']!r})")
    obs = rebuild_space(unpack_tree(header.get("observation_space"), arrays))
    act = rebuild_space(unpack_tree(header.get("action_space"), arrays))
    return obs, act, header


class OneConnection:
    """A client's connection to ``url`` + ``path``, whose first message (the spaces) must match
    ``expected`` (observation and action space)."""

    _path: str
    _where: str
    _expected: tuple[spaces.Space[Any], spaces.Space[Any]]

    def __init__(
        self,
        url: str,
        token: str,
        connect_timeout: float,
        beat: Heartbeat | None,
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        if not isinstance(token, str) or not token:
            raise ValueError("token must be the server's token (server.token), a non-empty string")
        self.url, self.connect_timeout, self.heartbeat = url, connect_timeout, beat
        self.ssl_context = ssl_context
        self._token = token
        self._ws: WebSocket | None = None
        self._busy = False
        self._closed = False

    async def _connection(self) -> WebSocket:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        if self._ws is None or self._ws.closed:
            ws = await connect(
                self.url,
                self._path,
                self._token,
                connect_timeout=self.connect_timeout,
                beat=self.heartbeat,
                ssl_context=self.ssl_context,
            )
            try:
                obs_space, act_space, _ = await read_hello(ws, self._where)
                if (obs_space, act_space) != self._expected:
                    raise ValueError(
                        f"{self._where} has spaces {obs_space}, {act_space}; {self!r} was given "
                        f"{self._expected[0]}, {self._expected[1]}"
                    )
            except BaseException:
                await ws.abort()
                raise
            self._ws = ws
        return self._ws

    async def _ask(self, message: bytes, op: str) -> tuple[dict[str, Any], list[Any]]:
        """Send one call and return its answer (``op`` expected); the server's error raised here."""
        if self._busy:
            raise RuntimeError(f"{type(self).__name__} calls must not overlap: await each before the next")
        self._busy = True
        done = False
        try:
            ws = await self._connection()
            try:
                answer = await ask(ws, message)
            except UnreadError:  # the connection was gone before the server read the call: again
                self._ws = None
                await ws.abort()
                answer = await ask(await self._connection(), message)
            reply, arrays = decode(answer)
            done = True
        finally:
            self._busy = False
            if not done and self._ws is not None:  # cancelled or failed mid-call: the stream is out of turn
                ws, self._ws = self._ws, None
                await ws.abort()
        if reply["op"] == "error":
            raise remote_error(reply, self._where)
        if reply["op"] != op:
            raise ProtocolError(f"expected a {op!r} reply, got {reply['op']!r}")
        return reply, arrays

    async def close(self) -> None:
        """Close the connection (the envs stay on the server, which owns them); idempotent."""
        self._closed = True
        ws, self._ws = self._ws, None
        if ws is not None:
            await ws.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()
