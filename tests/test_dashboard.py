"""The dashboard (``aiocollect.dashboard``): endpoints through an ASGI client under every backend, the SSE
stream, ``serve()`` with uvicorn on a loopback port, and the page end to end in headless Chromium."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import math
import re
import shutil
import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx
import pytest
import torch
from starlette.applications import Starlette
from starlette.routing import Mount

from aiocollect import Collector, CollectorClosedError, MultiAsyncCollector, MultiSyncCollector
from aiocollect.dashboard import create_app, serve
from support import cartpole2 as cartpole

pytestmark = [pytest.mark.anyio, pytest.mark.all_loops]  # a server: every loop in the README's run

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
# Chromium as root, without network or GPU (see .ci/run): no sandbox, and nothing that dials out
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


class Policy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return torch.distributions.Categorical(logits=self.linear(observation)).sample()


# -- helpers -----------------------------------------------------------------------------------------
def parse_sse(raw: str) -> tuple[str, Any] | None:
    """``(event name, parsed data)`` of one Server-Sent Events message; ``None`` for one without data."""
    name, data = "message", None
    for line in raw.split("\n"):
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: ") :])
    return None if data is None else (name, data)


class EventStreamClient:
    """``GET path`` on an ASGI app, whose Server-Sent Events it reads as they come (``httpx.ASGITransport``
    collects the whole body before it returns, which never happens for an endless stream). Leaving
    ``async with`` tells the app that the client left (``http.disconnect``) and waits for it to finish.

    ``async for name, data in client`` (a plain iterator, no async generator to finalise).
    """

    def __init__(self, app: Any, task_group: anyio.abc.TaskGroup, path: str) -> None:
        self.app, self.task_group, self.path = app, task_group, path
        self.chunks_in, self.chunks = anyio.create_memory_object_stream[bytes](math.inf)
        self.started, self.left, self.done = anyio.Event(), anyio.Event(), anyio.Event()
        self.status = 0
        self.headers: dict[str, str] = {}
        self.text = ""

    async def __aenter__(self) -> EventStreamClient:
        path, _, query = self.path.partition("?")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "GET",
            "headers": [(b"accept", b"text/event-stream"), (b"host", b"127.0.0.1")],
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": query.encode(),
            "server": ("dash", 80),
            "client": ("127.0.0.1", 123),
            "root_path": "",
        }
        request_read = False

        async def receive() -> dict[str, Any]:
            nonlocal request_read
            if not request_read:
                request_read = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await self.left.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.status = message["status"]
                self.headers = {k.decode(): v.decode() for k, v in message["headers"]}
                self.started.set()
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    try:
                        self.chunks_in.send_nowait(message["body"])
                    except anyio.BrokenResourceError:
                        pass  # we left already
                if not message.get("more_body", False):
                    self.chunks_in.close()

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            finally:
                self.chunks_in.close()
                self.started.set()
                self.done.set()

        self.task_group.start_soon(run)
        await self.started.wait()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.left.set()
        self.chunks.close()
        with anyio.fail_after(5):  # the app noticed and finished
            await self.done.wait()

    def __aiter__(self) -> EventStreamClient:
        return self

    async def __anext__(self) -> tuple[str, Any]:
        while True:
            while "\n\n" not in self.text:
                try:
                    self.text += (await self.chunks.receive()).decode()
                except anyio.EndOfStream:
                    raise StopAsyncIteration from None
            raw, self.text = self.text.split("\n\n", 1)
            message = parse_sse(raw)
            if message is not None:
                return message


async def sse_messages(response: httpx.Response) -> AsyncIterator[tuple[str, Any]]:
    """The messages of a (real, network) ``httpx`` streaming response."""
    text = ""
    async for chunk in response.aiter_text():
        text += chunk
        while "\n\n" in text:
            raw, text = text.split("\n\n", 1)
            if (message := parse_sse(raw)) is not None:
                yield message


async def wait_until(predicate: Callable[[], bool], limit: float = 10.0) -> None:
    with anyio.fail_after(limit):
        while not predicate():  # noqa: ASYNC110 - polling a collector's counters
            await anyio.sleep(0.01)


async def consume(collector: Any, stop: anyio.Event) -> None:
    """A trainer's loop: takes batches until ``stop`` (checked between batches, so that the collector is
    never cancelled mid-batch by the test) or until the collector closes."""
    try:
        async for _ in collector:
            if stop.is_set():
                return
    except CollectorClosedError:
        pass


@asynccontextmanager
async def consuming(collector: Any) -> AsyncIterator[None]:
    """``consume(collector)`` in a task for the duration of the block."""
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(consume, collector, stop)
        try:
            yield
        finally:
            stop.set()


@asynccontextmanager
async def dashboard(collector: Any, *, lifespan: bool = True, **kwargs: Any) -> AsyncIterator[Any]:
    """An entered collector that collects (a consumer task), its app (lifespan running) and clients:
    ``ns.client`` (``httpx.ASGITransport``) and ``ns.events(path)`` (an :class:`EventStreamClient`)."""
    async with collector, consuming(collector), anyio.create_task_group() as tg:
        app = create_app(collector, **kwargs)
        ns = type("NS", (), {})()
        ns.collector, ns.app = collector, app
        # as the page does: on an allowed host, with the app's token (tests of the guard drop either)
        ns.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app),
            base_url="http://127.0.0.1",
            headers={"X-Aiocollect-Token": app.state.token},
        )
        ns.events = lambda path="/events": EventStreamClient(app, tg, path)
        async with ns.client:
            if lifespan:
                async with app.router.lifespan_context(app):
                    yield ns
            else:
                yield ns


def in_process() -> Collector:
    return Collector(cartpole, Policy(), frames_per_batch=64, seed=0)


# -- JSON endpoints ----------------------------------------------------------------------------------
async def test_statistics_endpoint():
    async with dashboard(in_process()) as d:
        await wait_until(lambda: d.collector.statistics().frames > 0)
        response = await d.client.get("/statistics")
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/json"
        body = response.json()
        assert set(body) == set(d.collector.statistics().to_dict())
        assert body["frames"] > 0 and body["workers"][0]["state"] == "collecting"
        await wait_until(lambda: d.collector.statistics().frames > body["frames"])
        assert (await d.client.get("/statistics")).json()["frames"] > body["frames"]


async def test_pause_resume_holds_a_pause():
    async with dashboard(in_process()) as d:
        c = d.collector
        await wait_until(lambda: c.statistics().frames > 0)
        response = await d.client.post("/pause")
        assert response.status_code == 200
        assert response.json() == {"held": True, "paused": True}
        assert c.statistics().to_dict()["paused"] is True
        frames = c.statistics().frames
        await anyio.sleep(0.3)  # a window for a batch that must not come
        assert c.statistics().frames == frames  # no batch while the dashboard holds the pause
        assert (await d.client.post("/pause")).json() == {"held": True, "paused": True}  # idempotent
        # a pause of the trainer's own outlives the dashboard's
        async with c.pause():
            assert (await d.client.post("/resume")).json() == {"held": False, "paused": True}
            assert c.statistics().paused
        assert not c.statistics().paused
        assert (await d.client.post("/resume")).json() == {"held": False, "paused": False}
        await wait_until(lambda: c.statistics().frames > frames)


async def test_pause_is_released_at_shutdown():
    async with dashboard(in_process(), lifespan=False) as d:
        async with d.app.router.lifespan_context(d.app):
            assert (await d.client.post("/pause")).json()["held"]
            assert d.collector.statistics().paused
        assert not d.collector.statistics().paused
        assert not d.app.state.dashboard.pause_held


async def test_pause_needs_the_lifespan():
    async with dashboard(in_process(), lifespan=False) as d:
        response = await d.client.post("/pause")
        assert response.status_code == 503
        assert "lifespan" in response.json()["error"]
        assert not d.collector.statistics().paused
        assert (await d.client.post("/resume")).json() == {"held": False, "paused": False}


async def test_update_weights_returns_increasing_versions():
    async with dashboard(in_process()) as d:
        versions = [(await d.client.post("/update-weights")).json()["version"] for _ in range(3)]
        assert versions == [1, 2, 3]
        assert (await d.client.get("/statistics")).json()["policy_version"] == 3


async def test_update_weights_without_weights_is_a_409():
    collector = Collector(cartpole, None, frames_per_batch=64)  # RandomPolicy: nothing to update
    async with dashboard(collector) as d:
        response = await d.client.post("/update-weights")
        assert response.status_code == 409
        assert "TypeError" in response.json()["error"]
        assert (await d.client.get("/update-weights")).status_code == 405


async def test_page_is_self_contained():
    async with dashboard(in_process(), title="<CartPole> & co") as d:
        response = await d.client.get("/")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/html")
        page = response.text
        assert "&lt;CartPole&gt; &amp; co" in page and "<CartPole>" not in page
        # no CDN, no absolute URL: the page works offline and wherever the app is mounted
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
        assert not re.search(r"""(fetch|EventSource)\(\s*["'`]/""", page)
        for needle in ('id="pause"', 'id="resume"', 'id="update-weights"', "new EventSource", "<canvas"):
            assert needle in page


async def test_mounted_in_another_app():
    async with Collector(cartpole, Policy(), frames_per_batch=64) as collector:
        dash = create_app(collector)

        @asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            async with dash.router.lifespan_context(dash):  # the dashboard's pause task lives here
                yield

        parent = Starlette(routes=[Mount("/dashboard", app=dash)], lifespan=lifespan)
        async with (
            lifespan(parent),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(parent),
                base_url="http://localhost",
                headers={"X-Aiocollect-Token": dash.state.token},
                follow_redirects=True,
            ) as client,
        ):
            page = await client.get("/dashboard")
            assert page.status_code == 200 and str(page.url) == "http://localhost/dashboard/"
            assert (await client.get("/dashboard/statistics")).json()["frames"] == 0
            assert (await client.post("/dashboard/pause")).json() == {"held": True, "paused": True}
            assert (await client.post("/dashboard/resume")).json() == {"held": False, "paused": False}
            assert (await client.post("/dashboard/update-weights")).json() == {"version": 1}


