"""Where the time goes: ``statistics().trainer_wait``, ``collector_wait`` and ``time_split`` on workloads
whose answer is known (an env that sleeps, a policy that sleeps, a trainer that sleeps), and the window's
arithmetic on its own. Tolerances are wide: they must hold on a loaded 2-core machine."""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial
from typing import Any

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch

from aiocollect import (
    AsyncEnvCollector,
    Collector,
    CollectorStatistics,
    GymEnv,
    MultiAsyncCollector,
    MultiAsyncEnvCollector,
    MultiSyncCollector,
)
from aiocollect._observe._sinks import statistics_scalars
from aiocollect._observe._stats import StatsTracker
from aiocollect._observe._timesplit import (
    PARTS,
    SplitClock,
    SplitWindow,
    SplitWindows,
    combine_splits,
    member_split,
)
from support import HookedEnv, Timing

PARTS_SET = set(PARTS)


def slow_env(step_delay: float = 0.0) -> GymEnv:
    return GymEnv(HookedEnv(gym.make("CartPole-v1"), step_delay=step_delay))


class SleepyPolicy(torch.nn.Module):
    """CartPole's action 0, after sleeping ``delay`` seconds (a slow forward pass)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay)
        return torch.zeros(observation.shape[:-1], dtype=torch.int64)


def lead(split: dict[str, float], part: str) -> float:
    """How much ``part``'s share exceeds the largest other part's (> 0: it is the largest)."""
    return split[part] - max(v for k, v in split.items() if k != part)


def check_split(split: dict[str, float] | None, per_frame: dict[str, float] | None) -> None:
    assert split is not None and per_frame is not None
    assert set(split) == PARTS_SET == set(per_frame)
    assert all(v >= 0 for v in split.values()) and all(v >= 0 for v in per_frame.values())
    assert sum(split.values()) == pytest.approx(1.0, abs=1e-6)


# -- the window's arithmetic ------------------------------------------------------------------------------
def test_window_reads_the_parts_of_its_span() -> None:
    window = SplitWindow(window_s=10.0)
    assert window.seconds() is None
    # (now, started, env, policy, transfer, wait, frames)
    window.add((10.0, 0.0, 4.0, 2.0, 1.0, 2.0, 100))
    wall, parts, frames = window.seconds()  # type: ignore[misc]
    assert (wall, frames) == (10.0, 100)  # since the producer started
    assert parts == pytest.approx([4.0, 2.0, 1.0, 2.0, 1.0])
    window.add((20.0, 0.0, 14.0, 2.0, 1.0, 2.0, 300))  # 10 s of env only
    fractions, per_frame = window.read()
    assert fractions["env"] == pytest.approx(1.0)
    assert per_frame["env"] == pytest.approx(10.0 * 1e6 / 200)
    window.add((35.0, 0.0, 14.0, 2.0, 1.0, 17.0, 300))  # then 15 s of waiting: the window forgets env
    fractions, _ = window.read()
    assert fractions["wait"] == pytest.approx(1.0)


def test_window_ignores_a_sender_without_a_clock() -> None:
    window = SplitWindow()
    window.add(())
    assert window.seconds() is None
    assert combine_splits([None, None]) is None


def test_combined_split_weights_producers_by_their_time() -> None:
    busy = (10.0, [10.0, 0.0, 0.0, 0.0, 0.0], 1000)
    idle = (10.0, [0.0, 0.0, 0.0, 10.0, 0.0], 0)
    fractions, per_frame = combine_splits([busy, idle, None])  # type: ignore[misc]
    assert fractions["env"] == pytest.approx(0.5) and fractions["wait"] == pytest.approx(0.5)
    assert per_frame["env"] == pytest.approx(10.0 * 1e6 / 1000)


def test_a_hosted_collectors_producers_read_together() -> None:
    """A node's or actor's batches carry one Totals per producer of its collector: the windows of each
    read as one, like a collector's workers; a node without a split (or a malformed entry) adds nothing."""
    windows = SplitWindows(window_s=10.0)
    assert windows.seconds() is None and member_split(windows) is None
    windows.add(())  # an older node: no split
    windows.add([(10.0, 0.0, 10.0, 0.0, 0.0, 0.0, 100), ()])  # producer 1 not heard from yet
    assert windows.seconds() == (10.0, pytest.approx([10.0, 0.0, 0.0, 0.0, 0.0]), 100)
    # producer 1 on its own clock (another process): 5 s of waiting
    windows.add([(20.0, 0.0, 20.0, 0.0, 0.0, 0.0, 200), (105.0, 100.0, 0.0, 0.0, 0.0, 5.0, 0), "bad"])
    wall, parts, frames = windows.seconds()  # type: ignore[misc]
    # producer 0 from its older sample on (10 s, 100 frames), producer 1 since it started (5 s)
    assert (wall, frames) == (pytest.approx(15.0), 100)
    assert parts == pytest.approx([10.0, 0.0, 0.0, 5.0, 0.0])
    fractions, per_frame = windows.read()
    assert fractions["env"] == pytest.approx(2 / 3) and fractions["wait"] == pytest.approx(1 / 3)
    assert per_frame["env"] == pytest.approx(10.0 * 1e6 / 100)

    class Member:
        time_split = windows

    assert member_split(Member()) == windows.seconds()


