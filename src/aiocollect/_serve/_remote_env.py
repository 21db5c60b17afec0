"""``RemoteEnv``: an :class:`aiocollect.AsyncEnvProtocol` env stepped by a :func:`serve_envs` server."""

from __future__ import annotations

import ssl
from typing import Any

from gymnasium import spaces

from ._actions import action_encoder
from ._client import OneConnection, is_local, read_hello, run_blocking
from ._env_server import local_spaces
from ._wire import encode, pack_tree, unpack_tree
from ._ws import CLIENT_HEARTBEAT, Heartbeat, check_client_tls, connect, heartbeat, split_url

__all__ = ["RemoteEnv", "fetch_spaces"]


async def fetch_spaces(
    url: str,
    index: int,
    token: str,
    connect_timeout: float,
    beat: Heartbeat | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> tuple[spaces.Space[Any], spaces.Space[Any], int]:
    """Env ``index``'s spaces and the server's number of envs, from a short ``/spaces`` connection."""
    ws = await connect(
        url, f"/spaces/{index}", token, connect_timeout=connect_timeout, beat=beat, ssl_context=ssl_context
    )
    try:
        obs, act, header = await read_hello(ws, f"{url} env {index}")
        return obs, act, header["num_envs"]
    finally:
        await ws.abort()


class RemoteEnv(OneConnection):
    """A gymnasium env that lives in a :func:`aiocollect.serve_envs` server, behind
    :class:`aiocollect.AsyncEnvProtocol`: ``await reset()``, ``await step()``, ``await close()``.

    Args:
        url: the server's ``ws://host:port`` (``server.url``).
        index: which of the server's envs (0-based); one client per env at a time.
        token: the server's shared secret (``server.token``).
        observation_space, action_space: the env's spaces, if known; otherwise the constructor fetches
            them from the server (a short blocking request, in a helper thread). On an event loop prefer
            ``await RemoteEnv.open(...)``, which fetches them without blocking.
        connect_timeout: seconds to connect and complete the WebSocket handshake.
        heartbeat_interval, heartbeat_timeout: while a call waits for its answer, the server is pinged
            after ``heartbeat_interval`` quiet seconds, and a server silent for ``heartbeat_timeout``
            seconds (its machine gone, its process stopped, the network cut) fails the call with
            :class:`aiocollect.RemoteConnectionError`. A long env step is not silence: the server
            answers pings meanwhile. ``None``: no heartbeat.
        ssl_context: for a ``wss://`` url (a server with TLS), the ``ssl.SSLContext`` that checks its
            certificate (default: the system's certificate authorities).

    The connection opens on the first call and closes with :meth:`close` (or ``async with``). A call
    cancelled mid-way closes it too (its answer would arrive out of turn); the next call reconnects.
    A server that dropped the idle connection (no call for longer than its own ``heartbeat_timeout``)
    is reconnected to at the next call. A server that goes away fails the pending call with
    :class:`aiocollect.RemoteConnectionError` (a ``ConnectionError``) as soon as the socket reports it
    (or its heartbeat runs out); a wrong token with ``PermissionError``. An env
    that raises on the server raises here too: builtin exception types as themselves, others as
    :class:`aiocollect.WorkerError` with the remote type name and traceback.

    Example:
        >>> import anyio, gymnasium as gym
        >>> from aiocollect import RemoteEnv, serve_envs
        >>> async def main():
        ...     async with serve_envs([lambda: gym.make("CartPole-v1")], token="t" * 16) as server:
        ...         async with await RemoteEnv.open(server.url, index=0, token="t" * 16) as env:
        ...             obs, info = await env.reset(seed=1)
        ...             obs, reward, terminated, truncated, info = await env.step(0)
        ...             return env.action_space, reward
        >>> anyio.run(main)
        (Discrete(2), 1.0)
    """

    def __init__(
        self,
        url: str,
        *,
        index: int,
        token: str,
        observation_space: spaces.Space[Any] | None = None,
        action_space: spaces.Space[Any] | None = None,
        connect_timeout: float = 10.0,
        heartbeat_interval: float | None = CLIENT_HEARTBEAT[0],
        heartbeat_timeout: float | None = CLIENT_HEARTBEAT[1],
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"index must be the env's position on the server (an int >= 0), got {index!r}")
        check_client_tls(url, ssl_context)
        super().__init__(
            url, token, connect_timeout, heartbeat(heartbeat_interval, heartbeat_timeout), ssl_context
        )
        self.index = index
        self._path, self._where = f"/envs/{index}", f"{url} env {index}"
        if observation_space is None or action_space is None:
            here = local_spaces(split_url(url)[1], index, token) if is_local(url) else None
            observation_space, action_space = here or run_blocking(self._fetch_spaces)
        self.observation_space: spaces.Space[Any] = observation_space
        self.action_space: spaces.Space[Any] = action_space
        self._expected = (observation_space, action_space)
        self._encode = action_encoder(action_space)

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        index: int,
        token: str,
        connect_timeout: float = 10.0,
        heartbeat_interval: float | None = CLIENT_HEARTBEAT[0],
        heartbeat_timeout: float | None = CLIENT_HEARTBEAT[1],
        ssl_context: ssl.SSLContext | None = None,
    ) -> RemoteEnv:
        """A connected ``RemoteEnv`` whose spaces were fetched without blocking the event loop."""
        beat = heartbeat(heartbeat_interval, heartbeat_timeout)
        check_client_tls(url, ssl_context)
        ws = await connect(
            url, f"/envs/{index}", token, connect_timeout=connect_timeout, beat=beat, ssl_context=ssl_context
        )
        try:
            obs_space, act_space, _ = await read_hello(ws, f"{url} env {index}")
            env = cls(
                url,
                index=index,
                token=token,
                observation_space=obs_space,
                action_space=act_space,
                heartbeat_interval=heartbeat_interval,
                heartbeat_timeout=heartbeat_timeout,
                ssl_context=ssl_context,
            )
        except BaseException:
            await ws.aclose()
            raise
        env.connect_timeout, env._ws = connect_timeout, ws
        return env

    async def _fetch_spaces(self) -> tuple[spaces.Space[Any], spaces.Space[Any]]:
        obs, act, _ = await fetch_spaces(
            self.url, self.index, self._token, self.connect_timeout, self.heartbeat, self.ssl_context
        )
        return obs, act

    async def _call(self, header: dict[str, Any], value: Any) -> tuple[dict[str, Any], list[Any]]:
        arrays: list[Any] = []
        header["value"] = pack_tree(value, arrays)
        return await self._ask(encode(header, arrays), header["op"])

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """``env.reset(seed=seed, options=options)`` on the server: ``(obs, info)``."""
        reply, arrays = await self._call({"op": "reset", "seed": seed}, options)
        return unpack_tree(reply["obs"], arrays), unpack_tree(reply["info"], arrays)

    async def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        """``env.step(action)`` on the server: ``(obs, reward, terminated, truncated, info)``."""
        reply, arrays = await self._call({"op": "step"}, self._encode(action))
        obs, info = unpack_tree(reply["obs"], arrays), unpack_tree(reply["info"], arrays)
        return obs, reply["reward"], reply["terminated"], reply["truncated"], info

    def __repr__(self) -> str:
        return f"RemoteEnv({self.url!r}, index={self.index})"