# -- the event stream --------------------------------------------------------------------------------
async def test_event_stream_yields_statistics_and_events():
    async with dashboard(in_process(), interval=0.05) as d:
        c = d.collector
        seen: dict[str, list[Any]] = {}
        with anyio.fail_after(10):
            async with d.events() as response:
                assert response.status == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                assert response.headers["cache-control"] == "no-cache"
                assert c._hub.active  # subscribed to the collector's events
                published = False
                async for name, data in response:
                    seen.setdefault(name, []).append(data)
                    kinds = {e["kind"] for e in seen.get("event", [])}
                    if not published and "batch" in kinds:
                        await d.client.post("/update-weights")
                        published = True
                    if len(seen.get("statistics", [])) >= 3 and {"episode", "weights_published"} <= kinds:
                        break  # and disconnect
            # the stream's subscription is closed (the history's, for the app's lifespan, remains)
            await wait_until(lambda: len(c._hub._streams) == 1)
        stats = seen["statistics"]
        assert set(c.statistics().to_dict()) | {"time", "pause_held"} == set(stats[0])
        assert stats[-1]["frames"] >= stats[0]["frames"] and stats[-1]["frames"] > 0
        assert [s["time"] for s in stats] == sorted(s["time"] for s in stats)
        events = seen["event"]
        episode = next(e for e in events if e["kind"] == "episode")
        assert {"kind", "time", "episode_return", "length", "worker_id"} <= set(episode)
        assert next(e for e in events if e["kind"] == "weights_published")["version"] == 1
        batch = next(e for e in events if e["kind"] == "batch")
        assert batch["frames"] == 64 and batch["worker_id"] == 0


