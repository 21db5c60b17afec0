"""DistributedCollector / DistributedSyncCollector (torch.distributed over gloo on 127.0.0.1), the submitit
launchers (real jobs through submitit's LocalExecutor) and RPCCollector (TensorPipe).

Run with ``pytest -m distributed`` (``nox -s distributed``); the default run leaves them out.
"""

from __future__ import annotations

import os
import stat
import sys
import threading
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
    RPCCollector,
    submitit_delayed_launcher,
)
from support import ConstantPolicy, check_remote_split, pendulum
from support import process_tree as _ours
from support import wait_gone as _alive

# the node processes inherit these (gloo and TensorPipe bind to the loopback interface)
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("TP_SOCKET_IFNAME", "lo")

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.anyio,
    pytest.mark.timeout(180),
    pytest.mark.usefixtures("support_by_value"),
]

# submitit jobs unpickle what they run: ship this module's functions by value (and support's: the fixture)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture
def anyio_backend() -> tuple[str, dict]:
    return ("asyncio", {})


class _Exploding:
    """Pendulum that raises at its 40th step (in the node)."""

    def __init__(self) -> None:
        self.env = GymEnv("Pendulum-v1")
        self.steps = 0

    def __getattr__(self, name):
        return getattr(self.env, name)

    def step(self, td):
        self.steps += 1
        if self.steps == 40:
            raise FloatingPointError("the env exploded")
        return self.env.step(td)


def exploding():
    return _Exploding()


async def _check_weights_and_budget(c, policy, *, sync: bool, nodes: int, fpb: int, total: int) -> list:
    """Iterate ``c``; after batch 1 publish value 1.0 (``wait=True``). Returns the batches."""
    batches = []
    async for batch in c:
        batches.append(batch)
        if len(batches) == 1:
            with torch.no_grad():
                policy.value.fill_(1.0)
            assert await c.update_weights(wait=True) == 1
            assert c.worker_policy_versions() == [1] * nodes
    assert all(b.numel() == fpb for b in batches)
    assert sum(b.numel() for b in batches) == total
    assert c.statistics().frames == total
    assert bool((batches[0]["action"] == 0.0).all())
    if sync:  # every batch asked for after the update runs it
        assert len(batches) > 1 and all(bool((b["action"] == 1.0).all()) for b in batches[1:])
        return batches
    # An async node keeps collecting while its last batch waits for the consumer, so when the update
    # returned it may hold two batches collected with the old weights (one waiting, one being collected);
    # everything it collects after them runs the new weights.
    per_node: dict[int, list[float]] = {}
    for b in batches[1:]:
        values = set(b["action"].flatten().tolist())
        assert len(values) == 1, values  # a batch never mixes weights
        per_node.setdefault(int(b["collector", "node_id"].flatten()[0]), []).append(values.pop())
    for node, values in per_node.items():
        stale = values.index(1.0) if 1.0 in values else len(values)
        assert stale <= 2 and all(v == 1.0 for v in values[stale:]), (node, values)
    assert any(1.0 in values for values in per_node.values()), per_node
    return batches


def _traj_ids_disjoint(batches, node_of) -> None:
    ids: dict[int, set[int]] = {}
    for b in batches:
        for node, tid in node_of(b):
            ids.setdefault(node, set()).add(tid)
    nodes = sorted(ids)
    assert len(nodes) > 1
    for a in nodes:
        for b in nodes:
            if a < b:
                assert not ids[a] & ids[b], (a, b)


async def test_distributed_async_weights_budget_traj_ids_and_reaping():
    policy = ConstantPolicy(0.0)
    pids: set[int] = set()
    with anyio.fail_after(60):
        async with DistributedCollector(
            pendulum, policy, frames_per_batch=32, total_frames=32 * 8, num_collectors=2
        ) as c:
            pids = _ours(c.node_pids())
            assert len(pids) >= 2
            batches = await _check_weights_and_budget(c, policy, sync=False, nodes=2, fpb=32, total=256)
            stats = c.statistics()
            assert {w.worker_id for w in stats.workers} == {0, 1}
            assert sum(w.frames for w in stats.workers) >= 256
            check_remote_split(c, members=2)
    _traj_ids_disjoint(
        batches,
        lambda b: [(int(b["collector", "node_id"][0]), int(t)) for t in b["collector", "traj_ids"].unique()],
    )
    closed = c.statistics()
    assert closed.workers[0].state == "stopped"
    assert closed.time_split is not None and closed.workers[1].time_split is not None  # the last split
    assert _alive(pids) == []


class _Slow(gym.Wrapper):
    """A Pendulum whose steps take 20 ms (in the node)."""

    def step(self, action):
        time.sleep(0.02)
        return self.env.step(action)


def slow_pendulum():
    return GymEnv(_Slow(gym.make("Pendulum-v1")))


