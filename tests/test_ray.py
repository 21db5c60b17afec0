"""RayCollector on a real local Ray cluster (``-m distributed``; ``nox -s distributed``).

One session-scoped local cluster serves every test here (starting one costs ~10 s); the 2-node
``ray.cluster_utils.Cluster`` test runs in a subprocess, since a process joins one Ray cluster at a time.
Every RayCollector starts fresh actors (a Python process each, importing torch), so the tests share
collectors between checks to keep the file within a few minutes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import anyio
import cloudpickle
import gymnasium as gym
import psutil
import pytest
import torch
from tensordict import TensorDict

from aiocollect import (
    CollectorClosedError,
    GymEnv,
    MultiSyncCollector,
    RayCollector,
    WorkerDiedError,
    WorkerTimeoutError,
)
from support import ConstantPolicy, ListBuffer, broken_factory, check_remote_split, pendulum

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180), pytest.mark.usefixtures("support_by_value")]
#: the tests that start Ray; the others (argument checks, no ray import) run in the default suite
distributed = pytest.mark.distributed

# the actors cannot import this test module (pytest puts tests/ on the driver's sys.path only): its
# env constructors and policy classes travel by value (and support's: the support_by_value fixture)
cloudpickle.register_pickle_by_value(sys.modules[__name__])

REMOTE = {"num_cpus": 0}  # the actors take no CPU slot: any number fit on this 2-core machine


@pytest.fixture
def anyio_backend() -> tuple[str, dict]:
    return ("asyncio", {"use_uvloop": False})


@pytest.fixture(scope="module")
def _ray_module_cluster():
    """One local cluster for this module's tests, shut down after them: a cluster kept for the session
    left Ray's processes (children of the test process) and threads to the test files run after this one,
    whose leak checks then failed, depending on the order the files ran in."""
    ray = pytest.importorskip("ray")  # here, not at import: the default suite collects this file
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    if ray.is_initialized():  # pragma: no cover - someone else's cluster: use it, leave it
        yield ray
        return
    from aiocollect._remote._ray_local import init_local

    init_local(  # ray.init, kept on loopback (Ray would move 127.0.0.1 to the machine's address)
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


def _alive_actors(ray) -> list[str]:
    return list(ray._private.state.actors(actor_state_name="ALIVE"))


@pytest.fixture
def ray_cluster(_ray_module_cluster):
    """The module's cluster; a test leaves no actor alive in it (or it fails: such an actor could
    disturb the next test)."""
    ray = _ray_module_cluster
    yield
    deadline = time.monotonic() + 10  # ray.kill is asynchronous: the GCS marks the actor dead soon after
    while (alive := _alive_actors(ray)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"actors left alive after the test: {alive}"


# -- helpers (pickled by value into the actors; more in support) ------------------------------------
class FailingStep(gym.Wrapper):
    def __init__(self, env, at: int) -> None:
        super().__init__(env)
        self.at = at
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if self.steps >= self.at:
            # a builtin type: classes of this module travel by value, and a class pickled by value
            # comes back as a new class (only importable classes keep their identity over the wire)
            raise ZeroDivisionError(f"env step {self.steps} exploded")
        return self.env.step(action)


def failing_pendulum():
    return GymEnv(FailingStep(gym.make("Pendulum-v1"), at=40))


def ray_processes(collector: RayCollector) -> list[psutil.Process]:
    """The actors' processes and everything under them (worker processes, forkservers)."""
    procs = []
    for info in collector.actor_info():
        proc = psutil.Process(info["pid"])
        procs += [proc, *proc.children(recursive=True)]
    return procs


def assert_gone(procs: list[psutil.Process]) -> None:
    alive = []
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append((p.pid, p.name()))
        except psutil.NoSuchProcess:
            pass
    assert not alive, f"processes left after async with: {alive}"


def actions(batch) -> set[float]:
    return {round(v, 4) for v in batch["action"].unique().tolist()}


