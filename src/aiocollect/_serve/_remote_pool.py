"""``RemoteEnvPool``: many envs of one :func:`serve_envs` server over **one** connection.

The calls that the pool's envs make while a message is being written go out together in the next
message (one ``batch`` message per round instead of one per env), and the server answers each message
with one message: the WebSocket, JSON and syscall costs are paid per round, not per env step. A sender
task and a receiver task, owned by the pool's ``async with``, carry them; answers come back in order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
from gymnasium import spaces

from ._actions import action_encoder
from ._common import remote_error
from ._remote_env import fetch_spaces
from ._spaces import rebuild_space
from ._wire import ProtocolError, decode, encode, pack_tree, unpack_tree
from ._ws import CLIENT_HEARTBEAT, RemoteConnectionError, WebSocket, connect, heartbeat, split_url

__all__ = ["PooledRemoteEnv", "RemoteEnvPool"]


class _Round:
    """The calls that go out in one message, and (once answered) their answers: all its callers wait on
    one event."""

    __slots__ = ("answers", "arrays", "calls", "columns", "error", "event")

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, Any], Any]] = []
        self.event = anyio.Event()
        self.answers: list[Any] = []
        self.arrays: list[Any] = []
        self.columns: list[Any] | None = None  # a columnar answer: one info tree per call
        self.error: BaseException | None = None


class PooledRemoteEnv:
    """One env of a :class:`RemoteEnvPool` (an :class:`aiocollect.AsyncEnvProtocol` env); its
    ``close()`` does nothing: the pool owns the connection."""

    def __init__(
        self, pool: RemoteEnvPool, index: int, obs: spaces.Space[Any], act: spaces.Space[Any]
    ) -> None:
        self._pool, self.index = pool, index
        self.observation_space, self.action_space = obs, act
        self._encode = action_encoder(act)

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """``env.reset(seed=seed, options=options)`` on the server: ``(obs, info)``."""
        obs, info = await self._pool.call(self.index, {"op": "reset", "seed": seed}, options)
        return obs, info

    async def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        """``env.step(action)`` on the server: ``(obs, reward, terminated, truncated, info)``."""
        obs, reward, terminated, truncated, info = await self._pool.call(
            self.index, {"op": "step"}, self._encode(action)
        )
        return obs, reward, terminated, truncated, info

    async def close(self) -> None:
        """Nothing to do: the pool's ``async with`` closes the connection."""

    def __repr__(self) -> str:
        return f"PooledRemoteEnv({self._pool.url!r}, index={self.index})"


