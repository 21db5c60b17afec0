"""Worker process restarts (``restart=RestartPolicy(...)``): a worker that dies or hangs is replaced.

The replacement runs the same env constructor and policy, is seeded from its worker's seed and its
replacement count, takes trajectory ids no earlier generation took, and loads the newest weights before
its first frame. The run still reaches ``total_frames`` exactly; ``MultiSyncCollector`` collects the
replaced worker's share of the batch again; a spent budget ends the run with the original error type
(``WorkerDiedError``, ``WorkerTimeoutError``) and the restart history as a note.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDictBase

from aiocollect import (
    GymEnv,
    MultiAsyncCollector,
    MultiAsyncEnvCollector,
    MultiSyncCollector,
    PipeWeightSync,
    ProcessCollector,
    RestartPolicy,
    WorkerDiedError,
    WorkerTimeoutError,
)
from aiocollect._core._restart import derive_seed
from support import Timing, cartpole, pendulum, take_until
from test_async_envs import Counter, StepPolicy
from test_async_workers import shares

pytestmark = pytest.mark.anyio

BACKENDS = [("asyncio", {"use_uvloop": False}), ("asyncio", {"use_uvloop": True}), ("trio", {})]
POLICY = RestartPolicy(max_restarts=3, window=60.0, backoff=0.0, max_backoff=0.0)
#: ids of a worker's first replacement start this far along its own sequence (``restarted_options``)
GENERATION = 1 << 32


def rotating(kinds: tuple[str, ...] = ("sync", "async")) -> pytest.MarkDecorator:
    """``kind`` x backend (CI's runs of the suite take one backend each: ``--loop-tier``)."""
    params = []
    for kind in kinds:
        for backend in BACKENDS:
            label = "uvloop" if backend[1].get("use_uvloop") else backend[0]
            params.append(pytest.param(kind, backend, id=f"{kind}-{label}"))
    return pytest.mark.parametrize(("kind", "anyio_backend"), params)


def _collector(kind: str, total: int, **kwargs: Any) -> Any:
    if kind == "process":
        return ProcessCollector(cartpole, frames_per_batch=16, total_frames=total, **kwargs)
    if kind == "sync":
        return MultiSyncCollector([cartpole, cartpole], frames_per_batch=32, total_frames=total, **kwargs)
    return MultiAsyncCollector([cartpole, cartpole], frames_per_batch=16, total_frames=total, **kwargs)


def _parts(kind: str, batch: TensorDictBase) -> list[tuple[int, TensorDictBase]]:
    """(worker, frames) of a batch: a MultiSync batch is ``[workers, T]``."""
    if kind == "sync":
        return [(i, batch[i]) for i in range(batch.batch_size[0])]
    return [(int(batch["collector", "worker_id"][0]), batch)]


def _kill(collector: Any, index: int) -> float:
    os.kill(collector._pool.workers[index].process.pid, signal.SIGKILL)
    return time.monotonic()


def _check_generations(kind: str, batches: list[TensorDictBase], workers: int = 2) -> list[set[int]]:
    """Per worker, the generations its delivered frames came from; ids never go back to an older one."""
    seen: list[set[int]] = [set() for _ in range(workers)]
    for batch in batches:
        for worker, part in _parts(kind, batch):
            ids = part["collector", "traj_ids"].reshape(-1)
            ids = ids[ids >= 0]
            generations = {int(g) for g in (ids // (GENERATION * workers)).tolist()}
            assert len(generations) == 1, generations  # no batch mixes a worker and its replacement
            (g,) = generations
            assert all(g >= old for old in seen[worker])
            seen[worker].add(g)
    return seen


@rotating(kinds=("sync", "async", "process"))
async def test_killed_worker_is_replaced(kind: str, leaks: Any) -> None:
    """A worker SIGKILLed mid-run is replaced: the run reaches total_frames exactly (async: each worker,
    the replacement too, delivers 3 batches after the restart: a shared budget could go to the other
    worker alone), the replacement's trajectories are new (ids of its own generation), the restart is an
    event and counted."""
    total = -1 if kind == "async" else 320
    collector = _collector(kind, total, restart=POLICY, seed=3)
    victim = 0 if kind == "process" else 1
    batches = []
    async with collector, collector.events(kinds=["restarted"]) as events:
        with anyio.fail_after(60):
            async for batch in collector:
                batches.append(batch.clone())
                if len(batches) == 2:
                    _kill(collector, victim)
                    restarted = [await anext(events)]  # the others' slots fill meanwhile
                    if kind == "async":
                        # 3: past the (at most 2) batches of the killed worker still in its slots
                        batches += [b.clone() for b in await take_until(collector, each=3)]
                        break
        while (event := events.receive_nowait()) is not None:
            restarted.append(event)
        stats = collector.statistics()
    frames = sum(b.numel() for b in batches)
    assert frames == (320 if total > 0 else stats.frames)
    assert [(e.worker, e.env, e.restarts) for e in restarted] == [(victim, -1, 1)]
    assert restarted[0].cause.startswith("WorkerDiedError: ")
    assert [w.restarts for w in stats.workers] == ([1] if kind == "process" else [0, 1])
    assert stats.restarts == 1 and stats.frames == frames
    generations = _check_generations(kind, batches, workers=len(stats.workers))
    if kind == "process":
        assert generations[0] == {0, 1}
    else:  # async: worker 1 may have delivered nothing before it was killed
        assert generations[0] == {0} and 1 in generations[1] and generations[1] <= {0, 1}


class HangOnce(gym.Env):
    """Pendulum-like: hangs at step 5 of the first env built with ``marker`` absent (creating it), so
    only the first generation of a worker hangs."""

    observation_space = gym.spaces.Box(-1, 1, (3,), np.float32)
    action_space = gym.spaces.Box(-2, 2, (1,), np.float32)

    def __init__(self, marker: str) -> None:
        self.hang = not Path(marker).exists()
        if self.hang:
            Path(marker).write_text("hung")
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(3, np.float32), {}

    def step(self, action):
        self.t += 1
        if self.hang and self.t == 5:
            time.sleep(3600)  # killed by the collector
        return np.zeros(3, np.float32), 0.0, False, self.t % 20 == 0, {}


def _hanging(marker: str) -> GymEnv:
    return GymEnv(HangOnce(marker))


@rotating(kinds=("async",))
async def test_hung_worker_is_replaced(kind: str, leaks: Any, tmp_path: Path) -> None:
    """A worker that delivers nothing within worker_timeout is killed and replaced; the others go on
    meanwhile, and the replacement delivers."""
    marker = str(tmp_path / "hung")
    collector = MultiAsyncCollector(
        [pendulum, lambda: _hanging(marker)],
        frames_per_batch=16,
        total_frames=-1,
        worker_timeout=1.0,
        restart=POLICY,
    )
    others = 0
    async with collector, collector.events(kinds=["restarted"]) as events:
        with anyio.fail_after(60):
            async for batch in collector:
                if int(batch["collector", "worker_id"][0]) == 0:
                    others += 1
                elif int(batch["collector", "traj_ids"].min()) >= GENERATION:
                    break  # the replacement's first batch
        restarted = []
        while (event := events.receive_nowait()) is not None:
            restarted.append(event)
    assert others > 1  # worker 0 went on while worker 1 hung
    assert [(e.worker, e.env) for e in restarted] == [(1, -1)]
    assert restarted[0].cause.startswith("WorkerTimeoutError: ")
    assert collector.statistics().workers[1].restarts == 1


@rotating()
async def test_spent_budget_raises_the_original_error(kind: str, leaks: Any, timing: Timing) -> None:
    """Past its budget, a worker's death ends the run with WorkerDiedError (the history as a note);
    within 2 s (a speed figure)."""
    once = RestartPolicy(max_restarts=1, window=60.0, backoff=0.0, max_backoff=0.0)
    collector = _collector(kind, -1, restart=once)
    killed = 0.0
    with pytest.raises(WorkerDiedError) as info:
        async with collector, collector.events(kinds=["restarted"]) as events:
            with anyio.fail_after(60):
                async for _ in collector:
                    if not killed or events.receive_nowait() is not None:
                        killed = _kill(collector, 0)
    timing.bound(time.monotonic() - killed, 2.0, "the spent budget's error")
    assert info.value.exitcode == -signal.SIGKILL
    assert any("restart budget spent" in note for note in info.value.__notes__)


@pytest.mark.parametrize("anyio_backend", BACKENDS, ids=["asyncio", "uvloop", "trio"])
async def test_spent_budget_on_a_hang_raises_worker_timeout(
    leaks: Any, tmp_path: Path, timing: Timing
) -> None:
    """ProcessCollector, ``max_restarts=0``: a hang ends the run with WorkerTimeoutError (the history
    as a note), as without a policy; within 2 s of worker_timeout (a speed figure)."""
    none = RestartPolicy(max_restarts=0)
    marker = str(tmp_path / "hung")
    collector = ProcessCollector(
        lambda: _hanging(marker), frames_per_batch=16, total_frames=-1, worker_timeout=0.5, restart=none
    )
    started = 0.0
    with pytest.raises(WorkerTimeoutError) as info:
        async with collector:
            started = time.monotonic()  # the first batch hangs at its 5th step
            with anyio.fail_after(30):
                async for _ in collector:
                    pass
    timing.bound(time.monotonic() - started, 0.5 + 2.0, "the hang's error")  # worker_timeout, then the bound
    assert any("restart budget spent" in note for note in info.value.__notes__)


class Constant(torch.nn.Module):
    """Pendulum action = its one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.weight.expand(*observation.shape[:-1], 1).clone()


@rotating()
async def test_replacement_runs_the_latest_weights(kind: str, leaks: Any) -> None:
    """A replacement loads the weights published before its first frame: its frames never carry an
    older version (nor older weights) than the last one published before the restart."""
    policy = Constant()
    if kind == "sync":
        collector = MultiSyncCollector(
            [pendulum, pendulum],
            policy,
            frames_per_batch=16,
            total_frames=-1,
            restart=POLICY,
            track_policy_version=True,
        )
    else:
        collector = MultiAsyncCollector(
            [pendulum, pendulum],
            policy,
            frames_per_batch=8,
            total_frames=-1,
            restart=POLICY,
            track_policy_version=True,
        )
    async with collector, collector.events(kinds=["restarted"]) as events:
        with anyio.fail_after(60):
            await collector.__anext__()
            with torch.no_grad():
                policy.weight.fill_(0.5)
            version = await collector.update_weights(policy)
            _kill(collector, 1)
            await anext(events)  # replaced
            after = 0
            async for batch in collector:
                for worker, part in _parts(kind, batch):
                    if worker == 1 and int(part["collector", "traj_ids"].max()) >= GENERATION:
                        assert (part["collector", "policy_version"] >= version).all()
                        assert (part["action"] == 0.5).all()
                        after += 1
                if after >= 2:
                    break


# -- MultiAsyncEnvCollector: async envs in worker processes ---------------------------------------------
def _async_env_collector(total: int, **kwargs: Any) -> MultiAsyncEnvCollector:
    """2 worker processes of 3 ``Counter`` async envs each (env ids 0-2 and 3-5)."""
    return MultiAsyncEnvCollector(
        shares(2, 3), StepPolicy(), frames_per_batch=12, total_frames=total, **kwargs
    )


@rotating(kinds=("shared-memory", "pipe"))
async def test_async_env_worker_is_replaced(kind: str, leaks: Any) -> None:
    """MultiAsyncEnvCollector: a worker process SIGKILLed mid-run is replaced (its envs' restarts are
    the worker's own): the run reaches total_frames exactly; the replacement has its predecessor's env
    ids, trajectory ids of its own generation, envs reset with a seed derived from the worker's, and the
    weights published before the kill (through shared memory or the pipe); the restart is an event and
    counted."""
    sync = PipeWeightSync() if kind == "pipe" else None
    # no frame budget: the run goes on until the replacement delivered twice (with a budget, worker 0 could
    # deliver it all first on a loaded machine; the budget across a replacement is the fleet's, tested above)
    collector = _async_env_collector(-1, restart=POLICY, seed=3, track_policy_version=True, weight_sync=sync)
    batches: list[TensorDictBase] = []
    replaced = 0
    async with collector, collector.events(kinds=["restarted", "worker_started"]) as events:
        with anyio.fail_after(60):
            async for batch in collector:
                batches.append(batch.clone())
                if len(batches) == 2:
                    version = await collector.update_weights()
                    _kill(collector, 1)
                    started = await anext(events)  # the replacement is ready
                    restarted = await anext(events)  # and up to date
                    seeds = await collector.get_distant_attr("env.seeds")
                ids = batch["collector", "traj_ids"]
                replaced += int(batch["collector", "worker_id"][0]) == 1 and int(ids.min()) >= GENERATION * 2
                if replaced == 2:
                    break
        stats = collector.statistics()
    assert stats.frames == sum(b.numel() for b in batches) == 12 * len(batches)
    assert (type(started).__name__, started.worker_id) == ("WorkerStarted", 1)
    assert (restarted.worker, restarted.env, restarted.restarts) == (1, -1, 1)
    assert restarted.cause.startswith("WorkerDiedError: ")
    assert stats.restarts == 1 and [w.restarts for w in stats.workers] == [0, 1]
    assert seeds[0][0] == 3 and seeds[1][0] == derive_seed(3 + 3, 1)  # env 3: worker 1's first
    generations = _check_generations("async", batches)
    assert generations[0] == {0} and 1 in generations[1]
    for batch in batches:
        worker = int(batch["collector", "worker_id"][0])
        assert ((batch["collector", "env_id"] // 3) == worker).all()
        if int(batch["collector", "traj_ids"].min()) >= GENERATION * 2:
            assert (batch["collector", "policy_version"] >= version).all()


@rotating(kinds=("async-envs",))
async def test_async_env_worker_spent_budget_raises(kind: str, leaks: Any, timing: Timing) -> None:
    """MultiAsyncEnvCollector past its budget: WorkerDiedError with the history as a note; within 2 s (a
    speed figure)."""
    once = RestartPolicy(max_restarts=1, window=60.0, backoff=0.0, max_backoff=0.0)
    collector = _async_env_collector(-1, restart=once)
    killed = 0.0
    with pytest.raises(WorkerDiedError) as info:
        async with collector, collector.events(kinds=["restarted"]) as events:
            with anyio.fail_after(60):
                async for _ in collector:
                    if not killed or events.receive_nowait() is not None:
                        killed = _kill(collector, 0)
    timing.bound(time.monotonic() - killed, 2.0, "the spent budget's error")
    assert info.value.exitcode == -signal.SIGKILL
    assert any("restart budget spent" in note for note in info.value.__notes__)


class BlockOnce(Counter):
    """A ``Counter`` that blocks its worker's event loop (a sync call that never returns) at its 5th
    step, in the first worker process only (``marker`` absent when it is built: it creates it)."""

    def __init__(self, env_id: int, marker: str) -> None:
        super().__init__(env_id)
        self.block = not Path(marker).exists()
        if self.block:
            Path(marker).write_text("hung")

    async def step(self, action: Any) -> Any:
        if self.block and self.steps == 5:
            time.sleep(3600)  # noqa: ASYNC251 - the whole worker hangs: killed by the collector
        return await super().step(action)


@rotating(kinds=("async-envs",))
async def test_hung_async_env_worker_is_replaced(kind: str, leaks: Any, tmp_path: Path) -> None:
    """A MultiAsyncEnvCollector worker that delivers nothing within worker_timeout is killed and
    replaced; the other worker goes on meanwhile."""
    marker = str(tmp_path / "hung")
    fns = [
        [lambda i=i: Counter(i) for i in range(3)],
        [lambda i=i: BlockOnce(3 + i, marker) for i in range(3)],
    ]
    collector = MultiAsyncEnvCollector(
        fns, frames_per_batch=12, total_frames=-1, worker_timeout=1.0, restart=POLICY
    )
    others = 0
    async with collector, collector.events(kinds=["restarted"]) as events:
        with anyio.fail_after(60):
            async for batch in collector:
                if int(batch["collector", "worker_id"][0]) == 0:
                    others += 1
                elif int(batch["collector", "traj_ids"].min()) >= GENERATION * 2:
                    break  # the replacement's first batch
        restarted = await anext(events)
    assert others > 1
    assert (restarted.worker, restarted.env) == (1, -1)
    assert restarted.cause.startswith("WorkerTimeoutError: ")
    assert collector.statistics().workers[1].restarts == 1