async def test_event_stream_kinds_filter_and_pause_events():
    async with dashboard(in_process(), interval=0.05) as d:
        with anyio.fail_after(10):
            async with d.events("/events?kinds=paused,resumed") as response:
                names: list[str] = []
                async for name, data in response:
                    names.append(data["kind"] if name == "event" else name)
                    if names == ["statistics"]:
                        await d.client.post("/pause")
                        await d.client.post("/resume")
                    if "resumed" in names:
                        break
        assert [n for n in names if n != "statistics"] == ["paused", "resumed"]


async def test_event_streams_end_at_shutdown():
    async with dashboard(in_process(), lifespan=False, interval=0.05) as d:
        names: list[str] = []
        with anyio.fail_after(10):
            async with d.events() as response:
                async with d.app.router.lifespan_context(d.app):
                    names.append((await anext(response))[0])
                # the lifespan ended: the stream says so and ends by itself
                names.extend([name async for name, _ in response])
        assert names[0] == "statistics" and names[-1] == "shutdown"
        assert not d.collector._hub.active
        assert (await d.client.get("/events")).status_code == 503  # no new stream once closing


async def test_event_stream_after_the_collector_closed():
    collector = in_process()
    async with dashboard(collector, interval=0.05) as d:
        await wait_until(lambda: collector.statistics().frames > 0)
        await collector.aclose()
        with anyio.fail_after(5):
            async with d.events() as response:
                names = []
                async for name, data in response:
                    names.append(name)
                    assert data["workers"][0]["state"] == "stopped"
                    if len(names) == 2:
                        break
        assert names == ["statistics", "statistics"]


