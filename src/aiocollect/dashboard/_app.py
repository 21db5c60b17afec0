"""The dashboard's controls (a pause it holds, weight updates, ending its streams) and the JSON and
Server-Sent Events it writes (``create_app`` builds the app over them: ``_create.py``)."""

from __future__ import annotations

import json
import logging
import math
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import anyio
import anyio.abc

from ._history import History

__all__ = ["DashboardControls", "LifespanNotRunning", "sse", "to_json"]

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
