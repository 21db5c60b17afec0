"""The fault matrix: every fault, for every collector, ends in a precise exception, promptly, with no
process, thread, fd or shared-memory segment left behind.

Collectors: ``Collector`` (in process), ``ProcessCollector``, ``MultiSyncCollector`` and
``MultiAsyncCollector`` (``worker_backend="process"``; the multi ones also
``worker_backend="serial"``). The multi collectors run a healthy worker beside the faulty one, so the
test also sees the other worker stopped.

Each cell's verdict is what happened: the exception's type, text and traceback, which worker, its exit
code, the collector closed for good, nothing left behind. Each cell also measures the time from the fault
(the env or policy raising, a signal sent, a hang starting plus ``worker_timeout``) to the exception
leaving ``async with`` (so the workers are already reaped): a speed figure, checked against ``BOUND``
seconds only by the cell's ``timed`` instance (marked ``timing``: ``nox -s timing`` runs them alone).
``AIOCOLLECT_FAULT_REPORT=path.json`` writes the measured times there.

Backends: each cell runs under asyncio, asyncio+uvloop and trio; CI's three runs of the suite
(``--loop-tier``) run each cell under one of them, a different one each, so that every collector and every
fault meets every backend.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import gymnasium as gym
import numpy as np
import psutil
import pytest
import torch

from aiocollect import (
    Collector,
    CollectorClosedError,
    GymEnv,
    MultiAsyncCollector,
    MultiSyncCollector,
    PipeWeightSync,
    ProcessCollector,
    Sink,
    WorkerDiedError,
    WorkerTimeoutError,
)
from support import SETTLE, Leaks, Timing, alive, children, gone, segments, wait_until

pytestmark = pytest.mark.anyio

#: seconds from a fault to the exception leaving ``async with`` (workers reaped by then)
BOUND = 2.0
#: seconds for the workers of a trainer killed with SIGKILL to notice and exit on their own
ORPHAN_BOUND = 5.0

BACKEND_PARAMS = [
    ("asyncio", {"use_uvloop": False}, "asyncio"),
    ("asyncio", {"use_uvloop": True}, "uvloop"),
    ("trio", {}, "trio"),
]

KINDS = ["collector", "process", "sync", "async", "sync-serial", "async-serial"]
PROCESS_KINDS = ["process", "sync", "async"]
MULTI = {"sync", "async", "sync-serial", "async-serial"}

#: measured fault-to-error times (and the backpressure figures), written to $AIOCOLLECT_FAULT_REPORT
TIMES: dict[str, float] = {}
FIGURES: dict[str, Any] = {}


def matrix(kinds: list[str]) -> pytest.MarkDecorator:
    """Parametrize ``kind`` x ``anyio_backend`` (``--loop-tier`` keeps one backend per cell)."""
    params = [
        pytest.param(kind, (name, options), id=f"{kind}-{label}")
        for kind in kinds
        for name, options, label in BACKEND_PARAMS
    ]
    return pytest.mark.parametrize(("kind", "anyio_backend"), params)


def record(request: pytest.FixtureRequest, timing: Timing, seconds: float, bound: float = BOUND) -> None:
    """The cell's time from the fault to the exception (a speed figure, bounded by ``timing``)."""
    TIMES[request.node.name] = round(seconds, 3)
    timing.bound(seconds, bound, "from the fault to the exception")


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    path = os.environ.get("AIOCOLLECT_FAULT_REPORT")
    if path:
        Path(path).write_text(json.dumps({"times": TIMES, "figures": FIGURES}, indent=1, sort_keys=True))


