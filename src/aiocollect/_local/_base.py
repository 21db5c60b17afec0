"""What every collector shares: the batch lock and pause gate, background collection into a replay
buffer, the frame budget, statistics bookkeeping and the event stream."""

from __future__ import annotations

import abc
import warnings
from collections.abc import AsyncIterator, Collection, Mapping
from contextlib import asynccontextmanager
from math import ceil
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, cast

import anyio
import anyio.abc
from tensordict import TensorDictBase

from .._core._errors import CollectorClosedError
from .._core._mistakes import warn_if_spent
from .._observe._events import (
    BatchDelivered,
    EpisodeFinished,
    EventHub,
    EventStream,
    LoopLag,
    MetricsLogged,
    Paused,
    Resumed,
)
from .._observe._progress import Progress
from .._observe._stats import StatsTracker
from ._pauses import Pauses

if TYPE_CHECKING:
    from .._episodes._assembler import EpisodeStatistics
    from .._observe._sinks import Sink

__all__ = ["CollectorBase"]


def _leaves(exc: BaseException) -> list[BaseException]:
    subs = exc.exceptions if isinstance(exc, BaseExceptionGroup) else None
    return [exc] if subs is None else [leaf for e in subs for leaf in _leaves(e)]


class CollectorBase(abc.ABC):
    """Mixed into ``Collector`` and the multi-worker collectors (which set ``total_frames``,
    ``frames_per_batch`` and ``replay_buffer``, and implement ``__anext__``).

    Typed for users: ``async with Collector(...) as c`` gives the collector's own class, and
    ``async for batch in c`` gives ``TensorDictBase`` batches; a collector with a ``replay_buffer`` is
    iterated with ``async for frames in c.fill()`` (ints).
    """

    total_frames: int
    frames_per_batch: int
    replay_buffer: Any

    def _init_base(self, progress: Any = None) -> None:
        self._progress = Progress(progress, self.total_frames)
        self._stats = StatsTracker(total_frames=self.total_frames)
        self._lock = anyio.Lock()
        self._pauses = Pauses()
        self._closed = self._failed = False
        self._closed_reason = "it was closed"
        self._task_group: anyio.abc.TaskGroup | None = None
        self._background: anyio.CancelScope | None = None
        self._hub = EventHub()
        self._lag = LoopLag()
        self._background_error: Exception | None = None
        self._last_frames = 0  # frames of the batch delivered last (fill() reads them)
        self._stop_requested = False  # request_stop(): the next batch turn ends the iteration

    # -- state ------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def _close(self, reason: str | None = None, *, failed: bool = False, now: bool = True) -> None:
        """The one writer of the closed state: ``now``: closed, nothing new starts; ``reason``: what a use
        of the closed collector says; ``failed``: the run failed (a close from another task is not)."""
        self._closed, self._failed = self._closed or now, self._failed or failed
        self._closed_reason = reason or self._closed_reason

    def _check_open(self) -> None:
        if self._closed:
            raise CollectorClosedError(f"the collector is closed: {self._closed_reason}")

    def _budget_reached(self) -> bool:
        return 0 < self.total_frames <= self._stats.frames

    def request_stop(self) -> None:
        """End ``async for`` (``fill()``, ``start()``) once the batch in flight is delivered or written
        (never a partial one); sync: from a signal handler, a thread or a task (``stop_on_signals``)."""
        self._stop_requested = True
        self._stopping()

    def _stopping(self, drain: bool = False) -> None:  # noqa: B027 - a hook: fleets stop their members
        """A stop was requested: a collector whose members collect ahead of the batches delivered tells
        them to stop (fleets); nothing here."""

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    def _active(self) -> None:
        """Raise unless the collector can deliver a batch (open; fleets: also entered)."""
        self._check_open()

    def __len__(self) -> int:
        if self.total_frames < 0:
            raise TypeError("an endless collector (total_frames=-1) has no len()")
        if getattr(self, "_episodes", None) is not None:
            raise TypeError("a trajs_per_batch collector has no len(): its batches vary in frames")
        return ceil(self.total_frames / self.frames_per_batch)

    def __aiter__(self) -> AsyncIterator[TensorDictBase]:
        """``async for batch in collector``: the collector is its own iterator of batches.

        With a ``replay_buffer`` the batches go to the buffer and this yields ``None`` for each one
        (deprecated, it warns once per loop): iterate :meth:`fill` instead.
        """
        if self.replay_buffer is not None:
            name = type(self).__name__
            warnings.warn(
                f"`async for` over a {name} with a replay_buffer yields None for each batch (deprecated): "
                "write `async for frames in collector.fill():`, which yields the frames of each batch "
                "written to the buffer",
                DeprecationWarning,
                stacklevel=2,
            )
        warn_if_spent(self)  # a second `async for` yields nothing: say so
        # __anext__ gives a batch, or None (only) in the replay-buffer mode warned about above
        return cast("AsyncIterator[TensorDictBase]", self)

    @abc.abstractmethod
    async def __anext__(self) -> TensorDictBase | None:
        """The next batch (``None`` where it went to ``replay_buffer``); ``StopAsyncIteration`` once
        ``total_frames`` are collected."""

    def fill(self) -> AsyncIterator[int]:
        """Collect into ``replay_buffer``: ``async for frames in collector.fill():`` yields the frames of
        each batch written to the buffer (an ``int``, as counted towards ``total_frames``).

        The replay-buffer twin of ``async for batch in collector`` (same budget, same ``pause()``);
        :meth:`start` runs it in the background.

        Example:
            >>> async def fill(collector):  # doctest: +SKIP
            ...     async with collector:
            ...         async for frames in collector.fill():
            ...             print(f"{frames} frames written, {len(collector.replay_buffer)} in the buffer")
        """
        self._check_open()
        if self.replay_buffer is None:
            name = type(self).__name__
            raise RuntimeError(
                f"fill() needs a replay_buffer: {name}(..., replay_buffer=rb); without one, iterate the "
                "batches: `async for batch in collector:`"
            )
        return _Fill(warn_if_spent(self))

    async def _batch_turn(self) -> None:
        """The start of every ``__anext__``: ``StopAsyncIteration`` once the budget is spent or a stop
        requested, else wait for the batch lock (after any ``pause()``) and check again, since another
        consumer may have taken the last batch or closed the collector meanwhile. The caller releases
        ``self._lock`` when done."""
        self._active()
        if self._stop_requested or self._budget_reached():
            raise StopAsyncIteration
        self._stats.awaiting()  # statistics().trainer_wait: until _record
        await self._acquire_batch_lock()
        try:
            self._active()
            if self._stop_requested or self._budget_reached():
                raise StopAsyncIteration
        except BaseException:
            self._lock.release()
            raise

    async def _acquire_batch_lock(self) -> None:
        """Wait until no ``pause()`` holds the collector, then take the batch lock."""
        while True:
            if self._pauses:  # no coroutine per batch when none is open
                await self._pauses.resumed()
            await self._lock.acquire()
            if not self._pauses:
                return
            self._lock.release()

    # -- async with: the collector's task group ---------------------------------------------------
    async def __aenter__(self) -> Self:
        self._check_open()
        if self._task_group is not None:
            raise RuntimeError(f"the {type(self).__name__} is entered already (async with collector: ...)")
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._task_group = tg
        tg.start_soon(self._lag.run)  # the event loop's lag while entered (statistics().loop_lag_ms)
        try:
            await self._on_enter()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.aclose()
            await self._exit_task_group()  # outside the shield: the task group's scope is the older one
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        try:
            await self.aclose()
        finally:
            suppressed = await self._exit_task_group(exc_type, exc, tb)
        if self._background_error is not None and (
            exc is None or isinstance(exc, anyio.get_cancelled_exc_class())
        ):
            raise self._background_error  # start()'s background collection failed
        return suppressed

    async def _exit_task_group(
        self,
        exc_type: type[BaseException] | None = None,
        exc: BaseException | None = None,
        tb: TracebackType | None = None,
    ) -> bool:
        """Close the collector's task group. Our tasks (background collection, readers, the lag monitor)
        never raise; a background failure is kept (raised by ``__aexit__``) and cancels the body. The
        body's own exception goes on as itself, never wrapped in an ExceptionGroup.

        The one exception our tasks do raise is trio's Ctrl-C: trio raises ``KeyboardInterrupt`` in
        whichever task runs when SIGINT arrives, one of ours as well as the body. It goes on as itself
        too, as it would have from the body."""
        tg, self._task_group = self._task_group, None
        if tg is None:
            return False
        tg.cancel_scope.cancel()
        try:
            return bool(await tg.__aexit__(exc_type, exc, tb))
        except BaseExceptionGroup as group:  # trio wraps the body's exception: let it go on unwrapped
            cancelled = anyio.get_cancelled_exc_class()
            others = [e for e in _leaves(group) if e is not exc and not isinstance(e, cancelled)]
            if not others:
                return False
            if all(isinstance(e, KeyboardInterrupt) for e in others):
                if isinstance(exc, KeyboardInterrupt):
                    return False  # the body's own (one Ctrl-C per exception)
                raise others[0] from None
            raise

    @abc.abstractmethod
    async def _on_enter(self) -> None:
        """Start what the collector owns (workers, ...) inside its task group; may raise."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close the collector: stop its workers, free its memory, close its envs. Idempotent."""

    def episode_statistics(self) -> EpisodeStatistics | None:
        """With ``trajs_per_batch``: trajectories in flight, delivered and discarded, their mean and
        longest length and policy-version spans (:class:`EpisodeStatistics`); else ``None``."""
        assembler = getattr(self, "_episodes", None)
        return None if assembler is None else assembler.statistics(self._stats.episodes, self._stats.frames)

    # -- events -----------------------------------------------------------------------------------
    def events(self, max_buffer: int = 1024, kinds: Collection[str] | None = None) -> EventStream:
        """An async iterator over this collector's events (batches, episodes, weights, workers, pauses,
        the trainer's metrics); ``kinds`` (e.g. ``{"metrics"}``): only those.

        Bounded: a reader that falls ``max_buffer`` events behind loses the oldest, so a stuck dashboard
        never slows collection. The stream ends when the collector closes.

        Example:
            >>> async def watch(collector):  # doctest: +SKIP
            ...     async with collector.events() as events:
            ...         async for event in events:
            ...             print(event.kind, event.to_dict())
        """
        return self._hub.subscribe(max_buffer, kinds)

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Put the trainer's own numbers (loss, KL, learning rate, ...) beside the collector's: they go,
        stamped with the frames collected so far, to the dashboard (plotted, kept in its history) and to
        the logging sinks (:meth:`add_sink`), as a ``metrics`` event. Cheap; never blocks.

        Example:
            >>> async def train(collector):  # doctest: +SKIP
            ...     async for batch in collector:
            ...         loss, kl = update(batch)
            ...         collector.log_metrics({"loss": loss.item(), "kl": kl}, step=updates)
        """
        event = MetricsLogged.of(metrics, frames=self._stats.frames, step=step)
        self._hub.publish(event)

    async def add_sink(self, sink: Sink) -> None:
        """Write ``statistics()`` and the logged metrics to ``sink`` (e.g. ``TensorBoardSink(logdir)``,
        ``WandbSink(project=...)``) on its schedule while the collector is entered; the sink is flushed and
        closed with the collector. Returns once the sink is open (its errors are raised here).

        Example:
            >>> async def main(collector):  # doctest: +SKIP
            ...     async with collector:
            ...         await collector.add_sink(TensorBoardSink("runs/ppo", every=5))
        """
        self._check_open()
        if self._task_group is None:
            name = type(self).__name__
            raise RuntimeError(
                f"add_sink() needs an entered collector: `async with {name}(...) as c: await c.add_sink(s)`"
            )
        await self._task_group.start(sink.run, self)

    def _record(
        self,
        frames: int,
        episodes: list[tuple[int, float, int]],
        *,
        worker_id: int | None,
        policy_version: int,
    ) -> None:
        """Count a delivered batch; ``episodes`` are ``(worker_id, return, length)`` of those that ended."""
        self._last_frames = int(frames)
        self._stats.record(frames, [e[1] for e in episodes], [e[2] for e in episodes])
        stats = self._stats
        if self._progress.shown:  # frames/s sums the deliveries of its window: not for nothing per batch
            self._progress.update(frames, stats.frames, stats.frames_per_second(), stats.mean_return())
        if self._hub.active:
            for worker, ret, length in episodes:
                self._hub.publish(EpisodeFinished(ret, length, worker, frames=stats.frames))
            self._hub.publish(BatchDelivered(frames, worker_id, policy_version))

    # -- background collection and pause ----------------------------------------------------------
    async def start(self) -> None:
        """Collect into ``replay_buffer`` in the background until the collector closes (or
        ``total_frames`` is reached).

        Needs ``replay_buffer`` and an entered collector (``async with collector:``), whose task group
        owns the background task.
        """
        self._check_open()
        name = type(self).__name__
        if self.replay_buffer is None:
            raise RuntimeError(f"start() needs a replay_buffer: {name}(..., replay_buffer=rb)")
        if self._task_group is None:
            raise RuntimeError(
                f"start() needs an entered collector: `async with {name}(...) as c: await c.start()`"
            )
        if self._background is not None:
            raise RuntimeError("start() was called already")
        await self._task_group.start(self._run_free)

    async def _run_free(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        with anyio.CancelScope() as scope:
            self._background = scope
            task_status.started()
            try:
                async for _ in self.fill():
                    pass
            except Exception as exc:  # raised by __aexit__, with its own type and traceback
                self._background_error = exc
                if self._task_group is not None:
                    self._task_group.cancel_scope.cancel()  # and the `async with` body stops

    @asynccontextmanager
    async def pause(self) -> AsyncIterator[None]:
        """No new batch starts (and none is delivered or written) while this context is open; a batch
        in flight completes first.

        Example:
            >>> async def trainer_step(collector):  # doctest: +SKIP
            ...     async with collector.pause():
            ...         ...  # e.g. torch.compile the policy while no rollout runs
        """
        with self._pauses.hold(on_last=lambda: self._hub.publish(Resumed())):
            await self._wait_idle()
            if self._pauses.count == 1:
                self._hub.publish(Paused())
            yield

    async def _wait_idle(self) -> None:
        """Wait for the batch in flight (``pause()``)."""
        async with self._lock:
            pass

    def _finish_progress(self) -> None:
        stats = self._stats
        self._progress.close(stats.frames, stats.frames_per_second(), stats.mean_return())

    @property
    def paused(self) -> bool:
        return bool(self._pauses)


class _Fill:
    """The iterator of :meth:`CollectorBase.fill`: one ``int`` per batch written to the replay buffer.

    A plain async iterator (not an async generator), so breaking out of the loop leaves nothing to
    finalise.
    """

    def __init__(self, collector: CollectorBase) -> None:
        self._collector = collector

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> int:
        collector = self._collector
        await collector.__anext__()
        # read before anything else runs: __anext__ recorded its batch under the batch lock, just now
        return collector._last_frames
