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

from aiocollect import GymEnv, RayCollector, Restarted, RestartPolicy, WorkerDiedError
from support import ConstantPolicy, crashing, pendulum

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


def _new_generation(batch) -> bool:
    """Whether ``batch``'s trajectories are a replacement's (ids of a later generation: >= 2**32)."""
    return bool((batch["collector", "traj_ids"] >= 2**32).all())


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
async def test_a_killed_actor_is_replaced_with_the_newest_weights(ray, sync):
    """Actor 1 is killed after weights version 1 were published: a new actor takes its slot, runs
    version 1 from its first frame, under trajectory ids no earlier batch used; a Restarted event
    (env -1) and the counts say so; the run goes on (sync: every batch still holds both shares)."""
    policy = ConstantPolicy(0.0)
    events: list[Restarted] = []
    with anyio.fail_after(180):
        async with (
            RayCollector(
                [pendulum, pendulum],
                policy,
                frames_per_batch=32,
                total_frames=-1,
                num_collectors=2,
                sync=sync,
                collector_kwargs={"seed": 3},
                remote_config=REMOTE,
                restart=RestartPolicy(max_restarts=2, window=600.0, backoff=0.0),
            ) as c,
            c.events() as stream,
        ):
            await c.__anext__()
            old_pid = c.actor_info()[1]["pid"]
            with torch.no_grad():
                policy.value.fill_(1.0)
            assert await c.update_weights(policy) == 1
            ray.kill(c.actors[1])
            fresh = 0
            async for batch in c:
                part = batch[1] if sync else batch
                if not sync and int(batch["collector", "worker_id"][0]) != 1:
                    continue
                if not _new_generation(part):
                    continue
                assert (part["action"] == 1.0).all()  # version 1's weights from its first frame
                assert c.worker_policy_versions()[1] == 1
                fresh += 1
                if fresh == 3:
                    break
            events += _restarted(stream)
            stats = c.statistics()
            new_pid = c.actor_info()[1]["pid"]
    assert [(e.worker, e.env, e.restarts) for e in events] == [(1, -1, 1)]
    assert events[0].cause.startswith("WorkerDiedError: actor 1")
    assert stats.restarts == 1 == stats.workers[1].restarts and stats.workers[0].restarts == 0
    assert new_pid != old_pid and _pid_gone(old_pid) and _pid_gone(new_pid)


async def test_an_actor_past_its_budget_ends_the_run_with_its_error(ray, timing):
    """With max_restarts=1 the second kill of actor 0 ends the run with WorkerDiedError, the restart
    history as a note, within 2 s of the kill."""
    with anyio.fail_after(180):
        async with RayCollector(
            pendulum,
            frames_per_batch=32,
            total_frames=-1,
            num_collectors=1,
            remote_config=REMOTE,
            restart=RestartPolicy(max_restarts=1, window=600.0, backoff=0.0),
        ) as c:
            await c.__anext__()
            ray.kill(c.actors[0])
            generation = 0
            with pytest.raises(WorkerDiedError) as info:
                async for batch in c:
                    if _new_generation(batch) and generation == 0:
                        generation = 1
                        ray.kill(c.actors[0])
                        killed = time.monotonic()
            seen = time.monotonic()
    assert generation == 1
    timing.bound(seen - killed, 2.0, "the replacement")
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "restart budget spent: 1 restart(s)" in notes and "WorkerDiedError: actor 0" in notes


class HangsOnce(gym.Wrapper):
    """Hangs at its 40th step unless ``marker`` exists (it creates it): the first actor hangs, its
    replacement does not."""

    def __init__(self, env, marker: str) -> None:
        super().__init__(env)
        self.marker, self.steps = marker, 0

    def step(self, action):
        self.steps += 1
        if self.steps == 40 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            time.sleep(3600)
        return self.env.step(action)


async def test_a_hung_actor_is_killed_and_replaced(ray, tmp_path):
    marker = str(tmp_path / "hung")

    def hangs_once():
        return GymEnv(HangsOnce(gym.make("Pendulum-v1"), marker))

    events: list[Restarted] = []
    with anyio.fail_after(180):
        async with (
            RayCollector(
                hangs_once,
                frames_per_batch=32,
                total_frames=320,
                num_collectors=1,
                remote_config=REMOTE,
                progress_timeout=3.0,
                restart=RestartPolicy(max_restarts=1, window=600.0, backoff=0.0),
            ) as c,
            c.events() as stream,
        ):
            old_pid = c.actor_info()[0]["pid"]
            async for _ in c:
                events += _restarted(stream)
            stats = c.statistics()
    assert await anyio.Path(marker).exists() and stats.frames == 320
    assert [(e.worker, e.env) for e in events] == [(0, -1)]
    assert events[0].cause.startswith("WorkerTimeoutError: actor 0")
    assert stats.restarts == 1 and _pid_gone(old_pid)


async def _first_batches_after_a_replacement(ray, seed: int) -> tuple[list, list]:
    """A seeded run whose actor 1 is killed once both actors delivered: each actor's first batch of the
    first generation, and actor 1's first batch from its replacement (their observations)."""
    first: dict[int, torch.Tensor] = {}
    fresh = None
    with anyio.fail_after(180):
        async with RayCollector(
            [pendulum, pendulum],
            ConstantPolicy(0.5),
            frames_per_batch=16,
            total_frames=-1,
            num_collectors=2,
            collector_kwargs={"seed": seed},
            remote_config=REMOTE,
            restart=RestartPolicy(max_restarts=1, window=600.0, backoff=0.0),
        ) as c:
            killed = False
            async for batch in c:
                actor = int(batch["collector", "worker_id"][0])
                if _new_generation(batch):
                    assert actor == 1
                    fresh = batch["observation"].clone()
                    break
                first.setdefault(actor, batch["observation"].clone())
                if len(first) == 2 and not killed:
                    ray.kill(c.actors[1])
                    killed = True
    assert fresh is not None
    return [first[0], first[1]], [fresh]


async def test_a_replaced_actor_runs_its_derived_seed(ray):
    """The replacement of a seeded actor is seeded with ``derive_seed(actor's seed, 1)``, end to end: two
    seeded runs give the same first batch from the replacement (whenever the kill came), which is not
    its predecessor's first batch."""
    first_a, fresh_a = await _first_batches_after_a_replacement(ray, 11)
    first_b, fresh_b = await _first_batches_after_a_replacement(ray, 11)
    for a, b in zip(first_a + fresh_a, first_b + fresh_b, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(first_a[1], fresh_a[0])
