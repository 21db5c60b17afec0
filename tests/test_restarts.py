"""Restart policies (``restart=RestartPolicy(...)``): an env that raises is rebuilt and the run goes on.

Every collector that runs the shared rollout (``Collector``'s thread, the worker processes of
``MultiSyncCollector`` and ``MultiAsyncCollector``) meets the same faults: an env that raises once, one
that raises every few steps, one that always raises (the budget runs out: the env's own error, promptly).
The data contract is checked on the batches: the run reaches ``total_frames`` exactly, the frame before a
restart ends its trajectory (truncated and done), no trajectory id goes on across a restart, no frame of the
failed step is delivered.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import anyio
import anyio.lowlevel
import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDictBase

from aiocollect import (
    Collector,
    GymEnv,
    MultiAsyncCollector,
    MultiSyncCollector,
    RestartPolicy,
    RolloutOptions,
)
from aiocollect._core._restart import RestartBudget, derive_seed
from support import EnvFailure, Timing

pytestmark = pytest.mark.anyio

#: the worker-process cases run under every backend (CI's runs of the suite take one each: --loop-tier)
BACKENDS = [("asyncio", {"use_uvloop": False}), ("asyncio", {"use_uvloop": True}), ("trio", {})]


def _label(backend: tuple[str, dict]) -> str:
    return "uvloop" if backend[1].get("use_uvloop") else backend[0]


def rotating() -> pytest.MarkDecorator:
    """Parametrize ``kind`` (sync, async) x ``anyio_backend``."""
    params = [
        pytest.param(kind, backend, id=f"{kind}-{_label(backend)}")
        for kind in ["sync", "async"]
        for backend in BACKENDS
    ]
    return pytest.mark.parametrize(("kind", "anyio_backend"), params)


def one_backend() -> pytest.MarkDecorator:
    """Parametrize ``anyio_backend`` (ids ``asyncio``, ``uvloop``, ``trio``)."""
    return pytest.mark.parametrize("anyio_backend", [pytest.param(b, id=_label(b)) for b in BACKENDS])


FAST = RestartPolicy(max_restarts=1000, window=60.0, backoff=0.0, max_backoff=0.0)


# -- envs that fail when told -------------------------------------------------------------------------
class Faulty:
    """``create_env_fn`` of CartPole envs whose ``step`` raises :class:`EnvFailure` at the ``at``-th step
    call (counted over every env it built, the failing calls too), every ``every``-th one, or always.

    ``built``: the envs built so far; ``seeds``: the seeds they were given (``set_seed``)."""

    def __init__(self, *, at: tuple[int, ...] = (), every: int = 0, always: bool = False, subclass=False):
        self.at, self.every, self.always, self.subclass = set(at), every, always, subclass
        self.calls = 0
        self.built = 0
        self.closed = 0
        self.seeds: list[int] = []
        self.raised: threading.Event | None = None  # set at each fault (in-process tests only)
        self.failed_builds: set[int] = set()  # the builds (1, 2, ...) that raise

    def fault(self) -> None:
        self.calls += 1
        n = self.calls
        if self.always or n in self.at or (self.every and n % self.every == 0):
            if self.raised is not None:
                self.raised.set()
            raise EnvFailure(f"step {n} failed")

    def __call__(self) -> GymEnv:
        self.built += 1
        if self.built in self.failed_builds:
            raise EnvFailure(f"build {self.built} failed")
        if self.subclass:  # a GymEnv subclass with its own step: the rollout's per-step loop
            return _FaultyGymEnv(gym.make("CartPole-v1"), self)
        return _RecordingGymEnv(_FaultyWrapper(gym.make("CartPole-v1"), self), self)  # the fused loop


class _FaultyWrapper(gym.Wrapper):
    def __init__(self, env: gym.Env, owner: Faulty) -> None:
        super().__init__(env)
        self.owner = owner

    def step(self, action: Any) -> Any:
        self.owner.fault()
        return self.env.step(action)


class _RecordingGymEnv(GymEnv):
    """Records the seeds it is given and its closes (neither keeps the rollout off its fused loop)."""

    def __init__(self, env: gym.Env, owner: Faulty) -> None:
        super().__init__(env)
        self.owner = owner

    def set_seed(self, seed: int) -> int:
        self.owner.seeds.append(seed)
        return super().set_seed(seed)

    def close(self) -> None:
        self.owner.closed += 1
        super().close()


class _FaultyGymEnv(_RecordingGymEnv):
    def step(self, td: Any) -> Any:
        self.owner.fault()
        return super().step(td)


class LeftPolicy(torch.nn.Module):
    """Always action 0: a policy called at every step (not the random batches' block of actions)."""

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return torch.zeros(observation.shape[:-1], dtype=torch.int64)


def check_contract(batches: list[TensorDictBase]) -> tuple[int, int]:
    """The invariants over a single-env run's batches (time last): a trajectory id changes only after a
    done frame or at a batch boundary, and never comes back. Returns (frames, truncated frames): CartPole
    truncates only at 500 steps, so in a short run every truncated frame is a restart's cut."""
    seen: set[int] = set()
    frames = cut = 0
    last = None
    for batch in batches:
        ids = batch["collector", "traj_ids"].reshape(-1).tolist()
        done = batch["next", "done"].reshape(-1).tolist()
        truncated = batch["next", "truncated"].reshape(-1).tolist()
        terminated = batch["next", "terminated"].reshape(-1).tolist()
        for t, i in enumerate(ids):
            assert i >= 0
            if i != last:
                assert i not in seen, f"trajectory {i} goes on after another one"
                seen.add(i)
            if t + 1 < len(ids) and ids[t + 1] != i:
                assert done[t], f"trajectory {i} ends at frame {t} without done"
            if done[t] and t + 1 < len(ids):
                assert ids[t + 1] != i
            assert done[t] == (truncated[t] or terminated[t])
            last = i
        frames += len(ids)
        cut += sum(truncated)
    return frames, cut


async def collect(collector: Any, entered: list[float] | None = None) -> list[TensorDictBase]:
    """The batches of a whole run (``entered``: gets the time ``async with`` was entered)."""
    out = []
    async with collector:
        if entered is not None:
            entered.append(time.monotonic())
        with anyio.fail_after(30):
            async for batch in collector:
                out.append(batch.clone())
    return out


def _raise(exc: Exception) -> None:
    raise exc


# -- RestartPolicy ------------------------------------------------------------------------------------
def test_policy_checks_its_fields() -> None:
    with pytest.raises(TypeError, match="max_restarts"):
        RestartPolicy(max_restarts=1.5)
    with pytest.raises(ValueError, match="window"):
        RestartPolicy(window=0)
    with pytest.raises(ValueError, match="max_backoff"):
        RestartPolicy(backoff=2.0, max_backoff=1.0)
    with pytest.raises(TypeError, match="KeyboardInterrupt"):
        RestartPolicy(on=(KeyboardInterrupt,))
    with pytest.raises(TypeError, match="restart must be a RestartPolicy"):
        RolloutOptions(frames_per_batch=8, restart=3)
    assert RestartPolicy(on=OSError).on == (OSError,)
    assert RestartPolicy(window=math.inf).window == math.inf


def test_backoff_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy(backoff=0.5, max_backoff=3.0)
    assert [policy.delay(k) for k in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_which_errors_count() -> None:
    policy = RestartPolicy(on=(RuntimeError,))
    assert policy.counts(RuntimeError("env"))
    assert not policy.counts(KeyError("other"))
    with pytest.raises(ValueError) as ours:
        RolloutOptions(frames_per_batch=0)  # a ValueError raised by aiocollect's own checks
    assert not RestartPolicy().counts(ours.value)
    with pytest.raises(ValueError) as envs:
        _raise(ValueError("raised by the env"))
    assert RestartPolicy().counts(envs.value)


def test_budget_counts_within_the_window() -> None:
    now = [0.0]
    budget = RestartBudget(RestartPolicy(max_restarts=2, window=10.0, backoff=1.0), clock=lambda: now[0])
    assert budget.admit(EnvFailure("a")) == 1.0
    assert budget.admit(EnvFailure("b"), progressed=False) == 2.0  # failed again before a step
    with pytest.raises(EnvFailure, match="c") as info:
        budget.admit(EnvFailure("c"))
    assert "restart budget spent: 2 restart(s) within 10 s" in info.value.__notes__[0]
    now[0] = 10.5  # the first two are out of the window
    assert budget.admit(EnvFailure("d"), progressed=False) == 4.0  # the third attempt in a row
    assert budget.admit(EnvFailure("e")) == 1.0  # the env stepped since: the backoff starts again
    assert [r.restarts for r in budget.drain()] == [1, 2, 3, 4]
    assert budget.drain() == []


def test_derived_seeds_are_reproducible_and_distinct() -> None:
    seeds = [derive_seed(3, k) for k in range(1, 50)]
    assert len(set(seeds)) == len(seeds)
    assert seeds == [derive_seed(3, k) for k in range(1, 50)]
    assert derive_seed(3, 0) == 3
    assert derive_seed(-3, 1) != derive_seed(3, 1)


# -- Collector ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("subclass", [False, True], ids=["fused", "per-step"])
@pytest.mark.parametrize("policy", [None, LeftPolicy()], ids=["random", "policy"])
async def test_collector_env_raises_once(subclass: bool, policy: Any) -> None:
    env = Faulty(at=(10,), subclass=subclass)
    collector = Collector(env, policy, frames_per_batch=16, total_frames=64, seed=5, restart=FAST)
    async with collector.events(kinds=["restarted"]) as events:
        batches = await collect(collector)
        restarted = [events.receive_nowait() for _ in range(2)]
    assert (collector._rollout.env.fused_gym is None) == subclass  # the loop this case is about
    frames, cut = check_contract(batches)
    assert frames == 64
    assert cut == 1 + sum(batches[0]["next", "truncated"][9:].reshape(-1).tolist())
    first = batches[0]
    assert first["next", "truncated"][8].item() and first["next", "done"][8].item()  # calls 1-9: frames 0-8
    assert first["collector", "traj_ids"][9] != first["collector", "traj_ids"][8]
    assert env.built == 2 and env.closed == 2  # the failed env, then the rebuilt one at close
    assert env.seeds == [5, derive_seed(5, 1)]
    stats = collector.statistics()
    assert stats.restarts == 1 and stats.workers[0].restarts == 1 and stats.frames == 64
    assert restarted[0] is not None and restarted[1] is None
    assert (restarted[0].worker, restarted[0].env, restarted[0].restarts) == (0, 0, 1)
    assert restarted[0].cause == "EnvFailure: step 10 failed"


async def test_collector_restart_at_a_batch_start_starts_a_new_trajectory() -> None:
    env = Faulty(at=(9,))  # calls 1-8 fill the first batch; the 9th is the second batch's first step
    batches = await collect(Collector(env, frames_per_batch=8, total_frames=24, restart=FAST))
    check_contract(batches)
    assert batches[1]["collector", "traj_ids"][0] != batches[0]["collector", "traj_ids"][-1]
    assert not batches[0]["next", "truncated"][-1].item()  # delivered before the fault: left as it was


async def test_collector_env_raises_every_few_steps() -> None:
    env = Faulty(every=7)
    collector = Collector(env, LeftPolicy(), frames_per_batch=32, total_frames=256, restart=FAST)
    batches = await collect(collector)
    frames, cut = check_contract(batches)
    assert frames == 256
    restarts = collector.statistics().restarts
    assert restarts == env.calls // 7 and restarts > 30
    # every restart but those at a batch's first step cuts the frame before it
    assert restarts - len(batches) <= cut <= restarts


async def test_collector_budget_spent_raises_the_env_error_promptly(leaks: Any, timing: Timing) -> None:
    env = Faulty(always=True)
    policy = RestartPolicy(max_restarts=3, window=60.0, backoff=0.01)
    collector = Collector(env, frames_per_batch=16, total_frames=64, restart=policy)
    start = time.monotonic()
    with pytest.raises(EnvFailure, match="step 4 failed") as info:
        await collect(collector)
    timing.bound(time.monotonic() - start, 2.0, "the spent budget's error")
    assert any("restart budget spent: 3 restart(s) within 60 s" in n for n in info.value.__notes__)
    assert env.built == 4 and env.closed == 4  # each failed env closed once, the last by the collector
    assert collector.statistics().restarts == 3


async def test_a_failed_rebuild_counts_and_is_retried() -> None:
    env = Faulty(at=(5,))
    env.failed_builds = {2}  # the first rebuild raises: the second one runs
    collector = Collector(env, frames_per_batch=16, total_frames=32, restart=FAST)
    batches = await collect(collector)
    assert check_contract(batches) == (32, 1)
    assert env.built == 3 and collector.statistics().restarts == 2


async def test_without_a_policy_the_first_error_ends_the_run() -> None:
    env = Faulty(at=(3,))
    with pytest.raises(EnvFailure, match="step 3 failed"):
        await collect(Collector(env, frames_per_batch=16, total_frames=64))
    assert env.built == 1


async def test_policy_errors_are_not_restarted() -> None:
    calls = [0]

    def broken(td: TensorDictBase) -> TensorDictBase:
        calls[0] += 1
        if calls[0] > 3:  # the dry call and two steps go well
            raise KeyError("policy bug")
        return td.set("action", torch.zeros((), dtype=torch.int64))

    env = Faulty()
    collector = Collector(env, broken, frames_per_batch=16, total_frames=64, restart=FAST)
    with pytest.raises(KeyError, match="policy bug"):
        await collect(collector)
    assert env.built == 1 and env.calls == 2 and collector.statistics().restarts == 0


def test_restart_needs_an_env_factory() -> None:
    with pytest.raises(TypeError, match="create_env_fn is an env instance"):
        Collector(GymEnv("CartPole-v1"), frames_per_batch=8, restart=FAST)


async def test_backoff_is_cut_short_by_close(leaks: Any) -> None:
    env = Faulty(at=(3,))
    env.raised = threading.Event()
    slow = RestartPolicy(max_restarts=1, backoff=60.0, max_backoff=60.0)
    async with Collector(env, frames_per_batch=16, total_frames=64, restart=slow) as collector:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(collector.__anext__)
                await anyio.to_thread.run_sync(env.raised.wait)  # the rollout thread: to its backoff
                tg.cancel_scope.cancel()
    assert env.closed == env.built


# -- worker processes ---------------------------------------------------------------------------------
def _multi(kind: str, env: Faulty, policy: RestartPolicy, total: int = 256) -> Any:
    """The flat keyword (sync), or the field of ``rollout=`` (async): the same option either way."""
    if kind == "sync":  # each worker unpickles its own copy of ``env``
        return MultiSyncCollector([env, env], frames_per_batch=64, total_frames=total, seed=1, restart=policy)
    options = RolloutOptions(frames_per_batch=64, total_frames=total, seed=1, restart=policy)
    return MultiAsyncCollector([env, env], rollout=options)


@rotating()
async def test_workers_restart_their_envs(kind: str, leaks: Any) -> None:
    collector = _multi(kind, Faulty(every=9), FAST)
    async with collector.events(kinds=["restarted"]) as events:
        batches = await collect(collector)
        restarted = []
        while (event := events.receive_nowait()) is not None:
            restarted.append(event)
    # the trainer sees each worker's restarts: an event each, counted per worker and in all
    workers = collector.statistics().workers
    assert restarted and {e.worker for e in restarted} <= {0, 1} and {e.env for e in restarted} == {0}
    assert [w.restarts for w in workers] == [sum(e.worker == i for e in restarted) for i in (0, 1)]
    assert collector.statistics().restarts == len(restarted)
    frames = 0
    cut = 0
    for batch in batches:
        for part in [batch[0], batch[1]] if kind == "sync" else [batch]:  # sync: [workers, T]
            f, c = check_contract([part])
            frames += f
            cut += c
    assert frames == 256
    assert cut > 0


@rotating()
async def test_workers_budget_spent_raises_the_env_error(kind: str, leaks: Any, timing: Timing) -> None:
    collector = _multi(kind, Faulty(always=True), RestartPolicy(max_restarts=2, backoff=0.0))
    entered: list[float] = []
    with pytest.raises(EnvFailure) as info:
        await collect(collector, entered)
    # the workers are up: they fail at their first step
    timing.bound(time.monotonic() - entered[0], 2.0, "the spent budget's error")
    assert any("restart budget spent: 2 restart(s)" in n for n in info.value.__notes__)


# -- AsyncEnvCollector ------------------------------------------------------------------------------
class AsyncFaulty(Faulty):
    """:class:`Faulty`'s faults for async envs: each env's episodes never end on their own (so every
    truncated frame is a restart's cut); its observation is its step count."""

    def __call__(self) -> _AsyncEnv:  # type: ignore[override]
        self.built += 1
        return _AsyncEnv(self)


class _AsyncEnv:
    observation_space = gym.spaces.Box(0, 10**6, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, owner: Faulty) -> None:
        self.owner = owner
        self.t = 0

    async def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
        self.owner.seeds.append(seed)
        self.t = 0
        return np.zeros(1, np.float32), {}

    async def step(self, action: int) -> Any:
        await anyio.lowlevel.checkpoint()
        self.owner.fault()
        self.t += 1
        return np.full(1, self.t, np.float32), 1.0, False, False, {}

    async def close(self) -> None:
        self.owner.closed += 1


def check_async_contract(batches: list[TensorDictBase]) -> int:
    """Per env, over its frames in order: a trajectory id changes only after a done frame or between
    batches, and never comes back; returns the truncated frames (the restarts' cuts)."""
    last: dict[int, tuple[int, int, bool]] = {}  # env id: (traj id, batch, done)
    seen: set[int] = set()
    cut = 0
    for b, batch in enumerate(batches):
        envs = batch["collector", "env_id"].tolist()
        ids = batch["collector", "traj_ids"].tolist()
        done = batch["next", "done"].reshape(-1).tolist()
        truncated = batch["next", "truncated"].reshape(-1).tolist()
        for env, i, d in zip(envs, ids, done, strict=True):
            before = last.get(env)
            if before is None or before[0] != i:
                assert i not in seen, f"trajectory {i} goes on after another one"
                seen.add(i)
                assert before is None or before[2] or before[1] != b, f"env {env}'s trajectory ends undone"
            last[env] = (i, b, d)
        cut += sum(truncated)
    return cut


async def test_async_envs_restart(anyio_backend: Any) -> None:
    from aiocollect import AsyncEnvCollector

    faulty = AsyncFaulty(every=23)
    fns = [faulty] * 4
    collector = AsyncEnvCollector(fns, frames_per_batch=32, total_frames=256, seed=3, restart=FAST)
    async with collector.events(kinds=["restarted"]) as events:
        batches = await collect(collector)
        restarted = []
        while (event := events.receive_nowait()) is not None:
            restarted.append(event)
    assert sum(b.numel() for b in batches) == 256
    cut = check_async_contract(batches)
    restarts = collector.statistics().restarts
    assert restarts == faulty.calls // 23 == len(restarted) > 5
    assert 0 < cut <= restarts
    assert faulty.built == 4 + restarts and faulty.closed == faulty.built
    assert {e.env for e in restarted} <= {0, 1, 2, 3} and all(e.worker == 0 for e in restarted)
    # env i is reset with seed 3 + i at first, with derive_seed(3 + i, k) after its k-th restart
    assert sorted(faulty.seeds[:4]) == [3, 4, 5, 6]  # the tasks start in any order
    assert set(faulty.seeds[4:]) <= {derive_seed(3 + i, k) for i in range(4) for k in range(1, restarts + 1)}


async def test_async_env_budget_spent(timing: Timing) -> None:
    from aiocollect import AsyncEnvCollector

    faulty = AsyncFaulty(always=True)
    policy = RestartPolicy(max_restarts=2, backoff=0.0)
    collector = AsyncEnvCollector([faulty], frames_per_batch=8, total_frames=32, restart=policy)
    entered: list[float] = []
    with pytest.raises(EnvFailure, match="step 3 failed") as info:
        await collect(collector, entered)
    timing.bound(time.monotonic() - entered[0], 2.0, "the spent budget's error")
    assert any("restart budget spent: 2 restart(s)" in n for n in info.value.__notes__)
    assert faulty.closed == faulty.built == 3


async def test_async_env_budget_spent_then_dropped() -> None:
    from aiocollect import AsyncEnvCollector

    always, healthy = AsyncFaulty(always=True), AsyncFaulty()
    policy = RestartPolicy(max_restarts=2, backoff=0.0)
    collector = AsyncEnvCollector(
        [always, healthy], frames_per_batch=8, total_frames=32, restart=policy, on_env_error="drop"
    )
    batches = await collect(collector)
    assert sum(b.numel() for b in batches) == 32
    assert set(torch.cat([b["collector", "env_id"] for b in batches]).tolist()) == {1}
    assert [w.restarts for w in collector.statistics().workers] == [2, 0]
    assert always.closed == always.built == 3


async def test_async_vector_env_restarts_whole() -> None:
    from aiocollect import AsyncEnvCollector

    faulty = Faulty(every=40)

    def make() -> gym.vector.VectorEnv:  # a gymnasium vector env: the collector steps it in a thread
        faulty.built += 1
        return gym.vector.SyncVectorEnv([lambda: _FaultyWrapper(gym.make("CartPole-v1"), faulty)] * 3)

    single = Faulty(every=40)

    def make_single() -> gym.Env:  # a gymnasium env: stepped in a thread too
        return _FaultyWrapper(gym.make("CartPole-v1"), single)

    collector = AsyncEnvCollector([make, make_single], frames_per_batch=30, total_frames=300, restart=FAST)
    batches = await collect(collector)
    assert sum(b.numel() for b in batches) == 300
    check_async_contract(batches)
    workers = collector.statistics().workers
    assert len(workers) == 4 and workers[1].restarts == workers[2].restarts == 0  # on the first row
    assert workers[0].restarts == faulty.calls // 40 > 0 and workers[3].restarts == single.calls // 40
    # a restart counts when it is admitted (its Restarted event goes out then): the run may reach its
    # total_frames while the last admitted rebuild is still waiting, and that one never builds
    assert faulty.built - 1 <= workers[0].restarts <= faulty.built


@one_backend()
async def test_async_env_workers_restart(leaks: Any) -> None:
    from aiocollect import MultiAsyncEnvCollector

    faulty = AsyncFaulty(every=17)  # each worker process unpickles its own copy
    collector = MultiAsyncEnvCollector(
        [[faulty] * 2, [faulty] * 2], frames_per_batch=32, total_frames=256, restart=FAST
    )
    restarted = []
    async with collector.events(kinds=["restarted"]) as events:
        batches = await collect(collector)
        while (event := events.receive_nowait()) is not None:
            restarted.append(event)
    assert sum(b.numel() for b in batches) == 256
    assert check_async_contract(batches) > 0
    assert (
        restarted and {e.worker for e in restarted} <= {0, 1} and {e.env for e in restarted} <= {0, 1, 2, 3}
    )
    assert collector.statistics().restarts == len(restarted)


# -- node-hosted collectors (torch.distributed and RPC nodes, Ray actors) ---------------------------------
def test_remote_collectors_send_the_policy_typed() -> None:
    from aiocollect._remote._args import member_rollouts

    kwargs = [{"restart": FAST}, {"restart": FAST}]
    options = member_rollouts(kwargs, 64)
    assert [o.restart for o in options] == [FAST, FAST] and kwargs == [{}, {}]


async def test_a_node_restarts_its_env() -> None:
    import cloudpickle

    from aiocollect._remote._messages import HostSpec
    from aiocollect._remote._node import NodeCore

    rollout = RolloutOptions(frames_per_batch=16, total_frames=-1, restart=FAST).for_member(0, 2)
    env = Faulty(at=(6,))
    host = HostSpec(0, 2, cloudpickle.dumps((env, Collector, {})), cloudpickle.dumps(None), rollout)
    core = NodeCore.from_spec(host)
    async with core:
        with anyio.fail_after(10):
            batch = (await core.next_batch()).batch
        assert core.collector.statistics().restarts == 1
    assert check_contract([batch]) == (16, 1)
    assert batch["next", "truncated"][4].item()  # calls 1-5: frames 0-4
    assert all(i % 2 == 0 for i in batch["collector", "traj_ids"].tolist())  # member 0 of 2's ids
