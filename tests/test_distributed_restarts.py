"""Restarts on the torch.distributed and RPC nodes (``-m distributed``): the envs a node's collector
restarts are seen by the trainer (events, ``statistics().restarts``, per node), and a node process that
dies under a restart policy still ends the run with ``WorkerDiedError``, saying why it is not replaced."""

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

from aiocollect import (
    DistributedCollector,
    DistributedSyncCollector,
    GymEnv,
    RayCollector,
    Restarted,
    RestartPolicy,
    RPCCollector,
    WorkerDiedError,
)
from support import ConstantPolicy, fd_count, pendulum
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


class CrashesAt(gym.Wrapper):
    """Raises at its ``at``-th step (every env built does: a restart meets it again ``at`` steps on)."""

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
    complete, and its restarts are events (worker: the node), counted per node and in all."""
    if anyio_backend == "trio" and kind != "gloo":
        pytest.skip("one engine under trio is enough: the counting is the engine's, not the loop's")
    cls = CLASSES[kind]
    events: list[Restarted] = []
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
                    while (event := stream.receive_nowait()) is not None:
                        if isinstance(event, Restarted):
                            events.append(event)
            stats = c.statistics()
    assert stats.frames == 640
    assert events, "no Restarted event reached the trainer"
    assert {e.worker for e in events} == {1}
    assert all(e.env == 0 and e.cause.startswith("ZeroDivisionError: the simulator") for e in events)
    assert stats.restarts == len(events) == stats.workers[1].restarts
    assert stats.workers[0].restarts == 0
    assert _alive(pids) == []


async def test_a_killed_node_under_a_policy_ends_the_run_saying_why(warm_forkserver, anyio_backend):
    """torch.distributed cannot take a new rank into a live process group: a node killed under a restart
    policy ends the run with ``WorkerDiedError`` as without one, a note saying it is not replaced; nothing
    of it is left (processes, fds, listening sockets)."""
    before = (fd_count(), _listening())
    with anyio.fail_after(90):
        async with DistributedCollector(
            [pendulum, pendulum],
            frames_per_batch=32,
            total_frames=-1,
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
    assert "not replaced" in "".join(getattr(info.value, "__notes__", []))
    assert seen - killed < 5
    assert _alive(pids) == []
    assert await anyio.to_thread.run_sync(_settled, before) == before


@pytest.mark.parametrize("cls", [DistributedCollector, DistributedSyncCollector, RPCCollector, RayCollector])
def test_restart_must_be_a_policy(cls):
    with pytest.raises(TypeError, match="restart must be a RestartPolicy or None"):
        cls([pendulum], frames_per_batch=8, num_collectors=1, restart=3)
