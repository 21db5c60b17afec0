"""Restarts on the torch.distributed and RPC nodes (``-m distributed``): the envs a node's collector
restarts are seen by the trainer (events, ``statistics().restarts``, per node); a node that dies under a
restart policy relaunches the whole group (the group's budget, the newest weights, new trajectory ids),
unless the trainer did not start the nodes (then ``WorkerDiedError``, saying why)."""

from __future__ import annotations

import os
import signal
import sys
import time

import anyio
import cloudpickle
import gymnasium as gym
import psutil
import pytest
import torch

from aiocollect import (
    DistributedCollector,
    DistributedSyncCollector,
    GymEnv,
    MultiSyncCollector,
    RayCollector,
    Restarted,
    RestartPolicy,
    RPCCollector,
    WorkerDiedError,
    WorkerFailed,
    WorkerStarted,
)
from aiocollect._remote._launchers import MPLauncher
from support import ConstantPolicy, crashing, fd_count, pendulum, segments
from support import process_tree as _tree
from support import wait_gone as _alive

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("TP_SOCKET_IFNAME", "lo")

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.anyio,
    pytest.mark.timeout(180),
    pytest.mark.usefixtures("support_by_value"),
]

cloudpickle.register_pickle_by_value(sys.modules[__name__])

POLICY = RestartPolicy(max_restarts=50, window=600.0, backoff=0.0)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request) -> str:
    return request.param


def _listening() -> list[tuple[str, int]]:
    """This process's listening sockets."""
    me = psutil.Process(os.getpid())
    return sorted(
        (c.laddr.ip, c.laddr.port) for c in me.net_connections("inet") if c.status == psutil.CONN_LISTEN
    )


def _settled(expected: tuple[int, list[tuple[str, int]]]) -> tuple[int, list[tuple[str, int]]]:
    """Open fds and listening sockets once they are back to ``expected`` (or after 5 s)."""
    deadline = time.monotonic() + 5.0
    while (now := (fd_count(), _listening())) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


CLASSES = {"gloo": DistributedCollector, "gloo-sync": DistributedSyncCollector, "rpc": RPCCollector}


@pytest.mark.parametrize("kind", list(CLASSES))
async def test_a_nodes_env_restarts_reach_the_trainer(kind, anyio_backend):
    """Node 1's env crashes every 25 steps and is restarted inside the node; every delivered batch is
    complete, and its restarts are events (worker: the node), counted per node and in all: exactly those
    made while collecting node 1's delivered batches (each rebuilt env gives 24 frames, then raises). Node
    1 is asked for a batch first thing and the nodes are asked for ``total_frames`` exactly, so it
    delivers at least one however slow it is (it used to be asked for none when node 0 was quicker)."""
    if anyio_backend == "trio" and kind != "gloo":
        pytest.skip("one engine under trio is enough: the counting is the engine's, not the loop's")
    cls = CLASSES[kind]
    events: list[Restarted] = []
    node1_frames = 0
    with anyio.fail_after(120):
        async with cls(
            [pendulum, crashing],
            ConstantPolicy(),
            frames_per_batch=64,
            total_frames=640,
            collector_kwargs={"restart": POLICY},
        ) as c:
            pids = _tree(c.node_pids())
            async with c.events() as stream:
                async for batch in c:
                    assert batch.numel() == 64  # complete: the failed steps gave no frame
                    node1_frames += _frames_of(batch, 1)
                    while (event := stream.receive_nowait()) is not None:
                        if isinstance(event, Restarted):
                            events.append(event)
            stats = c.statistics()
    assert stats.frames == 640
    assert node1_frames >= 64, "node 1 delivered no batch"
    assert len(events) == (node1_frames - 1) // 24, "the restarts of node 1's delivered batches"
    assert {e.worker for e in events} == {1}
    assert all(e.env == 0 and e.cause.startswith("ZeroDivisionError: the simulator") for e in events)
    assert stats.restarts == len(events) == stats.workers[1].restarts
    assert stats.workers[0].restarts == 0
    assert _alive(pids) == []


def _frames_of(batch, node: int) -> int:
    """Node ``node``'s frames in ``batch`` (a sync batch stacks the nodes' batches on dim 0)."""
    if ("collector", "node_id") in batch.keys(include_nested=True):
        return int((batch["collector", "node_id"] == node).sum())
    return batch[node].numel()