async def test_async_nodes_are_asked_for_total_frames_and_no_more():
    """The nodes are asked for ``total_frames`` in all, not a batch more: a slow node's first batch (it
    is asked for one first thing) is among those delivered, and the nodes sent ``total_frames``. (The
    batch being delivered was left out of the count, so a quick node was asked for it once more and a
    slow node's batch was never delivered.)"""
    with anyio.fail_after(60):
        async with DistributedCollector(
            [pendulum, slow_pendulum], ConstantPolicy(), frames_per_batch=32, total_frames=32 * 6
        ) as c:
            nodes = [int(b["collector", "node_id"][0]) async for b in c]
            stats = c.statistics()
    assert len(nodes) == 6 and nodes.count(1) >= 1, nodes
    assert [w.frames for w in stats.workers] == [32 * nodes.count(0), 32 * nodes.count(1)]


async def test_distributed_sync_stacks_per_node_with_multi_collectors():
    """DistributedSyncCollector over MultiSyncCollector nodes (2 thread workers each): batches stack
    [node, worker, time]; update_after_each_batch keeps every node on the newest weights."""
    policy = ConstantPolicy(0.0)
    with anyio.fail_after(60):
        async with DistributedSyncCollector(
            pendulum,
            policy,
            frames_per_batch=64,
            total_frames=64 * 4,
            num_collectors=2,
            collector_class=MultiSyncCollector,
            num_workers_per_collector=2,
            collector_kwargs={"worker_backend": "serial"},
            update_at_each_batch=True,
        ) as c:
            batches = []
            async for batch in c:
                batches.append(batch)
                with torch.no_grad():
                    policy.value.fill_(float(len(batches)))
            assert c.policy_version == 3  # before batches 2, 3 and 4
            check_remote_split(c, members=2)  # each node's: its 2 workers' together
            pids = _ours(c.node_pids())
    assert [tuple(b.batch_size) for b in batches] == [(2, 2, 16)] * 4
    for i, b in enumerate(batches):
        assert bool((b["action"] == float(i)).all()), i
    # nodes x workers: four disjoint id sets
    _traj_ids_disjoint(
        batches,
        lambda b: [
            (2 * n + w, int(t))
            for n in range(2)
            for w in range(2)
            for t in b["collector", "traj_ids"][n, w].unique()
        ],
    )
    assert _alive(pids) == []


async def test_distributed_interval_seed_and_state_dict():
    policy = ConstantPolicy(0.0)
    with anyio.fail_after(60):
        async with DistributedCollector(
            pendulum,
            policy,
            frames_per_batch=16,
            total_frames=-1,
            num_collectors=2,
            max_weight_update_interval=2,
            collector_kwargs={"seed": 3},
        ) as c:
            with torch.no_grad():
                policy.value.fill_(0.5)
            seen = []
            async for batch in c:
                seen.append(float(batch["action"][0]))
                if len(seen) == 8:
                    break
            # each node got the weights after its second batch without an update, unasked
            assert seen[-1] == 0.5 and c.policy_version >= 1
            assert await c.set_seed(10) == 11
            await c.reset()
            assert await c.getattr_env("batch_size", node=1) == torch.Size([])
            assert (await c.getattr_policy("value")).tolist() == [0.5]
            state = await c.state_dict()
            assert set(state) >= {"node0", "node1", "frames", "policy_version"}
            await c.load_state_dict(state)
            first = await c.__anext__()
            assert first.numel() == 16


@pytest.mark.parametrize("engine", ["distributed", "rpc"])
async def test_remote_error_surfaces_with_its_type_and_nodes_are_reaped(engine):
    cls = DistributedCollector if engine == "distributed" else RPCCollector
    with anyio.fail_after(60):
        with pytest.raises(FloatingPointError, match="the env exploded") as info:
            async with cls([pendulum, exploding], frames_per_batch=16, total_frames=-1) as c:
                pids = _ours(c.node_pids())
                async for _ in c:
                    pass
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "raised in node 1" in notes and "in step" in notes
    assert c.statistics().workers[1].state == "failed"
    assert _alive(pids) == []


class _LockedPolicy(ConstantPolicy):
    def __init__(self) -> None:
        super().__init__(0.0)
        self.lock = threading.Lock()  # does not pickle


@pytest.mark.parametrize("engine", ["distributed", "rpc"])
async def test_unpicklable_policy_fails_on_entering_before_any_node(engine):
    """The policy is pickled on entering (in a thread: a large one would hold the loop), before any node
    is launched; the env constructors are checked by the constructor."""
    cls = DistributedCollector if engine == "distributed" else RPCCollector
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    c = cls(pendulum, _LockedPolicy(), frames_per_batch=16, num_collectors=2)
    with anyio.fail_after(30), pytest.raises(TypeError, match="the policy cannot be pickled for the nodes"):
        async with c:
            pass
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children
    lock = threading.Lock()
    with pytest.raises(TypeError, match="of node 1 do not pickle"):
        cls([pendulum, lambda: (lock, pendulum())[1]], frames_per_batch=16)