async def test_multi_collector_dashboard():
    collector = MultiSyncCollector(
        [cartpole, cartpole], Policy(), frames_per_batch=128, worker_backend="serial"
    )
    async with dashboard(collector, interval=0.05) as d:
        await wait_until(lambda: collector.statistics().frames > 0, limit=30)
        body = (await d.client.get("/statistics")).json()
        assert [w["worker_id"] for w in body["workers"]] == [0, 1]
        assert (await d.client.post("/pause")).json() == {"held": True, "paused": True}
        assert {w["state"] for w in (await d.client.get("/statistics")).json()["workers"]} == {"paused"}
        assert (await d.client.post("/update-weights")).json() == {"version": 1}
        assert (await d.client.post("/resume")).json() == {"held": False, "paused": False}
        await wait_until(lambda: [w.policy_version for w in collector.statistics().workers] == [1, 1])


def test_create_app_checks_its_arguments():
    with pytest.raises(ValueError, match="interval"):
        create_app(object(), interval=0)
    with pytest.raises(ValueError, match="max_buffer"):
        create_app(object(), max_buffer=0)
    with pytest.raises(TypeError, match="allowed_hosts must be a list"):
        create_app(object(), allowed_hosts="trainer.lab")
    with pytest.raises(ValueError, match="token must be a string of at least 16"):
        create_app(object(), token="short")


# -- the server's history, the trainer's metrics, downloads ------------------------------------------
async def test_a_late_stream_gets_the_whole_run_first():
    """A page opened late (or reloaded) asks for ``events?history=1``: the server's record of the run comes
    first (statistics samples, episodes stamped with frames, the trainer's metrics, the other events),
    then the live stream, with nothing doubled between the two."""
    async with dashboard(in_process(), interval=0.02) as d:
        c = d.collector
        await wait_until(lambda: c.statistics().episodes > 0)
        for step in range(3):
            c.log_metrics({"loss": 1.0 / (step + 1), "kl": torch.tensor(0.01 * step)}, step=step)
        await d.client.post("/update-weights")
        await wait_until(lambda: len(d.app.state.dashboard.history.samples) >= 5)
        with anyio.fail_after(10):
            async with d.events("/events?history=1") as response:
                name, history = await anext(response)
                c.log_metrics({"loss": 0.1}, step=3)  # live, after the history
                live: list[Any] = []
                async for name, data in response:
                    live.append((name, data))
                    if name == "event" and data["kind"] == "metrics":
                        break
        assert name == "event" and live[-1][1]["metrics"] == {"loss": 0.1}
        samples = history["samples"]
        assert len(samples) >= 5 and set(c.statistics().to_dict()) <= set(samples[0])
        assert [s["time"] for s in samples] == sorted(s["time"] for s in samples)
        assert samples[-1]["frames"] >= samples[0]["frames"] > 0 or samples[0]["frames"] == 0
        _, frames, ret, length, worker = history["episodes"][0]
        assert frames > 0 and frames % 64 == 0 and ret == length and worker == 0
        assert [m["step"] for m in history["metrics"]] == [0, 1, 2]
        assert history["metrics"][1]["metrics"] == {"loss": 0.5, "kl": pytest.approx(0.01)}
        assert {e["kind"] for e in history["events"]} >= {"weights_published"}
        # the live stream does not repeat the history's metrics
        assert [d["step"] for n, d in live if n == "event" and d["kind"] == "metrics"] == [3]


async def test_history_downloads_as_json_and_csv():
    async with dashboard(in_process(), interval=0.02) as d:
        c = d.collector
        await wait_until(lambda: c.statistics().frames >= 256)
        c.log_metrics({"loss": 0.25, "frames": 7.0}, step=1)  # a metric named like a column stays apart
        await wait_until(lambda: len(d.app.state.dashboard.history.samples) >= 3)
        response = await d.client.get("/history.json")
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/json"
        assert 'filename="aiocollect-history.json"' in response.headers["content-disposition"]
        record = response.json()
        assert record["samples"] and record["metrics"][0]["metrics"] == {"loss": 0.25, "frames": 7.0}
        response = await d.client.get("/history.csv")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/csv")
        assert 'filename="aiocollect-history.csv"' in response.headers["content-disposition"]
        rows = list(csv.DictReader(io.StringIO(response.text)))
        stats = [r for r in rows if r["kind"] == "statistics"]
        (metric,) = [r for r in rows if r["kind"] == "metrics"]
        assert len(stats) >= 3 and all(int(r["frames"]) >= 0 for r in stats)
        assert float(stats[-1]["frames_per_second"]) >= 0 and stats[-1]["loss"] == ""
        assert metric["loss"] == "0.25" and metric["metric:frames"] == "7.0" and metric["step"] == "1"
        assert [float(r["time"]) for r in rows] == sorted(float(r["time"]) for r in rows)


