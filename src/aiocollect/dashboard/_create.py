"""``create_app``: the dashboard's Starlette app over a collector (starlette is imported when it is called:
``_routes.py`` and ``_guard.py``, which import ``_app.py``, are imported here only)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._app import DashboardControls

if TYPE_CHECKING:
    from starlette.applications import Starlette

__all__ = ["create_app"]


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
