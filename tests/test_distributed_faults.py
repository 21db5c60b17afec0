"""Faults of the remote collectors (torch.distributed, RPC): a consumer cancelled mid-batch, dead nodes.

Run with ``pytest -m distributed`` (``nox -s distributed``); the default run leaves them out.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

import anyio
import cloudpickle
import psutil
import pytest
import torch.distributed as dist

from aiocollect import (
    DistributedCollector,
    DistributedSyncCollector,
    GymEnv,
    MultiSyncCollector,
    RPCCollector,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)
from aiocollect._remote import _launchers, _nodes
from aiocollect._remote._processes import ExternalNode
from aiocollect._transport._store import StoreServer
from aiocollect._transport._wire import encode
from aiocollect._weightsync import _distributed as _distributed_weights
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


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request) -> str:
    return request.param


class _Slow:
    """Pendulum that takes 5 ms a step: a batch of 32 takes 0.16 s, long enough to be cancelled in."""

    def __init__(self) -> None:
        self.env = GymEnv("Pendulum-v1")

    def __getattr__(self, name):
        return getattr(self.env, name)

    def step(self, td):
        time.sleep(0.005)
        return self.env.step(td)


def slow():
    return _Slow()


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
async def test_consumer_cancelled_mid_batch_then_used_again_and_closed(sync, timing):
    """A consumer cancelled while the nodes collect leaves the collector usable: the late batches are
    taken off the wire (or the nodes would block in their sends), the next batch comes, and leaving
    ``async with`` is prompt."""
    cls = DistributedSyncCollector if sync else DistributedCollector
    with anyio.fail_after(90):
        async with cls([slow, slow], frames_per_batch=64, total_frames=-1) as c:
            pids = _tree(c.node_pids())
            for _ in range(3):
                with anyio.move_on_after(0.05) as scope:
                    await c.__anext__()
                assert scope.cancelled_caught
            with anyio.fail_after(30):  # before the fix: no batch ever came (120 s gloo timeout)
                batch = await c.__anext__()
                assert batch.numel() == 64
                batch = await c.__anext__()
            start = time.monotonic()
        closed_in = time.monotonic() - start
    timing.bound(closed_in, 10, "leaving `async with`")
    assert _alive(pids) == []


async def _until_error(c) -> tuple[BaseException, float]:
    """Iterate until the collector raises; the error and when (``time.monotonic()``) it came."""
    with pytest.raises(Exception) as info:  # the type is checked by the caller
        async for _ in c:
            pass
    return info.value, time.monotonic()


ENGINES = {
    "distributed": (DistributedCollector, "torch.distributed"),
    "rpc": (RPCCollector, "torch.distributed.rpc"),
}


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("engine", list(ENGINES))
async def test_a_killed_node_is_worker_died_error_whatever_the_engine(engine, how, warm_forkserver, timing):
    cls, name = ENGINES[engine]
    before = _resources()
    with anyio.fail_after(90):
        async with cls([pendulum, slow], frames_per_batch=32, total_frames=-1) as c:
            pids = _tree(c.node_pids())
            await c.__anext__()
            os.kill(c.node_pids()[1], how)
            killed = time.monotonic()
            error, seen = await _until_error(c)
    assert isinstance(error, WorkerDiedError), repr(error)
    assert (error.index, error.rank, error.engine, error.signal) == (1, 2, name, int(how))
    assert "node 1" in str(error)
    timing.bound(seen - killed, 5, "the fault to surface")
    assert _alive(pids) == []
    _assert_released(before, engine)


def _assert_released(before: tuple[int, list[tuple[str, int]], int], engine: str) -> None:
    """No fd, listening socket or torch pool thread more than ``before`` (RPC: but what torch keeps of
    the first agent of the process, if this test ran the first)."""
    fds, listening, pool = _settled(before)
    slack = (2, 4) if engine == "rpc" else (0, 0)
    assert fds <= before[0] + slack[0] and listening == before[1] and pool <= before[2] + slack[1], (
        f"before: {before}, after: {(fds, listening, pool)}"
    )


class _ExplodingPolicy(ConstantPolicy):
    """Raises at its 30th call, in the node."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.calls = 0

    def forward(self, observation):
        self.calls += 1
        if self.calls >= 30:
            raise ArithmeticError("the policy exploded")
        return super().forward(observation)


