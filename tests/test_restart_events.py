"""Env restarts reach the trainer as they happen, on every collector family: a ``Restarted`` event per
restart, counted in ``statistics().restarts`` in the same step, whether or not a batch follows.

Two faults: an env that raises at step 3 of every episode (the run ends with its error once the budget of 2
restarts is spent, before its member ever delivers a batch), and one that raises at step 3 in its first two
builds and then waits in ``step`` until the test lets it go (the restarts must be reported while no batch
can come). A reader checks, each time it has read every event published, that the events and the
statistics agree.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import gymnasium as gym
import pytest

from aiocollect import (
    AsyncEnvCollector,
    Collector,
    GymEnv,
    MultiAsyncCollector,
    MultiAsyncEnvCollector,
    MultiSyncCollector,
    ProcessCollector,
    Restarted,
    RestartPolicy,
    WorkerFailed,
)

pytestmark = pytest.mark.anyio

BUDGET = RestartPolicy(max_restarts=2, window=600.0, backoff=0.0, max_backoff=0.0)
KINDS = ["collector", "sync", "sync-serial", "async", "process", "asyncenv", "multiasyncenv"]


class Unstable(gym.Wrapper):
    """Raises at step 3 of every episode once ``crashes`` is true; otherwise, while ``gate`` does not
    exist, waits in ``step`` (a slow simulator)."""

    def __init__(self, env: gym.Env, crashes: bool, gate: str | None) -> None:
        super().__init__(env)
        self.crashes, self.gate, self.steps = crashes, gate, 0

    def reset(self, **kwargs: Any) -> Any:
        self.steps = 0
        return self.env.reset(**kwargs)

    def step(self, action: Any) -> Any:
        self.steps += 1
        if self.crashes and self.steps == 3:
            raise ZeroDivisionError("the simulator went unstable at step 3")
        while self.gate is not None and not Path(self.gate).exists():
            time.sleep(0.005)
        return self.env.step(action)


class Faulty:
    """An env factory whose first ``crashing`` builds crash at step 3 of each episode (``None``: every
    build); the later ones wait at each step until ``gate`` exists. ``raw``: gymnasium envs (the async-env
    collectors), else ``GymEnv``."""

    def __init__(self, crashing: int | None = None, gate: str | None = None, raw: bool = False) -> None:
        self.crashing, self.gate, self.raw = crashing, gate, raw
        self.built = 0

    def __call__(self) -> Any:
        self.built += 1
        crashes = self.crashing is None or self.built <= self.crashing
        env = Unstable(gym.make("CartPole-v1"), crashes, None if crashes else self.gate)
        return env if self.raw else GymEnv(env)


def healthy() -> GymEnv:
    return GymEnv("CartPole-v1")


def raw_healthy() -> gym.Env:
    return gym.make("CartPole-v1")


def build(kind: str, faulty: Faulty, total: int) -> tuple[Any, int]:
    """The collector of ``kind`` with the faulty env (and a healthy one where there are several members),
    and the faulty member's index (its ``Restarted`` events' ``worker``)."""
    common: dict[str, Any] = {"total_frames": total, "restart": BUDGET}
    if kind == "collector":
        return Collector(faulty, None, frames_per_batch=20, **common), 0
    if kind in ("sync", "sync-serial"):
        backend = "serial" if kind == "sync-serial" else "process"
        return MultiSyncCollector(
            [healthy, faulty], None, frames_per_batch=40, worker_backend=backend, **common
        ), 1
    if kind == "async":
        return MultiAsyncCollector([healthy, faulty], None, frames_per_batch=20, **common), 1
    if kind == "process":
        return ProcessCollector(faulty, None, frames_per_batch=20, **common), 0
    faulty.raw = True
    if kind == "asyncenv":
        return AsyncEnvCollector([raw_healthy, faulty], None, frames_per_batch=20, **common), 0
    return MultiAsyncEnvCollector([[raw_healthy], [faulty]], None, frames_per_batch=20, **common), 1


def faulty_statistics(kind: str, member: int) -> int:
    """The index of the faulty env's entry in ``statistics().workers`` (``AsyncEnvCollector``'s are its
    envs: the faulty one is env 1)."""
    return 1 if kind == "asyncenv" else member


def from_faulty(kind: str, member: int, batch: Any) -> bool:
    """Whether ``batch`` holds frames of the faulty env."""
    if kind == "asyncenv":
        return bool((batch["collector", "env_id"] == 1).any())
    if kind in ("async", "multiasyncenv"):
        return bool((batch["collector", "worker_id"] == member).any())
    return True  # one batch holds every member's frames (or there is one member)


class Watch:
    """Reads a collector's events; each time it has read every event published so far, checks that the
    ``Restarted`` events read and ``statistics().restarts`` agree."""

    def __init__(self, collector: Any) -> None:
        self.collector = collector
        self.stream = collector.events(max_buffer=1 << 16)  # subscribed before the collector starts
        self.events: list[Any] = []
        self.disagreements: list[tuple[int, int]] = []

    def drain(self) -> None:
        while (event := self.stream.receive_nowait()) is not None:
            self.events.append(event)
        seen = len(self.restarts())
        if self.collector.statistics().restarts != seen:
            self.disagreements.append((seen, self.collector.statistics().restarts))

    def restarts(self) -> list[Restarted]:
        return [e for e in self.events if isinstance(e, Restarted)]

    async def run(self, until: int | None = None) -> None:
        """Until the stream ends, or until ``until`` restarts were seen."""
        async for event in self.stream:
            self.events.append(event)
            self.drain()
            if until is not None and len(self.restarts()) >= until:
                return


async def drive(collector: Any, watch: Watch) -> BaseException | None:
    """Iterate ``collector`` to its end beside ``watch``; the error that ended it, if any."""
    error: list[BaseException] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch.run)

        async def consume() -> None:
            try:
                async with collector:
                    async for _ in collector:
                        pass
            except Exception as exc:
                error.append(exc)

        with anyio.fail_after(120):
            await consume()
        tg.cancel_scope.cancel()
    watch.drain()
    return error[0] if error else None


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
@pytest.mark.parametrize("kind", KINDS)
async def test_restarts_before_any_batch_are_counted(kind: str) -> None:
    collector, member = build(kind, Faulty(), total=4000)
    watch = Watch(collector)
    error = await drive(collector, watch)
    assert isinstance(error, ZeroDivisionError)  # the env's own error, once the budget is spent
    restarts = watch.restarts()
    assert [(e.worker, e.restarts) for e in restarts] == [(member, 1), (member, 2)]
    assert all(e.cause == "ZeroDivisionError: the simulator went unstable at step 3" for e in restarts)
    failed = [i for i, e in enumerate(watch.events) if isinstance(e, WorkerFailed)]
    assert failed and failed[0] > watch.events.index(restarts[-1])  # the restarts came first
    stats = collector.statistics()
    assert stats.restarts == 2
    assert stats.workers[faulty_statistics(kind, member)].restarts == 2
    assert watch.disagreements == []


@pytest.mark.parametrize("kind", KINDS)
async def test_restarts_are_reported_while_no_batch_can_come(kind: str, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    # no frame budget: the healthy member could take a shared one alone before any restart (the run
    # would end with none reported); the run ends with the faulty member's first batch instead
    collector, member = build(kind, Faulty(crashing=2, gate=str(gate)), total=-1)
    watch = Watch(collector)
    seen: list[int] = []
    error: list[BaseException] = []
    async with anyio.create_task_group() as tg:

        async def consume() -> None:
            try:
                async with collector:
                    async for batch in collector:
                        if from_faulty(kind, member, batch):
                            assert gate.exists()  # the faulty env gives no frame until then
                            break
            except Exception as exc:
                error.append(exc)

        tg.start_soon(consume)
        try:
            with anyio.move_on_after(60):
                await watch.run(until=2)  # the rebuilt env waits at its first step: no batch from it
                seen.append(collector.statistics().restarts)
        finally:
            gate.touch()  # the run may end (and the collector close) in any case
        with anyio.fail_after(120):
            await watch.run()
    assert error == []
    assert seen == [2]
    assert [(e.worker, e.restarts) for e in watch.restarts()] == [(member, 1), (member, 2)]
    assert collector.statistics().restarts == 2
    assert watch.disagreements == []