# -- envs, policies, factories -----------------------------------------------------------------------
class FaultError(Exception):
    """Raised by the faulty env and policy; ``at`` is when (``time.monotonic``, the same clock in every
    process), kept through pickling."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.at = time.monotonic()


def _env_step_fault() -> None:
    raise FaultError("env step failed")


def _env_reset_fault() -> None:
    raise FaultError("env reset failed")


def _policy_fault() -> None:
    raise FaultError("policy failed")


#: set by a test to end a hang in this process (a worker process never sees it set: it is killed)
RELEASE = threading.Event()


class FaultyEnv(gym.Env):
    """Episodes of 4 steps. Raises at reset number ``fail_reset_at`` (1 is the collector's first, at
    start-up) or step ``fail_step_at``; hangs at step ``hang_at`` (writing the time it starts to
    ``hang_file``); sleeps ``delay`` per step; holds each step while the file ``gate`` exists (after writing
    ``gate`` + ".held"); writes its pid to ``pid_file`` when built."""

    observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(
        self,
        fail_reset_at: int | None = None,
        fail_step_at: int | None = None,
        hang_at: int | None = None,
        hang_file: str | None = None,
        delay: float = 0.0,
        gate: str | None = None,
    ) -> None:
        self.fail_reset_at = fail_reset_at
        self.fail_step_at = fail_step_at
        self.hang_at = hang_at
        self.hang_file = hang_file
        self.delay = delay
        self.gate = gate
        self.t = 0
        self.resets = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.resets += 1
        if self.fail_reset_at is not None and self.resets >= self.fail_reset_at:
            _env_reset_fault()
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.t += 1
        if self.fail_step_at is not None and self.t >= self.fail_step_at:
            _env_step_fault()
        if self.hang_at is not None and self.t == self.hang_at:
            if self.hang_file is not None:
                Path(self.hang_file).write_text(repr(time.monotonic()))
            RELEASE.wait(60)
        if self.delay:
            time.sleep(self.delay)
        if self.gate is not None and os.path.exists(self.gate):
            Path(self.gate + ".held").touch()
            while os.path.exists(self.gate):  # the test removes it: no event crosses the process
                time.sleep(0.002)
        return np.full(2, self.t % 4 / 4, np.float32), 1.0, self.t % 4 == 0, False, {}


def make_env(pid_file: str | None = None, start_delay: float = 0.0, **kwargs: Any) -> GymEnv:
    if pid_file is not None:
        Path(pid_file).write_text(str(os.getpid()))
    if start_delay:
        time.sleep(start_delay)
    return GymEnv(FaultyEnv(**kwargs))


def healthy() -> GymEnv:
    return GymEnv(FaultyEnv())


def broken_factory() -> GymEnv:
    raise FaultError("env factory failed")


class FaultyPolicy(torch.nn.Module):
    """Action 0; raises at call ``fail_at`` (call 1 is the dry call at construction or worker start)."""

    def __init__(self, fail_at: int | None = None, size: int = 0) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.padding = torch.nn.Parameter(torch.zeros(size))  # large weights fill a socket
        self.fail_at = fail_at
        self.calls = 0

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            _policy_fault()
        return torch.zeros(observation.shape[:-1], dtype=torch.int64) + self.weight.detach().long()


def build(
    kind: str, faulty: Callable[[], Any], policy: Any = None, *, other: Any = healthy, **kwargs: Any
) -> Any:
    """``kind``'s collector, with ``faulty`` as the only env (or beside a worker of ``other``)."""
    kwargs.setdefault("frames_per_batch", 20 if kind.startswith("sync") else 10)
    if kind == "collector":
        return Collector(faulty, policy, **kwargs)
    if kind == "process":
        return ProcessCollector(faulty, policy, **kwargs)
    cls = MultiSyncCollector if kind.startswith("sync") else MultiAsyncCollector
    backend = "serial" if kind.endswith("serial") else "process"
    return cls([other, faulty], policy, worker_backend=backend, **kwargs)


async def assert_closed_for_good(collector: Any, why: str) -> None:
    """The collector says it is closed (and why) on any further use."""
    assert collector.closed
    with pytest.raises(CollectorClosedError, match=why):
        await collector.__anext__()
    with pytest.raises(CollectorClosedError):
        async for _ in collector:
            pass
    with pytest.raises(CollectorClosedError):
        await collector.update_weights()
    with pytest.raises(CollectorClosedError):
        async with collector:
            pass


# -- errors raised by the env, the policy or the env factory ------------------------------------------
#: (what fails, where: start-up or mid-collection, the function in the traceback)
ERRORS = {
    "reset-at-start": (dict(fail_reset_at=1), None, "_env_reset_fault"),
    "reset-mid": (dict(fail_reset_at=8), None, "_env_reset_fault"),  # reset 8 is at step 28
    "step-mid": (dict(fail_step_at=25), None, "_env_step_fault"),
    "policy-at-start": ({}, 1, "_policy_fault"),
    "policy-mid": ({}, 25, "_policy_fault"),
    "factory": (None, None, "broken_factory"),
}


