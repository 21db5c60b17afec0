"""``RemoteEnvPool``: many envs of one :func:`serve_envs` server over **one** connection.

The calls that the pool's envs make while a round is out (sent, not yet answered) go out together in
the next message (one ``batch`` message per round instead of one per env; one round out at a time), and
the server answers each message with one message: the WebSocket, JSON and syscall costs are paid per
round, not per env step. Steps travel in columns: the round's env indices and actions as two arrays,
answered by the observations stacked in one array and rewards and flags as arrays. A sender
task and a receiver task, owned by the pool's ``async with``, carry them; answers come back in order.
"""

from __future__ import annotations

import ssl
from collections import deque
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
from gymnasium import spaces

from ._actions import action_encoder
from ._client import check_env_range
from ._common import remote_error
from ._remote_env import fetch_spaces
from ._spaces import rebuild_space
from ._wire import ProtocolError, decode, encode, pack_tree, unpack_tree
from ._ws import CLIENT_HEARTBEAT, RemoteConnectionError, WebSocket, check_client_tls, connect, heartbeat

__all__ = ["PooledRemoteEnv", "RemoteEnvPool"]


class _Round:
    """The calls that go out in one message, and (once answered) their answers: all its callers wait on
    one event. Steps travel in columns (``step_index``, ``step_actions``), other calls as items."""

    __slots__ = (
        "answers",
        "arrays",
        "calls",
        "error",
        "event",
        "step_actions",
        "step_index",
        "step_items",
        "steps",
    )

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, Any], Any]] = []
        self.step_index: list[int] = []
        self.step_actions: list[Any] = []
        self.step_items: int | None = None  # where the steps start among the items, if sent as items
        self.event = anyio.Event()
        self.answers: list[Any] = []
        self.arrays: list[Any] = []
        self.steps: _Steps | None = None
        self.error: BaseException | None = None