class KillsItsNode(gym.Wrapper):
    """SIGKILLs the process it runs in (its node) at its ``at``-th step, in every group."""

    def __init__(self, env, at: int) -> None:
        super().__init__(env)
        self.at, self.steps = at, 0

    def step(self, action):
        self.steps += 1
        if self.steps == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.env.step(action)


def node_killer():
    return GymEnv(KillsItsNode(gym.make("Pendulum-v1"), at=40))


class FixedLauncher(MPLauncher):
    """Nodes the trainer cannot start again (as nodes started outside it: ``submitit_delayed``)."""

    relaunchable = False


def _new_ids(batch) -> bool:
    """Whether ``batch`` holds a relaunched group's trajectories (ids of a later generation: >= 2**32)."""
    return bool((batch["collector", "traj_ids"] >= 2**32).any())


def _events(stream, kinds) -> list:
    out = []
    while (event := stream.receive_nowait()) is not None:
        if isinstance(event, kinds):
            out.append(event)
    return out


@pytest.mark.parametrize("kind", list(CLASSES))
async def test_a_killed_node_relaunches_the_group(kind, warm_forkserver, anyio_backend):
    """Node 1 is SIGKILLed after weights version 1 were published: every node is closed and the group
    relaunched (new processes, new trajectory ids, version 1 from the first frame); the run still ends
    with exactly ``total_frames``; one restart is counted (a ``Restarted`` event with ``env=-1``), the
    frames lost in flight are accounted, and nothing of either group is left."""
    if anyio_backend == "trio" and kind != "gloo":
        pytest.skip("one engine under trio is enough: the relaunch is the transport's, not the loop's")
    cls = CLASSES[kind]
    before = (fd_count(), _listening())
    policy = ConstantPolicy(0.0)
    frames = per_batch = 64
    total = 64 * 12
    events: list = []
    with anyio.fail_after(150):
        async with cls(
            [pendulum, pendulum],
            policy,
            frames_per_batch=per_batch,
            total_frames=total,
            collector_kwargs={"seed": 5},
            restart=RestartPolicy(max_restarts=2, window=600.0, backoff=0.0),
        ) as c:
            async with c.events() as stream:
                first = await c.__anext__()
                assert not _new_ids(first)
                with torch.no_grad():
                    policy.value.fill_(1.0)
                assert await c.update_weights(policy, wait=True) == 1
                old = c.node_pids()
                pids = _tree(old)
                os.kill(old[1], signal.SIGKILL)
                async for event in stream:  # the loss is seen before the next batch is asked for
                    events.append(event)
                    if isinstance(event, WorkerFailed):
                        break
                fresh, lost_group = 0, {}
                async for batch in c:
                    frames += batch.numel()
                    if _new_ids(batch):
                        fresh += 1
                        assert (batch["action"] == 1.0).all()  # version 1 before the first frame
                    elif kind != "gloo-sync":  # a lost node's batch, delivered after the loss
                        lost_group[int(batch["collector", "node_id"][0])] = batch
                events += _events(stream, (Restarted, WorkerFailed, WorkerStarted))
                events = [e for e in events if isinstance(e, (Restarted, WorkerFailed, WorkerStarted))]
            new = c.node_pids()
            pids |= _tree(new)
            stats = c.statistics()
    assert frames == total == stats.frames
    assert fresh > 0 and set(new).isdisjoint(old)
    for batch in lost_group.values():  # each node's last batch of the lost group ends its trajectories
        assert batch["next", "truncated"][..., -1, :].all() and batch["next", "done"][..., -1, :].all()
    print(f"lost group's batches delivered after the loss: {len(lost_group)}")
    restarted = [e for e in events if isinstance(e, Restarted)]
    assert [(e.worker, e.env, e.restarts) for e in restarted] == [(1, -1, 1)]
    assert restarted[0].cause.startswith("WorkerDiedError: node 1")
    assert [e.worker_id for e in events if isinstance(e, WorkerFailed)] == [1]
    assert sorted(e.worker_id for e in events if isinstance(e, WorkerStarted)) == [0, 1]
    assert stats.restarts == 1 == stats.workers[1].restarts and stats.workers[0].restarts == 0
    assert _alive(pids) == []
    fds, listening = await anyio.to_thread.run_sync(_settled, before)
    # torch keeps the first RPC agent of a process for good (its RRef context holds it): the first group's,
    # if this test made the first
    assert listening == before[1] and fds <= before[0] + (2 if kind == "rpc" else 0), (before, fds)