@pytest.mark.parametrize("fault", list(ERRORS))
@matrix(KINDS)
async def test_env_policy_and_factory_errors(request, leaks, timing, kind, fault):
    env_kwargs, policy_fail_at, function = ERRORS[fault]
    factory = broken_factory if env_kwargs is None else functools.partial(make_env, **env_kwargs)
    policy = FaultyPolicy(policy_fail_at)
    at_start = fault.endswith("at-start") or fault == "factory"
    batches = 0
    collector = None
    with anyio.fail_after(60), pytest.raises(FaultError) as info:
        # the in-process Collector builds its env and calls its policy once in the constructor
        collector = build(kind, factory, policy)
        async with collector:
            async for _ in collector:
                batches += 1
    caught = time.monotonic()
    error = info.value
    assert type(error) is FaultError  # the original type, never wrapped in a group or another type
    text = "".join(traceback.format_exception(error))
    assert function in text, text
    if kind != "collector":
        assert "raised in worker" in text and "worker traceback" in text, text
    assert (batches == 0) if at_start else (batches >= 1), batches
    record(request, timing, caught - error.at)
    if collector is not None:
        await assert_closed_for_good(collector, "FaultError")
    leaks.check()


@matrix(["process", "sync", "async", "sync-serial", "async-serial"])
async def test_unpicklable_factory_raises_before_any_process(leaks, kind):
    lock = threading.Lock()  # a closure over a lock does not pickle

    def unpicklable() -> GymEnv:
        assert lock is not None
        return healthy()

    with pytest.raises(TypeError, match=r"cannot be pickled"):
        build(kind, unpicklable)
    assert children() == []
    leaks.check()


@matrix(KINDS)
async def test_failure_closes_the_collector_at_once(leaks, kind):
    """Caught inside ``async with``: the collector is closed from then on, and says why."""
    collector = build(kind, functools.partial(make_env, fail_step_at=15))
    async with collector:
        with anyio.fail_after(60), pytest.raises(FaultError):
            async for _ in collector:
                pass
        await assert_closed_for_good(collector, "FaultError")
    await assert_closed_for_good(collector, "FaultError")
    leaks.check()


# -- a worker process killed -------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
@matrix(PROCESS_KINDS)
async def test_worker_killed_mid_collection(request, leaks, timing, kind, sig):
    collector = build(kind, functools.partial(make_env, delay=0.002))
    killed = 0.0
    with anyio.fail_after(60), pytest.raises(WorkerDiedError) as info:
        async with collector:
            async for _ in collector:
                if not killed:
                    pid = collector._pool.workers[-1].process.pid  # the faulty one
                    killed = time.monotonic()
                    os.kill(pid, sig)
    caught = time.monotonic()
    assert info.value.exitcode == -sig
    assert f"signal {int(sig)}" in str(info.value)
    assert info.value.index == collector.num_workers - 1
    record(request, timing, caught - killed)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    await assert_closed_for_good(collector, "WorkerDiedError")
    leaks.check()


@matrix(PROCESS_KINDS)
async def test_worker_killed_while_the_trainer_is_busy(request, leaks, timing, kind):
    """Killed while the event loop runs a (blocking) training step: the next call sends to a dead worker
    before its reader has seen the end of its socket, and must still raise why, not BrokenPipeError."""
    collector = build(kind, functools.partial(make_env, delay=0.002))
    async with collector:
        await collector.__anext__()
        pid = collector._pool.workers[-1].process.pid
        os.kill(pid, signal.SIGKILL)
        # the trainer's step holds the loop until the worker is dead (a zombie: not reaped yet)
        deadline = time.monotonic() + 30  # only stops a hang
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.01)  # noqa: ASYNC251 - the blocked loop is the behaviour under test
        assert not alive(pid)
        stepped = time.monotonic()
        with anyio.fail_after(60), pytest.raises(WorkerDiedError) as info:
            while True:
                await collector.__anext__()
        caught = time.monotonic()
    assert info.value.exitcode == -signal.SIGKILL
    record(request, timing, caught - stepped)  # from the end of the blocking step
    await assert_closed_for_good(collector, "WorkerDiedError")
    leaks.check()