class _ExplodingEnv(_Slow):
    """Raises at its 30th step, in the node."""

    steps = 0

    def step(self, td):
        self.steps += 1
        if self.steps >= 30:
            raise FloatingPointError("the env exploded")
        return self.env.step(td)


def exploding():
    return _ExplodingEnv()


@pytest.mark.parametrize("what", ["env", "policy"])
@pytest.mark.parametrize("engine", list(ENGINES))
async def test_env_and_policy_errors_keep_their_type_under_both_backends(engine, what, anyio_backend):
    if (anyio_backend, what) == ("asyncio", "env"):
        pytest.skip("test_distributed.py covers an env error under asyncio")
    cls, _ = ENGINES[engine]
    env_fns, policy, error = (
        ([pendulum, exploding], None, FloatingPointError)
        if what == "env"
        else ([pendulum, pendulum], _ExplodingPolicy(), ArithmeticError)
    )
    with anyio.fail_after(90):
        async with cls(env_fns, policy, frames_per_batch=16, total_frames=-1) as c:
            pids = _tree(c.node_pids())
            raised, _ = await _until_error(c)
    assert type(raised) is error and f"the {what} exploded" in str(raised), repr(raised)
    assert "raised in node" in "".join(getattr(raised, "__notes__", []))
    assert _alive(pids) == []


@pytest.mark.parametrize("engine", list(ENGINES))
async def test_update_weights_to_a_dead_node_is_worker_died_error_at_once(engine, warm_forkserver, timing):
    cls, _ = ENGINES[engine]
    before = _resources()
    with anyio.fail_after(90):
        async with cls([pendulum, pendulum], ConstantPolicy(), frames_per_batch=16, total_frames=-1) as c:
            pids = _tree(c.node_pids())
            await c.__anext__()
            await c.update_weights(wait=True)
            os.kill(c.node_pids()[1], signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(WorkerDiedError, match="node 1") as info:
                await c.update_weights(ConstantPolicy(1.0), wait=True)
            took = time.monotonic() - killed
    assert info.value.signal == signal.SIGKILL
    timing.bound(took, 5, "update_weights to fail")
    assert _alive(pids) == []
    _assert_released(before, engine)


@pytest.mark.parametrize("engine", list(ENGINES))
async def test_a_killed_worker_inside_a_node_keeps_its_type_and_exit_code(engine):
    cls, _ = ENGINES[engine]
    with anyio.fail_after(90):
        async with cls(
            [pendulum, slow],
            frames_per_batch=32,
            total_frames=-1,
            collector_class=MultiSyncCollector,
            num_workers_per_collector=2,
        ) as c:
            pids = _tree(c.node_pids())
            await c.__anext__()
            node = psutil.Process(c.node_pids()[1])
            workers = [w for child in node.children() for w in child.children()]
            assert workers, "the node's worker processes (children of its forkserver)"
            workers[0].send_signal(signal.SIGKILL)
            error, _ = await _until_error(c)
    assert isinstance(error, WorkerDiedError), repr(error)
    assert error.exitcode == -9 and error.signal == 9
    assert "raised in node 1" in "".join(getattr(error, "__notes__", []))
    assert _alive(pids) == []


def _listening(pid: int) -> list[tuple[str, int]]:
    return [
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]


@pytest.mark.parametrize("engine", list(ENGINES))
async def test_nothing_of_the_trainer_listens_on_a_wildcard_address(engine):
    """Local nodes reach the trainer on 127.0.0.1: its control port, data and weights stores and its gloo
    pairs listen there, not on every interface (torch's TCPStore would)."""
    cls, _ = ENGINES[engine]
    with anyio.fail_after(90):
        async with cls([pendulum, pendulum], ConstantPolicy(), frames_per_batch=32, total_frames=-1) as c:
            await c.__anext__()
            await c.update_weights()
            listening = _listening(os.getpid())
    assert len(listening) >= 2  # the control port and the data store at least
    wild = [(ip, port) for ip, port in listening if ip in ("0.0.0.0", "::", "")]
    assert wild == [], f"listening on a wildcard address: {wild} (all: {listening})"


def _torch_client(port: int, achieved: list[str]) -> None:
    """torch's own store client, as one attacks a TCPStore."""
    try:
        rogue = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=1))
    except Exception:
        return
    for key in ("abort", "go", "0/1"):  # pragma: no cover - the failure this test is for
        rogue.set(key, "1")
        achieved.append(f"TCPStore client set {key!r}")


