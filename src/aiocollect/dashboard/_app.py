"""The dashboard's controls (a pause it holds, weight updates, ending its streams) and ``create_app``."""

from __future__ import annotations

import json
import logging
import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from ._history import History

if TYPE_CHECKING:
    from starlette.applications import Starlette

__all__ = ["DashboardControls", "create_app"]

logger = logging.getLogger("aiocollect.dashboard")


class LifespanNotRunning(RuntimeError):
    """The app's lifespan (which owns the task that holds a pause) is not running."""


def _finite(obj: Any) -> Any:
    """``obj`` with NaN and infinities replaced by ``None`` (JSON has no such numbers)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def to_json(obj: Any) -> str:
    """Compact, strict JSON (non-finite floats become ``null``; unknown objects their ``str``)."""
    try:
        return json.dumps(obj, allow_nan=False, separators=(",", ":"), default=str)
    except ValueError:
        return json.dumps(_finite(obj), allow_nan=False, separators=(",", ":"), default=str)


def sse(name: str, data: Any) -> str:
    """One Server-Sent Events message (compact JSON has no newline, so one ``data:`` line)."""
    return f"event: {name}\ndata: {to_json(data)}\n\n"


class DashboardControls:
    """What the dashboard does to a collector besides reading it.

    * :meth:`pause` enters ``collector.pause()`` in a task that this object owns and holds it until
      :meth:`resume` (or the end of the lifespan); a second :meth:`pause` is a no-op.
    * :meth:`update_weights` publishes the policy's current weights.
    * :meth:`close_streams` ends every open event stream (at server shutdown: an open Server-Sent
      Events response would otherwise keep the server waiting for it).

    ``async with controls:`` opens the task group that holds the pause; :func:`create_app`'s lifespan
    does it, so it is open whenever the app is served (see the docs for mounting the app in another one).
    The app keeps it in ``app.state.dashboard``.
    """

    def __init__(self, collector: Any, policy: Any = None, *, interval: float = 0.5) -> None:
        self.collector = collector
        #: the hosts the app answers to and its token (a ``_guard.HostPolicy``; ``serve`` adds its host)
        self.policy = policy
        #: the run as the server saw it while the lifespan ran (a statistics sample every ``interval`` s)
        self.history = History(collector, interval=interval, pause_held=lambda: self.pause_held)
        self._history_scope: anyio.CancelScope | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self._lock: anyio.Lock | None = None
        self._release: anyio.Event | None = None
        self._released: anyio.Event | None = None
        self._waits: set[anyio.CancelScope] = set()
        self._encoded: OrderedDict[int, tuple[Any, str]] = OrderedDict()
        self.closing = False

    # -- lifespan ----------------------------------------------------------------------------------
    async def __aenter__(self) -> DashboardControls:
        if self._task_group is not None:
            raise RuntimeError("the dashboard's controls are open already")
        self.closing = False
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._task_group = task_group
        self.history.open()  # from now on, no event is missed
        self._history_scope = anyio.CancelScope()
        task_group.start_soon(self._keep_history, self._history_scope)
        return self

    async def _keep_history(self, scope: anyio.CancelScope) -> None:
        with scope:
            try:
                await self.history.run()
            except Exception:  # a collector whose statistics() fails must not take the app down
                logger.exception("the dashboard's history stopped")

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        self.close_streams()
        if self._history_scope is not None:
            self._history_scope.cancel()
            self._history_scope = None
        self.history.close()
        task_group, self._task_group = self._task_group, None
        assert task_group is not None
        with anyio.CancelScope(shield=True):
            await self._release_pause()
        return await task_group.__aexit__(exc_type, exc, tb)

    # -- pause -------------------------------------------------------------------------------------
    @property
    def pause_held(self) -> bool:
        """Whether the dashboard holds a pause now."""
        return self._release is not None

    def _get_lock(self) -> anyio.Lock:
        if self._lock is None:
            self._lock = anyio.Lock()
        return self._lock

    async def pause(self) -> None:
        """Pause the collector until :meth:`resume`; returns once the pause is in force (after the batch
        in flight, if any)."""
        if self._task_group is None:
            raise LifespanNotRunning(
                "the dashboard's lifespan is not running, so nothing can hold a pause: serve the app with "
                "lifespan events (uvicorn does), or enter `app.router.lifespan_context(app)` (or "
                "`app.state.dashboard`) around its use"
            )
        async with self._get_lock():
            if self._release is None:
                await self._task_group.start(self._hold)

    async def _hold(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        release, released = anyio.Event(), anyio.Event()
        started = False
        try:
            async with self.collector.pause():
                self._release, self._released = release, released
                started = True
                task_status.started()
                await release.wait()
        except Exception:
            if not started:
                raise  # from start(): the request that asked for the pause reports it
            logger.exception("releasing the dashboard's pause failed")
        finally:
            if started:
                self._release = self._released = None
                released.set()

    async def resume(self) -> None:
        """Release the dashboard's pause (a no-op without one); returns once it is released."""
        async with self._get_lock():
            await self._release_pause()

    async def _release_pause(self) -> None:
        release, released = self._release, self._released
        if release is not None and released is not None:
            release.set()
            await released.wait()

    # -- weights -----------------------------------------------------------------------------------
    async def update_weights(self) -> int:
        """``collector.update_weights()``: publish the policy's current weights; the new version."""
        return int(await self.collector.update_weights())

    # -- streams -----------------------------------------------------------------------------------
    def encode_event(self, event: Any) -> str:
        """``event.to_dict()`` as one SSE message, encoded once for all the streams that send it (every
        stream receives the same event objects)."""
        key = id(event)
        hit = self._encoded.get(key)
        if hit is not None and hit[0] is event:
            return hit[1]
        text = sse("event", event.to_dict())
        self._encoded[key] = (event, text)  # holding the event keeps its id from being reused
        if len(self._encoded) > 4096:
            self._encoded.popitem(last=False)
        return text

    @contextmanager
    def wait_scope(self, timeout: float) -> Iterator[anyio.CancelScope]:
        """A cancel scope with a ``timeout`` that :meth:`close_streams` cancels too."""
        with anyio.move_on_after(timeout) as scope:
            self._waits.add(scope)
            try:
                yield scope
            finally:
                self._waits.discard(scope)

    def close_streams(self) -> None:
        """End every open event stream (each sends a ``shutdown`` message first) and refuse new ones."""
        self.closing = True
        for scope in list(self._waits):
            scope.cancel()