# -- tests -------------------------------------------------------------------------------------------
@distributed
async def test_sync_stacks_one_batch_per_actor(ray_cluster):
    trainer = ConstantPolicy(0.0)
    batches = []
    async with RayCollector(
        pendulum,
        trainer,
        frames_per_batch=32,
        total_frames=32 * 4,
        num_collectors=2,
        sync=True,
        remote_config=REMOTE,
        collector_kwargs={"track_policy_version": True, "max_frames_per_traj": 5},
    ) as c:
        procs = ray_processes(c)
        assert len({info["pid"] for info in c.actor_info()}) == 2
        events = c.events()
        async for batch in c:
            batches.append(batch)
            if len(batches) == 1:
                with torch.no_grad():
                    trainer.value.fill_(0.5)
                assert await c.update_weights() == 1
        stats = c.statistics()
        check_remote_split(c, members=2)
    kinds = [e.kind async for e in events]  # the stream ends when the collector closes
    assert_gone(procs)
    assert [tuple(b.batch_size) for b in batches] == [(2, 16)] * 4
    assert sum(b.numel() for b in batches) == 128
    assert stats.frames == 128 and stats.batches == 4
    assert [w.frames for w in stats.workers] == [64, 64]
    assert {w.state for w in stats.workers} == {"stopped"}  # inside the block, budget delivered
    # the weights pushed after batch 1 run every later batch (sync: actors idle between batches)
    assert actions(batches[0]) == {0.0}
    for b in batches[1:]:
        assert actions(b) == {0.5}
        assert (b["collector", "policy_version"] == 1).all()
    assert c.worker_policy_versions() == [1, 1]
    # trajectory ids: actor i of 2 takes i, i + 2, ...; never shared
    ids = torch.stack([b["collector", "traj_ids"] for b in batches])
    assert (ids[:, 0] % 2 == 0).all() and (ids[:, 1] % 2 == 1).all()
    assert kinds.count("batch") == 4 and "weights_published" in kinds and "worker_stopped" in kinds
    assert c.statistics().workers[0].state == "stopped"
    with pytest.raises(CollectorClosedError):
        await c.__anext__()


@distributed
async def test_async_each_actor_batch_and_weight_schedule(ray_cluster):
    trainer = ConstantPolicy(0.0)
    batches = []
    async with RayCollector(
        pendulum,
        trainer,
        frames_per_batch=16,
        total_frames=16 * 14,
        num_collectors=2,
        remote_config=REMOTE,
        max_weight_update_interval=2,
        collector_kwargs={"track_policy_version": True, "max_frames_per_traj": 5},
    ) as c:
        procs = ray_processes(c)
        async for batch in c:
            batches.append(batch)
            if len(batches) == 1:
                with torch.no_grad():
                    trainer.value.fill_(0.5)
                await c.update_weights()
                # changed in place, never published: max_weight_update_interval=2 ships it anyway
                with torch.no_grad():
                    trainer.value.fill_(1.0)
        stats = c.statistics()
    assert_gone(procs)
    assert [tuple(b.batch_size) for b in batches] == [(16,)] * 14
    assert stats.frames == 16 * 14
    by_actor: dict[int, list] = {0: [], 1: []}
    for b in batches:
        (worker,) = b["collector", "worker_id"].unique().tolist()
        by_actor[worker].append(b)
    assert by_actor[0] and by_actor[1]
    # an actor's batch in flight when weights were pushed may be old, later ones are not; the in-place
    # change (1.0) reaches an actor within 2 of its batches
    busy = [mine for mine in by_actor.values() if len(mine) >= 5]
    assert busy
    for mine in busy:
        assert actions(mine[-1]) == {1.0}
        assert (mine[-1]["collector", "policy_version"] >= 2).all()
    for mine in by_actor.values():
        values = [max(actions(b)) for b in mine]
        assert values == sorted(values)
    ids0 = set(torch.cat([b["collector", "traj_ids"] for b in by_actor[0]]).tolist())
    ids1 = set(torch.cat([b["collector", "traj_ids"] for b in by_actor[1]]).tolist())
    assert len(ids0) > 3 and len(ids1) > 3 and not ids0 & ids1
    assert stats.policy_version >= 3  # one explicit update plus interval updates


