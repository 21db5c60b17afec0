"""Restarts on RayCollector (``-m distributed``): the envs an actor's collector restarts are seen by the
trainer, and an actor that dies or hangs under a restart policy is replaced by a new actor (derived seed,
fresh trajectory ids, the newest weights before its first frame), until its budget is spent."""

from __future__ import annotations

import os
import sys
import time

import anyio
import cloudpickle
import gymnasium as gym
import pytest
import torch

from aiocollect import GymEnv, RayCollector, Restarted, RestartPolicy, WorkerDiedError, WorkerTimeoutError
from support import ConstantPolicy, pendulum

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.distributed,
    pytest.mark.timeout(240),
    pytest.mark.usefixtures("support_by_value"),
]

cloudpickle.register_pickle_by_value(sys.modules[__name__])

REMOTE = {"num_cpus": 0}  # the actors take no CPU slot: any number fit on this 2-core machine


@pytest.fixture
def anyio_backend() -> tuple[str, dict]:
    return ("asyncio", {"use_uvloop": False})


@pytest.fixture(scope="module")
def ray_cluster():
    """One local cluster for this module (shut down after it); a test leaves no actor alive in it."""
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


@pytest.fixture
def ray(ray_cluster):
    yield ray_cluster
    deadline = time.monotonic() + 10  # ray.kill is asynchronous: the GCS marks the actor dead soon after
    while (alive := list(ray_cluster._private.state.actors(actor_state_name="ALIVE"))) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert not alive, f"actors left alive after the test: {alive}"


class CrashesAt(gym.Wrapper):
    """Raises at its ``at``-th step (every env built does)."""

    def __init__(self, env, at: int) -> None:
        super().__init__(env)
        self.at, self.steps = at, 0

    def step(self, action):
        self.steps += 1
        if self.steps == self.at:
            raise ZeroDivisionError(f"the simulator went unstable at step {self.steps}")
        return self.env.step(action)


def crashing():
    return GymEnv(CrashesAt(gym.make("Pendulum-v1"), at=25))


def _restarted(stream) -> list[Restarted]:
    out = []
    while (event := stream.receive_nowait()) is not None:
        if isinstance(event, Restarted):
            out.append(event)
    return out


def _pid_gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
async def test_an_actors_env_restarts_reach_the_trainer(ray, sync):
    events: list[Restarted] = []
    with anyio.fail_after(120):
        async with RayCollector(
            [pendulum, crashing],
            ConstantPolicy(),
            frames_per_batch=64,
            total_frames=640,
            num_collectors=2,
            sync=sync,
            collector_kwargs={"restart": RestartPolicy(max_restarts=50, backoff=0.0)},
            remote_config=REMOTE,
        ) as c:
            async with c.events() as stream:
                async for batch in c:
                    assert batch.numel() == 64
                    events += _restarted(stream)
            stats = c.statistics()
    assert stats.frames == 640 and events
    assert {e.worker for e in events} == {1}
    assert all(e.env == 0 and e.cause.startswith("ZeroDivisionError: the simulator") for e in events)
    assert stats.restarts == len(events) == stats.workers[1].restarts and stats.workers[0].restarts == 0