def create_app(
    collector: Any,
    *,
    title: str = "aiocollect",
    interval: float = 0.5,
    max_buffer: int = 1024,
    allowed_hosts: Sequence[str] | None = None,
    token: str | None = None,
) -> Starlette:
    """A Starlette app that shows ``collector`` live and controls it.

    Routes (relative to where the app is mounted):

    * ``GET /``: the page (self-contained HTML and JavaScript): plots of frames/s, episode returns and
      policy versions per worker, worker states, counters, an event log, and buttons to pause/resume
      collection and to publish the policy's weights.
    * ``GET /events``: Server-Sent Events: ``event: statistics`` (``collector.statistics().to_dict()`` plus
      ``time`` and ``pause_held``) every ``interval`` seconds, ``event: event`` (``event.to_dict()``) for
      each collector event, and ``event: shutdown`` before the stream ends at server shutdown.
      ``?kinds=episode,weights_published`` forwards only those event kinds; ``?history=1`` sends the
      server's record of the run first (``event: history``, as ``/history.json``), so that a page opened
      late or reloaded shows the whole run. ``event: event`` includes the trainer's
      ``collector.log_metrics(...)`` (kind ``metrics``).
    * ``GET /history.json``, ``GET /history.csv``: the server's record of the run, kept while the app's
      lifespan runs: a statistics sample every ``interval`` seconds, the episodes, the trainer's metrics
      and the other events; each series halves its resolution when full (bounded memory for any run).
    * ``GET /statistics``: ``collector.statistics().to_dict()`` as JSON.
    * ``GET /metrics``: the same statistics as Prometheus metrics in the OpenMetrics text format
      (:func:`aiocollect.metrics_text`: counters, rates, idle ratios, the time split; labels ``collector``
      and ``worker``), for a Prometheus server to scrape; needs ``pip install "aiocollect[metrics]"``
      (else 501). Behind the same host check as every route.
    * ``POST /pause``, ``POST /resume``: a pause held by the app (``collector.pause()`` entered in a task of
      the app's lifespan, released on resume or at shutdown); both answer ``{"held", "paused"}``.
    * ``POST /update-weights``: ``await collector.update_weights()``; answers ``{"version": N}``.

    Other web pages in your browser cannot use it: every request must name an allowed host (DNS
    rebinding), and the ``POST`` routes need the app's token in an ``X-Aiocollect-Token`` header (the page
    carries it and sends it; ``app.state.token`` for your own scripts) and no foreign ``Origin``.

    Everything runs on the collector's event loop and only awaits: the app never blocks collection.
    A reader that falls behind loses its oldest events (``max_buffer`` per stream), never slows the
    collector.

    Args:
        collector: any aiocollect collector (``Collector``, ``MultiSyncCollector``, ...), entered.
        title: the page's title.
        interval: seconds between two statistics messages of a stream.
        max_buffer: events buffered per stream before the oldest are dropped.
        allowed_hosts: host names the dashboard is reached by besides ``127.0.0.1``, ``localhost``,
            ``::1`` and the host :func:`serve` binds (e.g. ``["trainer.lab.example"]`` when served on
            ``0.0.0.0``); ``["*"]`` turns the check off. Any other ``Host`` is refused (400).
        token: the token of the ``POST`` routes (default: a random one per app).

    Example:
        >>> from aiocollect.dashboard import create_app, serve
        >>> async def main(collector):  # doctest: +SKIP
        ...     async with serve(create_app(collector), port=8000) as server:
        ...         print("dashboard at", server.url)
        ...         async for batch in collector:
        ...             ...
    """
    if not (isinstance(interval, int | float) and interval > 0):
        raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
    if isinstance(max_buffer, bool) or not isinstance(max_buffer, int) or max_buffer < 1:
        raise ValueError(f"max_buffer must be a positive int, got {max_buffer!r}")
    if allowed_hosts is not None and (
        isinstance(allowed_hosts, str) or not all(isinstance(h, str) and h for h in allowed_hosts)
    ):
        raise TypeError(f"allowed_hosts must be a list of host names, got {allowed_hosts!r}")
    if token is not None and (not isinstance(token, str) or len(token) < 16):
        raise ValueError("token must be a string of at least 16 characters (default: a random one)")
    try:
        from ._guard import HostPolicy
        from ._routes import build_app
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"aiocollect.dashboard needs starlette ({exc}): pip install 'aiocollect[dashboard]'"
        ) from exc
    controls = DashboardControls(collector, HostPolicy(allowed_hosts, token), interval=float(interval))
    return build_app(controls, title=title, interval=float(interval), max_buffer=max_buffer)
