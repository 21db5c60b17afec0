"""Collector statistics: a frozen, JSON-serialisable record, and the tracker that fills it."""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from ._timesplit import combine_splits

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
    ``"collecting"``, ``"paused"``, ``"stopped"``, ``"failed"``.

    ``time_split`` (fractions of the worker's wall time) and ``time_split_us`` (µs per frame), keyed
    ``"env"``, ``"policy"``, ``"transfer"``, ``"wait"``, ``"other"``, over the last ~10 s, and
    ``collector_wait`` (its ``"wait"`` fraction: its batches waited for the consumer): ``None`` where the
    worker does not measure them (see docs/why-slow.md)."""

    worker_id: int
    state: str
    frames: int
    policy_version: int
    time_split: dict[str, float] | None = None
    time_split_us: dict[str, float] | None = None
    collector_wait: float | None = None
    #: envs this worker rebuilt after a fault (``RestartPolicy``)
    restarts: int = 0

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
        trainer_wait: the fraction of the last ~10 s of wall time the consumer spent awaiting the next batch
            (in ``async for``); ``None`` before it first asked.
        collector_wait: the fraction of the producers' time their ready batches waited for the consumer
            (the ``"wait"`` of ``time_split``); ``None`` where not measured.
        time_split: where the producers' wall time went over the last ~10 s, as fractions keyed ``"env"``,
            ``"policy"``, ``"transfer"``, ``"wait"``, ``"other"`` (all workers together); ``None`` where
            not measured. ``time_split_us``: the same as µs per frame.
        restarts: envs rebuilt after a fault (``RestartPolicy``), all workers together.

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
    trainer_wait: float | None = None
    collector_wait: float | None = None
    time_split: dict[str, float] | None = None
    time_split_us: dict[str, float] | None = None
    restarts: int = 0

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
        # the consumer's waits for a batch: closed (start, end) intervals, and the open one's start
        self._waits: deque[tuple[float, float]] = deque()
        self._waiting_since: float | None = None
        self._first_ask: float | None = None
        #: the last measured split (by worker id, and of them all): kept once the workers are gone
        self._last_split: tuple[dict[int, WorkerStatistics], tuple[dict[str, float], dict[str, float]]] | None
        self._last_split = None

    def awaiting(self) -> None:
        """The consumer starts waiting for a batch (``__anext__``); :meth:`record` ends the wait."""
        now = time.monotonic()
        if self._first_ask is None:
            self._first_ask = now
        if self._waiting_since is not None:  # the last wait was cancelled: it counts until now
            self._waits.append((self._waiting_since, now))
        self._waiting_since = now

    def trainer_wait(self, now: float | None = None) -> float | None:
        """The fraction of the last ``rate_window_s`` seconds (since the first ask, in a younger run) the
        consumer spent waiting for a batch; ``None`` before it first asked."""
        if self._first_ask is None:
            return None
        now = time.monotonic() if now is None else now
        start = max(now - self._rate_window_s, self._first_ask)
        waits = self._waits
        while waits and waits[0][1] <= start:
            waits.popleft()
        waited = sum(min(end, now) - max(begin, start) for begin, end in waits if end > start)
        if self._waiting_since is not None:
            waited += now - max(self._waiting_since, start)
        span = now - start
        return min(max(waited / span, 0.0), 1.0) if span > 0 else 0.0

    def record(self, frames: int, returns: list[float], lengths: list[int]) -> None:
        now = time.monotonic()
        if self._waiting_since is not None:
            self._waits.append((self._waiting_since, now))
            self._waiting_since = None
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
        """Drop the deliveries and the consumer's waits older than the rate window (a run of days that
        never reads ``trainer_wait`` keeps no more than a window of them)."""
        while self._deliveries and now - self._deliveries[0][0] > self._rate_window_s:
            self._deliveries.popleft()
        while self._waits and now - self._waits[0][1] > self._rate_window_s:
            self._waits.popleft()

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
        splits: Sequence[tuple[float, list[float], int] | None] = (),
        split: tuple[float, list[float], int] | None = None,
    ) -> CollectorStatistics:
        """The statistics now: frames/s reads 0 while ``paused``, and once the run has ended (``total_frames``
        delivered) every worker that did not fail reads ``stopped``. ``splits``: each worker's measured
        time split (``SplitWindow.seconds()``, in the order of ``workers``; ``None``: not measured);
        ``split``: the collector's own, where its workers keep none (the async-env engine's)."""
        returns = self._returns
        lengths = self._lengths
        workers, combined = _with_splits(workers, splits)
        if combined is None and split is not None:
            combined = combine_splits([split])
        if combined is not None:
            self._last_split = ({w.worker_id: w for w in workers}, combined)
        elif self._last_split is not None:  # the workers are gone (a closed collector): their last split
            last, combined = self._last_split
            workers = tuple(_split_of(w, last.get(w.worker_id)) for w in workers)
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
            trainer_wait=self.trainer_wait(),
            collector_wait=combined[0]["wait"] if combined is not None else None,
            time_split=combined[0] if combined is not None else None,
            time_split_us=combined[1] if combined is not None else None,
            restarts=sum(w.restarts for w in workers),
        )


def _split_of(worker: WorkerStatistics, measured: WorkerStatistics | None) -> WorkerStatistics:
    if measured is None or measured.time_split is None:
        return worker
    split, per_frame, wait = measured.time_split, measured.time_split_us, measured.collector_wait
    return replace(worker, time_split=split, time_split_us=per_frame, collector_wait=wait)


def _with_splits(
    workers: tuple[WorkerStatistics, ...], splits: Sequence[tuple[float, list[float], int] | None]
) -> tuple[tuple[WorkerStatistics, ...], tuple[dict[str, float], dict[str, float]] | None]:
    """The workers with their time splits filled in, and the split of them all."""
    if not any(s is not None for s in splits):
        return workers, None
    out = list(workers)
    for i, measured in enumerate(splits[: len(out)]):
        split = combine_splits([measured])
        if split is not None:
            fractions, per_frame = split
            out[i] = replace(
                out[i], time_split=fractions, time_split_us=per_frame, collector_wait=fractions["wait"]
            )
    return tuple(out), combine_splits(splits)