async def test_a_relaunch_leaves_nothing_of_nodes_with_worker_processes(warm_forkserver, anyio_backend):
    """Nodes hosting a ``MultiSyncCollector`` (worker processes, shared-memory slots): after a relaunch
    and the end of the run, no process of either group and no shared-memory segment of any node is left."""
    if anyio_backend != "asyncio":
        pytest.skip("one backend is enough: what a node leaves does not depend on it")
    with anyio.fail_after(150):
        async with DistributedCollector(
            [pendulum, pendulum],
            frames_per_batch=32,
            total_frames=32 * 10,
            collector_class=MultiSyncCollector,
            num_workers_per_collector=2,
            restart=RestartPolicy(max_restarts=1, window=600.0, backoff=0.0),
        ) as c:
            await c.__anext__()
            old = c.node_pids()
            pids = _tree(old)
            assert segments(old[1])  # the node's workers' slots
            os.kill(old[1], signal.SIGKILL)
            frames = 32
            async for batch in c:
                frames += batch.numel()
            new = c.node_pids()
            pids |= _tree(new)
            stats = c.statistics()
    assert frames == stats.frames == 320 and stats.restarts == 1
    assert _alive(pids) == []
    assert [s for pid in [*old, *new] for s in segments(pid)] == []


class HangsOnce(gym.Wrapper):
    """Hangs at its 40th step unless ``marker`` exists (it creates it): the first group hangs, the
    relaunched one does not."""

    def __init__(self, env, marker: str) -> None:
        super().__init__(env)
        self.marker, self.steps = marker, 0

    def step(self, action):
        self.steps += 1
        if self.steps == 40 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            time.sleep(3600)
        return self.env.step(action)


async def test_a_hung_node_relaunches_the_group(warm_forkserver, anyio_backend, tmp_path):
    """A node whose env hangs past ``progress_timeout`` is a loss like a death: the group is relaunched
    (the hung process killed) and the run ends with its frames."""
    if anyio_backend != "asyncio":
        pytest.skip("one backend is enough: the timeout is the transport's")
    marker = str(tmp_path / "hung")

    def hangs_once():
        return GymEnv(HangsOnce(gym.make("Pendulum-v1"), marker))

    with anyio.fail_after(150):
        async with DistributedCollector(
            [hangs_once],
            frames_per_batch=32,
            total_frames=32 * 6,
            progress_timeout=3.0,
            restart=RestartPolicy(max_restarts=1, window=600.0, backoff=0.0),
        ) as c:
            pids = _tree(c.node_pids())
            async with c.events() as stream:
                frames = 0
                async for batch in c:
                    frames += batch.numel()
                events = _events(stream, Restarted)
            pids |= _tree(c.node_pids())
            stats = c.statistics()
    assert await anyio.Path(marker).exists() and frames == stats.frames == 32 * 6
    assert [(e.worker, e.env) for e in events] == [(0, -1)]
    assert events[0].cause.startswith("WorkerTimeoutError: node 0")
    assert stats.restarts == 1 and _alive(pids) == []


async def _first_batches_after_a_relaunch(seed: int) -> tuple[list, list]:
    """A seeded run whose node 1 is killed after the first batch: each node's first batch of the first
    group and of the relaunched one (their observations)."""
    first: dict[int, object] = {}
    fresh: dict[int, object] = {}
    killed = False
    with anyio.fail_after(120):
        async with DistributedCollector(
            [pendulum, pendulum],
            ConstantPolicy(0.5),
            frames_per_batch=16,
            total_frames=-1,
            collector_kwargs={"seed": seed},
            restart=RestartPolicy(max_restarts=1, window=600.0, backoff=0.0),
        ) as c:
            async for batch in c:
                node = int(batch["collector", "node_id"][0])
                target = fresh if _new_ids(batch) else first
                target.setdefault(node, batch["observation"].clone())
                if len(first) == 2 and not killed:  # once: node 0's batches may come before the restart
                    os.kill(c.node_pids()[1], signal.SIGKILL)
                    killed = True
                if len(fresh) == 2:
                    break
    return [first[0], first[1]], [fresh[0], fresh[1]]