def _rogue(port: int, held: list[Any]) -> list[str]:
    """A local client without the token: sets a rendezvous' abort key and a rank's address, and leaves a
    connection open that never authenticates; what it achieved (``held``: what to close or join)."""
    achieved: list[str] = []
    thread = threading.Thread(target=_torch_client, args=(port, achieved))  # blocks: the store says nothing
    thread.start()
    held.append(thread)
    for key, value in [(b"abort", b"1"), (b"go", b"1"), (b"0/1", b"garbage")]:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            request = b"\x01\x00\x00\x00\x02" + struct.pack("!I", len(key)) + key
            sock.sendall(b"AIOSTOR1" + os.urandom(16) + request + struct.pack("!I", len(value)) + value)
            with contextlib.suppress(OSError):
                if sock.recv(64):  # pragma: no cover - the failure this test is for
                    achieved.append(f"set {key!r}")
    held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
    return achieved


@pytest.mark.parametrize("engine", list(ENGINES))
async def test_a_local_client_without_the_token_cannot_disturb_the_rendezvous(
    engine, monkeypatch, anyio_backend
):
    """Each store of the collector (data, weights; RPC's) is attacked the moment it listens, before the
    nodes know its address, and a connection that never authenticates stays open through the rendezvous:
    the collector starts, and batches and weights flow (a TCPStore took the keys: the abort key failed the
    start, a forged address stalled gloo's rendezvous)."""
    if anyio_backend != "trio":
        pytest.skip("one backend is enough: the stores run in threads of their own")
    results: list[list[str]] = []
    held: list[Any] = []

    class Attacked(StoreServer):
        def __init__(self, host: str, port: int = 0) -> None:
            super().__init__(host, port)
            results.append(_rogue(self.address.port, held))

    for module in (_nodes, _distributed_weights):  # the collectors' store, the weights' store
        monkeypatch.setattr(module, "StoreServer", Attacked)
    cls, _ = ENGINES[engine]
    try:
        with anyio.fail_after(90):
            async with cls([pendulum, pendulum], ConstantPolicy(), frames_per_batch=32, total_frames=-1) as c:
                await c.__anext__()
                await c.update_weights(ConstantPolicy(0.5), wait=True)
                for _ in range(4):  # a batch collected ahead may still have the old weights
                    batch = await c.__anext__()
                    if (batch["action"] == 0.5).all():
                        break
                assert (batch["action"] == 0.5).all()
    finally:
        for item in held:
            item.join() if isinstance(item, threading.Thread) else item.close()
    assert len(results) == (2 if engine == "distributed" else 1) and results == [[]] * len(results)


def _settled(expected: Any, seconds: float = 5.0) -> Any:
    """:func:`_resources` once they equal ``expected``, or after ``seconds``."""
    deadline = time.monotonic() + seconds
    while (now := _resources()) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


def _resources() -> tuple[int, list[tuple[str, int]], int]:
    """Open fds, listening sockets and torch's native pool threads of this process."""
    pool = 0
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as comm:
            pool += comm.read().strip() == "pt_thread_pool"
    return fd_count(), _listening(os.getpid()), pool


@pytest.mark.parametrize("engine", list(ENGINES))
async def test_nothing_of_a_collector_remains_after_async_with(engine, warm_forkserver, anyio_backend):
    """No fd, listening socket, thread pool or process is left once ``async with`` is over (a TCPStore, the
    nodes' sentinel pipes and RPC's transport stayed open for the life of the process). torch keeps the
    first RPC agent of a process for good (its RRef context holds it): the first collector runs before the
    baseline, and what that one leaves is bounded below."""
    if anyio_backend != "asyncio":
        pytest.skip("one backend is enough: what a collector holds does not depend on it")
    cls, _ = ENGINES[engine]

    async def run_with(cls: type) -> set[int]:
        with anyio.fail_after(90):
            async with cls([pendulum, pendulum], ConstantPolicy(), frames_per_batch=32, total_frames=-1) as c:
                pids = _tree(c.node_pids())
                await c.__anext__()
                await c.update_weights(wait=True)
                await c.state_dict()
                await c.__anext__()
        return pids

    if engine == "rpc":  # the processes and pipes a first collector starts for good (the forkserver)
        await run_with(DistributedCollector)
    first = _resources()
    pids = await run_with(cls)

    assert _alive(pids) == []
    after = await anyio.to_thread.run_sync(_settled, first)
    if engine == "rpc":  # what torch keeps of the first RPC agent: the trainer's has 4 threads, TCP only
        assert after[0] - first[0] <= 2 and after[1] == first[1] and after[2] - first[2] <= 4
        first = after
        pids = await run_with(cls)
        assert _alive(pids) == []
    assert await anyio.to_thread.run_sync(_settled, first) == first