async def test_history_is_bounded_and_keeps_the_whole_run():
    from aiocollect.dashboard._history import History, Series

    series = Series(8)
    for i in range(1000):
        series.add(i)
    items = series.items()
    assert 4 <= len(items) <= 9 and items[0] == 0 and items[-1] == 999 and series.stride >= 128
    assert items == sorted(items)
    async with Collector(cartpole, Policy(), frames_per_batch=32) as c:
        history = History(c, interval=0.01, max_samples=16, max_episodes=16, max_metrics=16, max_events=4)
        history.open()
        first = history.sample()
        for i in range(40):
            await c.__anext__()
            c.log_metrics({"i": i})
            await c.update_weights()
            history.sample()
        record = history.to_dict()
    assert len(record["samples"]) <= 17 and record["samples"][0] is first
    assert record["samples"][-1]["frames"] == 40 * 32  # the newest is always there
    assert record["resolution"]["samples"] > 1
    assert len(record["metrics"]) <= 17 and record["metrics"][-1]["metrics"] == {"i": 39.0}
    assert len(record["events"]) == 4  # the newest other events
    assert len(record["episodes"]) <= 17


async def test_frames_per_second_is_zero_while_paused_and_workers_stop_at_the_end():
    async with dashboard(Collector(cartpole, Policy(), frames_per_batch=64, total_frames=640)) as d:
        c = d.collector
        await wait_until(lambda: c.statistics().frames >= 128)
        assert (await d.client.post("/pause")).json()["held"]
        body = (await d.client.get("/statistics")).json()
        assert body["paused"] and body["frames_per_second"] == 0
        assert (await d.client.post("/resume")).json()["held"] is False
        await wait_until(lambda: c.statistics().frames == 640)
        body = (await d.client.get("/statistics")).json()  # the run ended, the collector is still open
        assert not c.closed and [w["state"] for w in body["workers"]] == ["stopped"]


async def test_workers_of_a_multi_collector_stop_at_the_end_of_the_run():
    async with MultiAsyncCollector(
        [cartpole, cartpole], Policy(), frames_per_batch=64, total_frames=512, worker_backend="serial"
    ) as c:
        assert {w.state for w in c.statistics().workers} == {"collecting"}
        async for _ in c:
            pass
        stats = c.statistics()  # still entered: the run has ended, nobody collects any more
        assert stats.frames == 512 and [w.state for w in stats.workers] == ["stopped", "stopped"]


def test_frames_per_second_decays_to_zero_after_the_last_batch():
    from aiocollect._observe._stats import StatsTracker

    tracker = StatsTracker(rate_window_s=10.0)
    start = tracker._started
    for i in range(1, 21):  # 100 frames every 0.5 s for 10 s
        tracker._deliveries.append((start + 0.5 * i, 100))
        tracker._first = tracker._first or start + 0.5
        tracker.frames += 100
    end = start + 10.0
    assert tracker.frames_per_second(end) == pytest.approx(1900 / 9.5)
    assert tracker.frames_per_second(end + 5.25) == pytest.approx(1000 / 10)  # half the window is empty
    assert tracker.frames_per_second(end + 10.01) == 0.0
    assert tracker.snapshot(0, paused=True).frames_per_second == 0.0


async def test_log_metrics_checks_its_arguments():
    async with Collector(cartpole, Policy(), frames_per_batch=64) as c:
        with pytest.raises(TypeError, match="metric 'loss' must be a real number"):
            c.log_metrics({"loss": "low"})
        with pytest.raises(TypeError, match="metric 'loss' must be a real number"):
            c.log_metrics({"loss": torch.ones(3)})
        with pytest.raises(TypeError, match="metrics must be a mapping"):
            c.log_metrics([("loss", 1.0)])  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="metric names must be non-empty strings"):
            c.log_metrics({"": 1.0})
        with pytest.raises(TypeError, match="step must be an int"):
            c.log_metrics({"loss": 1.0}, step=1.5)  # type: ignore[arg-type]
        async with c.events(kinds={"metrics"}) as events:
            await c.__anext__()
            c.log_metrics({"loss": torch.tensor(0.5), "lr": 3e-4}, step=7)
            event = events.receive_nowait()
        assert event is not None and event.kind == "metrics"
        assert event.to_dict()["metrics"] == {"loss": 0.5, "lr": 3e-4}
        assert (event.frames, event.step) == (64, 7)
        assert events.receive_nowait() is None  # the batch and episodes were not for this stream


