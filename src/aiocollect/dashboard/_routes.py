"""The Starlette routes of the dashboard (imported only by ``create_app``: starlette is optional)."""

from __future__ import annotations

import html
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .._core._errors import CollectorClosedError
from ._app import DashboardControls, LifespanNotRunning, sse, to_json
from ._guard import Guard

__all__ = [
    "PAGE",
    "SSE_HEADERS",
    "EventStreamResponse",
    "build_app",
    "history_routes",
    "json_response",
    "metrics_routes",
]

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def download(filename: str) -> dict[str, str]:
    """Headers of a download (``Content-Disposition: attachment``) that is never cached."""
    return {"Content-Disposition": f'attachment; filename="{filename}"', "Cache-Control": "no-cache"}


def json_response(obj: Any, status_code: int = 200) -> Response:
    return Response(to_json(obj), status_code=status_code, media_type="application/json")


class EventStreamResponse(StreamingResponse):
    """``text/event-stream`` of statistics (every ``interval`` s) and events, until the client leaves or
    the dashboard closes its streams.

    The collector's event stream is opened in :meth:`__call__`, around the response, so it is closed
    however the response ends; the body only awaits (the event stream or a timeout) and formats.
    """

    def __init__(
        self,
        controls: DashboardControls,
        *,
        interval: float,
        max_buffer: int,
        kinds: set[str] | None,
        history: bool = False,
    ) -> None:
        self._controls = controls
        self._history = history
        self._interval = interval
        self._max_buffer = max_buffer
        self._kinds = kinds
        self._events: Any = None
        super().__init__(self._body(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = self.body_iterator
        try:
            async with self._controls.collector.events(max_buffer=self._max_buffer) as events:
                self._events = events
                await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()

    def _statistics(self) -> str:
        data = self._controls.collector.statistics().to_dict()
        data["time"] = time.time()
        data["pause_held"] = self._controls.pause_held
        return sse("statistics", data)

    async def _body(self) -> AsyncIterator[str]:
        controls, events, kinds, interval = self._controls, self._events, self._kinds, self._interval
        yield "retry: 2000\n\n"
        if self._history:
            # what the stream holds so far is in the history (both synchronous: nothing lost or doubled)
            while events.receive_nowait() is not None:
                pass
            record = controls.history.to_dict()
            yield await anyio.to_thread.run_sync(sse, "history", record)  # a long run: encode off the loop
        events_open = True
        next_statistics = anyio.current_time()
        pending: list[Any] = []
        while not controls.closing:
            timeout = next_statistics - anyio.current_time()
            if timeout > 0:
                with controls.wait_scope(timeout):
                    if events_open:
                        try:
                            pending.append(await events.__anext__())
                        except StopAsyncIteration:  # the collector closed: statistics only
                            events_open = False
                    else:
                        await anyio.sleep_forever()
            if controls.closing:
                break
            while (event := events.receive_nowait()) is not None:
                pending.append(event)
            encode = controls.encode_event
            parts = [encode(e) for e in pending if kinds is None or e.kind in kinds]
            pending.clear()
            now = anyio.current_time()
            if now >= next_statistics:
                parts.append(self._statistics())
                next_statistics += interval
                if next_statistics < now:  # fell behind (a slow client): no burst to catch up
                    next_statistics = now + interval
            if parts:
                yield "".join(parts)
        yield sse("shutdown", {"time": time.time()})


PAGE = resources.files(__package__).joinpath("index.html")


def history_routes(controls: DashboardControls) -> list[Route]:
    """``/history.json`` and ``/history.csv``: the server's record of the run, encoded off the loop."""

    async def history_json(request: Request) -> Response:
        record = controls.history.to_dict()
        body = await anyio.to_thread.run_sync(to_json, record)
        return Response(body, media_type="application/json", headers=download("aiocollect-history.json"))

    async def history_csv(request: Request) -> Response:
        record = controls.history.to_dict()
        body = await anyio.to_thread.run_sync(controls.history.to_csv, record)
        return Response(
            body, media_type="text/csv; charset=utf-8", headers=download("aiocollect-history.csv")
        )

    return [
        Route("/history.json", history_json, methods=["GET"]),
        Route("/history.csv", history_csv, methods=["GET"]),
    ]


def metrics_routes(controls: DashboardControls) -> list[Route]:
    """``/metrics``: the statistics as Prometheus metrics (OpenMetrics text; the ``metrics`` extra), read
    on the loop and formatted off it; 501 naming the extra where ``prometheus_client`` is missing."""
    collector = controls.collector
    name = type(collector).__name__

    async def metrics(request: Request) -> Response:
        from .._observe._metrics import CONTENT_TYPE, format_metrics

        stats = collector.statistics()
        try:
            body = await anyio.to_thread.run_sync(format_metrics, stats, name)
        except ImportError as exc:
            return Response(f"{exc}\n", status_code=501, media_type="text/plain; charset=utf-8")
        return Response(body, media_type=CONTENT_TYPE, headers={"Cache-Control": "no-cache"})

    return [Route("/metrics", metrics, methods=["GET"])]


def build_app(controls: DashboardControls, *, title: str, interval: float, max_buffer: int) -> Starlette:
    collector = controls.collector
    policy = controls.policy
    page = (
        PAGE.read_text(encoding="utf-8")
        .replace("{{TITLE}}", html.escape(title))
        .replace("{{TOKEN}}", html.escape(policy.token))
    )

    async def index(request: Request) -> Response:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    async def statistics(request: Request) -> Response:
        return json_response(collector.statistics().to_dict())

    async def events(request: Request) -> Response:
        if controls.closing:
            return json_response({"error": "the dashboard is shutting down"}, 503)
        raw = request.query_params.get("kinds")
        kinds = {k.strip() for k in raw.split(",") if k.strip()} if raw else None
        history = request.query_params.get("history", "") not in ("", "0", "false")
        return EventStreamResponse(
            controls, interval=interval, max_buffer=max_buffer, kinds=kinds, history=history
        )

    def pause_state() -> dict[str, bool]:
        return {"held": controls.pause_held, "paused": bool(collector.statistics().paused)}

    async def pause(request: Request) -> Response:
        try:
            await controls.pause()
        except LifespanNotRunning as exc:
            return json_response({"error": str(exc)}, 503)
        except (CollectorClosedError, RuntimeError) as exc:
            return json_response({"error": f"{type(exc).__name__}: {exc}"}, 409)
        return json_response(pause_state())

    async def resume(request: Request) -> Response:
        await controls.resume()
        return json_response(pause_state())

    async def update_weights(request: Request) -> Response:
        try:
            version = await controls.update_weights()
        except (CollectorClosedError, TypeError, ValueError, RuntimeError) as exc:
            return json_response({"error": f"{type(exc).__name__}: {exc}"}, 409)
        return json_response({"version": version})

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with controls:
            yield

    app = Starlette(
        routes=[
            Route("/", index, methods=["GET"]),
            Route("/events", events, methods=["GET"]),
            Route("/statistics", statistics, methods=["GET"]),
            *history_routes(controls),
            *metrics_routes(controls),
            Route("/pause", pause, methods=["POST"]),
            Route("/resume", resume, methods=["POST"]),
            Route("/update-weights", update_weights, methods=["POST"]),
        ],
        lifespan=lifespan,
        middleware=[Middleware(Guard, policy=policy)],
    )
    app.state.dashboard = controls
    app.state.token = policy.token
    return app
