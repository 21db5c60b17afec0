"""What every collector shares: the batch lock and pause gate, background collection into a replay
buffer, the frame budget, statistics bookkeeping and the event stream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from math import ceil
from typing import Any

import anyio
import anyio.abc

from ._errors import CollectorClosedError
from ._events import (
    BatchDelivered,
    EpisodeFinished,
    EventHub,
    EventStream,
    LoopLag,
    Paused,
    Resumed,
)
from ._progress import Progress
from ._stats import StatsTracker


class CollectorBase:
    """Mixed into ``Collector`` and the multi-worker collectors (which set ``total_frames``,
    ``frames_per_batch`` and ``replay_buffer``, and implement ``__anext__``)."""

    total_frames: int
    frames_per_batch: int
    replay_buffer: Any

    def _init_base(self, progress: Any = None) -> None:
        self._progress = Progress(progress, self.total_frames)
        self._stats = StatsTracker()
        self._lock = anyio.Lock()
        self._paused = 0
        self._unpaused: anyio.Event | None = None
        self._closed = False
        self._failed = False
        self._closed_reason = "it was closed"
        self._task_group: anyio.abc.TaskGroup | None = None
        self._background: anyio.CancelScope | None = None
        self._hub = EventHub()
        self._lag = LoopLag()

    # -- state ------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise CollectorClosedError(f"the collector is closed: {self._closed_reason}")

    def _budget_reached(self) -> bool:
        return 0 < self.total_frames <= self._stats.frames

    def __len__(self) -> int:
        if self.total_frames < 0:
            raise TypeError("an endless collector (total_frames=-1) has no len()")
        return ceil(self.total_frames / self.frames_per_batch)

    def __aiter__(self) -> Any:
        return self

    async def _acquire_batch_lock(self) -> None:
        """Wait until no ``pause()`` holds the collector, then take the batch lock."""
        while True:
            if self._unpaused is not None:
                await self._unpaused.wait()
            await self._lock.acquire()
            if not self._paused:
                return
            self._lock.release()

    def _start_monitoring(self) -> None:
        """Measure the event loop's lag while the collector is entered (statistics().loop_lag_ms)."""
        assert self._task_group is not None
        self._task_group.start_soon(self._lag.run)

    # -- events -----------------------------------------------------------------------------------
    def events(self, max_buffer: int = 1024) -> EventStream:
        """An async iterator over this collector's events (batches, episodes, weights, workers, pauses).

        Bounded: a reader that falls ``max_buffer`` events behind loses the oldest, so a stuck dashboard
        never slows collection. The stream ends when the collector closes.

        Example:
            >>> async def watch(collector):  # doctest: +SKIP
            ...     async with collector.events() as events:
            ...         async for event in events:
            ...             print(event.kind, event.to_dict())
        """
        return self._hub.subscribe(max_buffer)

    def _record(
        self,
        frames: int,
        episodes: list[tuple[int, float, int]],
        *,
        worker_id: int | None,
        policy_version: int,
    ) -> None:
        """Count a delivered batch; ``episodes`` are ``(worker_id, return, length)`` of those that ended."""
        self._stats.record(frames, [e[1] for e in episodes], [e[2] for e in episodes])
        stats = self._stats
        self._progress.update(frames, stats.frames, stats.frames_per_second(), stats.mean_return())
        if self._hub.active:
            for worker, ret, length in episodes:
                self._hub.publish(EpisodeFinished(ret, length, worker))
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
            async for _ in self:
                pass

    @asynccontextmanager
    async def pause(self) -> AsyncIterator[None]:
        """No new batch starts (and none is delivered or written) while this context is open; a batch
        in flight completes first.

        Example:
            >>> async def trainer_step(collector):  # doctest: +SKIP
            ...     async with collector.pause():
            ...         ...  # e.g. torch.compile the policy while no rollout runs
        """
        self._paused += 1
        if self._unpaused is None:
            self._unpaused = anyio.Event()
        try:
            async with self._lock:  # waits for the batch in flight
                pass
            if self._paused == 1:
                self._hub.publish(Paused())
            yield
        finally:
            self._paused -= 1
            if not self._paused and self._unpaused is not None:
                self._unpaused.set()
                self._unpaused = None
                self._hub.publish(Resumed())

    def _finish_progress(self) -> None:
        stats = self._stats
        self._progress.close(stats.frames, stats.frames_per_second(), stats.mean_return())

    @property
    def paused(self) -> bool:
        return self._paused > 0