class _Hanging:
    """Pendulum that hangs (60 s) at its 40th step, in the node."""

    def __init__(self) -> None:
        self.env = GymEnv("Pendulum-v1")
        self.steps = 0

    def __getattr__(self, name):
        return getattr(self.env, name)

    def step(self, td):
        self.steps += 1
        if self.steps == 40:
            time.sleep(60)
        return self.env.step(td)


def hanging():
    return _Hanging()


@pytest.mark.parametrize("engine", list(ENGINES))
async def test_a_hung_node_is_a_timeout_naming_it_and_leaving_is_prompt(engine, timing):
    cls, _ = ENGINES[engine]
    with anyio.fail_after(90):
        with pytest.raises(WorkerTimeoutError, match=r"node 1 .*progress_timeout=3 s") as info:
            async with cls(
                [pendulum, hanging], frames_per_batch=16, total_frames=-1, progress_timeout=3
            ) as c:
                pids = _tree(c.node_pids())
                try:
                    async for _ in c:
                        pass
                finally:
                    leaving = time.monotonic()
        left_in = time.monotonic() - leaving
    assert "a hung env or policy" in str(info.value)
    timing.bound(left_in, 8, "leaving `async with`")
    assert _alive(pids) == []


@pytest.mark.parametrize("limit", ["progress_timeout", "worker_timeout"])
async def test_a_hung_multi_worker_node_leaves_no_process(limit, anyio_backend, timing):
    """Both workers of node 1 hang in ``env.step``: after the timeout, every process of the collector (nodes,
    their forkservers and workers) is gone by the time ``async with`` is left (a node's forkserver took 3-5
    s to shut down, and outlived a killed node)."""
    if (anyio_backend, limit) not in [("asyncio", "progress_timeout"), ("trio", "worker_timeout")]:
        pytest.skip("one backend per timeout: starting 2 nodes of 2 workers each takes a while")
    kwargs: dict[str, Any] = (
        {"progress_timeout": 3}
        if limit == "progress_timeout"
        else {"progress_timeout": None, "collector_kwargs": {"worker_timeout": 2}}
    )
    with anyio.fail_after(90):
        with pytest.raises(WorkerTimeoutError):
            async with DistributedSyncCollector(
                [pendulum, hanging],
                frames_per_batch=32,
                total_frames=-1,
                collector_class=MultiSyncCollector,
                num_workers_per_collector=2,
                **kwargs,
            ) as c:
                await c.__anext__()
                pids = _tree(c.node_pids())
                assert len(pids) >= 8  # 2 nodes, each with a forkserver and 2 workers
                try:
                    async for _ in c:
                        pass
                finally:
                    leaving = time.monotonic()
        left = time.monotonic()
    timing.bound(left - leaving, 5, "leaving `async with`")
    assert _alive(pids, 0.5) == [], "processes left after `async with`"


_FAILED_START = """
import time, anyio, torch
from aiocollect import {cls}, GymEnv

def pendulum():
    return GymEnv("Pendulum-v1")

def broken():
    raise KeyError("no such env")

async def main():
    try:
        async with {cls}([pendulum, broken], torch.nn.Linear(3, 1), frames_per_batch=16) as c:
            raise SystemExit("started")
    except KeyError as exc:
        print("raised", type(exc).__name__, flush=True)

if __name__ == "__main__":
    anyio.run(main)
    print("main returned", time.monotonic(), flush=True)
"""