class RemoteEnvPool:
    """Envs ``start`` to ``stop - 1`` of a :func:`aiocollect.serve_envs` server (default: all of them),
    sharing one connection; ``async with`` connects and yields the pool, a sequence of
    :class:`PooledRemoteEnv` (``pool.envs``), each an :class:`aiocollect.AsyncEnvProtocol` env.

    The fast way to step many envs of one server: their concurrent calls travel together (see the
    module docs). :class:`aiocollect.RemoteEnv` opens a connection per env instead, and can be made by
    a plain ``lambda``. A lost connection fails every pending and later call with
    :class:`aiocollect.RemoteConnectionError`: a server that goes away, or one silent for
    ``heartbeat_timeout`` seconds (its machine gone, its process stopped, the network cut; the pool's
    receiver pings it after ``heartbeat_interval`` quiet seconds and answers its pings, busy or idle;
    ``None``: no heartbeat).

    Example:
        >>> import anyio, gymnasium as gym
        >>> from aiocollect import AsyncEnvCollector, RemoteEnvPool, serve_envs
        >>> async def main():
        ...     async with serve_envs([lambda: gym.make("CartPole-v1")] * 8) as server:
        ...         async with RemoteEnvPool(server.url, token=server.token) as pool:
        ...             collector = AsyncEnvCollector(pool.envs, frames_per_batch=64, total_frames=64)
        ...             async with collector:
        ...                 return [batch.batch_size async for batch in collector]
        >>> anyio.run(main)
        [torch.Size([64])]
    """

    def __init__(
        self,
        url: str,
        *,
        token: str,
        start: int = 0,
        stop: int | None = None,
        connect_timeout: float = 10.0,
        heartbeat_interval: float | None = CLIENT_HEARTBEAT[0],
        heartbeat_timeout: float | None = CLIENT_HEARTBEAT[1],
    ) -> None:
        split_url(url)
        if not isinstance(token, str) or not token:
            raise ValueError("token must be the server's token (server.token), a non-empty string")
        if (
            not isinstance(start, int)
            or start < 0
            or (stop is not None and (not isinstance(stop, int) or stop <= start))
        ):
            raise ValueError(
                f"start and stop must be env indices with 0 <= start < stop, got {start!r}, {stop!r}"
            )
        self.url, self.start, self.stop, self.connect_timeout = url, start, stop, connect_timeout
        self.heartbeat = heartbeat(heartbeat_interval, heartbeat_timeout)
        self._token = token
        self.envs: list[PooledRemoteEnv] = []
        self._ws: WebSocket | None = None
        self._tg: Any = None
        self._next: _Round | None = None  # the round the calls made now join
        self._in_flight: deque[_Round] = deque()
        self._wake: anyio.Event | None = None
        self._error: BaseException | None = None

    def __len__(self) -> int:
        return len(self.envs)

    def __getitem__(self, i: int) -> PooledRemoteEnv:
        return self.envs[i]

    def __iter__(self) -> Iterator[PooledRemoteEnv]:
        return iter(self.envs)

    async def __aenter__(self) -> RemoteEnvPool:
        stop = self.stop
        if stop is None:  # all the server's envs: ask how many there are
            stop = (
                await fetch_spaces(self.url, self.start, self._token, self.connect_timeout, self.heartbeat)
            )[2]
        ws = await connect(
            self.url,
            f"/batch/{self.start}/{stop}",
            self._token,
            connect_timeout=self.connect_timeout,
            beat=self.heartbeat,
        )
        try:
            header, arrays = decode(await ws.receive())
            if header["op"] != "spaces" or not isinstance(header.get("envs"), list):
                raise ProtocolError(f"{self.url} did not start with its envs' spaces")
            self.envs = [
                PooledRemoteEnv(
                    self,
                    self.start + i,
                    rebuild_space(unpack_tree(desc["observation_space"], arrays)),
                    rebuild_space(unpack_tree(desc["action_space"], arrays)),
                )
                for i, desc in enumerate(header["envs"])
            ]
            self._wake, self._next = anyio.Event(), _Round()
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
        except BaseException:
            await ws.abort()
            raise
        self._ws = ws
        self._tg.start_soon(self._sender, ws)
        self._tg.start_soon(self._receiver, ws)
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        tg, ws, self._tg, self._ws = self._tg, self._ws, None, None
        self._fail(RemoteConnectionError(f"RemoteEnvPool({self.url!r}) is closed"))
        if tg is not None:
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
        if ws is not None:
            await ws.aclose()

    async def call(self, index: int, header: dict[str, Any], value: Any) -> tuple[Any, ...]:
        """Send one env call with the next message and wait for its answer: ``(obs, info)`` for a
        reset, ``(obs, reward, terminated, truncated, info)`` for a step."""
        if self._error is not None:
            raise RemoteConnectionError(f"{self.url}: {self._error}")
        if self._wake is None or self._next is None:
            raise RuntimeError("use the envs of a RemoteEnvPool inside its `async with`")
        header["i"] = index
        round_ = self._next
        position = len(round_.calls)
        round_.calls.append((header, value))
        self._wake.set()
        await round_.event.wait()
        if round_.error is not None:
            if isinstance(round_.error, TypeError):  # raised here, before sending
                raise TypeError(str(round_.error)) from round_.error
            raise RemoteConnectionError(f"{self.url}: {round_.error}") from round_.error
        arrays = round_.arrays
        if round_.columns is not None:  # a batch of steps, in columns
            obs = arrays[0][position]
            obs = obs.copy() if type(obs) is np.ndarray else obs
            flags = bool(arrays[2][position]), bool(arrays[3][position])
            return obs, float(arrays[1][position]), *flags, unpack_tree(round_.columns[position], arrays)
        answer = round_.answers[position]
        if answer["op"] == "error":
            raise remote_error(answer, f"{self.url} env {index}")
        if answer["op"] != header["op"]:
            raise ProtocolError(f"expected a {header['op']!r} answer, got {answer['op']!r}")
        obs, info = unpack_tree(answer["obs"], arrays), unpack_tree(answer["info"], arrays)
        if answer["op"] == "reset":
            return obs, info
        return obs, answer["reward"], answer["terminated"], answer["truncated"], info

    async def _sender(self, ws: WebSocket) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            round_, self._next = self._next, _Round()
            assert round_ is not None
            try:
                arrays: list[Any] = []
                items = []
                for header, value in round_.calls:
                    header["value"] = pack_tree(value, arrays)
                    items.append(header)
                message = encode({"op": "batch", "items": items}, arrays)
            except Exception as exc:  # a value that cannot travel: its round's callers get the error
                round_.error = exc
                round_.event.set()
                continue
            self._in_flight.append(round_)
            try:
                await ws.send(message)
            except RemoteConnectionError as exc:
                self._fail(exc)
                return

    async def _receiver(self, ws: WebSocket) -> None:
        while True:
            try:
                header, arrays = decode(await ws.receive())
                round_ = self._in_flight.popleft()
                if header["op"] == "error":
                    raise remote_error(header, self.url)
                items = header.get("items") if header["op"] == "batch" else None
                columns = _columns(header, arrays, round_) if items is None else None
                if columns is None and (not isinstance(items, list) or len(items) != len(round_.calls)):
                    raise ProtocolError(f"{self.url} answered {len(round_.calls)} calls with {header!r:.200}")
            except Exception as exc:  # lost, malformed or refused: every call fails
                self._fail(exc)
                await ws.abort()
                return
            round_.answers, round_.columns, round_.arrays = items or [], columns, arrays
            round_.event.set()

    def _fail(self, exc: BaseException) -> None:
        """Fail every pending call (and every later one) with ``RemoteConnectionError``."""
        if self._error is None:
            self._error = exc
        rounds = [*self._in_flight, *([self._next] if self._next is not None else [])]
        self._in_flight.clear()
        self._next = _Round()
        for round_ in rounds:
            round_.error = exc
            round_.event.set()
        if self._wake is not None:
            self._wake.set()


def _columns(header: dict[str, Any], arrays: list[Any], round_: _Round) -> list[Any] | None:
    """The info trees of a columnar answer to ``round_`` (``None``: not one, or not a valid one)."""
    columns = header.get("columns") if header["op"] == "batch" else None
    n = len(round_.calls)
    if not isinstance(columns, dict) or columns.get("n") != n or len(arrays) < 4:
        return None
    infos = columns.get("info")
    if not isinstance(infos, list) or len(infos) != n or any(c[0].get("op") != "step" for c in round_.calls):
        return None
    if arrays[0].ndim < 1 or arrays[0].shape[0] != n or any(a.shape != (n,) for a in arrays[1:4]):
        return None
    return infos
