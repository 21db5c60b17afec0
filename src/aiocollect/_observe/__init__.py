"""Observability: events, statistics, the time split, progress bars, logging sinks and Prometheus metrics."""

__all__: list[str] = []
