"""``serve_envs``: gymnasium envs stepped on request over WebSocket, for :class:`aiocollect.RemoteEnv`.

One connection per env (path ``/envs/<index>``), per range of envs (``/batch/<start>/<stop>``,
``RemoteEnvPool``) or per vector client (``/vector/<start>/<stop>``, ``RemoteVectorEnv``: all its envs
stepped by one message), one request at a time on it. Requests from all connections meet in one queue;
a stepper task takes whatever has arrived and runs it in one worker thread hop (reset/step, then the
reply's encoding), so many envs cost one thread hop per round, and the event loop never steps an env.

A server hosts either single gymnasium envs (``env_fns``) or one gymnasium vector env
(``vector_env_fn``), stepped whole by a vector client's message.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import ssl
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import gymnasium as gym

from ._actions import action_checker
from ._common import Server, check_host_port, check_server_tls, check_token, error_message
from ._env_jobs import Job, Uniform, run_job, uniform_action_checker
from ._hop import StepThread
from ._spaces import describe_space
from ._vector_jobs import HostedVector, SingleEnvs, VectorJob, open_vector_env
from ._vector_thread import serve_in_thread
from ._wire import encode, pack_tree
from ._ws import SERVER_HEARTBEAT, Heartbeat, RemoteConnectionError, WebSocket, accept, heartbeat

__all__ = ["EnvServer", "check_env_fns", "local_num_envs", "local_spaces", "serve_envs"]

#: seconds a connection to an env waits for the env's previous connection to end before it is refused
HANDOVER_TIMEOUT = 5.0

#: the env servers running in this process, by port: a RemoteEnv made on the loop that runs one of them
#: reads its spaces here (a blocking fetch from its own loop would wait for itself)
_RUNNING: dict[int, EnvServer] = {}


def local_spaces(port: int, index: int, token: str) -> tuple[Any, Any] | None:
    """The spaces of env ``index`` of this process's server on ``port`` (``None``: no such server here);
    ``PermissionError`` for a wrong token, ``ValueError`` for an index out of range."""
    server = _RUNNING.get(port)
    if server is None:
        return None
    if not hmac.compare_digest(token.encode(), server.token.encode()):
        raise PermissionError(f"{server.url} refused the token: pass the server's token= to the client")
    if not 0 <= index < server.num_envs:
        raise ValueError(f"{server.url} has {server.num_envs} envs; index {index} is out of range")
    return server.spaces(index)


def local_num_envs(port: int) -> int | None:
    """How many envs this process's server on ``port`` has (``None``: no such server here)."""
    server = _RUNNING.get(port)
    return None if server is None else server.num_envs