async def test_rpc_async_then_sync_in_one_process():
    """Two RPC collectors one after the other (each its own agent), weights, budget, traj ids."""
    for sync in (False, True):
        policy = ConstantPolicy(0.0)
        with anyio.fail_after(60):
            async with RPCCollector(
                pendulum,
                policy,
                frames_per_batch=32,
                total_frames=32 * 6,
                num_collectors=2,
                sync=sync,
                tensorpipe_options={"num_worker_threads": 4},
            ) as c:
                pids = _ours(c.node_pids())
                batches = await _check_weights_and_budget(c, policy, sync=sync, nodes=2, fpb=32, total=192)
                check_remote_split(c, members=2)
        if sync:
            assert [tuple(b.batch_size) for b in batches] == [(2, 16)] * 6
            _traj_ids_disjoint(
                batches,
                lambda b: [(n, int(t)) for n in range(2) for t in b["collector", "traj_ids"][n].unique()],
            )
        assert _alive(pids) == []


def test_rpc_rejects_bad_tensorpipe_options():
    with pytest.raises(TypeError, match="tensorpipe_options"):
        RPCCollector(pendulum, frames_per_batch=8, num_collectors=1, tensorpipe_options={"no_such": 1})
    with pytest.raises(ValueError, match="mpi"):
        DistributedCollector(pendulum, frames_per_batch=8, num_collectors=1, backend="mpi")
    with pytest.raises(ValueError, match="exclude"):
        DistributedCollector(
            pendulum,
            ConstantPolicy(),
            frames_per_batch=8,
            num_collectors=1,
            update_at_each_batch=True,
            max_weight_update_interval=2,
        )


async def test_submitit_local_executor_jobs(tmp_path):
    pytest.importorskip("submitit")
    policy = ConstantPolicy(0.0)
    with anyio.fail_after(90):
        async with DistributedCollector(
            pendulum,
            policy,
            frames_per_batch=32,
            total_frames=32 * 6,
            num_collectors=2,
            launcher="submitit",
            slurm_kwargs={"folder": str(tmp_path / "%j"), "cluster": "local", "timeout_min": 5},
        ) as c:
            # the submitted pickles carry the control token (and the policy): 0600 in 0700 folders
            assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o700
            pickles = list(tmp_path.rglob("*_submitted.pkl"))
            assert len(pickles) == 2
            assert {stat.S_IMODE(p.stat().st_mode) for p in pickles} == {0o600}
            assert {stat.S_IMODE(p.parent.stat().st_mode) for p in pickles} == {0o700}
            jobs = [n.process for n in c._nodes.nodes]
            job_pids = {j.pid for j in jobs}
            pids = _ours(job_pids)
            batches = await _check_weights_and_budget(c, policy, sync=False, nodes=2, fpb=32, total=192)
    assert len(batches) == 6
    assert all(j.exitcode == 0 for j in jobs)
    assert _alive(pids) == []


def _delayed_main() -> int:
    async def run() -> int:
        frames = 0
        async with DistributedCollector(
            pendulum, frames_per_batch=16, total_frames=64, num_collectors=2, launcher="submitit_delayed"
        ) as c:
            async for batch in c:
                frames += batch.numel()
        return frames

    return anyio.run(run)


def test_submitit_delayed_launcher(tmp_path):
    """The login-node decorator submits the trainer's job and two node jobs; they meet through the
    rendezvous file (no node name is parsed)."""
    pytest.importorskip("submitit")
    launch = submitit_delayed_launcher(
        2,
        folder=str(tmp_path / "%j"),
        cluster="local",
        main_parameters={"timeout_min": 5},
        node_parameters={"timeout_min": 5},
        node_timeout=120,
    )(_delayed_main)
    assert launch() == 64


def pendulum_pair():
    return GymEnv("Pendulum-v1", num_envs=2)


async def test_state_dict_loads_with_torch_load_weights_only(tmp_path):
    """A checkpoint saved as the docs say loads with torch.load's default (weights only)."""
    with anyio.fail_after(90):
        async with DistributedCollector(
            pendulum_pair,
            ConstantPolicy(0.5),
            frames_per_batch=16,
            total_frames=-1,
            num_collectors=2,
            collector_kwargs={"max_frames_per_traj": 3},  # episodes end: trajectory ids advance
        ) as c:
            async for _ in c:
                if c.statistics().frames >= 32:
                    break
            torch.save(await c.state_dict(), tmp_path / "collector.pt")
            loaded = torch.load(tmp_path / "collector.pt", weights_only=True)
            await c.load_state_dict(loaded)
            assert (await c.__anext__()).numel() == 16