@distributed
async def test_async_flush_delivers_only_the_new_weights(ray_cluster):
    """sync=False: after update_weights(flush=True) every batch runs the new weights; the batches the
    actors had collected with the old ones are dropped and counted, not delivered (issue 15)."""
    trainer = ConstantPolicy(0.0)
    batches = []
    async with RayCollector(
        pendulum,
        trainer,
        frames_per_batch=16,
        total_frames=16 * 8,
        num_collectors=2,
        remote_config=REMOTE,
        collector_kwargs={"track_policy_version": True},
    ) as c:
        procs = ray_processes(c)
        async for batch in c:
            batches.append(batch)
            if len(batches) == 2:
                with torch.no_grad():
                    trainer.value.fill_(1.0)
                assert await c.update_weights(flush=True) == 1
        stats = c.statistics()
    assert_gone(procs)
    assert len(batches) == 8 and stats.frames == 16 * 8
    for b in batches[2:]:
        assert actions(b) == {1.0}
        assert (b["collector", "policy_version"] == 1).all()
    assert stats.frames_discarded % 16 == 0


@distributed
async def test_multi_process_collectors_inside_actors(ray_cluster):
    """Each actor runs a MultiSyncCollector with 2 worker processes: ids unique over all 4 workers,
    and the workers are reaped when the RayCollector exits."""
    trainer = ConstantPolicy(0.25)
    async with RayCollector(
        [[pendulum, pendulum]] * 2,
        trainer,
        frames_per_batch=16,
        total_frames=16 * 6,
        num_collectors=2,
        collector_class=MultiSyncCollector,
        collector_kwargs={"max_frames_per_traj": 4},
        remote_config=REMOTE,
    ) as c:
        batches = [b async for b in c]
        procs = ray_processes(c)
        assert len(procs) >= 2 + 4  # two actors, two workers under each
        check_remote_split(c, members=2)  # each actor's: its 2 worker processes' together
    assert_gone(procs)
    assert [tuple(b.batch_size) for b in batches] == [(2, 8)] * 6  # an actor's batch: [workers, time]
    assert all(actions(b) == {0.25} for b in batches)
    ids_of: dict[tuple[int, int], set[int]] = {}
    for b in batches:
        (actor,) = b["collector", "worker_id"].unique().tolist()
        for w in range(2):
            ids_of.setdefault((actor, w), set()).update(b["collector", "traj_ids"][w].tolist())
    assert len(ids_of) == 4
    seen: set[int] = set()
    for ids in ids_of.values():
        assert not ids & seen
        seen |= ids


@distributed
async def test_remote_exception_surfaces_with_its_type(ray_cluster):
    async with RayCollector(
        failing_pendulum,
        None,
        frames_per_batch=32,
        total_frames=-1,
        num_collectors=2,
        sync=True,
        remote_config=REMOTE,
    ) as c:
        procs = ray_processes(c)
        with pytest.raises(ZeroDivisionError, match="exploded") as info:
            async for _ in c:
                pass
        assert type(info.value) is ZeroDivisionError  # not Ray's RayTaskError(ZeroDivisionError)
        assert c.statistics().batches == 2  # 2 x 16 steps per actor, then step 40 raises
        assert any("remote traceback" in note for note in info.value.__notes__)
        assert {w.state for w in c.statistics().workers} & {"failed"}
        with pytest.raises(CollectorClosedError, match="ZeroDivisionError"):
            await c.__anext__()
    assert_gone(procs)


@distributed
async def test_start_failure_surfaces_from_async_with(ray_cluster):
    """Every actor fails to build its env: the KeyError comes out of ``async with`` and the actors are
    gone."""
    collector = RayCollector(broken_factory, frames_per_batch=8, num_collectors=2, remote_config=REMOTE)
    with pytest.raises(KeyError, match="no such env"):
        async with collector:
            pytest.fail("the collector started")
    pids = [info["pid"] for info in collector.actor_info()]
    assert len(pids) == 2
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def pendulum_pair():
    return GymEnv("Pendulum-v1", num_envs=2)


