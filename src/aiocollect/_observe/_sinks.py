"""Logging sinks: a collector's ``statistics()`` and the trainer's ``log_metrics`` written to TensorBoard or
Weights & Biases on a schedule, in a thread, never on the event loop (``await collector.add_sink(sink)``)."""

from __future__ import annotations

import abc
import importlib
import importlib.util
import logging
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread

from ._events import MetricsLogged
from ._stats import CollectorStatistics

__all__ = ["Sink", "TensorBoardSink", "WandbSink", "statistics_scalars"]

logger = logging.getLogger("aiocollect.sinks")


def statistics_scalars(stats: CollectorStatistics, prefix: str = "collector/") -> dict[str, float]:
    """The numbers of ``stats`` worth a curve, by tag (``None`` ones left out).

    Example:
        >>> stats = CollectorStatistics(100, 1, 2, 20.0, 20.0, 50.0, 3)
        >>> statistics_scalars(stats)["collector/frames_per_second"]
        50.0
    """
    values: dict[str, float | None] = {
        "frames_per_second": stats.frames_per_second,
        "mean_return": stats.mean_return,
        "mean_length": stats.mean_length,
        "min_return": stats.min_return,
        "max_return": stats.max_return,
        "episodes": stats.episodes,
        "batches": stats.batches,
        "policy_version": stats.policy_version,
        "restarts": stats.restarts,
    }
    if stats.loop_lag_ms:
        values["loop_lag_p50_ms"] = stats.loop_lag_ms.get("p50")
        values["loop_lag_p99_ms"] = stats.loop_lag_ms.get("p99")
    values["trainer_wait"] = stats.trainer_wait
    values["collector_wait"] = stats.collector_wait
    for part, fraction in (stats.time_split or {}).items():
        values[f"time_split/{part}"] = fraction
    for part, us in (stats.time_split_us or {}).items():
        values[f"time_split_us/{part}"] = us
    return {prefix + k: float(v) for k, v in values.items() if v is not None}