@matrix(PROCESS_KINDS)
async def test_worker_killed_during_start_up(request, leaks, timing, kind, tmp_path):
    pid_file = tmp_path / "pid"
    collector = build(kind, functools.partial(make_env, pid_file=str(pid_file), start_delay=30))
    killed = 0.0

    async def kill_when_started() -> None:
        nonlocal killed
        while not pid_file.exists() or not pid_file.read_text():  # noqa: ASYNC110 - another process writes it
            await anyio.sleep(0.01)
        killed = time.monotonic()
        os.kill(int(pid_file.read_text()), signal.SIGKILL)

    error = None
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_when_started)
            try:
                async with collector:
                    pytest.fail("started although a worker was killed")
            except WorkerDiedError as exc:
                error = exc
    caught = time.monotonic()
    assert error is not None and error.exitcode == -signal.SIGKILL
    record(request, timing, caught - killed)
    await assert_closed_for_good(collector, "failed to start with WorkerDiedError")
    leaks.check()


@matrix(PROCESS_KINDS)
async def test_start_up_cancelled_promptly(request, leaks, timing, kind, tmp_path):
    """A worker stuck building its env (``worker_timeout`` does not cover start-up: building an env may
    take long). Cancelling ``async with`` terminates it at once: it cannot read the ``Close`` it would
    otherwise be given a grace period to obey."""
    pid_file = tmp_path / "pid"
    factory = functools.partial(make_env, pid_file=str(pid_file), start_delay=60)
    collector = build(kind, factory, worker_timeout=0.5)
    cancelled = 0.0
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:

            async def cancel_when_started() -> None:
                nonlocal cancelled
                # the worker writes its pid in the env factory, then sleeps there for 60 s
                await wait_until(pid_file.exists)
                cancelled = time.monotonic()
                tg.cancel_scope.cancel()

            tg.start_soon(cancel_when_started)
            async with collector:
                pytest.fail("started although a worker is still building its env")
    record(request, timing, time.monotonic() - cancelled)
    await assert_closed_for_good(collector, "closed")
    leaks.check()


# -- a worker hung in env.step: worker_timeout -------------------------------------------------------
@matrix(KINDS)
async def test_hung_step_ends_in_worker_timeout(request, leaks, timing, kind, tmp_path):
    hang_file = tmp_path / "hang"
    timeout = 0.5
    RELEASE.clear()
    factory = functools.partial(make_env, hang_at=25, hang_file=str(hang_file))
    collector = build(kind, factory, worker_timeout=timeout)
    batches = 0
    try:
        with anyio.fail_after(60), pytest.raises(WorkerTimeoutError, match=r"worker_timeout=0\.5") as info:
            async with collector:
                async for _ in collector:
                    batches += 1
        caught = time.monotonic()
    finally:
        RELEASE.set()  # a thread stuck in step cannot be killed: end the hang (for thread workers)
    assert batches >= 1
    assert isinstance(info.value, TimeoutError)
    hung = float(hang_file.read_text())
    record(request, timing, caught - hung - timeout)
    await assert_closed_for_good(collector, "WorkerTimeoutError")
    # a thread (in-process Collector, serial backend) that was stuck ends once the hang does
    leaks.check(wait=5.0 if kind == "collector" or kind.endswith("serial") else 0.0)


# -- the consumer cancelled --------------------------------------------------------------------------
@matrix(KINDS)
async def test_consumer_cancelled_mid_batch_then_continues(request, leaks, timing, kind):
    # each batch takes >= 0.5 s of 10 ms steps: the cancellation lands mid-batch
    slow = functools.partial(make_env, delay=0.01)
    collector = build(kind, slow, other=slow, frames_per_batch=50 * (1 + kind.startswith("sync")))
    async with collector:
        await collector.__anext__()
        for _ in range(10):  # async workers collect ahead: take what they have until a wait starts
            with anyio.move_on_after(0.2) as scope:
                start = time.monotonic()
                await collector.__anext__()
            if scope.cancelled_caught:
                break
        cancelled = time.monotonic() - start - 0.2
        assert scope.cancelled_caught
        record(request, timing, cancelled)
        assert not collector.closed  # a cancelled consumer is not a failure
        with anyio.fail_after(30):
            batch = await collector.__anext__()
        assert batch.numel() == collector.frames_per_batch
    assert collector.closed
    leaks.check()