@distributed
async def test_state_dict_loads_with_torch_load_weights_only(ray_cluster, tmp_path):
    """A checkpoint saved as the docs say loads with torch.load's default (weights only)."""
    async with RayCollector(
        pendulum_pair,
        ConstantPolicy(0.5),
        frames_per_batch=16,
        num_collectors=2,
        remote_config=REMOTE,
        collector_kwargs={"max_frames_per_traj": 3},  # episodes end: trajectory ids advance
    ) as c:
        with anyio.fail_after(90):
            async for _ in c:
                if c.statistics().frames >= 32:
                    break
            torch.save(await c.state_dict(), tmp_path / "collector.pt")
            loaded = torch.load(tmp_path / "collector.pt", weights_only=True)
            await c.load_state_dict(loaded)
            assert (await c.__anext__()).numel() == 16


@distributed
async def test_seed_state_dict_replay_buffer_and_pause(ray_cluster):
    rb = ListBuffer()
    async with RayCollector(
        pendulum,
        None,
        frames_per_batch=16,
        num_collectors=2,
        sync=True,
        replay_buffer=rb,
        remote_config=REMOTE,
        collector_kwargs={"seed": 7},
    ) as c:
        procs = ray_processes(c)
        assert await c.__anext__() is None
        first = rb.batches[-1]
        assert await c.set_seed(7) == 8  # actor 0 seeded 7, actor 1 seeded 8
        assert await c.__anext__() is None
        assert (rb.batches[-1]["action"] == first["action"]).all()  # reproducible from a seed
        assert not (first["action"][0] == first["action"][1]).all()  # distinct seeds per actor

        await c.reset()
        state = await c.state_dict()
        assert state["frames"] == 32 and set(state) >= {"worker0", "worker1", "batches"}
        await c.load_state_dict({**state, "frames": 16})
        assert c.statistics().frames == 16

        await c.start()  # background collection into the replay buffer
        with anyio.fail_after(60):
            await rb.wait_for(5)
        async with c.pause():
            rb.paused = True
            await anyio.sleep(0.5)
            rb.paused = False
            assert c.statistics().paused
        assert rb.violations == 0
    assert_gone(procs)


@distributed
@pytest.mark.parametrize("anyio_backend", [("trio", {})])
async def test_trio_update_after_each_batch(ray_cluster):
    """trio cannot await Ray's asyncio futures: the waits run in worker threads (ray.get)."""
    trainer = ConstantPolicy(0.0)
    seen = []
    async with RayCollector(
        pendulum,
        trainer,
        frames_per_batch=16,
        total_frames=16 * 4,
        num_collectors=2,
        sync=True,
        update_at_each_batch=True,
        remote_config=REMOTE,
    ) as c:
        procs = ray_processes(c)
        async for batch in c:
            seen.append(actions(batch))
            with torch.no_grad():
                trainer.value.add_(1.0)  # a training step: the next batch runs these weights
        assert await c.update_weights(wait=True) == 4
        assert c.worker_policy_versions() == [4, 4]
    assert_gone(procs)
    assert seen == [{0.0}, {1.0}, {2.0}, {3.0}]


CLUSTER_SCRIPT = textwrap.dedent(
    """
    import os, sys
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import anyio, ray, torch
    from ray.cluster_utils import Cluster
    from aiocollect import GymEnv, RayCollector

    def cartpole():
        return GymEnv("CartPole-v1")

    async def main(address):
        async with RayCollector(cartpole, frames_per_batch=32, total_frames=32 * 4, num_collectors=2,
                                sync=True,
                                ray_init_config={"address": address, "_node_ip_address": "127.0.0.1"},
                                remote_config={"num_cpus": 1}) as c:
            nodes = {info["node_id"] for info in c.actor_info()}
            shapes = [tuple(b.batch_size) async for b in c]
        return nodes, shapes

    node = {"num_cpus": 1, "object_store_memory": 80 * 2**20, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        cluster.add_node(**node)
        cluster.wait_for_nodes()
        nodes, shapes = anyio.run(main, cluster.address)
        assert len(nodes) == 2, nodes  # one actor per node: each node has one CPU
        assert shapes == [(2, 16)] * 4, shapes
        # we connected to this cluster, we did not start it: it is still up
        assert not ray.is_initialized()
        ray.init(address=cluster.address, log_to_driver=False, _node_ip_address="127.0.0.1")
        alive = [n for n in ray.nodes() if n["Alive"]]
        assert len(alive) == 2, alive
        ray.shutdown()
        print("CLUSTER OK")
    finally:
        cluster.shutdown()
    """
)