# -- the guard: other web pages in the browser (cross-origin requests, DNS rebinding) ----------------
async def test_state_changing_routes_need_the_token():
    async with dashboard(in_process()) as d:
        token = d.app.state.token
        assert len(token) >= 32 and token != create_app(d.collector).state.token  # one per app
        assert f'<meta name="aiocollect-token" content="{token}">' in (await d.client.get("/")).text
        for path in ("/pause", "/resume", "/update-weights"):
            missing = await d.client.post(path, headers={"X-Aiocollect-Token": ""})
            assert missing.status_code == 403 and "wrong" in missing.json()["error"]
            wrong = await d.client.post(path, headers={"X-Aiocollect-Token": "x" * 43})
            assert wrong.status_code == 403 and "wrong" in wrong.json()["error"]
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(d.app), base_url="http://127.0.0.1"
        ) as bare:
            response = await bare.post("/pause")
            assert response.status_code == 403 and "missing x-aiocollect-token" in response.json()["error"]
        assert not d.collector.statistics().paused
        assert d.collector.policy_version == 0
        assert (await d.client.post("/pause")).json() == {"held": True, "paused": True}  # with it: works


async def test_cross_origin_requests_are_refused():
    async with dashboard(in_process()) as d:
        for headers in (
            {"Origin": "http://evil.example"},
            {"Origin": "http://127.0.0.1:9999"},  # another port is another origin
            {"Origin": "null"},
            {"Sec-Fetch-Site": "cross-site"},
        ):
            response = await d.client.post("/pause", headers=headers)
            assert response.status_code == 403, headers
            assert "cross" in response.json()["error"]
        assert not d.collector.statistics().paused
        # the page's own requests carry its own origin
        same = await d.client.post(
            "/pause", headers={"Origin": "http://127.0.0.1", "Sec-Fetch-Site": "same-origin"}
        )
        assert same.status_code == 200 and same.json()["held"]


async def test_dns_rebinding_is_refused_by_host():
    """A page of evil.example whose name now resolves to 127.0.0.1 is same-origin for the browser: its
    requests say ``Host: evil.example``, and are refused, reads included."""
    async with dashboard(in_process()) as d:
        rebound = {"Host": "evil.example:8000", "Origin": "http://evil.example:8000"}
        for method, path in (
            ("GET", "/"),
            ("GET", "/statistics"),
            ("GET", "/events"),
            ("GET", "/history.json"),
            ("GET", "/history.csv"),
            ("POST", "/pause"),
        ):
            response = await d.client.request(method, path, headers=rebound)
            assert response.status_code == 400, path
            assert "host 'evil.example:8000' is not allowed" in response.json()["error"]
        assert not d.collector.statistics().paused
        for host in ("localhost:8000", "127.0.0.1", "[::1]:8000"):
            assert (await d.client.get("/statistics", headers={"Host": host})).status_code == 200


async def test_allowed_hosts_add_names_or_turn_the_check_off():
    async with dashboard(in_process(), allowed_hosts=["Trainer.Lab"]) as d:
        assert (await d.client.get("/statistics", headers={"Host": "trainer.lab:8000"})).status_code == 200
        assert (await d.client.get("/statistics", headers={"Host": "other.lab"})).status_code == 400
    async with dashboard(in_process(), allowed_hosts=["*"]) as d:
        assert (await d.client.get("/statistics", headers={"Host": "other.lab"})).status_code == 200
        assert (await d.client.post("/pause", headers={"Host": "other.lab"})).status_code == 200


def test_import_without_starlette(monkeypatch: pytest.MonkeyPatch):
    """``import aiocollect.dashboard`` works without starlette; ``create_app`` says what to install."""
    import aiocollect

    monkeypatch.setattr(aiocollect, "dashboard", sys.modules["aiocollect.dashboard"])  # put back after
    for name in [
        m for m in sys.modules if m == "starlette" or m.startswith(("starlette.", "aiocollect.dash"))
    ]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "starlette", None)  # makes `import starlette` fail
    spec = importlib.util.find_spec("aiocollect.dashboard")
    assert spec is not None
    import aiocollect.dashboard as fresh

    with pytest.raises(ImportError, match=r"aiocollect\[dashboard\]"):
        fresh.create_app(object())