class Sink(abc.ABC):
    """Writes a collector's statistics and the trainer's metrics every ``every`` seconds.

    :meth:`run` (started by ``await collector.add_sink(sink)`` in the collector's task group) waits on the
    event loop; :meth:`open`, :meth:`write` and :meth:`close` run in a worker thread, one at a time. The
    last write and :meth:`close` happen when the collector closes (or its ``async with`` ends). A write
    that fails is logged (``aiocollect.sinks``) and collection goes on.

    Subclass it for another backend: implement the three thread-side methods.
    """

    def __init__(self, *, every: float = 10.0) -> None:
        if isinstance(every, bool) or not isinstance(every, int | float) or not every > 0:
            raise ValueError(f"every must be a positive number of seconds between writes, got {every!r}")
        self.every = float(every)
        self.writes = 0  # statistics written so far (tests and curious users read it)
        self._running = False
        self._last: tuple[int, int, int] | None = None

    # -- in the writer thread ----------------------------------------------------------------------------
    @abc.abstractmethod
    def open(self) -> None:
        """Open the writer (a worker thread; errors reach ``add_sink``)."""

    @abc.abstractmethod
    def write(self, statistics: CollectorStatistics | None, metrics: list[MetricsLogged]) -> None:
        """Write one statistics record (``None``: nothing new since the last) and the metrics logged since
        the last call (a worker thread)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and close the writer (a worker thread)."""

    # -- on the event loop -------------------------------------------------------------------------------
    async def run(self, collector: Any, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Open, then write every ``every`` seconds until the collector closes or this task is cancelled;
        then write once more and close."""
        if self._running:
            raise RuntimeError("this sink is added to a collector already: make one sink per collector")
        self._running = True
        stream = collector.events(max_buffer=1 << 16, kinds={"metrics"})
        try:
            await anyio.to_thread.run_sync(self.open)
        except BaseException:
            stream.close()
            self._running = False
            raise
        task_status.started()
        pending: list[MetricsLogged] = []
        try:
            deadline = anyio.current_time() + self.every
            while not stream.ended:
                with anyio.CancelScope(deadline=deadline):  # not move_on_at: newer than our anyio floor
                    while True:
                        try:
                            pending.append(await stream.__anext__())
                        except StopAsyncIteration:
                            break  # the collector closed
                await self._flush(collector, pending)
                deadline = max(deadline + self.every, anyio.current_time())
        finally:
            with anyio.CancelScope(shield=True):
                while (event := stream.receive_nowait()) is not None:
                    pending.append(event)
                stream.close()
                try:
                    await self._flush(collector, pending)
                finally:
                    try:
                        await anyio.to_thread.run_sync(self.close)
                    except Exception:
                        logger.exception("closing %r failed", self)

    async def _flush(self, collector: Any, pending: list[MetricsLogged]) -> None:
        """Write the statistics (if they changed) and ``pending``; the metrics leave ``pending`` only once
        written (a write cancelled before it ran is made by the last flush instead)."""
        try:
            stats = collector.statistics()
        except Exception:  # the sink is a task of the collector's task group: it never raises
            logger.exception("%r could not read the statistics", self)
            return
        key = (stats.frames, stats.batches, stats.episodes)
        fresh = stats if key != self._last else None
        if fresh is None and not pending:
            return
        n = len(pending)
        metrics = pending[:n]
        done = False

        def job() -> None:
            nonlocal done
            self.write(fresh, metrics)
            done = True

        try:
            await anyio.to_thread.run_sync(job)
        except Exception:
            logger.exception("%r could not write; collection goes on", self)
            del pending[:n]  # not retried
        finally:
            if done:
                del pending[:n]
                if fresh is not None:
                    self._last = key
                    self.writes += 1


def _require(package: str, extra: str) -> None:
    """Raise a clear ``ImportError`` unless ``package`` is installed (imported later, in the writer thread:
    a large import would hold the event loop)."""
    if importlib.util.find_spec(package) is None:
        raise ImportError(f"{package} is not installed: pip install 'aiocollect[{extra}]'")


class TensorBoardSink(Sink):
    """TensorBoard event files (``torch.utils.tensorboard.SummaryWriter``) in ``logdir``.

    The collector's numbers go under ``collector/`` (``collector/frames_per_second``,
    ``collector/mean_return``, ...), the trainer's metrics under their own names; every curve's step is
    the frame count (``step="trainer"``: the metrics logged with a ``step`` use it instead).

    Example:
        >>> async def main(collector):  # doctest: +SKIP
        ...     async with collector:
        ...         await collector.add_sink(TensorBoardSink("runs/ppo", every=5))
        ...         async for batch in collector:
        ...             collector.log_metrics({"loss": train(batch)})
    """

    def __init__(self, logdir: str | Path, *, every: float = 10.0, step: str = "frames") -> None:
        super().__init__(every=every)
        if step not in ("frames", "trainer"):
            raise ValueError(f"step must be 'frames' or 'trainer', got {step!r}")
        _require("tensorboard", "tensorboard")
        self.logdir = Path(logdir)
        self.step = step
        self._writer: Any = None

    def open(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(self.logdir))

    def write(self, statistics: CollectorStatistics | None, metrics: list[MetricsLogged]) -> None:
        writer = self._writer
        if statistics is not None:
            for tag, value in statistics_scalars(statistics).items():
                writer.add_scalar(tag, value, global_step=statistics.frames)
        for event in metrics:
            step = event.step if self.step == "trainer" and event.step is not None else event.frames
            for name, value in event.metrics.items():
                writer.add_scalar(name, value, global_step=step, walltime=event.time)
        writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __repr__(self) -> str:
        return f"TensorBoardSink({str(self.logdir)!r}, every={self.every})"


class WandbSink(Sink):
    """A Weights & Biases run (``wandb.init(project=..., mode=...)``; ``mode="offline"`` by default: the run
    is written under ``dir``/wandb/ and uploaded later with ``wandb sync``).

    Every entry carries ``frames`` (the x-axis of every curve: ``define_metric("*", step_metric="frames")``);
    the collector's numbers are under ``collector/``, the trainer's metrics under their own names, with
    ``trainer/step`` when ``log_metrics`` was given one. The run is made with ``reinit="create_new"``, so
    a run of your own is left alone; it is finished when the collector closes. More ``wandb.init``
    arguments go through ``init`` (e.g. ``name``, ``config``, ``tags``).

    Example:
        >>> async def main(collector):  # doctest: +SKIP
        ...     async with collector:
        ...         await collector.add_sink(WandbSink(project="ppo", config={"lr": 3e-4}))
    """

    def __init__(
        self,
        project: str | None = None,
        *,
        mode: str = "offline",
        every: float = 10.0,
        dir: str | Path | None = None,
        **init: Any,
    ) -> None:
        super().__init__(every=every)
        if mode not in ("online", "offline", "disabled", "shared"):
            raise ValueError(f"mode must be 'offline', 'online', 'shared' or 'disabled', got {mode!r}")
        _require("wandb", "wandb")
        self.project = project
        self.mode = mode
        self.dir = None if dir is None else Path(dir)
        self.init = init
        #: the ``wandb`` run while the sink is open
        self.run_: Any = None

    def open(self) -> None:
        wandb = importlib.import_module("wandb")
        kwargs = dict(self.init)
        # no console capture (it would wrap sys.stdout under the progress bar), no system-metrics sampler
        kwargs.setdefault("settings", wandb.Settings(console="off", silent=True, x_disable_stats=True))
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            kwargs.setdefault("dir", str(self.dir))
        run = wandb.init(project=self.project, mode=self.mode, reinit="create_new", **kwargs)
        run.define_metric("frames")
        run.define_metric("*", step_metric="frames")
        self.run_ = run

    def write(self, statistics: CollectorStatistics | None, metrics: list[MetricsLogged]) -> None:
        run = self.run_
        for event in metrics:
            entry: dict[str, float] = dict(event.metrics)
            entry["frames"] = event.frames
            if event.step is not None:
                entry["trainer/step"] = event.step
            run.log(entry)
        if statistics is not None:
            run.log({**statistics_scalars(statistics), "frames": statistics.frames})

    def close(self) -> None:
        if self.run_ is not None:
            self.run_.finish()
            self.run_ = None

    def __repr__(self) -> str:
        return f"WandbSink(project={self.project!r}, mode={self.mode!r}, every={self.every})"