def test_clock_counts_an_open_wait() -> None:
    clock = SplitClock()
    with clock.waiting():
        time.sleep(0.01)
        inside = clock.totals()[5]
    assert inside >= 0.009
    assert clock.wait >= inside


# -- known workloads ----------------------------------------------------------------------------------------


async def run(collector: Any, train: float = 0.0) -> CollectorStatistics:
    with anyio.fail_after(60):
        async with collector:
            async for _ in collector:
                if train:
                    await anyio.sleep(train)  # the trainer's own work: not awaiting a batch
            return collector.statistics()


@pytest.mark.anyio
async def test_env_bound_collector(timing: Timing) -> None:
    """An env sleeping 1 ms per step, a trainer doing nothing: the trainer waits, the env takes the time.
    Shares of time are speed figures (the ``timed`` instance checks them); the verdict is that the env's
    sleep is counted as env time (at least 1 ms a frame, however loaded the machine)."""
    stats = await run(Collector(partial(slow_env, 0.001), None, frames_per_batch=20, total_frames=300))
    assert stats.trainer_wait is not None and stats.collector_wait is not None
    check_split(stats.time_split, stats.time_split_us)
    assert stats.time_split_us["env"] > 800  # type: ignore[index]  # µs per frame: a 1 ms sleep per frame
    timing.share(stats.trainer_wait, above=0.7, what="trainer_wait")
    timing.share(stats.time_split["env"], above=0.6, what="env share")  # type: ignore[index]
    timing.share(stats.collector_wait, below=0.3, what="collector_wait")
    (worker,) = stats.workers
    assert worker.time_split == stats.time_split and worker.collector_wait == stats.collector_wait


@pytest.mark.anyio
async def test_trainer_bound_collector(timing: Timing) -> None:
    """A fast env and a trainer sleeping 30 ms per batch: the batches wait for the trainer."""
    stats = await run(Collector(slow_env, None, frames_per_batch=20, total_frames=200), train=0.03)
    assert stats.trainer_wait is not None and stats.collector_wait is not None
    check_split(stats.time_split, stats.time_split_us)
    assert stats.time_split["wait"] == stats.collector_wait  # type: ignore[index]
    timing.share(stats.trainer_wait, below=0.5, what="trainer_wait")
    timing.share(stats.collector_wait, above=0.5, what="collector_wait")


