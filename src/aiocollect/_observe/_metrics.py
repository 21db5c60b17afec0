"""Prometheus metrics of a collector, in the OpenMetrics text format (``pip install "aiocollect[metrics]"``).

``prometheus_client`` writes the format; it is imported only when metrics are asked for. Each call reads
``collector.statistics()`` once: the counters (frames, batches, episodes, discarded frames, env
restarts), the rates, the idle ratios and the time split, for the collector and for each of its workers
(labels ``collector`` and ``worker``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ._stats import WORKER_STATES, CollectorStatistics

__all__ = ["CONTENT_TYPE", "format_metrics", "metrics_text", "statistics_metrics"]

#: the media type of :func:`metrics_text` (OpenMetrics 1.0.0)
CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"
_INSTALL = 'pip install "aiocollect[metrics]"'


def _client() -> Any:
    try:
        import prometheus_client.core as core
        from prometheus_client.openmetrics import exposition
    except ImportError as exc:
        raise ImportError(f"Prometheus metrics need prometheus_client ({exc}): {_INSTALL}") from exc
    return core, exposition


def metrics_text(collector: Any, *, name: str | None = None) -> str:
    """``collector.statistics()`` as Prometheus metrics in the OpenMetrics text format, labelled
    ``collector=name`` (default: the collector's class name) and, per worker, ``worker``.

    For an app that serves its own ``/metrics`` (the dashboard serves this one at ``GET /metrics``).
    Needs ``prometheus_client``: ``pip install "aiocollect[metrics]"``.

    Example:
        >>> async def metrics(collector):  # doctest: +SKIP
        ...     text = aiocollect.metrics_text(collector, name="ppo")
        ...     # aiocollect_frames_total{collector="ppo"} 4096.0 ...
    """
    _client()  # before reading the statistics: a missing extra says so first
    return format_metrics(collector.statistics(), name if name is not None else type(collector).__name__)


def format_metrics(stats: CollectorStatistics, name: str) -> str:
    """One statistics record as OpenMetrics text, labelled ``collector=name`` (pure: any thread)."""
    core, exposition = _client()

    class _Once:
        def collect(self) -> Iterator[Any]:
            return statistics_metrics(stats, name, core)

    registry = core.CollectorRegistry(auto_describe=False)
    registry.register(_Once())
    text: str = exposition.generate_latest(registry).decode("utf-8")
    return text


def statistics_metrics(stats: CollectorStatistics, name: str, core: Any) -> Iterator[Any]:
    """The metric families of one statistics record (``core``: ``prometheus_client.core``)."""
    c, w = ["collector"], ["collector", "worker"]
    gauge, counter = core.GaugeMetricFamily, core.CounterMetricFamily
    for key, doc in (
        ("frames", "frames delivered"),
        ("batches", "batches delivered"),
        ("episodes", "episodes completed"),
        ("frames_discarded", "frames collected and dropped: newer weights overtook them"),
        ("restarts", "envs rebuilt after a fault (RestartPolicy)"),
    ):
        family = counter(f"aiocollect_{key}", doc, labels=c)
        family.add_metric([name], getattr(stats, key))
        yield family
    scalars = {
        "frames_per_second": ("frames delivered per second, last ~10 s", stats.frames_per_second),
        "policy_version": ("the newest policy version published", stats.policy_version),
        "paused": ("1 while pause() holds the collector", int(stats.paused)),
        "mean_return": ("mean return of the recent episodes", stats.mean_return),
        "mean_length": ("mean length of the recent episodes", stats.mean_length),
        "trainer_wait": ("fraction of wall time the consumer awaited a batch", stats.trainer_wait),
        "collector_wait": ("fraction of the producers' time ready batches waited", stats.collector_wait),
    }
    for key, (doc, value) in scalars.items():
        if value is not None:
            family = gauge(f"aiocollect_{key}", doc, labels=c)
            family.add_metric([name], float(value))
            yield family
    if stats.loop_lag_ms:
        family = gauge("aiocollect_loop_lag_ms", "the event loop's recent lag (ms)", labels=[*c, "quantile"])
        for q, value in stats.loop_lag_ms.items():
            family.add_metric([name, q.lstrip("p")], float(value))
        yield family
    yield from _splits(stats, name, core)
    workers = stats.workers
    if not workers:
        return
    frames = counter("aiocollect_worker_frames", "frames a worker collected", labels=w)
    restarts = counter("aiocollect_worker_restarts", "envs a worker rebuilt after a fault", labels=w)
    version = gauge("aiocollect_worker_policy_version", "the policy version a worker runs", labels=w)
    state = gauge("aiocollect_worker_state", "1 for a worker's state", labels=[*w, "state"])
    wait = gauge("aiocollect_worker_collector_wait", "fraction of time a worker's batches waited", labels=w)
    for worker in workers:
        labels = [name, str(worker.worker_id)]
        frames.add_metric(labels, worker.frames)
        restarts.add_metric(labels, worker.restarts)
        version.add_metric(labels, worker.policy_version)
        for s in WORKER_STATES:
            state.add_metric([*labels, s], float(worker.state == s))
        if worker.collector_wait is not None:
            wait.add_metric(labels, worker.collector_wait)
    yield from (frames, restarts, version, state, wait)


def _splits(stats: CollectorStatistics, name: str, core: Any) -> Iterator[Any]:
    """The time split of the collector and of each worker, as fractions and as µs per frame."""
    fraction = core.GaugeMetricFamily(
        "aiocollect_time_split", "fraction of the producers' wall time, by part", labels=["collector", "part"]
    )
    per_frame = core.GaugeMetricFamily(
        "aiocollect_time_split_us_per_frame", "µs per frame, by part", labels=["collector", "part"]
    )
    worker_fraction = core.GaugeMetricFamily(
        "aiocollect_worker_time_split",
        "fraction of a worker's wall time, by part",
        labels=["collector", "worker", "part"],
    )
    worker_per_frame = core.GaugeMetricFamily(
        "aiocollect_worker_time_split_us_per_frame",
        "a worker's µs per frame, by part",
        labels=["collector", "worker", "part"],
    )
    for part, value in (stats.time_split or {}).items():
        fraction.add_metric([name, part], value)
    for part, value in (stats.time_split_us or {}).items():
        per_frame.add_metric([name, part], value)
    for worker in stats.workers:
        wid = str(worker.worker_id)
        for part, value in (worker.time_split or {}).items():
            worker_fraction.add_metric([name, wid, part], value)
        for part, value in (worker.time_split_us or {}).items():
            worker_per_frame.add_metric([name, wid, part], value)
    yield from (fraction, per_frame, worker_fraction, worker_per_frame)