class _Steps:
    """A round's step answers: in columns, or (``answers``) one by one."""

    __slots__ = ("answers", "errors", "infos", "obs", "rewards", "terminated", "truncated")

    def __init__(self) -> None:
        self.answers: list[Any] | None = None
        self.obs: Any = None
        self.rewards: list[float] = []
        self.terminated: list[bool] = []
        self.truncated: list[bool] = []
        self.infos: list[Any] | None = None
        self.errors: dict[str, Any] = {}


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
        return await self._pool.step(self.index, self._encode(action))

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
    ``None``: no heartbeat). A ``wss://`` url speaks TLS, the server's certificate checked with
    ``ssl_context`` (default: the system's certificate authorities).

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
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        check_client_tls(url, ssl_context)
        if not isinstance(token, str) or not token:
            raise ValueError("token must be the server's token (server.token), a non-empty string")
        check_env_range(start, stop)
        self.url, self.start, self.stop, self.connect_timeout = url, start, stop, connect_timeout
        self.heartbeat = heartbeat(heartbeat_interval, heartbeat_timeout)
        self.ssl_context = ssl_context
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
                await fetch_spaces(
                    self.url, self.start, self._token, self.connect_timeout, self.heartbeat, self.ssl_context
                )
            )[2]
        ws = await connect(
            self.url,
            f"/batch/{self.start}/{stop}",
            self._token,
            connect_timeout=self.connect_timeout,
            beat=self.heartbeat,
            ssl_context=self.ssl_context,
        )
        try:
            header, arrays = decode(await ws.receive())
            if header["op"] == "error":  # e.g. a server that hosts a vector env
                raise remote_error(header, self.url)
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
        round_ = self._join()
        header["i"] = index
        position = len(round_.calls)
        round_.calls.append((header, value))
        await self._answered(round_)
        return self._item(round_, round_.answers[position], header["op"], index)

    async def step(self, index: int, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        """Step env ``index`` with the next message (its action in the round's column of actions):
        ``(obs, reward, terminated, truncated, info)``."""
        round_ = self._join()
        k = len(round_.step_index)
        round_.step_index.append(index)
        round_.step_actions.append(action)
        await self._answered(round_)
        steps = round_.steps
        assert steps is not None
        if steps.answers is not None:
            obs, reward, terminated, truncated, info = self._item(round_, steps.answers[k], "step", index)
            return obs, reward, terminated, truncated, info
        if steps.errors and (error := steps.errors.get(str(k))) is not None:
            raise remote_error(error, f"{self.url} env {index}")
        info = {} if steps.infos is None else unpack_tree(steps.infos[k], round_.arrays)
        return steps.obs[k], steps.rewards[k], steps.terminated[k], steps.truncated[k], info

    def _join(self) -> _Round:
        """The round a call made now goes out with."""
        if self._error is not None:
            raise RemoteConnectionError(f"{self.url}: {self._error}")
        if self._wake is None or self._next is None:
            raise RuntimeError("use the envs of a RemoteEnvPool inside its `async with`")
        self._wake.set()
        return self._next

    async def _answered(self, round_: _Round) -> None:
        await round_.event.wait()
        if round_.error is not None:
            if isinstance(round_.error, TypeError):  # raised here, before sending
                raise TypeError(str(round_.error)) from round_.error
            raise RemoteConnectionError(f"{self.url}: {round_.error}") from round_.error

    def _item(self, round_: _Round, answer: dict[str, Any], op: str, index: int) -> tuple[Any, ...]:
        """The result of one call answered as an item."""
        arrays = round_.arrays
        if answer["op"] == "error":
            raise remote_error(answer, f"{self.url} env {index}")
        if answer["op"] != op:
            raise ProtocolError(f"expected a {op!r} answer, got {answer['op']!r}")
        obs, info = unpack_tree(answer["obs"], arrays), unpack_tree(answer["info"], arrays)
        if op == "reset":
            return obs, info
        return obs, answer["reward"], answer["terminated"], answer["truncated"], info

    async def _sender(self, ws: WebSocket) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            while self._in_flight:  # one round at a time: the calls made meanwhile join the next one
                await self._in_flight[-1].event.wait()
            round_, self._next = self._next, _Round()
            assert round_ is not None
            try:
                message = _encode_round(round_)
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
                if not isinstance(items, list) or len(items) != len(round_.calls):
                    raise ProtocolError(f"{self.url} answered {len(round_.calls)} calls with {header!r:.200}")
                if round_.step_items is not None:
                    round_.steps = _Steps()
                    round_.steps.answers = items[round_.step_items :]
                elif round_.step_index:
                    round_.steps = _steps(header, arrays, len(round_.step_index), self.url)
            except Exception as exc:  # lost, malformed or refused: every call fails
                self._fail(exc)
                await ws.abort()
                return
            round_.answers, round_.arrays = items, arrays
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


def _encode_round(round_: _Round) -> bytes:
    """A round's message: its steps in columns (arrays 0 and 1: env indices, actions) when their actions
    stack, as items otherwise (then answered as items too); its other calls as items."""
    arrays: list[Any] = []
    header: dict[str, Any] = {"op": "batch"}
    if round_.step_index:
        actions = _stack(round_.step_actions)
        if actions is None:  # e.g. dict actions: each step as an item, answered as one
            round_.step_items = len(round_.calls)
            round_.calls += [
                ({"op": "step", "i": i}, a)
                for i, a in zip(round_.step_index, round_.step_actions, strict=True)
            ]
        else:
            arrays += [np.array(round_.step_index, dtype=np.int64), actions]
            header["steps"] = {"n": len(round_.step_index)}
    items = []
    for call, value in round_.calls:
        call["value"] = pack_tree(value, arrays)
        items.append(call)
    header["items"] = items
    return encode(header, arrays)


def _stack(actions: list[Any]) -> np.ndarray | None:
    """The actions as one array (ints, or numeric arrays of one shape and dtype), or ``None``."""
    first = actions[0]
    if type(first) is int:
        return np.array(actions, dtype=np.int64) if all(type(a) is int for a in actions) else None
    if type(first) is np.ndarray and first.dtype.kind in "biuf":
        shape, dtype = first.shape, first.dtype
        if all(type(a) is np.ndarray and a.shape == shape and a.dtype == dtype for a in actions):
            return np.stack(actions)
    return None


def _steps(header: dict[str, Any], arrays: list[Any], n: int, url: str) -> _Steps:
    """The step answers of a batch reply (``ProtocolError`` if they do not answer ``n`` steps)."""
    section = header.get("steps")
    steps = _Steps()
    if not isinstance(section, dict) or section.get("n") != n:
        raise ProtocolError(f"{url} answered {n} steps with {section!r:.200}")
    if "answers" in section:  # observations that do not stack: one answer each
        answers = section["answers"]
        if not isinstance(answers, list) or len(answers) != n:
            raise ProtocolError(f"{url} answered {n} steps with {len(answers)} answers")
        steps.answers = answers
        return steps
    infos, errors = section.get("info"), section.get("errors")
    if (
        len(arrays) < 4
        or arrays[0].ndim < 1
        or arrays[0].shape[0] != n
        or any(a.shape != (n,) for a in arrays[1:4])
    ):
        raise ProtocolError(f"{url} answered {n} steps with arrays of shapes {[a.shape for a in arrays[:4]]}")
    if not (infos is None or (isinstance(infos, list) and len(infos) == n)) or not isinstance(errors, dict):
        raise ProtocolError(f"{url} answered {n} steps with malformed infos or errors")
    steps.obs, steps.infos, steps.errors = arrays[0], infos, errors
    steps.rewards, steps.terminated, steps.truncated = (
        arrays[1].tolist(),
        arrays[2].tolist(),
        arrays[3].tolist(),
    )
    return steps
