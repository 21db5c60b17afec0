"""``serve_envs_process``: a :func:`serve_envs` server in a process of its own, owned by ``async with``.

The parent sends the env factories to the child (cloudpickle, over a local pipe: parent to child, never
from the network); the child serves them and reports its port. The child stops when the parent closes
its end of the pipe (leaving ``async with``) or dies.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.to_thread
import cloudpickle

from .._core._errors import worker_died
from .._core._mistakes import check_main_guard
from ._common import check_host_port, check_token
from ._env_server import check_env_fns, serve_envs
from ._ws import SERVER_HEARTBEAT, Heartbeat, heartbeat

__all__ = ["EnvServerProcess", "serve_envs_process"]

#: what the forkserver imports once (so that a server process starts in a fraction of a second)
# aiocollect first: its lean tensordict import keeps torch._dynamo out of the forkserver (which any later
# collector of this process shares); the heap is frozen last (see aiocollect._workers._freeze)
_PRELOAD = ["aiocollect._serve._process", "gymnasium", "aiocollect._workers._freeze"]


def _child_main(conn: Any, payload: bytes, host: str, port: int, token: str, beat: Heartbeat | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is the parent's to handle
    try:
        env_fns, vector_env_fn = cloudpickle.loads(payload)
        anyio.run(_serve_child, conn, env_fns, vector_env_fn, host, port, token, beat)
    except BaseException as exc:
        try:
            conn.send(("error", cloudpickle.dumps(exc)))
        except Exception:
            conn.send(("error", cloudpickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))))
        raise SystemExit(1) from None


async def _serve_child(
    conn: Any, env_fns: Any, vector_env_fn: Any, host: str, port: int, token: str, beat: Heartbeat | None
) -> None:
    interval, timeout = (beat.interval, beat.timeout) if beat is not None else (None, None)
    server = serve_envs(
        env_fns,
        vector_env_fn=vector_env_fn,
        host=host,
        port=port,
        token=token,
        heartbeat_interval=interval,
        heartbeat_timeout=timeout,
    )
    async with server:
        conn.send(("ready", server.port))
        await anyio.wait_readable(conn.fileno())  # the parent closed its end (or died): stop


class EnvServerProcess:
    """A :func:`serve_envs` server in its own process (see :func:`serve_envs_process`): ``url``,
    ``token``, ``port``, ``pid``; :meth:`kill` ends it abruptly (a crash, for tests)."""

    def __init__(
        self,
        env_fns: Sequence[Callable[[], Any]] | None,
        *,
        vector_env_fn: Callable[[], Any] | None = None,
        host: str,
        port: int,
        token: str | None,
        start_method: str,
        startup_timeout: float,
        beat: Heartbeat | None = None,
    ) -> None:
        check_env_fns(env_fns, vector_env_fn)
        check_host_port(host, port)
        if start_method not in mp.get_all_start_methods():
            raise ValueError(
                f"start_method must be one of {mp.get_all_start_methods()}, got {start_method!r}"
            )
        self._payload = cloudpickle.dumps((None if env_fns is None else list(env_fns), vector_env_fn))
        self.host, self.port, self.token = host, port, check_token(token)
        self.start_method, self.startup_timeout = start_method, startup_timeout
        self.heartbeat = beat
        self.process: Any = None
        self._conn: Any = None
        #: the process's exit code once it was reaped (negative: killed by that signal)
        self.exitcode: int | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"ws://{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` to the server process (``SIGSTOP``/``SIGCONT``: a stalled server, for tests)."""
        if self.process is not None and self.process.pid is not None:
            os.kill(self.process.pid, signum)

    async def __aenter__(self) -> EnvServerProcess:
        check_main_guard(
            "serve_envs_process",
            self.start_method,
            other_fix="serve the envs in this process with serve_envs",
        )
        ctx: Any = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            ctx.set_forkserver_preload(_PRELOAD)
        self._conn, child = ctx.Pipe()
        args = (child, self._payload, self.host, self.port, self.token, self.heartbeat)
        self.process = ctx.Process(target=_child_main, args=args, name="aiocollect-env-server", daemon=True)
        try:
            try:
                await anyio.to_thread.run_sync(self.process.start)
            finally:
                child.close()
            with anyio.fail_after(self.startup_timeout):
                await anyio.wait_readable(self._conn.fileno())
            try:
                kind, value = self._conn.recv()
            except EOFError:
                await anyio.to_thread.run_sync(self.process.join, 5)
                raise worker_died(0, self.process.exitcode, member="env server") from None
            if kind == "error":
                raise cloudpickle.loads(value)
            self.port = value
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the server (its envs are closed) and reap its process; idempotent."""
        with anyio.CancelScope(shield=True):
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            process = self.process
            if process is None:
                return
            if process.pid is None:  # never started
                self.process = None
                return
            await anyio.to_thread.run_sync(process.join, 5)
            if process.exitcode is None:
                process.kill()
                await anyio.to_thread.run_sync(process.join)
            self.exitcode = process.exitcode
            process.close()  # its sentinel and pipe fds, now rather than at garbage collection
            self.process = None

    def kill(self) -> None:
        """SIGKILL the server process (its clients see their connections drop)."""
        if self.process is not None and self.process.pid is not None:
            self.process.kill()


def serve_envs_process(
    env_fns: Sequence[Callable[[], Any]] | None = None,
    *,
    vector_env_fn: Callable[[], Any] | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    start_method: str = "forkserver",
    startup_timeout: float = 60.0,
    heartbeat_interval: float | None = SERVER_HEARTBEAT[0],
    heartbeat_timeout: float | None = SERVER_HEARTBEAT[1],
) -> EnvServerProcess:
    """:func:`serve_envs` in a new process; ``async with`` starts it (and waits until it listens) and
    stops it. ``env_fns`` (or ``vector_env_fn``, one vector env: see :func:`serve_envs`) travel to the
    process with cloudpickle (lambdas are fine). The heartbeat arguments are :func:`serve_envs`'s.

    Example:
        >>> import anyio, gymnasium as gym
        >>> from aiocollect import RemoteEnv, serve_envs_process
        >>> async def main():
        ...     async with serve_envs_process([lambda: gym.make("CartPole-v1")] * 4) as server:
        ...         env = await RemoteEnv.open(server.url, index=3, token=server.token)
        ...         obs, info = await env.reset(seed=0)
        ...         await env.close()
        ...         return obs.shape
        >>> anyio.run(main)
        (4,)
    """
    return EnvServerProcess(
        env_fns,
        vector_env_fn=vector_env_fn,
        host=host,
        port=port,
        token=token,
        start_method=start_method,
        startup_timeout=startup_timeout,
        beat=heartbeat(heartbeat_interval, heartbeat_timeout),
    )