# -- serve(): uvicorn on a loopback port, in this event loop -------------------------------------------
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_serve_on_a_free_port_and_shut_down_with_open_streams(timing):
    async with Collector(cartpole, Policy(), frames_per_batch=64) as collector, consuming(collector):
        app = create_app(collector, interval=0.05)
        async with httpx.AsyncClient(timeout=10) as client:
            with anyio.fail_after(20):
                async with serve(app, port=0) as server:
                    assert server.url == f"http://127.0.0.1:{server.port}/" and server.port > 0
                    assert (await client.get(server.url + "statistics")).status_code == 200
                    token = {"X-Aiocollect-Token": app.state.token}
                    assert (await client.post(server.url + "pause", headers=token)).json()["held"]
                    assert (await client.post(server.url + "resume")).status_code == 403  # no token
                    rebound = {"Host": f"evil.example:{server.port}"}
                    assert (await client.get(server.url + "statistics", headers=rebound)).status_code == 400
                    response = await client.send(
                        client.build_request("GET", server.url + "events"), stream=True
                    )
                    messages = sse_messages(response)
                    assert (await anext(messages))[0] == "statistics"
                    started = anyio.current_time()
                # leaving serve(): the open stream ended (with a shutdown message), the pause was released
                names = [name async for name, _ in messages]
                await response.aclose()
                assert names[-1] == "shutdown"  # ended by the server's shutdown, not cut at its deadline
                timing.bound(anyio.current_time() - started, 3, "ending the stream")
                assert not collector.statistics().paused
                with pytest.raises(httpx.ConnectError):
                    await client.get(server.url + "statistics")


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_serve_ends_the_streams_of_a_mounted_dashboard(timing):
    async with Collector(cartpole, Policy(), frames_per_batch=64) as collector:
        dash = create_app(collector, interval=0.05)

        @asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            async with dash.router.lifespan_context(dash):
                yield

        parent = Starlette(routes=[Mount("/dashboard", app=dash)], lifespan=lifespan)
        async with httpx.AsyncClient(timeout=10) as client:
            with anyio.fail_after(20):
                async with serve(parent, port=0) as server:
                    request = client.build_request("GET", server.url + "dashboard/events")
                    response = await client.send(request, stream=True)
                    messages = sse_messages(response)
                    assert (await anext(messages))[0] == "statistics"
                    started = anyio.current_time()
                names = [name async for name, _ in messages]
                await response.aclose()
                assert names[-1] == "shutdown"  # ended by the server's shutdown, not cut at its deadline
                timing.bound(anyio.current_time() - started, 3, "ending the stream")


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_serve_stops_on_ctrl_c():
    reached_end = False
    with anyio.fail_after(30), pytest.raises(KeyboardInterrupt):
        async with serve(Starlette(), port=0) as server:
            signal.raise_signal(signal.SIGINT)  # as Ctrl-C: uvicorn's handler stops the server
            await anyio.sleep_forever()  # cancelled once the server has stopped
            reached_end = True
    assert not reached_end
    assert server.server.should_exit


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_serve_reports_a_port_in_use():
    app = Starlette()
    async with serve(app, port=0) as first:
        with pytest.raises(RuntimeError, match="could not start"):
            async with serve(app, port=first.port):
                pass


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_serve_lets_the_blocks_error_through_unwrapped():
    with pytest.raises(ValueError, match="boom"):
        async with serve(Starlette(), port=0):
            raise ValueError("boom")


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_serve_needs_asyncio():
    with pytest.raises(RuntimeError, match="asyncio"):
        async with serve(Starlette(), port=0):
            pass


# -- end to end: the example app in headless Chromium ------------------------------------------------
def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("dashboard_example", ROOT / "examples/dashboard/app.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # uvicorn runs on asyncio
async def test_the_example_prints_the_token_the_docs_curl_command_needs(capsys: pytest.CaptureFixture[str]):
    """docs/dashboard.md's `curl -X POST -H "X-Aiocollect-Token: $TOKEN" .../pause` works with the token
    the example prints."""
    example = load_example()
    args = example.Args(port=0, backend="serial", envs_per_worker=2, frames_per_batch=64, update_every=2)
    urls: list[str] = []
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: example.main(args, on_ready=urls.append, stop=stop))
        await wait_until(lambda: bool(urls), limit=30)
        printed = capsys.readouterr().out
        token = re.search(r"^control token: (\S+)$", printed, re.M)
        assert token is not None, printed
        async with httpx.AsyncClient(base_url=urls[0].rstrip("/"), timeout=10) as client:
            refused = await client.post("/pause")
            paused = await client.post("/pause", headers={"X-Aiocollect-Token": token[1]})
            resumed = await client.post("/resume", headers={"X-Aiocollect-Token": token[1]})
        stop.set()
    assert refused.status_code == 403, refused.text
    assert paused.status_code == 200 and paused.json()["held"] is True, paused.text
    assert resumed.status_code == 200, resumed.text


