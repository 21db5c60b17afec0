"""``RemoteVectorEnv``: envs of a :func:`serve_envs` server stepped together, one message per step."""

from __future__ import annotations

import ssl
from typing import Any

import numpy as np
from gymnasium import spaces

from ._actions import batch_action_encoder
from ._client import OneConnection, check_env_range, is_local, read_hello, run_blocking
from ._env_server import local_num_envs, local_spaces
from ._remote_env import fetch_spaces
from ._wire import ProtocolError, encode, pack_tree, unpack_tree
from ._ws import CLIENT_HEARTBEAT, check_client_tls, connect, heartbeat, split_url

__all__ = ["RemoteVectorEnv"]


class RemoteVectorEnv(OneConnection):
    """Envs ``start`` to ``stop - 1`` of a :func:`aiocollect.serve_envs` server (default: all of them),
    stepped together as one vector env with same-step autoreset: an
    :class:`aiocollect.AsyncVectorEnvProtocol` env (``num_envs``, ``single_observation_space``,
    ``single_action_space``, ``await reset()``, ``await step()``, ``await close()``).

    A step is **one** message carrying the ``num_envs`` actions as one array, answered by one message:
    the observations stacked, rewards, ``terminated`` and ``truncated`` as arrays ``[num_envs]``, and the
    infos in gymnasium's vector layout. A sub-env whose episode ended in this step is already reset (as
    gymnasium's ``AutoresetMode.SAME_STEP``): ``obs[k]`` is the first observation of its next episode,
    ``info["final_obs"][k]`` its final one (``info["_final_obs"]``: the mask of the ended sub-envs). On
    the server, a server of single envs steps them in a loop in one worker-thread hop and resets each
    as its episode ends; a server that hosts a vector env (``serve_envs(vector_env_fn=...)``) steps it
    in one call. ``reset(seed=s)`` seeds sub-env ``k`` with ``s + k``.

    Args:
        url: the server's ``ws://host:port`` (``server.url``; ``wss://`` with TLS).
        token: the server's shared secret (``server.token``).
        start, stop: the envs to step (default: all the server's). A hosted vector env is stepped whole.
        single_observation_space, single_action_space, num_envs: if all known, nothing is fetched;
            otherwise the constructor fetches them (a short blocking request in a helper thread, so that
            a plain ``lambda`` can make one). On an event loop prefer ``await RemoteVectorEnv.open(...)``.
        connect_timeout, heartbeat_interval, heartbeat_timeout, ssl_context: as :class:`RemoteEnv`'s.

    The connection opens on the first call (or in :meth:`open`) and closes with :meth:`close` (or
    ``async with``); a call cancelled mid-way closes it, and the next call reconnects (the envs keep
    their state on the server). A server that goes away fails the pending call with
    :class:`aiocollect.RemoteConnectionError`; a wrong token raises ``PermissionError``; an env's error
    is raised with its type (as :class:`RemoteEnv`), and actions outside the space ``ValueError``.

    Example:
        >>> import anyio, gymnasium as gym, numpy as np
        >>> from aiocollect import RemoteVectorEnv, serve_envs
        >>> async def main():
        ...     async with serve_envs([lambda: gym.make("CartPole-v1")] * 4) as server:
        ...         async with await RemoteVectorEnv.open(server.url, token=server.token) as envs:
        ...             obs, info = await envs.reset(seed=0)
        ...             obs, reward, terminated, truncated, info = await envs.step(np.zeros(4, np.int64))
        ...             return envs.num_envs, obs.shape, reward.tolist()
        >>> anyio.run(main)
        (4, (4, 4), [1.0, 1.0, 1.0, 1.0])
    """

    def __init__(
        self,
        url: str,
        *,
        token: str,
        start: int = 0,
        stop: int | None = None,
        single_observation_space: spaces.Space[Any] | None = None,
        single_action_space: spaces.Space[Any] | None = None,
        num_envs: int | None = None,
        connect_timeout: float = 10.0,
        heartbeat_interval: float | None = CLIENT_HEARTBEAT[0],
        heartbeat_timeout: float | None = CLIENT_HEARTBEAT[1],
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        check_env_range(start, stop)
        check_client_tls(url, ssl_context)
        super().__init__(
            url, token, connect_timeout, heartbeat(heartbeat_interval, heartbeat_timeout), ssl_context
        )
        self.start = start
        known = single_observation_space is not None and single_action_space is not None
        if not known or (stop is None and num_envs is None):
            obs, act, total = self._local() or run_blocking(self._fetch)
            single_observation_space = obs if single_observation_space is None else single_observation_space
            single_action_space = act if single_action_space is None else single_action_space
            stop = total if stop is None else stop
        elif stop is None:
            assert num_envs is not None
            stop = start + num_envs
        if num_envs is not None and num_envs != stop - start:
            raise ValueError(f"num_envs={num_envs} but envs {start} to {stop - 1} are {stop - start}")
        assert single_observation_space is not None
        assert single_action_space is not None
        self.stop: int = stop
        #: the number of sub-envs, stepped together
        self.num_envs: int = stop - start
        self.single_observation_space: spaces.Space[Any] = single_observation_space
        self.single_action_space: spaces.Space[Any] = single_action_space
        self._expected = (single_observation_space, single_action_space)
        self._path = f"/vector/{start}/{stop}"
        self._where = f"{url} envs {start} to {stop - 1}"
        self._encode = batch_action_encoder(single_action_space, self.num_envs)

    def _local(self) -> tuple[Any, Any, int] | None:
        """The spaces and env count of a server running on this process's loops, if that is where it is."""
        if not is_local(self.url):
            return None
        port = split_url(self.url)[1]
        spaces_here = local_spaces(port, self.start, self._token)
        count = local_num_envs(port)
        if spaces_here is None or count is None:
            return None
        return *spaces_here, count

    async def _fetch(self) -> tuple[Any, Any, int]:
        return await fetch_spaces(
            self.url, self.start, self._token, self.connect_timeout, self.heartbeat, self.ssl_context
        )

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        token: str,
        start: int = 0,
        stop: int | None = None,
        connect_timeout: float = 10.0,
        heartbeat_interval: float | None = CLIENT_HEARTBEAT[0],
        heartbeat_timeout: float | None = CLIENT_HEARTBEAT[1],
        ssl_context: ssl.SSLContext | None = None,
    ) -> RemoteVectorEnv:
        """A connected ``RemoteVectorEnv`` whose spaces were fetched without blocking the event loop."""
        beat = heartbeat(heartbeat_interval, heartbeat_timeout)
        check_client_tls(url, ssl_context)
        if stop is None:  # how many envs the server has: the spaces connection's hello says
            stop = (await fetch_spaces(url, start, token, connect_timeout, beat, ssl_context))[2]
        ws = await connect(
            url,
            f"/vector/{start}/{stop}",
            token,
            connect_timeout=connect_timeout,
            beat=beat,
            ssl_context=ssl_context,
        )
        try:
            obs_space, act_space, _ = await read_hello(ws, f"{url} envs {start} to {stop - 1}")
            env = cls(
                url,
                token=token,
                start=start,
                stop=stop,
                single_observation_space=obs_space,
                single_action_space=act_space,
                heartbeat_interval=heartbeat_interval,
                heartbeat_timeout=heartbeat_timeout,
                connect_timeout=connect_timeout,
                ssl_context=ssl_context,
            )
        except BaseException:
            await ws.aclose()
            raise
        env._ws = ws
        return env

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset every sub-env (sub-env ``k`` seeded with ``seed + k``): ``(obs, info)``, stacked."""
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        arrays: list[Any] = []
        header = {"op": "reset", "seed": seed, "options": pack_tree(options, arrays)}
        reply, arrays = await self._ask(encode(header, arrays), "reset")
        obs = unpack_tree(reply.get("obs"), arrays)
        info = unpack_tree(reply["info"], arrays) if reply.get("info") is not None else {}
        return obs, info

    async def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Step every sub-env with its row of ``actions`` (``[num_envs, *action_shape]``, numpy or torch):
        ``(obs, reward, terminated, truncated, info)``, same-step autoreset (see the class docs)."""
        arrays: list[Any] = []
        message = encode({"op": "step", "actions": pack_tree(self._encode(actions), arrays)}, arrays)
        reply, arrays = await self._ask(message, "step")
        n = self.num_envs
        if len(arrays) < 3 or any(a.shape != (n,) for a in arrays[:3]):
            raise ProtocolError(f"{self._where} answered {n} steps with {[a.shape for a in arrays[:3]]}")
        obs = unpack_tree(reply.get("obs"), arrays)
        info = unpack_tree(reply["info"], arrays) if reply.get("info") is not None else {}
        final = reply.get("final")
        if final is not None:
            ended = unpack_tree(final.get("index"), arrays)
            if not isinstance(ended, np.ndarray) or ended.ndim != 1 or ended.dtype.kind not in "iu":
                raise ProtocolError(f"{self._where} answered with malformed final observations")
            info["final_obs"], info["_final_obs"] = _final_column(ended, unpack_tree(final["obs"], arrays), n)
        return obs, arrays[0], arrays[1], arrays[2], info

    def __repr__(self) -> str:
        return f"RemoteVectorEnv({self.url!r}, start={self.start}, stop={self.stop})"


def _final_column(ended: np.ndarray, finals: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Gymnasium's ``final_obs`` (an object array ``[n]``, ``None`` but where a sub-env ended), its mask."""
    column = np.full(n, None, dtype=object)
    mask = np.zeros(n, dtype=np.bool_)
    mask[ended] = True
    for j, k in enumerate(ended.tolist()):
        column[k] = _row(finals, j)
    return column, mask


def _row(value: Any, j: int) -> Any:
    if isinstance(value, dict):
        return {key: _row(v, j) for key, v in value.items()}
    if isinstance(value, list):
        return tuple(_row(v, j) for v in value)
    return value[j]