@matrix(KINDS)
async def test_task_group_cancelled_mid_batch(request, leaks, timing, kind):
    slow = functools.partial(make_env, delay=0.01)
    collector = build(kind, slow, other=slow, frames_per_batch=50 * (1 + kind.startswith("sync")))
    first = anyio.Event()

    async def consume() -> None:
        async with collector:
            async for _ in collector:
                first.set()

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await first.wait()
            await anyio.wait_all_tasks_blocked()  # the consumer waits for the next batch: mid-batch
            cancelled = time.monotonic()
            tg.cancel_scope.cancel()
    record(request, timing, time.monotonic() - cancelled)
    await assert_closed_for_good(collector, "closed")
    leaks.check()


UPDATES = [
    *(
        pytest.param(kind, "shared", id=f"{kind}-shared")
        for kind in ["collector", "process", "sync", "async"]
    ),
    *(pytest.param(kind, "pipe", id=f"{kind}-pipe") for kind in ["sync", "async-serial"]),
]


@pytest.mark.parametrize(
    ("kind", "scheme", "anyio_backend"),
    [
        pytest.param(
            *update.values,
            (name, options),
            id=f"{update.id}-{label}",
        )
        for update in UPDATES
        for name, options, label in BACKEND_PARAMS
    ],
)
async def test_consumer_cancelled_mid_weight_update(request, leaks, timing, tmp_path, kind, scheme):
    """``update_weights(wait=True)`` waits for the workers' batch in flight: cancelling it leaves a
    consistent collector (versions never reused, the next update reaches every worker). With weights on
    the control socket (``PipeWeightSync``, 16 MB: more than the socket holds while the worker collects),
    the cancellation lands mid-send and the channel must stay whole. The batch in flight is held at a
    gate (a file) while the update is cancelled: the update cannot have finished by then (a cause, not
    a deadline)."""
    gate = tmp_path / "gate"
    trainer = FaultyPolicy(size=4_000_000 if scheme == "pipe" else 0)
    collector = build(
        kind,
        functools.partial(make_env, delay=0.002, gate=str(gate)),
        trainer,
        frames_per_batch=50 * (1 + kind.startswith("sync")),
        track_policy_version=True,
        weight_sync=PipeWeightSync() if scheme == "pipe" else None,
    )
    async with collector, anyio.create_task_group() as tg:
        await collector.__anext__()
        gate.touch()
        tg.start_soon(collector.__anext__)  # the batch in flight while the update waits
        await wait_until(Path(f"{gate}.held").exists)  # the env holds that batch at the gate

        async def cancel_once_waiting(scope: anyio.CancelScope) -> None:
            await anyio.wait_all_tasks_blocked()  # update_weights waits for the held batch
            nonlocal cancelled_at
            cancelled_at = time.monotonic()
            scope.cancel()

        cancelled_at = 0.0
        with anyio.CancelScope() as scope:
            tg.start_soon(cancel_once_waiting, scope)
            await collector.update_weights(wait=True)
        assert scope.cancelled_caught or kind == "collector"  # the in-process copy may just finish
        if scope.cancelled_caught:  # the figure: from the cancel to the update's exit
            record(request, timing, time.monotonic() - cancelled_at)
        gate.unlink()
        with torch.no_grad():
            trainer.weight.fill_(1.0)
        with anyio.fail_after(30):
            version = await collector.update_weights(wait=True)
            assert version == collector.policy_version >= 1
            if kind in MULTI or kind == "process":
                assert collector.worker_policy_versions() == [version] * collector.num_workers
            batch = await collector.__anext__()
            while int(batch["collector", "policy_version"].min()) < version:  # async: one batch ahead
                batch = await collector.__anext__()
        assert (batch["action"] == 1).all()
    leaks.check()


# -- closing -----------------------------------------------------------------------------------------
@matrix(KINDS)
async def test_aclose_twice(leaks, kind):
    collector = build(kind, healthy, FaultyPolicy())
    async with collector:
        await collector.__anext__()
        await collector.aclose()
        await collector.aclose()
        await assert_closed_for_good(collector, "closed")
    await collector.aclose()
    await assert_closed_for_good(collector, "closed")
    leaks.check()