@pytest.mark.browser
@pytest.mark.skipif(
    shutil.which(CHROMIUM) is None,
    reason=f"needs Debian's chromium at {CHROMIUM} (apt-get install chromium; .ci/run installs it)",
)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # uvicorn and Playwright run on asyncio
async def test_dashboard_in_chromium(tmp_path: Path):
    playwright = pytest.importorskip("playwright.async_api", reason="needs the playwright package")
    example = load_example()
    # the example's own app; workers in threads (backend="serial") to start fast
    args = example.Args(port=0, backend="serial", envs_per_worker=4, frames_per_batch=512, update_every=2)
    urls: list[str] = []
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: example.main(args, on_ready=urls.append, stop=stop))
        await wait_until(lambda: bool(urls), limit=30)
        async with playwright.async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = await browser.new_page(viewport={"width": 1440, "height": 1000})
                errors: list[str] = []
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
                await page.goto(urls[0])

                async def shown() -> int:  # the counter on the page
                    return int(await page.eval_on_selector("#total-frames", "e => Number(e.dataset.value)"))

                async def plotted() -> int:  # the last point of the "Total frames" plot
                    return int(
                        await page.evaluate(
                            "() => { const s = window.aiocollectDashboard.samples;"
                            " return s.length ? s[s.length - 1].frames : 0; }"
                        )
                    )

                async def grows() -> int:
                    first = await plotted()
                    with anyio.fail_after(20):
                        while (now := await plotted()) <= first or await shown() != now:  # noqa: ASYNC110
                            await anyio.sleep(0.1)
                    return now

                await page.wait_for_selector("#conn.live", timeout=15_000)
                await grows()
                await grows()

                await page.click("#pause")
                await page.wait_for_function("() => document.body.dataset.paused === 'true'", timeout=10_000)
                await page.wait_for_selector("#resume:not([disabled])", timeout=10_000)
                async with httpx.AsyncClient(timeout=10) as client:  # the collector's own count, paused
                    frozen = (await client.get(urls[0] + "statistics")).json()["frames"]
                with anyio.fail_after(20):  # the statistics of the last batch before the pause arrive
                    while await plotted() != frozen:  # noqa: ASYNC110 - the page gives no notice of it
                        await anyio.sleep(0.1)
                await anyio.sleep(2.0)  # four statistics messages later: nothing moved (what must not come)
                assert await plotted() == frozen and await shown() == frozen
                assert await page.text_content("#state") == "paused (dashboard)"

                await page.click("#resume")
                await page.wait_for_function("() => document.body.dataset.paused === 'false'", timeout=10_000)
                assert await grows() > frozen

                # the trainer's metrics are plotted; a reload shows the whole run again (the server's
                # history), against frames or, toggled, against time
                await page.wait_for_selector("#metric-charts canvas[data-metric='loss']", timeout=10_000)
                before = await plotted()
                await page.reload()
                await page.wait_for_function(
                    "() => window.aiocollectDashboard.history !== null"
                    " && window.aiocollectDashboard.samples.length >= 4",
                    timeout=10_000,
                )
                first = await page.evaluate("() => window.aiocollectDashboard.samples[0].frames")
                assert first <= before and await plotted() >= before
                assert await page.evaluate("() => window.aiocollectDashboard.metrics.loss.length") > 0
                assert await page.evaluate("() => window.aiocollectDashboard.xMode") == "frames"
                await page.click("#x-axis")
                assert await page.text_content("#x-axis") == "x: time"
                assert await page.evaluate("() => window.aiocollectDashboard.xMode") == "time"

                await page.click("#update-weights")
                await page.wait_for_function(
                    "() => document.querySelector('#control-status').textContent.startsWith("
                    "'published policy version')",
                    timeout=10_000,
                )
                await page.wait_for_selector("#log li", timeout=10_000)
                shot = tmp_path / "dashboard.png"
                await page.screenshot(path=str(shot), full_page=True)
                assert shot.stat().st_size > 20_000
                assert errors == []
            finally:
                await browser.close()
                stop.set()  # the example ends after its next batch
