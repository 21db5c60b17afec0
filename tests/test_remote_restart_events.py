"""Env restarts on remote nodes reach the trainer as they happen (``-m distributed``): the torch.distributed
and RPC nodes and the Ray actors report each restart their collector makes at once (a control message, a
call the trainer keeps waiting in the actor), whether or not a batch follows, and a failure brings the
restarts made just before it; ``statistics().restarts`` and the ``Restarted`` events agree at every
moment. The faults are ``test_restart_events``' (an env that raises at step 3 of every episode; one that
raises in its first two builds, then waits in ``step`` until the test lets it go)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import anyio
import cloudpickle
import pytest

import test_restart_events
from aiocollect import DistributedCollector, RayCollector, RPCCollector, WorkerFailed
from test_restart_events import BUDGET, Faulty, Watch, drive, healthy

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("TP_SOCKET_IFNAME", "lo")

pytestmark = [pytest.mark.distributed, pytest.mark.anyio, pytest.mark.timeout(240)]

for module in (sys.modules[__name__], test_restart_events):  # nodes and actors cannot import tests/
    cloudpickle.register_pickle_by_value(module)

KINDS = ["gloo", "rpc", "ray"]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def ray_cluster() -> Any:
    ray = pytest.importorskip("ray")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    from aiocollect._remote._ray_local import init_local

    init_local(
        ray,
        {
            "address": "local",
            "num_cpus": 2,
            "include_dashboard": False,
            "object_store_memory": 100 * 2**20,
            "configure_logging": False,
            "log_to_driver": False,
            "_node_ip_address": "127.0.0.1",
        },
    )
    try:
        yield ray
    finally:
        ray.shutdown()


def build(kind: str, faulty: Faulty, total: int) -> Any:
    """Node (actor) 0 healthy, node 1 the faulty one; each restarts its envs under :data:`BUDGET`."""
    common: dict[str, Any] = {
        "frames_per_batch": 20,
        "total_frames": total,
        "collector_kwargs": {"restart": BUDGET},
    }
    if kind == "ray":
        return RayCollector(
            [healthy, faulty], None, num_collectors=2, remote_config={"num_cpus": 0}, **common
        )
    return (DistributedCollector if kind == "gloo" else RPCCollector)([healthy, faulty], None, **common)


def from_node_1(batch: Any) -> bool:
    """Whether ``batch`` holds node (actor) 1's frames."""
    keys = batch.keys(include_nested=True)
    key = ("collector", "node_id") if ("collector", "node_id") in keys else ("collector", "worker_id")
    return bool((batch[key] == 1).any())


@pytest.fixture
def cluster(kind: str, request: pytest.FixtureRequest) -> None:
    if kind == "ray":
        request.getfixturevalue("ray_cluster")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.usefixtures("cluster")
async def test_a_nodes_restarts_before_any_batch_are_counted(kind: str, anyio_backend: str) -> None:
    if anyio_backend == "trio" and kind != "gloo":
        pytest.skip("one engine under trio is enough")
    collector = build(kind, Faulty(), total=4000)
    watch = Watch(collector)
    error = await drive(collector, watch)
    assert isinstance(error, ZeroDivisionError)
    restarts = watch.restarts()
    assert [(e.worker, e.restarts) for e in restarts] == [(1, 1), (1, 2)]
    failed = [i for i, e in enumerate(watch.events) if isinstance(e, WorkerFailed)]
    assert failed and failed[0] > watch.events.index(restarts[-1])  # the restarts came first
    assert collector.statistics().restarts == 2 == collector.statistics().workers[1].restarts
    assert watch.disagreements == []


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.usefixtures("cluster")
async def test_a_nodes_restarts_are_reported_while_no_batch_can_come(
    kind: str, anyio_backend: str, tmp_path: Path
) -> None:
    if anyio_backend == "trio" and kind != "gloo":
        pytest.skip("one engine under trio is enough")
    gate = tmp_path / "gate"
    collector = build(kind, Faulty(crashing=2, gate=str(gate)), total=80)
    watch = Watch(collector)
    seen: list[int] = []
    error: list[BaseException] = []
    async with anyio.create_task_group() as tg:

        async def consume() -> None:
            try:
                async with collector:
                    async for batch in collector:
                        if from_node_1(batch):
                            assert gate.exists()  # node 1 gives no frame until then
            except Exception as exc:
                error.append(exc)

        tg.start_soon(consume)
        try:
            with anyio.move_on_after(120):
                await watch.run(until=2)
                seen.append(collector.statistics().restarts)
        finally:
            gate.touch()
        with anyio.fail_after(120):
            await watch.run()
    assert error == []
    assert seen == [2]
    assert [(e.worker, e.restarts) for e in watch.restarts()] == [(1, 1), (1, 2)]
    assert watch.disagreements == []