# -- backpressure ------------------------------------------------------------------------------------
@pytest.mark.parametrize("anyio_backend", [("asyncio", {"use_uvloop": True})], ids=["uvloop"])
async def test_slow_consumer_never_grows_memory(leaks, anyio_backend):
    """Workers far faster than the consumer: each holds at most its two slots, the parent queues at most
    one notice per slot, and the parent's RSS stays flat over 150 batches."""
    me = psutil.Process()
    rss: list[int] = []
    queued = []
    async with MultiAsyncCollector([healthy, healthy], frames_per_batch=256) as collector:
        with anyio.fail_after(120):
            async for _ in collector:
                await anyio.sleep(0.02)  # the trainer, 10x slower than the workers (the behaviour under test)
                queued.append(collector._pool.deliveries.statistics().current_buffer_used)
                if len(queued) > 40:  # warmed up
                    rss.append(me.memory_info().rss)
                if len(queued) == 150:
                    break
    assert max(queued) <= 4  # 2 workers x 2 slots
    growth = rss[-1] - min(rss[: len(rss) // 4 or 1])
    FIGURES["backpressure"] = {
        "batches": len(queued),
        "max_queued_notices": max(queued),
        "parent_rss_mib": [round(rss[0] / 2**20, 1), round(rss[-1] / 2**20, 1)],
        "growth_mib": round(growth / 2**20, 2),
    }
    assert growth < 8 * 2**20, f"parent RSS grew by {growth / 2**20:.1f} MiB while the consumer lagged"
    leaks.check()


# -- the trainer process interrupted or killed -------------------------------------------------------
TRAINER = textwrap.dedent(
    """
    import contextlib, json, os, sys, time
    import anyio, gymnasium as gym, numpy as np, psutil
    from aiocollect import Collector, GymEnv, MultiAsyncCollector, MultiSyncCollector

    class Slow(gym.Env):
        observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
        action_space = gym.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            return np.zeros(2, np.float32), {}

        def step(self, action):
            time.sleep(0.002)
            return np.zeros(2, np.float32), 1.0, False, False, {}

    def slow():
        return GymEnv(Slow())

    PIDS = []

    async def main(kinds):
        makers = {
            "collector": lambda: Collector(slow, frames_per_batch=20),
            "sync": lambda: MultiSyncCollector([slow, slow], frames_per_batch=40),
            "async": lambda: MultiAsyncCollector([slow, slow], frames_per_batch=20),
        }
        collectors = [makers[kind]() for kind in kinds]
        async with contextlib.AsyncExitStack() as stack:  # one task: the trainer's own loop
            for c in collectors:
                await stack.enter_async_context(c)
            while True:
                for c in collectors:
                    await c.__anext__()
                if not PIDS:
                    pools = [c._pool for c in collectors if hasattr(c, "_pool")]
                    PIDS.extend(w.process.pid for pool in pools for w in pool.workers)
                    print(json.dumps({"pids": PIDS}), flush=True)

    def alive(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    if __name__ == "__main__":
        # a process started from a background job inherits SIGINT ignored (and then neither asyncio nor trio
        # installs its Ctrl-C handler): behave as a trainer started from a terminal does
        import signal
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # one run per backend, each ended by a SIGINT; the last KeyboardInterrupt is not caught
        backends, *kinds = sys.argv[1:]
        for i, name in enumerate(backends.split(",")):
            PIDS.clear()
            backend = "trio" if name == "trio" else "asyncio"
            options = {"use_uvloop": name == "uvloop"} if backend == "asyncio" else {}
            try:
                anyio.run(main, kinds, backend=backend, backend_options=options)
            except KeyboardInterrupt:  # what the trainer sees, before the interpreter's own shutdown
                segments = [n for n in os.listdir("/dev/shm") if n.startswith(f"aiocollect_{os.getpid()}_")]
                print(json.dumps({"interrupted": time.monotonic(), "alive": [p for p in PIDS if alive(p)],
                                  "segments": segments}), flush=True)
                if i == len(backends.split(",")) - 1:
                    raise
    """
)


def start_trainer(tmp_path: Path, backends: list[str], kinds: list[str]) -> Any:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    return subprocess.Popen(
        [sys.executable, str(script), ",".join(backends), *kinds],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def read_json(proc: Any) -> dict[str, Any]:
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        pytest.fail(f"the trainer stopped: {proc.stderr.read() if proc.stderr else ''}")
    return json.loads(line)


def test_sigint_to_the_trainer(request, timing, tmp_path):
    """Ctrl-C in a trainer running the in-process and both multi-process collectors, under asyncio,
    asyncio+uvloop and trio in turn (one process, one SIGINT each): KeyboardInterrupt propagates out of
    ``anyio.run`` as itself, promptly, with every worker reaped and every segment unlinked by then."""
    backends = ["asyncio", "uvloop", "trio"]
    proc = start_trainer(tmp_path, backends, ["collector", "sync", "async"])
    for backend in backends:
        pids = read_json(proc)["pids"]  # once every collector delivered a batch
        assert len(pids) == 4 and not any(gone(p) for p in pids)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        report = read_json(proc)
        TIMES[f"{request.node.name}[{backend}]"] = round(report["interrupted"] - sent, 3)
        timing.bound(report["interrupted"] - sent, BOUND, f"from SIGINT to KeyboardInterrupt under {backend}")
        assert report["alive"] == [] and report["segments"] == [], (backend, report)
        assert all(gone(p) for p in pids), (backend, [p for p in pids if not gone(p)])
    _, err = proc.communicate(timeout=60)  # the interpreter's shutdown (torch's) takes 1-2 s more
    assert proc.returncode == -signal.SIGINT, (proc.returncode, err)  # an uncaught KeyboardInterrupt
    assert err.rstrip().endswith("KeyboardInterrupt"), err
    assert segments(proc.pid) == []


class InterruptingSink(Sink):
    """Raises ``KeyboardInterrupt`` from its first write after a batch: what trio does when SIGINT arrives
    while one of the collector's own tasks runs (trio raises it in whichever task runs, not only in the
    trainer's)."""

    raised_after: int | None = None  # the batches counted when it raised

    def open(self) -> None:
        pass

    def write(self, statistics: Any, metrics: Any) -> None:
        if statistics is not None and statistics.batches:
            self.raised_after = statistics.batches
            raise KeyboardInterrupt("in the sink's task")

    def close(self) -> None:
        pass


@pytest.mark.parametrize("kind", ["collector", "sync", "async"])
def test_keyboard_interrupt_in_a_collector_task_leaves_as_itself(warm_forkserver, kind):
    """A KeyboardInterrupt raised in one of the collector's tasks (here a sink's, under trio) leaves
    ``async with`` as itself, not in an ExceptionGroup, with the workers reaped: a trainer's
    ``except KeyboardInterrupt`` catches it. (Found in CI: trio put a Ctrl-C in a worker's reader task.)"""
    makers = {
        "collector": lambda: Collector(healthy, frames_per_batch=4),
        "sync": lambda: MultiSyncCollector([healthy, healthy], frames_per_batch=8),
        "async": lambda: MultiAsyncCollector([healthy, healthy], frames_per_batch=4),
    }
    sink = InterruptingSink(every=0.01)
    leaks = Leaks()

    async def main() -> None:
        async with makers[kind]() as c:
            await c.add_sink(sink)
            async for _ in c:
                pass

    with pytest.raises(KeyboardInterrupt, match="in the sink's task") as info:
        anyio.run(main, backend="trio")
    assert type(info.value) is KeyboardInterrupt
    assert sink.raised_after is not None and sink.raised_after >= 1  # mid-collection, after a batch
    leaks.check(SETTLE)


@pytest.mark.slow  # a second trainer subprocess (torch imported twice more): ~10-30 s on two cores
def test_sigkill_to_the_trainer_workers_exit(request, timing, tmp_path):
    """A trainer killed with SIGKILL runs no cleanup: its workers exit by themselves when their socket to it
    closes (an idle sync worker at once, a collecting async worker at its next batch), and the resource
    tracker unlinks the segments."""
    proc = start_trainer(tmp_path, ["asyncio"], ["sync", "async"])
    pids = read_json(proc)["pids"]
    sent = time.monotonic()
    proc.kill()
    proc.wait(30)  # not communicate(): the forkserver holds the trainer's stdout until its own exit
    deadline = sent + 10
    while not all(gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    elapsed = time.monotonic() - sent
    assert all(gone(p) for p in pids), [p for p in pids if not gone(p)]
    record(request, timing, elapsed, ORPHAN_BOUND)
    while segments(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert segments(proc.pid) == []  # unlinked by multiprocessing's resource tracker
    TIMES[f"{request.node.name}[segments]"] = round(time.monotonic() - sent, 3)
    proc.communicate(timeout=30)
