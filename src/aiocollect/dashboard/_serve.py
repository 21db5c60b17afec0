"""``serve``: run an ASGI app with uvicorn inside the current event loop, beside the collector."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

import anyio

from ._app import DashboardControls

__all__ = ["MAX_REQUEST_HEAD", "RunningServer", "serve"]

#: the largest request head (bytes) the dashboard's server reads before it answers 431/400: uvicorn's
#: pure-Python h11 protocol (the default here) bounds it; a request over it never reaches the app
MAX_REQUEST_HEAD = 16 * 1024


@dataclass(frozen=True)
class RunningServer:
    """A server started by :func:`serve`: ``url`` (with the real port when ``port=0``) and the
    ``uvicorn.Server``."""

    url: str
    server: Any

    @property
    def port(self) -> int:
        return int(self.server.servers[0].sockets[0].getsockname()[1])

    def stop(self) -> None:
        """Ask the server to shut down (as Ctrl-C does); leaving ``async with serve(...)`` waits for it."""
        self.server.should_exit = True


@asynccontextmanager
async def serve(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "warning",
    timeout_graceful_shutdown: int | None = 5,
    **config: Any,
) -> AsyncIterator[RunningServer]:
    """Serve ``app`` with ``uvicorn.Server(config).serve()`` in a task of the current event loop.

    ``async with serve(app, port=0) as server:`` returns once the server listens (``server.url``); leaving
    the block shuts it down gracefully (open event streams of a :func:`create_app` app, served or mounted,
    end first, since a streaming response would otherwise hold the shutdown) and waits for it. On Ctrl-C
    uvicorn stops the server, then the block is cancelled and ``KeyboardInterrupt`` raised.

    uvicorn runs on asyncio only: ``anyio.run(main)`` (its default backend, with or without uvloop) or
    ``asyncio.run(main())``.

    Args:
        app: an ASGI app, e.g. :func:`create_app`'s.
        host, port: where to listen (``port=0``: a free port).
        log_level: uvicorn's log level.
        timeout_graceful_shutdown: seconds to wait for open requests at shutdown before cancelling them.
        config: more ``uvicorn.Config`` arguments. By default the server speaks HTTP/1.1 with uvicorn's
            ``h11`` protocol, whose request heads are bounded (:data:`MAX_REQUEST_HEAD`): one bad
            request is answered with 400 (or 431) and closes its connection only.
    """
    config.setdefault("http", "h11")
    config.setdefault("h11_max_incomplete_event_size", MAX_REQUEST_HEAD)
    server = _make_server(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=timeout_graceful_shutdown,
        **config,
    )
    tasks = _ServerTasks(server, _find_controls(app), f"{host}:{port}")
    for c in tasks.controls:  # the dashboard answers to the host it is served on
        if c.policy is not None:
            c.policy.allow(host)
    up = False
    body_error: BaseException | None = None
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(tasks.run)
            while not (server.started or tasks.finished.is_set()):  # noqa: ASYNC110
                await anyio.sleep(0.01)
            up = bool(server.started)
            if up:
                tg.start_soon(tasks.watch, tg.cancel_scope)
                bound_host, bound_port = server.servers[0].sockets[0].getsockname()[:2]
                shown_host = f"[{bound_host}]" if ":" in bound_host else bound_host
                try:
                    yield RunningServer(f"http://{shown_host}:{bound_port}/", server)
                finally:
                    tasks.close_streams()
                    server.should_exit = True
    except BaseExceptionGroup as group:
        # the task group wraps what the caller's block raised (the tasks raise nothing): raise it as it was,
        # outside this handler so that its __context__ stays its own
        if len(group.exceptions) != 1:
            raise
        body_error = group.exceptions[0]
    if body_error is not None:
        raise body_error
    if not up:
        raise RuntimeError(tasks.failure[0] if tasks.failure else "uvicorn stopped before it started")
    if server.signalled is not None:
        raise KeyboardInterrupt(f"the server stopped on signal {server.signalled}")


def _make_server(app: Any, **config: Any) -> Any:
    """A ``uvicorn.Server`` for ``app``; raise unless on asyncio with uvicorn installed."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(
            "uvicorn runs on asyncio only: run the program with anyio.run(main) (asyncio backend) or "
            "asyncio.run(main())"
        ) from None
    try:
        import uvicorn
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(f"serve() needs uvicorn ({exc}): pip install 'aiocollect[dashboard]'") from exc
    return _server_class(uvicorn)(uvicorn.Config(app, **config))


class _ServerTasks:
    """What :func:`serve` runs beside the caller's block: the server, and a watcher of its exit flags."""

    def __init__(self, server: Any, controls: list[DashboardControls], where: str) -> None:
        self.server = server
        self.controls = controls
        self.where = where
        self.finished = anyio.Event()
        self.failure: list[str] = []

    def close_streams(self) -> None:
        for c in self.controls:
            c.close_streams()

    async def run(self) -> None:
        try:
            # only should_exit stops it: a cancelled caller still gets a graceful shutdown
            with anyio.CancelScope(shield=True):
                await self.server.serve()
        except SystemExit as exc:  # uvicorn's way to report a failed start-up (port in use, lifespan)
            self.failure.append(
                f"uvicorn could not start on {self.where} (exit code {exc.code}); see its log"
            )
        finally:
            self.finished.set()

    async def watch(self, scope: anyio.CancelScope) -> None:
        server = self.server
        # uvicorn's own flags (set by a signal handler too) have no event to wait on: uvicorn polls them
        while not (server.should_exit or self.finished.is_set()):  # noqa: ASYNC110
            await anyio.sleep(0.05)
        self.close_streams()
        if server.signalled is not None:  # Ctrl-C: stop the caller's block too, then raise below
            scope.cancel()


def _find_controls(app: Any, depth: int = 0) -> list[DashboardControls]:
    """The dashboards in ``app``: its own (``app.state.dashboard``) and those of the apps mounted in it."""
    found = []
    controls = getattr(getattr(app, "state", None), "dashboard", None)
    if isinstance(controls, DashboardControls):
        found.append(controls)
    if depth < 8:
        for route in getattr(app, "routes", None) or ():
            sub = getattr(route, "app", None)
            if sub is not None and sub is not app:
                found.extend(_find_controls(sub, depth + 1))
    return found


def _server_class(uvicorn: Any) -> Any:
    """``uvicorn.Server`` that stops on SIGINT/SIGTERM without raising the signal again from its task
    (:func:`serve` cancels the caller's block and raises ``KeyboardInterrupt`` there instead)."""

    class Server(uvicorn.Server):
        signalled: int | None = None

        @contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return

            def on_signal(sig: int, frame: FrameType | None) -> None:
                self.signalled = sig
                self.handle_exit(sig, frame)

            previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server
