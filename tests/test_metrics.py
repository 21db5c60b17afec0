"""Prometheus metrics: ``aiocollect.metrics_text(collector)`` and the dashboard's ``GET /metrics``, parsed
back with ``prometheus_client``'s own OpenMetrics parser; a missing extra names the install command."""

from __future__ import annotations

import sys
from typing import Any

import anyio
import gymnasium as gym
import httpx
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

import aiocollect
from aiocollect import Collector, GymEnv, MultiSyncCollector, RestartPolicy
from aiocollect.dashboard import create_app
from support import cartpole2 as cartpole

pytestmark = pytest.mark.anyio

PARTS = {"env", "policy", "transfer", "wait", "other"}


def samples(text: str) -> dict[str, list[Any]]:
    """The samples of an OpenMetrics text by sample name (the parser checks the format as it goes)."""
    assert text.endswith("# EOF\n")
    out: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def value(found: dict[str, list[Any]], name: str, **labels: str) -> float:
    (match,) = [s for s in found[name] if all(s.labels.get(k) == v for k, v in labels.items())]
    return float(match.value)


async def collect(collector: Any, batches: int) -> None:
    with anyio.fail_after(60):
        n = 0
        async for _ in collector:
            n += 1
            if n == batches:
                return


async def test_metrics_text_of_a_collector() -> None:
    async with Collector(cartpole, None, frames_per_batch=32, total_frames=-1) as collector:
        await collect(collector, 3)
        stats = collector.statistics()
        found = samples(aiocollect.metrics_text(collector, name="ppo"))
    assert value(found, "aiocollect_frames_total", collector="ppo") == stats.frames == 96
    assert value(found, "aiocollect_batches_total", collector="ppo") == 3
    assert 0 <= value(found, "aiocollect_trainer_wait", collector="ppo") <= 1
    parts = {s.labels["part"] for s in found["aiocollect_time_split"]}
    assert parts == PARTS
    total = sum(s.value for s in found["aiocollect_time_split"])
    assert total == pytest.approx(1.0, abs=0.05)  # fractions, measured at two close moments
    assert {s.labels["part"] for s in found["aiocollect_worker_time_split_us_per_frame"]} == PARTS
    assert value(found, "aiocollect_worker_frames_total", collector="ppo", worker="0") == 96
    assert value(found, "aiocollect_worker_state", collector="ppo", worker="0", state="collecting") == 1


class FailsOnce(gym.Wrapper):
    """CartPole whose first instance raises at its 10th step: one restart."""

    built = 0

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1"))
        FailsOnce.built += 1
        self.steps = 0 if FailsOnce.built == 1 else -(10**9)

    def step(self, action: Any) -> Any:
        self.steps += 1
        if self.steps == 10:
            raise RuntimeError("the simulator went unstable")
        return self.env.step(action)


async def test_metrics_count_restarts() -> None:
    FailsOnce.built = 0
    policy = RestartPolicy(max_restarts=2, backoff=0.0)
    async with Collector(lambda: GymEnv(FailsOnce()), None, frames_per_batch=32, restart=policy) as collector:
        await collect(collector, 2)
        found = samples(aiocollect.metrics_text(collector, name="run"))
    assert value(found, "aiocollect_restarts_total", collector="run") == 1
    assert value(found, "aiocollect_worker_restarts_total", collector="run", worker="0") == 1


async def test_metrics_text_labels_each_worker() -> None:
    collector = MultiSyncCollector(
        [cartpole] * 2, None, frames_per_batch=64, total_frames=-1, worker_backend="serial"
    )
    async with collector:
        await collect(collector, 2)
        found = samples(aiocollect.metrics_text(collector))
    name = "MultiSyncCollector"  # the default label: the collector's class
    assert {s.labels["worker"] for s in found["aiocollect_worker_frames_total"]} == {"0", "1"}
    assert value(found, "aiocollect_frames_discarded_total", collector=name) == 0
    for worker in ("0", "1"):
        assert 0 <= value(found, "aiocollect_worker_collector_wait", collector=name, worker=worker) <= 1
        parts = {
            s.labels["part"] for s in found["aiocollect_worker_time_split"] if s.labels["worker"] == worker
        }
        assert parts == PARTS


async def test_dashboard_serves_metrics_behind_its_host_check() -> None:
    async with Collector(cartpole, None, frames_per_batch=32, total_frames=-1) as collector:
        await collect(collector, 1)
        app = create_app(collector)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://127.0.0.1"
        ) as client:
            response = await client.get("/metrics")  # a GET: no token needed, as every GET route
            rebound = await client.get("/metrics", headers={"Host": "evil.example"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    found = samples(response.text)
    assert value(found, "aiocollect_frames_total", collector="Collector") == 32
    assert rebound.status_code == 400  # DNS rebinding: refused like every route


async def test_a_missing_extra_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m.startswith("prometheus_client")]:
        monkeypatch.setitem(sys.modules, name, None)  # import fails
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    collector = Collector(cartpole, None, frames_per_batch=32, total_frames=64)
    try:
        with pytest.raises(ImportError, match=r'pip install "aiocollect\[metrics\]"'):
            aiocollect.metrics_text(collector)
        app = create_app(collector)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://127.0.0.1"
        ) as client:
            response = await client.get("/metrics")
        assert response.status_code == 501
        assert 'pip install "aiocollect[metrics]"' in response.text
    finally:
        await collector.aclose()