@pytest.mark.anyio
@pytest.mark.parametrize("fused", [True, False], ids=["fused-loop", "generic-loop"])
async def test_policy_bound_collector(fused: bool, timing: Timing) -> None:
    """A policy sleeping 2 ms per call: the policy takes the time (the env's share is small), in GymEnv's
    fused loop and in the rollout's generic one (``max_frames_per_traj`` takes it)."""
    kwargs: dict[str, Any] = {} if fused else {"max_frames_per_traj": 50}
    collector = Collector(slow_env, SleepyPolicy(0.002), frames_per_batch=20, total_frames=200, **kwargs)
    assert collector._rollout.env.fused_gym is not None  # fused, unless max_frames_per_traj
    stats = await run(collector)
    check_split(stats.time_split, stats.time_split_us)
    assert stats.time_split_us["policy"] > 1500  # type: ignore[index]  # a 2 ms sleep per call
    timing.share(stats.time_split["policy"], above=0.6, what="policy share")  # type: ignore[index]
    timing.share(stats.time_split["env"], below=0.3, what="env share")  # type: ignore[index]


@pytest.mark.anyio
async def test_statistics_before_the_first_batch() -> None:
    collector = Collector(slow_env, None, frames_per_batch=20, total_frames=40)
    stats = collector.statistics()
    assert stats.trainer_wait is None  # the consumer has not asked yet
    await collector.aclose()
    json_ready = stats.to_dict()
    assert "time_split" in json_ready and "trainer_wait" in json_ready


@pytest.mark.anyio
@pytest.mark.parametrize("kind", [MultiSyncCollector, MultiAsyncCollector])
async def test_workers_report_their_split(kind: type, timing: Timing) -> None:
    """Each worker process measures its own split and sends it with its batch notices."""
    collector = kind(
        [partial(slow_env, 0.002)] * 2, None, frames_per_batch=40, total_frames=400, worker_backend="process"
    )
    stats = await run(collector)
    check_split(stats.time_split, stats.time_split_us)
    assert stats.time_split is not None and stats.time_split_us is not None
    assert stats.time_split_us["env"] > 1500  # µs per frame: a 2 ms sleep per step, in every worker
    # env-bound: the env is the largest part (on a loaded machine the hand-offs' share grows)
    timing.share(lead(stats.time_split, "env"), above=0.0, what="env's lead over the next part")
    timing.share(stats.time_split["env"], above=0.3, what="env share")
    timing.share(stats.trainer_wait, above=0.5, what="trainer_wait")
    assert len(stats.workers) == 2
    for worker in stats.workers:
        check_split(worker.time_split, worker.time_split_us)
        assert worker.time_split is not None and worker.collector_wait == worker.time_split["wait"]
        assert worker.time_split_us is not None and worker.time_split_us["env"] > 1500
        timing.share(lead(worker.time_split, "env"), above=0.0, what=f"worker {worker.worker_id}'s env lead")


@pytest.mark.anyio
async def test_serial_workers_wait_for_the_trainer(timing: Timing) -> None:
    collector = MultiSyncCollector(
        [slow_env] * 2, None, frames_per_batch=40, total_frames=200, worker_backend="serial"
    )
    stats = await run(collector, train=0.04)
    assert stats.collector_wait is not None and all(w.collector_wait is not None for w in stats.workers)
    timing.share(stats.collector_wait, above=0.5, what="collector_wait")
    for w in stats.workers:
        timing.share(w.collector_wait, above=0.4, what=f"worker {w.worker_id}'s collector_wait")


def test_sinks_write_the_idle_ratios_and_the_split() -> None:
    split = dict.fromkeys(PARTS, 0.2)
    stats = CollectorStatistics(100, 1, 0, None, None, 50.0, 0, trainer_wait=0.9, collector_wait=0.2)
    stats = replace(stats, time_split=split, time_split_us=split)
    scalars = statistics_scalars(stats)
    assert scalars["collector/trainer_wait"] == 0.9
    assert scalars["collector/collector_wait"] == 0.2
    assert {f"collector/time_split/{p}" for p in PARTS} <= set(scalars)
    assert {f"collector/time_split_us/{p}" for p in PARTS} <= set(scalars)