@distributed
def test_two_node_cluster(tmp_path):
    pytest.importorskip("ray")
    script = tmp_path / "cluster.py"
    script.write_text(CLUSTER_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=tmp_path,
        # every Ray address stays on loopback: Ray would otherwise turn 127.0.0.1 into the machine's
        # own interface address when connecting, which the nodes (bound to 127.0.0.1) do not listen on
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
    )
    assert out.returncode == 0 and "CLUSTER OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


# -- without Ray: argument checks and imports (the default suite) ------------------------------------
def test_import_and_construction_do_not_import_ray():
    code = textwrap.dedent(
        """
        import sys
        import aiocollect
        from aiocollect import GymEnv, RayCollector
        RayCollector(lambda: GymEnv("CartPole-v1"), frames_per_batch=8, num_collectors=2)
        assert "ray" not in sys.modules, "ray was imported"
        print("OK")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-2000:]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_collectors": 0}, ValueError, "num_collectors"),
        ({"frames_per_batch": 0}, ValueError, "frames_per_batch"),
        ({"collector_kwargs": {"total_frames": 10}}, ValueError, "total_frames"),
        ({"collector_kwargs": {"traj_id_start": 3}}, ValueError, "traj_id_start"),
        ({"collector_kwargs": [{}]}, ValueError, "one per actor"),
        ({"remote_config": [{}, {}, {}]}, ValueError, "one per actor"),
        ({"collector_class": dict}, TypeError, "collector_class"),
        ({"update_at_each_batch": True}, TypeError, "nn.Module"),
        ({"max_weight_update_interval": -2}, ValueError, "max_weight_update_interval"),
        ({"sync": 1}, TypeError, "sync"),
        ({"ray_init_config": "auto"}, TypeError, "ray_init_config"),
        ({"create_env_fn": [pendulum]}, ValueError, "one per actor"),
        ({"create_env_fn": [pendulum, 3]}, TypeError, r"create_env_fn\[1\]"),
        (
            {"progress_timeout": 0},
            ValueError,
            "progress_timeout must be a positive number of seconds or None",
        ),
        ({"progress_timeout": "600"}, ValueError, "progress_timeout must be"),
    ],
)
def test_arguments_are_checked_before_anything_starts(kwargs, error, match):
    args = {"create_env_fn": pendulum, "frames_per_batch": 8, "num_collectors": 2, **kwargs}
    with pytest.raises(error, match=match):
        RayCollector(**args)


def test_interval_and_after_each_batch_exclude_each_other():
    with pytest.raises(ValueError, match="drop max_weight_update_interval"):
        RayCollector(
            pendulum,
            ConstantPolicy(),
            frames_per_batch=8,
            num_collectors=2,
            update_at_each_batch=True,
            max_weight_update_interval=2,
        )


async def test_iterating_without_async_with_says_how():
    c = RayCollector(pendulum, frames_per_batch=8, num_collectors=2)
    with pytest.raises(RuntimeError, match="async with RayCollector"):
        await c.__anext__()
    assert len(RayCollector(pendulum, frames_per_batch=8, total_frames=32, num_collectors=2)) == 4


def test_batches_cross_as_numpy_and_come_back_as_writable_copies():
    from aiocollect._remote._ray_wire import Wire, from_wires, to_wire

    def batch(offset: int):
        return TensorDict(
            {
                "observation": torch.arange(6.0).reshape(2, 3) + offset,
                "action": torch.tensor([1, 0]),
                "next": {"done": torch.tensor([[False], [True]])},
                "collector": {"traj_ids": torch.tensor([offset, offset])},
            },
            batch_size=[2],
        )

    wires = [to_wire(batch(0)), to_wire(batch(10))]
    assert all(isinstance(w, Wire) for w in wires)
    for w in wires:  # as Ray hands them back: read-only views of its object store
        for array in w.arrays:
            array.flags.writeable = False
    one = from_wires([wires[0]], stack=False)
    both = from_wires(wires, stack=True)
    assert (one == batch(0)).all() and one.names == ["time"]
    assert both.batch_size == (2, 2) and (both[1] == batch(10)).all() and both.names == [None, "time"]
    assert both["next", "done"].dtype == torch.bool
    one["observation"].add_(1)  # writable, and a copy: the wire's arrays are untouched
    assert wires[0].arrays[0][0, 0] == 0
    # a leaf numpy cannot hold travels as the TensorDict itself
    bf16 = TensorDict({"x": torch.zeros(2, dtype=torch.bfloat16)}, batch_size=[2])
    assert to_wire(bf16) is bf16
    mixed = from_wires(
        [
            to_wire(TensorDict({"x": torch.zeros(2)}, batch_size=[2])),
            TensorDict({"x": torch.ones(2)}, batch_size=[2]),
        ],
        stack=True,
    )
    assert mixed["x"].tolist() == [[0.0, 0.0], [1.0, 1.0]]


# -- faults: one error vocabulary whatever the engine ---------------------------------------------
@distributed
async def test_a_killed_actor_is_worker_died_error(ray_cluster, timing):
    """A SIGKILLed actor is ``WorkerDiedError`` (engine ``"ray"``, its actor id, Ray's error as the
    cause), not Ray's own ``ActorDiedError``; how long Ray takes to notice is measured (docs/ray.md)."""
    ray = pytest.importorskip("ray")
    with anyio.fail_after(120):
        async with RayCollector(
            pendulum, None, frames_per_batch=32, total_frames=-1, num_collectors=2, remote_config=REMOTE
        ) as c:
            procs = ray_processes(c)
            await c.__anext__()
            os.kill(c.actor_info()[1]["pid"], signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(WorkerDiedError) as info:
                async for _ in c:
                    pass
            took = time.monotonic() - killed
    error = info.value
    assert (error.index, error.engine) == (1, "ray")
    assert error.actor and "actor 1" in str(error)
    assert isinstance(error.__cause__, ray.exceptions.RayActorError)
    timing.bound(took, 30, "Ray noticing the dead actor")
    print(f"Ray noticed the SIGKILLed actor in {took:.2f} s")
    assert_gone(procs)


@distributed
async def test_a_killed_worker_inside_an_actor_keeps_its_type(ray_cluster):
    """A worker process of an actor's MultiSyncCollector SIGKILLed: ``WorkerDiedError`` with its exit
    code, not ``ray.exceptions.UnserializableException``."""
    with anyio.fail_after(120):
        async with RayCollector(
            [[pendulum, pendulum]],
            None,
            frames_per_batch=32,
            total_frames=-1,
            num_collectors=1,
            collector_class=MultiSyncCollector,
            remote_config=REMOTE,
        ) as c:
            procs = ray_processes(c)
            await c.__anext__()
            actor = psutil.Process(c.actor_info()[0]["pid"])
            workers = [w for child in actor.children() for w in child.children()]
            assert workers, "the actor's worker processes (children of its forkserver)"
            workers[0].send_signal(signal.SIGKILL)
            with pytest.raises(WorkerDiedError) as info:
                async for _ in c:
                    pass
    assert info.value.exitcode == -9 and info.value.signal == 9
    assert_gone(procs)


class _Hanging(gym.Wrapper):
    """Hangs (60 s) at its 40th step, in the actor."""

    def __init__(self, env) -> None:
        super().__init__(env)
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if self.steps == 40:
            time.sleep(60)
        return self.env.step(action)


def hanging_pendulum():
    return GymEnv(_Hanging(gym.make("Pendulum-v1")))


@distributed
@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
async def test_a_hung_actor_is_a_timeout_naming_it_and_is_killed(ray_cluster, sync, timing):
    """Liveness without configuration: an actor that delivers no batch within ``progress_timeout``
    (default 600 s; 3 s here) fails the collector with ``WorkerTimeoutError`` naming it; it is killed
    (not closed: its env is stuck), and leaving ``async with`` is prompt."""
    with anyio.fail_after(120):
        with pytest.raises(
            WorkerTimeoutError, match=r"actor 1 \(Ray actor \w+, .*progress_timeout=3 s"
        ) as info:
            async with RayCollector(
                [pendulum, hanging_pendulum],
                None,
                frames_per_batch=32,
                total_frames=-1,
                num_collectors=2,
                sync=sync,
                remote_config=REMOTE,
                progress_timeout=3,
            ) as c:
                procs = ray_processes(c)
                try:
                    async for _ in c:
                        pass
                finally:
                    leaving = time.monotonic()
        left_in = time.monotonic() - leaving
    assert "a hung env or policy" in str(info.value)
    timing.bound(left_in, 5, "leaving `async with`")
    assert_gone(procs)


# -- the trainer SIGKILLed: the cluster it started goes with it ----------------------------------------
def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


@pytest.mark.parametrize("goodbye", [True, False], ids=["closed", "trainer-died"])
def test_the_watchdog_kills_what_it_watches_only_when_the_trainer_dies(goodbye):
    from aiocollect._remote._ray_reaper import start_watchdog

    watched, other = _sleeper(), _sleeper()
    try:
        watchdog = start_watchdog()
        assert watchdog is not None
        watchdog.watch([watched.pid])
        if goodbye:
            watchdog.close()
        else:  # what the trainer's death does: its end of the pipe closes without a goodbye
            watchdog._process.stdin.close()
            watchdog._process.wait(10)
        assert watchdog._process.poll() == 0
        if goodbye:
            assert watched.poll() is None
        else:
            assert watched.wait(5) == -signal.SIGKILL
        assert other.poll() is None  # not watched: left alone
    finally:
        for p in (watched, other):
            p.kill()
            p.wait()


RAY_TRAINER = textwrap.dedent(
    """
    import json, os, anyio, psutil
    from aiocollect import GymEnv, RayCollector

    def pendulum():
        return GymEnv("Pendulum-v1")

    async def main():
        init = {"num_cpus": 2, "object_store_memory": 80 * 2**20, "log_to_driver": False}
        async with RayCollector(pendulum, frames_per_batch=32, num_collectors=2,
                                remote_config={"num_cpus": 0}, ray_init_config=init) as c:
            await c.__anext__()
            tree = [p.pid for p in psutil.Process().children(recursive=True)]
            print(json.dumps({"actors": [i["pid"] for i in c.actor_info()], "tree": tree}), flush=True)
            await anyio.sleep(600)

    anyio.run(main)
    """
)


@distributed
def test_a_sigkilled_trainer_takes_the_cluster_it_started_along(tmp_path):
    """The trainer (which started its own Ray cluster) is SIGKILLed: its actors and every process of the
    cluster are gone within seconds (Ray's dashboard and runtime-env agents lived 60 s, the actors 1.6 s)."""
    pytest.importorskip("ray")
    script = tmp_path / "trainer.py"
    script.write_text(RAY_TRAINER)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    trainer = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path, env=env
    )
    try:
        line = trainer.stdout.readline()
        assert line, "the trainer did not start"
        started = json.loads(line)
        procs = [
            psutil.Process(pid) for pid in {*started["tree"], *started["actors"]} if psutil.pid_exists(pid)
        ]
        assert any("DashboardAgent" in " ".join(p.cmdline()) for p in procs), [p.cmdline() for p in procs]
    finally:
        trainer.kill()
        trainer.wait()
        trainer.stdout.close()
    killed = time.monotonic()
    alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    while alive and time.monotonic() - killed < 10:
        time.sleep(0.05)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    took = time.monotonic() - killed
    for p in alive:  # not to leave them to the next test
        p.kill()
    assert not alive, f"left {took:.1f} s after the trainer's SIGKILL: {[p.cmdline()[:2] for p in alive]}"
    print(f"every process of the cluster was gone {took:.2f} s after the trainer's SIGKILL")