@pytest.mark.parametrize("engine", list(ENGINES))
def test_the_trainer_exits_at_once_after_a_failed_start(engine, tmp_path, anyio_backend, timing):
    """A node fails while the others join the data and weight groups: the error is raised, and the
    process exits at once, not after torch's rendezvous timeout (an abandoned rendezvous thread held it)."""
    if anyio_backend != "asyncio":
        pytest.skip("one backend is enough: the script runs its own event loop")
    script = tmp_path / "failed_start.py"
    script.write_text(_FAILED_START.format(cls=ENGINES[engine][0].__name__))
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=150, env=dict(os.environ)
    )
    ended = time.monotonic()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "raised KeyError" in proc.stdout
    returned = float(proc.stdout.split("main returned")[1].split()[0])
    timing.bound(ended - returned, 10, "the exit after main returned")


class _RogueLauncher(_launchers.Launcher):
    """Node 0 is a real node; node 1 is a local process that has the token (it connects and says hello as
    rank 2) and then breaks the protocol as ``how`` says."""

    local = True

    def __init__(self, how: str) -> None:
        self.how = how
        self.started: list[Any] = []

    async def launch(self, address: Any, ranks: list[int]) -> dict[int, Any]:
        nodes = await _launchers.MPLauncher().launch(address, ranks[:-1])
        self.started = [node.pid for node in nodes.values()]
        thread = threading.Thread(target=self._rogue, args=(address, ranks[-1]), daemon=True)
        thread.start()
        self.started.append(thread)
        nodes[ranks[-1]] = ExternalNode()
        return nodes

    def _rogue(self, address: Any, rank: int) -> None:
        with _launchers.connect(address, rank) as sock:
            if self.how == "hangs_up":
                return
            if self.how == "garbage":  # a frame that does not unpickle
                sock.sendall(struct.pack("!Q", 5) + b"\x80\x05junk")
            elif self.how == "unexpected":  # a valid pickle that is no message of the protocol
                sock.sendall(encode(12345))
            sock.settimeout(30)
            with contextlib.suppress(OSError):
                while sock.recv(1 << 16):  # until the trainer closes it
                    pass


@pytest.mark.parametrize("how", ["garbage", "unexpected", "hangs_up"])
@pytest.mark.parametrize("engine", list(ENGINES))
async def test_a_rogue_node_is_one_error_naming_it(engine, how, anyio_backend):
    """A process with the token that breaks the control protocol (a frame that does not unpickle, an object
    that is no message) or hangs up is one error of the vocabulary naming the node, not an ExceptionGroup
    of the collector's tasks, and the real node is stopped."""
    if (anyio_backend, how) == ("trio", "hangs_up"):
        pytest.skip("one backend is enough for a hang-up (the other faults tests cover EOF)")
    cls, name = ENGINES[engine]
    launcher = _RogueLauncher(how)
    with anyio.fail_after(90):
        with pytest.raises(Exception) as info:
            async with cls([pendulum, pendulum], frames_per_batch=16, total_frames=-1, launcher=launcher):
                pass
    error = info.value
    expected = WorkerDiedError if how == "hangs_up" else WorkerError
    assert type(error) is expected, repr(error)
    assert "node 1" in str(error) and name in str(error), str(error)
    if how != "hangs_up":
        assert "broke the control protocol" in str(error)
    pid, thread = launcher.started
    thread.join(30)
    assert not thread.is_alive()
    assert _alive({pid}) == []


@pytest.mark.parametrize("engine", list(ENGINES))
async def test_leaving_with_a_stopped_node_kills_it_within_2_s(engine, anyio_backend, timing):
    """A node that hangs (SIGSTOP: it answers nothing, not even ``Close``) before progress_timeout: leaving
    ``async with`` gives it 2 s whatever worker_timeout, then kills it (it took 15 s + 2 s)."""
    if (anyio_backend, engine) == ("trio", "rpc"):
        pytest.skip("one backend is enough for RPC: the grace is the trainer's, not the engine's")
    cls, _ = ENGINES[engine]
    with anyio.fail_after(90):
        async with cls(
            [pendulum, pendulum],
            frames_per_batch=16,
            total_frames=-1,
            collector_kwargs={"worker_timeout": 60},
        ) as c:
            await c.__anext__()
            pids = _tree(c.node_pids())
            os.kill(c.node_pids()[1], signal.SIGSTOP)
            leaving = time.monotonic()
        left_in = time.monotonic() - leaving
    assert _alive(pids) == []
    timing.bound(left_in, 2 + 2, "leaving `async with`")