class SleepyAsyncEnv:
    """An async env (CartPole's spaces) whose step awaits ``delay`` seconds: a network call."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.t = 0

    async def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
        self.t = 0
        return np.zeros(4, np.float32), {}

    async def step(self, action: Any) -> Any:
        await anyio.sleep(self.delay)
        self.t += 1
        return np.zeros(4, np.float32), 1.0, self.t >= 20, False, {}

    async def close(self) -> None:
        pass


@pytest.mark.anyio
async def test_async_env_engine_split(timing: Timing) -> None:
    """The engine's policy task: awaiting the envs (env), the policy, the consumer (wait)."""
    fns = [partial(SleepyAsyncEnv, 0.005) for _ in range(4)]
    stats = await run(AsyncEnvCollector(fns, frames_per_batch=40, total_frames=400))
    check_split(stats.time_split, stats.time_split_us)
    assert stats.trainer_wait is not None
    timing.share(stats.time_split["env"], above=0.5, what="env share")  # type: ignore[index]
    timing.share(stats.trainer_wait, above=0.5, what="trainer_wait")
    fast = [partial(SleepyAsyncEnv, 0.0) for _ in range(4)]
    stats = await run(AsyncEnvCollector(fast, frames_per_batch=20, total_frames=100), train=0.2)
    check_split(stats.time_split, stats.time_split_us)
    assert stats.collector_wait is not None and stats.trainer_wait is not None
    timing.share(stats.collector_wait, above=0.5, what="collector_wait, the trainer slow")
    timing.share(stats.trainer_wait, below=0.5, what="trainer_wait, the trainer slow")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [("asyncio", {"use_uvloop": False})])
async def test_async_env_workers_report_their_split(timing: Timing) -> None:
    """Each worker process of MultiAsyncEnvCollector sends its engine's totals with its batch notices."""
    fns = [[partial(SleepyAsyncEnv, 0.005) for _ in range(3)] for _ in range(2)]
    stats = await run(MultiAsyncEnvCollector(fns, frames_per_batch=30, total_frames=300))
    check_split(stats.time_split, stats.time_split_us)
    timing.share(stats.time_split["env"], above=0.4, what="env share")  # type: ignore[index]
    assert len(stats.workers) == 2
    for worker in stats.workers:
        check_split(worker.time_split, worker.time_split_us)


@pytest.mark.anyio
async def test_split_outlives_the_workers() -> None:
    """After the collector closed (its workers gone), statistics() keeps their last measured split."""
    collector = MultiSyncCollector(
        [slow_env] * 2, None, frames_per_batch=40, total_frames=120, worker_backend="serial"
    )
    inside = await run(collector)
    after = collector.statistics()
    assert inside.time_split is not None and after.time_split == inside.time_split
    assert [w.time_split for w in after.workers] == [w.time_split for w in inside.workers]


@pytest.mark.anyio
async def test_a_closed_collector_keeps_its_last_split() -> None:
    collector = Collector(partial(slow_env, 0.001), None, frames_per_batch=20, total_frames=100)
    inside = await run(collector)
    await anyio.sleep(
        0.05
    )  # a closed collector's numbers do not drift (a window for a change that must not come)
    assert collector.statistics().time_split == inside.time_split


def test_the_consumer_waits_kept_are_bounded_by_the_window_when_never_read() -> None:
    """A run of days whose trainer never reads trainer_wait keeps a window of waits, not one per batch."""
    tracker = StatsTracker(rate_window_s=0.05)
    for _ in range(50):
        tracker.awaiting()
        tracker.record(8, [], [])
    time.sleep(0.06)  # past the 0.05 s window (a sleep never ends early: the behaviour under test)
    tracker.awaiting()
    tracker.record(8, [], [])
    assert len(tracker._waits) <= 2
    assert tracker.trainer_wait() is not None
