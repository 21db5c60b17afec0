"""Collector statistics: a frozen, JSON-serialisable record, and the tracker that fills it."""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import Any

__all__ = ["WORKER_STATES", "CollectorStatistics", "StatsTracker", "WorkerState", "WorkerStatistics"]


class WorkerState(enum.StrEnum):
    """A worker's (node's, actor's) state; each member *is* its string: ``WorkerState.FAILED == "failed"``."""

    STARTING = "starting"
    COLLECTING = "collecting"
    PAUSED = "paused"
    STOPPED = "stopped"
    FAILED = "failed"


WORKER_STATES = tuple(state.value for state in WorkerState)


@dataclass(frozen=True)
class WorkerStatistics:
    """One worker: ``state`` is a :class:`WorkerState`, i.e. one of the strings ``"starting"``,
    ``"collecting"``, ``"paused"``, ``"stopped"``, ``"failed"``."""

    worker_id: int
    state: str
    frames: int
    policy_version: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", WorkerState(self.state))


@dataclass(frozen=True)
class CollectorStatistics:
    """What a collector has done so far.

    Attributes:
        frames: frames delivered (valid frames only).
        batches: batches delivered.
        episodes: episodes completed.
        mean_return: mean return of the last ``window`` completed episodes (``None`` before the first).
        mean_length: mean length of the same episodes.
        frames_per_second: delivery rate over the last ~10 seconds (since the first batch in a younger
            run): it decays to 0 within that window once batches stop coming, and reads 0 while paused.
        policy_version: the newest version published (by ``update_weights``).
        min_return, max_return: extremes of the same recent episodes.
        workers: one :class:`WorkerStatistics` per worker (one for the in-process ``Collector``); each
            reads ``stopped`` once the run has ended (``total_frames`` delivered), unless it failed.
        paused: whether ``pause()`` holds the collector.
        loop_lag_ms: the event loop's recent lag, ``{"p50": ..., "p99": ...}`` in ms, measured while the
            collector is entered (``async with``); ``None`` before.
        frames_discarded: frames collected and never delivered because newer weights overtook them
            (``update_weights(flush=True)``, ``max_policy_lag=0`` on ``MultiAsyncCollector``).

    Example:
        >>> CollectorStatistics(0, 0, 0, None, None, 0.0, 0).to_dict()["frames"]
        0
    """

    frames: int
    batches: int
    episodes: int
    mean_return: float | None
    mean_length: float | None
    frames_per_second: float
    policy_version: int
    min_return: float | None = None
    max_return: float | None = None
    workers: tuple[WorkerStatistics, ...] = ()
    paused: bool = False
    loop_lag_ms: dict[str, float] | None = None
    frames_discarded: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class StatsTracker:
    """Accumulates per-batch figures; read with :meth:`snapshot`. Used from the event loop only."""

    def __init__(self, window: int = 100, rate_window_s: float = 10.0, total_frames: int = -1) -> None:
        self.frames = 0
        self.batches = 0
        self.episodes = 0
        self.total_frames = total_frames
        self._returns: deque[float] = deque(maxlen=window)
        self._lengths: deque[int] = deque(maxlen=window)
        self._deliveries: deque[tuple[float, int]] = deque()
        self._rate_window_s = rate_window_s
        self._started = time.monotonic()
        self._first: float | None = None  # when the first batch was delivered

    def record(self, frames: int, returns: list[float], lengths: list[int]) -> None:
        now = time.monotonic()
        self.frames += frames
        self.batches += 1
        self.episodes += len(returns)
        self._returns.extend(returns)
        self._lengths.extend(lengths)
        if self._first is None:
            self._first = now
        self._deliveries.append((now, frames))
        self._forget(now)

    def _forget(self, now: float) -> None:
        """Drop the deliveries older than the rate window."""
        while self._deliveries and now - self._deliveries[0][0] > self._rate_window_s:
            self._deliveries.popleft()

    def mean_return(self) -> float | None:
        return sum(self._returns) / len(self._returns) if self._returns else None

    def load(self, frames: int, batches: int, episodes: int) -> None:
        self.frames, self.batches, self.episodes = frames, batches, episodes

    @property
    def finished(self) -> bool:
        """Whether ``total_frames`` (when positive) are delivered: the run has ended."""
        return 0 < self.total_frames <= self.frames

    def frames_per_second(self, now: float | None = None) -> float:
        """Frames delivered over the last ``rate_window_s`` seconds (or since the first batch, in a younger
        run), per second. It decays to 0 within the window once batches stop coming (a pause, a stalled
        trainer, the end of the run), instead of holding the last rate."""
        if self._first is None:
            return 0.0
        now = time.monotonic() if now is None else now
        self._forget(now)
        start = now - self._rate_window_s
        if self._first > start:  # a run younger than the window
            if len(self._deliveries) == 1:  # one batch so far: the rate since the tracker started
                return self._deliveries[0][1] / max(now - self._started, 1e-9)
            # the first batch is the time base (start-up before it is not collection)
            frames = sum(f for t, f in self._deliveries if t > self._first)
            return frames / max(now - self._first, 1e-9)
        return sum(f for _, f in self._deliveries) / self._rate_window_s

    def snapshot(
        self,
        policy_version: int,
        *,
        workers: tuple[WorkerStatistics, ...] = (),
        paused: bool = False,
        loop_lag_ms: dict[str, float] | None = None,
    ) -> CollectorStatistics:
        """The statistics now: frames/s reads 0 while ``paused``, and once the run has ended (``total_frames``
        delivered) every worker that did not fail reads ``stopped``."""
        returns = self._returns
        lengths = self._lengths
        if self.finished:
            workers = tuple(
                w
                if w.state in (WorkerState.STOPPED, WorkerState.FAILED)
                else replace(w, state=WorkerState.STOPPED)
                for w in workers
            )
        return CollectorStatistics(
            min_return=min(returns) if returns else None,
            max_return=max(returns) if returns else None,
            workers=workers,
            paused=paused,
            loop_lag_ms=loop_lag_ms,
            frames=self.frames,
            batches=self.batches,
            episodes=self.episodes,
            mean_return=sum(returns) / len(returns) if returns else None,
            mean_length=sum(lengths) / len(lengths) if lengths else None,
            frames_per_second=0.0 if paused else self.frames_per_second(),
            policy_version=policy_version,
        )