async def test_a_seeded_run_relaunches_the_same_way(warm_forkserver, anyio_backend):
    """The relaunched nodes are seeded with ``derive_seed(node's seed, relaunches)``: two seeded runs
    whose group is relaunched give the same first batches from the new group (whenever the kill came),
    which are not the first group's."""
    if anyio_backend != "asyncio":
        pytest.skip("one backend is enough: the seeds are the transport's")
    first_a, fresh_a = await _first_batches_after_a_relaunch(11)
    first_b, fresh_b = await _first_batches_after_a_relaunch(11)
    for a, b in zip(first_a + fresh_a, first_b + fresh_b, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(first_a[0], fresh_a[0]) and not torch.equal(first_a[1], fresh_a[1])


async def test_submitit_jobs_are_submitted_again(tmp_path, anyio_backend):
    """``launcher="submitit"`` (local executor): a node job killed under a restart policy is answered
    with new jobs for the whole group; the run ends with its frames and no job process is left."""
    pytest.importorskip("submitit")
    if anyio_backend != "asyncio":
        pytest.skip("one backend is enough: the launcher is the same")
    with anyio.fail_after(150):
        async with DistributedSyncCollector(  # sync: every batch needs both nodes
            pendulum,
            frames_per_batch=64,
            total_frames=64 * 4,
            num_collectors=2,
            launcher="submitit",
            slurm_kwargs={"folder": str(tmp_path / "%j"), "cluster": "local", "timeout_min": 5},
            restart=RestartPolicy(max_restarts=1, window=600.0, backoff=0.0),
        ) as c:
            await c.__anext__()
            jobs = [n.process.job.job_id for n in c._nodes.nodes]
            old = c.node_pids()
            pids = _tree(old)
            os.kill(old[1], signal.SIGKILL)
            frames = 64
            async for batch in c:
                frames += batch.numel()
            pids |= _tree(c.node_pids())
            relaunched = [n.process.job.job_id for n in c._nodes.nodes]
            stats = c.statistics()
    assert frames == stats.frames == 64 * 4 and stats.restarts == 1
    assert set(relaunched).isdisjoint(jobs)
    assert _alive(pids) == []


async def test_a_node_that_keeps_dying_spends_the_groups_budget(warm_forkserver, anyio_backend):
    """Node 1 kills itself at its 40th step in every group: with ``max_restarts=2`` the third death ends
    the run with the node's ``WorkerDiedError``, the restart history as a note; nothing is left."""
    before = (fd_count(), _listening())
    pids: set[int] = set()
    with anyio.fail_after(150):
        async with DistributedCollector(
            [pendulum, node_killer],
            frames_per_batch=32,
            total_frames=-1,
            restart=RestartPolicy(max_restarts=2, window=600.0, backoff=0.0),
        ) as c:
            with pytest.raises(WorkerDiedError) as info:
                async for _ in c:
                    pids |= _tree([p for p in c.node_pids() if p is not None])
            stats = c.statistics()
    assert info.value.index == 1
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "restart budget spent: 2 restart(s)" in notes and notes.count("WorkerDiedError: node 1") == 2
    assert stats.restarts == 2 == stats.workers[1].restarts
    assert _alive(pids) == []
    assert await anyio.to_thread.run_sync(_settled, before) == before


async def test_nodes_the_trainer_cannot_relaunch_end_the_run_saying_why(
    warm_forkserver, anyio_backend, timing
):
    """A launcher that cannot start nodes again (``submitit_delayed``'s): a node killed under a restart
    policy ends the run with ``WorkerDiedError`` as without one, a note saying why; nothing is left."""
    before = (fd_count(), _listening())
    with anyio.fail_after(90):
        async with DistributedCollector(
            [pendulum, pendulum],
            frames_per_batch=32,
            total_frames=-1,
            launcher=FixedLauncher(),
            restart=RestartPolicy(max_restarts=3),
        ) as c:
            pids = _tree(c.node_pids())
            await c.__anext__()
            os.kill(c.node_pids()[1], signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(WorkerDiedError) as info:
                async for _ in c:
                    pass
            seen = time.monotonic()
    assert info.value.index == 1
    assert "cannot be" in "".join(getattr(info.value, "__notes__", []))
    timing.bound(seen - killed, 5, "the restart")
    assert _alive(pids) == []
    assert await anyio.to_thread.run_sync(_settled, before) == before


@pytest.mark.parametrize("cls", [DistributedCollector, DistributedSyncCollector, RPCCollector, RayCollector])
def test_restart_must_be_a_policy(cls):
    with pytest.raises(TypeError, match="restart must be a RestartPolicy or None"):
        cls([pendulum], frames_per_batch=8, num_collectors=1, restart=3)
