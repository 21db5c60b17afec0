"""The dashboard's record of a run, kept by the server: statistics samples, episodes, the trainer's metrics
and the other events, each bounded (a series halves its resolution when full), so that a page opened late
or reloaded shows the whole run."""

from __future__ import annotations

import csv
import io
import time
from collections import deque
from typing import Any

import anyio

__all__ = ["History", "Series"]

# statistics fields written to the CSV, in order (loop lag flattened)
CSV_STATISTICS = (
    "frames",
    "batches",
    "episodes",
    "frames_per_second",
    "mean_return",
    "mean_length",
    "min_return",
    "max_return",
    "policy_version",
    "paused",
    "trainer_wait",
    "collector_wait",
)


class Series:
    """A bounded list that keeps every ``stride``-th item added: when it holds ``limit`` items it drops
    every other one and doubles ``stride`` (the run stays whole, at half the resolution). The newest item
    added is always shown last (``items()``), kept or not.

    Example:
        >>> s = Series(4)
        >>> for i in range(10):
        ...     s.add(i)
        >>> s.items(), s.stride
        ([0, 4, 8, 9], 4)
    """

    def __init__(self, limit: int) -> None:
        if limit < 2:
            raise ValueError(f"a series keeps at least 2 items, got limit={limit!r}")
        self.limit = limit
        self.stride = 1
        self.added = 0
        self._kept: list[Any] = []
        self._newest: Any = None

    def add(self, item: Any) -> None:
        if self.added % self.stride == 0:
            self._kept.append(item)
            if len(self._kept) >= self.limit:
                self._kept = self._kept[::2]
                self.stride *= 2
        self.added += 1
        self._newest = item

    def items(self) -> list[Any]:
        """The kept items, oldest first, then the newest one if it was not kept."""
        if self.added and (not self._kept or self._kept[-1] is not self._newest):
            return [*self._kept, self._newest]
        return list(self._kept)

    def __len__(self) -> int:
        return len(self.items())


class History:
    """What a dashboard remembers of its collector while its lifespan runs (:meth:`run`): a statistics
    sample every ``interval`` seconds, every finished episode ``[time, frames, return, length, worker]``,
    every ``log_metrics`` call and the other events (weights, workers, pauses), each series bounded.

    Read it with :meth:`to_dict` (the ``history`` message and ``/history.json``) or :meth:`to_csv`.
    """

    def __init__(
        self,
        collector: Any,
        *,
        interval: float,
        max_samples: int = 2048,
        max_episodes: int = 4096,
        max_metrics: int = 4096,
        max_events: int = 512,
        pause_held: Any = None,
    ) -> None:
        self.collector = collector
        self.interval = interval
        self.samples = Series(max_samples)
        self.episodes = Series(max_episodes)
        self.metrics = Series(max_metrics)
        self.events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self.started: float | None = None
        self._pause_held = pause_held or (lambda: False)
        self._stream: Any = None
        self._frames = 0

    # -- recording ---------------------------------------------------------------------------------------
    def open(self) -> None:
        """Start listening to the collector's events (the dashboard's lifespan does)."""
        if self._stream is None:
            self.started = time.time() if self.started is None else self.started
            self._frames = int(self.collector.statistics().frames)
            # large: read at every sample, and at every read of the history
            self._stream = self.collector.events(max_buffer=1 << 16)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def catch_up(self) -> None:
        """Take in the events published since the last call (synchronous: nothing is missed or doubled
        between this and a stream opened just before)."""
        stream = self._stream
        if stream is None:
            return
        while (event := stream.receive_nowait()) is not None:
            kind = event.kind
            if kind == "batch":
                self._frames += int(event.frames)
            elif kind == "episode":
                frames = int(getattr(event, "frames", 0)) or self._frames
                self.episodes.add([event.time, frames, event.episode_return, event.length, event.worker_id])
            elif kind == "metrics":
                self._frames = max(self._frames, int(event.frames))
                self.metrics.add(
                    {"time": event.time, "frames": event.frames, "step": event.step, "metrics": event.metrics}
                )
            else:
                record = event.to_dict()
                record.setdefault("frames", self._frames)
                self.events.append(record)

    def sample(self) -> dict[str, Any]:
        """Add a statistics sample (``collector.statistics()`` with ``time`` and ``pause_held``)."""
        data = self.collector.statistics().to_dict()
        data["time"] = time.time()
        data["pause_held"] = bool(self._pause_held())
        self._frames = max(self._frames, int(data["frames"]))
        self.samples.add(data)
        return data

    async def run(self) -> None:
        """Sample every ``interval`` seconds until cancelled, or until the collector closes (a last sample
        then: its workers read ``stopped``)."""
        self.open()
        while True:
            self.catch_up()
            self.sample()
            stream = self._stream
            if stream is None or stream.ended:
                return
            await anyio.sleep(self.interval)

    # -- reading -----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The whole record (JSON-serialisable once non-finite floats are taken care of)."""
        self.catch_up()
        return {
            "started": self.started,
            "interval": self.interval,
            "resolution": {
                "samples": self.samples.stride,
                "episodes": self.episodes.stride,
                "metrics": self.metrics.stride,
            },
            "samples": self.samples.items(),
            "episodes": self.episodes.items(),
            "metrics": self.metrics.items(),
            "events": list(self.events),
        }

    def to_csv(self, record: dict[str, Any] | None = None) -> str:
        """One row per statistics sample (``kind=statistics``) and per ``log_metrics`` call
        (``kind=metrics``), in time order; a column per metric name."""
        record = self.to_dict() if record is None else record
        fixed = ["kind", "time", *CSV_STATISTICS, "loop_lag_p50_ms", "loop_lag_p99_ms", "step"]
        names = sorted({name for m in record["metrics"] for name in m["metrics"]})
        column = {n: f"metric:{n}" if n in fixed else n for n in names}  # a metric named "frames" stays apart
        rows: list[tuple[float, dict[str, Any]]] = []
        for s in record["samples"]:
            row = {k: s.get(k) for k in CSV_STATISTICS}
            lag = s.get("loop_lag_ms") or {}
            row.update(kind="statistics", time=s["time"])
            row.update(loop_lag_p50_ms=lag.get("p50"), loop_lag_p99_ms=lag.get("p99"))
            rows.append((s["time"], row))
        for m in record["metrics"]:
            row = {"kind": "metrics", "time": m["time"], "frames": m["frames"], "step": m["step"]}
            row.update({column[n]: v for n, v in m["metrics"].items()})
            rows.append((m["time"], row))
        rows.sort(key=lambda r: r[0])
        out = io.StringIO()
        writer = csv.DictWriter(out, [*fixed, *column.values()], lineterminator="\n")
        writer.writeheader()
        for _, row in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
        return out.getvalue()