class EnvServer(Server):
    """A running env server (see :func:`serve_envs`): ``url``, ``token``, ``port``, ``num_envs``."""

    def __init__(
        self,
        env_fns: Sequence[Callable[[], gym.Env[Any, Any]]] | None,
        host: str,
        port: int,
        token: str | None,
        beat: Heartbeat | None = None,
        ssl_context: ssl.SSLContext | None = None,
        vector_env_fn: Callable[[], Any] | None = None,
    ):
        check_env_fns(env_fns, vector_env_fn)
        check_host_port(host, port)
        self.env_fns = list(env_fns or [])
        self.vector_env_fn = vector_env_fn
        #: the hosted vector env (``vector_env_fn``), once entered
        self.vector: HostedVector | None = None
        self._vector_made: Any = None  # what vector_env_fn returned (closed on exit)
        self.host, self.port, self.token = host, port, check_token(token)
        self.heartbeat = beat
        self.ssl_context = check_server_tls(ssl_context)
        self.num_envs = len(self.env_fns)
        self.envs: list[gym.Env[Any, Any]] = []
        self._hello: list[bytes] = []
        self._checkers: list[Callable[[Any], Any]] = []
        self._uniform: Uniform | None = None  # checks a column of actions, when all envs share a space
        self._owner: dict[int, anyio.abc.ByteStream] = {}  # env index -> the connection that has it
        self._claims: dict[anyio.abc.ByteStream, range] = {}
        self._freed: dict[int, anyio.Event] = {}
        self._jobs: list[Job] = []
        self._wake = anyio.Event()
        self._limiter = anyio.CapacityLimiter(1)
        self._stack: contextlib.AsyncExitStack | None = None

    async def __aenter__(self) -> EnvServer:
        async with contextlib.AsyncExitStack() as stack:
            if self.vector_env_fn is not None:
                await anyio.to_thread.run_sync(self._make_vector, limiter=self._limiter)
                stack.push_async_callback(self._close_envs)
            else:
                self.envs = await anyio.to_thread.run_sync(self._make_envs, limiter=self._limiter)
                stack.push_async_callback(self._close_envs)
                self._hello = [self._describe(i, *self.spaces(i)) for i in range(self.num_envs)]
                self._checkers = [action_checker(env.action_space) for env in self.envs]
                first = self.envs[0].action_space
                if all(env.action_space == first for env in self.envs):
                    self._uniform = uniform_action_checker(first)
            await self._listen(stack, self._handle, self._stepper, raw=self.ssl_context is None)
            _RUNNING[self.port] = self
            stack.callback(_RUNNING.pop, self.port, None)
            self._stack = stack.pop_all()
        return self

    # -- envs ---------------------------------------------------------------------------------------------
    def _make_envs(self) -> list[gym.Env[Any, Any]]:
        envs: list[gym.Env[Any, Any]] = []
        try:
            for fn in self.env_fns:
                env = fn()
                if not isinstance(env, gym.Env):
                    raise TypeError(f"env_fns must return gymnasium envs, got {type(env).__name__}")
                envs.append(env)
        except BaseException:
            for env in envs:
                env.close()
            raise
        return envs

    def _make_vector(self) -> None:
        assert self.vector_env_fn is not None
        made = self._vector_made = self.vector_env_fn()
        try:
            self.vector = HostedVector(*open_vector_env(made))
        except BaseException:
            self._vector_made = None
            if callable(getattr(made, "close", None)):
                made.close()
            raise
        self.num_envs = self.vector.num_envs

    def spaces(self, index: int) -> tuple[Any, Any]:
        """Env ``index``'s observation and action spaces (a hosted vector env's: its sub-envs')."""
        if self.vector is not None:
            return self.vector.single_observation_space, self.vector.single_action_space
        env = self.envs[index]
        return env.observation_space, env.action_space

    async def _close_envs(self) -> None:
        envs, self.envs = self.envs, []
        made, self._vector_made, self.vector = self._vector_made, None, None
        if made is not None:
            envs = [made]
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(_close_all, envs, limiter=self._limiter)

    def _hello_batch(self, start: int, stop: int) -> bytes:
        arrays: list[Any] = []
        envs = [
            {
                "observation_space": pack_tree(describe_space(self.envs[i].observation_space), arrays),
                "action_space": pack_tree(describe_space(self.envs[i].action_space), arrays),
            }
            for i in range(start, stop)
        ]
        return encode({"op": "spaces", "start": start, "num_envs": self.num_envs, "envs": envs}, arrays)

    def _describe(self, index: int, obs_space: Any, act_space: Any, **more: Any) -> bytes:
        arrays: list[Any] = []
        header = {
            "op": "spaces",
            "index": index,
            "num_envs": self.num_envs,
            "observation_space": pack_tree(describe_space(obs_space), arrays),
            "action_space": pack_tree(describe_space(act_space), arrays),
            "vector": self.vector is not None,
            **more,
        }
        return encode(header, arrays)

    def _greeting(self, kind: str | None, start: int, stop: int) -> tuple[bytes, Any]:
        """The first message of a connection (its spaces, or an error that ends it), and for a vector
        client the envs it steps."""
        if kind == "vector":
            try:
                host: Any = self.vector
                if host is None:
                    host = SingleEnvs(self.envs, start, stop)
                elif (start, stop) != (0, self.num_envs):
                    raise ValueError(
                        f"{self.url} hosts one vector env of {self.num_envs} sub-envs, stepped whole: "
                        "connect to all of them (start=0, stop=None)"
                    )
            except ValueError as exc:
                return error_message(exc), None
            hello = self._describe(start, host.single_observation_space, host.single_action_space, stop=stop)
            return hello, host
        if kind == "spaces":
            return self._describe(start, *self.spaces(start)), None
        if self.vector is not None:
            return error_message(
                TypeError(
                    f"{self.url} hosts one gymnasium vector env of {self.num_envs} sub-envs, stepped "
                    "together: connect with aiocollect.RemoteVectorEnv(url, token=...), not RemoteEnv "
                    "or RemoteEnvPool"
                )
            ), None
        return (self._hello_batch(start, stop) if kind == "batch" else self._hello[start]), None

    # -- connections ------------------------------------------------------------------------------------
    async def _route(self, stream: anyio.abc.ByteStream, path: str) -> int | None:
        """Accept ``/spaces/<i>``; accept ``/envs/<i>`` (or ``/batch/<start>/<stop>``) once its envs are
        free (a client reconnecting after a cancelled call waits for its old connection's last step),
        claiming them for ``stream``."""
        kind, start, stop = _parse_path(path)
        if kind is None or not 0 <= start < stop <= self.num_envs:
            return 404
        if kind != "spaces":
            wanted = range(start, stop)
            with anyio.move_on_after(HANDOVER_TIMEOUT):
                while (busy := next((i for i in wanted if i in self._owner), None)) is not None:
                    await self._freed.setdefault(busy, anyio.Event()).wait()
            if any(i in self._owner for i in wanted):
                return 409
            for i in wanted:
                self._owner[i] = stream
            self._claims[stream] = wanted
        return None

    def _release(self, stream: anyio.abc.ByteStream) -> None:
        for index in self._claims.pop(stream, ()):
            if self._owner.get(index) is stream:
                del self._owner[index]
                freed = self._freed.pop(index, None)
                if freed is not None:
                    freed.set()

    async def _handle(self, stream: anyio.abc.ByteStream) -> None:
        try:
            route = functools.partial(self._route, stream)
            accepted = await accept(
                stream, self.token, route, beat=self.heartbeat, ssl_context=self.ssl_context
            )
            if accepted is not None:
                await self._converse(*accepted)
        finally:
            self._release(stream)

    async def _converse(self, ws: WebSocket, path: str) -> None:
        kind, start, stop = _parse_path(path)
        batch = kind == "batch"
        try:
            hello, host = self._greeting(kind, start, stop)
            name = f"aiocollect-vector-envs-{start}-{stop}"
            if host is not None and (taken := ws.detach()) is not None:
                # a vector client over a plain socket: a thread of its own serves it, the loop is off it
                await serve_in_thread(*taken, host, hello, self.heartbeat, name)
                return
            await ws.send(hello)
            if kind == "spaces" or (kind == "vector" and host is None) or (kind != "vector" and self.vector):
                await ws.aclose()  # a look at the spaces only (a client's constructor), or refused
                return
            await ws.adopt_event_loop()
            if host is not None:  # a vector client: its own stepping thread, for as long as it is connected
                async with StepThread(name) as thread:  # (TLS: the loop reads, a thread steps)
                    await self._answer_in_order(ws, functools.partial(self._serve_vector, host, thread))
                return
            await self._answer_in_order(
                ws, functools.partial(self._serve_one, start=start, stop=stop, batch=batch)
            )
        except RemoteConnectionError:
            pass
        finally:
            await ws.abort()

    async def _serve_one(self, message: bytes, *, start: int, stop: int, batch: bool) -> bytes:
        job = Job(message, start, stop, batch)  # decoded where it runs, in the worker thread
        self._jobs.append(job)
        self._wake.set()
        await job.done.wait()
        return job.reply

    async def _serve_vector(
        self, host: SingleEnvs | HostedVector, thread: StepThread, message: bytes
    ) -> bytes:
        """A vector client's message, decoded, run and its reply encoded in one hop to the connection's
        thread (it holds all its envs' calls already: the stepper's gathering would only add wake-ups)."""
        job = VectorJob(host, message)
        await thread.run(job.run)
        return job.reply

    async def _stepper(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            jobs, self._jobs = self._jobs, []
            with anyio.CancelScope(shield=True):  # a job is never left half done
                await anyio.to_thread.run_sync(self._run_jobs, jobs, limiter=self._limiter)
            for job in jobs:
                job.done.set()

    def _run_jobs(self, jobs: list[Job]) -> None:
        for job in jobs:
            try:
                job.reply = run_job(self.envs, self._checkers, job, self._uniform)
            except Exception as exc:
                job.reply = error_message(exc)


def _close_all(envs: list[Any]) -> None:
    for env in envs:
        env.close()


def check_env_fns(env_fns: Any, vector_env_fn: Any) -> None:
    """``TypeError`` unless exactly one of ``env_fns`` (a non-empty list of callables) and
    ``vector_env_fn`` (a callable) is given."""
    if vector_env_fn is not None:
        if env_fns is not None:
            raise TypeError("pass env_fns (single envs) or vector_env_fn (one vector env), not both")
        if not callable(vector_env_fn):
            raise TypeError(
                "vector_env_fn must be a callable returning a gymnasium vector env, e.g. "
                "lambda: gymnasium.make_vec('CartPole-v1', 64)"
            )
        return
    if not isinstance(env_fns, Sequence) or not env_fns or not all(callable(fn) for fn in env_fns):
        raise TypeError(
            "env_fns must be a non-empty list of callables, each returning a gymnasium env "
            "(or pass vector_env_fn=, a callable returning one gymnasium vector env)"
        )


def _parse_path(path: str) -> tuple[str | None, int, int]:
    """``(kind, start, stop)``: ``/envs/3`` -> ("envs", 3, 4), ``/spaces/3`` -> ("spaces", 3, 4),
    ``/batch/0/64`` -> ("batch", 0, 64), ``/vector/0/64`` -> ("vector", 0, 64); anything else
    (None, 0, 0)."""
    parts = path.rsplit("/", 3)
    if len(parts) >= 3 and parts[-3] in ("batch", "vector") and _number(parts[-2]) and _number(parts[-1]):
        return parts[-3], int(parts[-2]), int(parts[-1])
    if len(parts) >= 2 and parts[-2] in ("envs", "spaces") and _number(parts[-1]):
        return parts[-2], int(parts[-1]), int(parts[-1]) + 1
    return None, 0, 0


def _number(text: str) -> bool:
    return text.isdigit() and len(text) < 10


def serve_envs(
    env_fns: Sequence[Callable[[], gym.Env[Any, Any]]] | None = None,
    *,
    vector_env_fn: Callable[[], Any] | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    heartbeat_interval: float | None = SERVER_HEARTBEAT[0],
    heartbeat_timeout: float | None = SERVER_HEARTBEAT[1],
    ssl_context: ssl.SSLContext | None = None,
) -> EnvServer:
    """A WebSocket server stepping the gymnasium envs ``env_fns`` make, for :class:`aiocollect.RemoteEnv`,
    :class:`aiocollect.RemoteEnvPool` and :class:`aiocollect.RemoteVectorEnv`; or (``vector_env_fn``
    instead) one gymnasium vector env, stepped whole by each message of a ``RemoteVectorEnv``.

    ``vector_env_fn`` returns a ``gymnasium.vector.VectorEnv`` (``gymnasium.make_vec(...)``, or an
    ``aiocollect.GymEnv(id, num_envs=n)``, whose vector env is served): one of same-step autoreset, or a
    gymnasium ``SyncVectorEnv``/``AsyncVectorEnv`` (its ended sub-envs are then reset at once with
    ``reset_mask``). ``RemoteEnv`` and ``RemoteEnvPool`` cannot step one sub-env of it alone: they get a
    ``TypeError`` saying so.

    An async context manager: entering it makes the envs (in a worker thread) and starts listening on
    ``host``:``port`` (loopback and a free port by default); leaving it stops serving and closes the envs.
    Every connection must present ``token`` (``None``: a random one, read back as ``server.token``).
    A client connection quiet for ``heartbeat_interval`` seconds is pinged, and one silent for
    ``heartbeat_timeout`` seconds (a client machine gone, a process stopped) is dropped, its envs freed
    for the next client (either ``None``: never). With ``ssl_context`` (a server-side
    ``ssl.SSLContext`` holding its certificate) it speaks TLS: ``server.url`` is ``wss://...``.

    Example:
        >>> import anyio, gymnasium as gym
        >>> from aiocollect import RemoteEnv, serve_envs
        >>> async def main():
        ...     async with serve_envs([lambda: gym.make("CartPole-v1")] * 2) as server:
        ...         env = await RemoteEnv.open(server.url, index=1, token=server.token)
        ...         obs, info = await env.reset(seed=0)
        ...         await env.close()
        ...         return obs.shape
        >>> anyio.run(main)
        (4,)
    """
    beat = heartbeat(heartbeat_interval, heartbeat_timeout)
    return EnvServer(env_fns, host, port, token, beat, ssl_context, vector_env_fn)
