"""On-policy asynchronous collection: ``update_weights(flush=True)`` and ``max_policy_lag`` on
``MultiAsyncCollector`` (stale batches dropped, rollouts in flight restarted, discarded frames counted),
and per-worker ``frames_per_batch``."""

from __future__ import annotations

import random
import time

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch

from aiocollect import GymEnv, MultiAsyncCollector, MultiSyncCollector, PipeWeightSync
from support import ConstantPolicy, cartpole, children, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("leaks")]


class CounterEnv(gym.Env):
    """Observation ``[steps since reset, steps since the env was built]``, each step sleeping ``delay``:
    shows whether an env was reset and how many steps no batch holds. Episodes end every 50 steps."""

    observation_space = gym.spaces.Box(0, np.inf, (2,), np.float32)
    action_space = gym.spaces.Box(-np.inf, np.inf, (1,), np.float32)

    def __init__(self, delay: float = 0.002) -> None:
        self.delay = delay
        self.since_reset = 0
        self.total = 0

    def _obs(self) -> np.ndarray:
        return np.array([self.since_reset, self.total], np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.since_reset = 0
        return self._obs(), {}

    def step(self, action):
        time.sleep(self.delay)
        self.since_reset += 1
        self.total += 1
        return self._obs(), 1.0, False, self.since_reset >= 50, {}


def counter_env() -> GymEnv:
    return GymEnv(CounterEnv())


def set_value(policy: ConstantPolicy, value: float) -> None:
    with torch.no_grad():
        policy.value.fill_(value)


def check_batch(batch, version: int, value: float | None = None) -> None:
    """Every frame collected with ``version`` (the action is the weight: ``value``, by default the version
    number), and the batch's own invariants: within a trajectory, each frame's observation is the
    previous frame's next observation."""
    assert (batch["collector", "policy_version"] == version).all()
    expected = float(version) if value is None else value
    assert torch.allclose(batch["action"], torch.tensor(expected))
    ids = batch["collector", "traj_ids"]
    assert (ids >= 0).all()
    same = ids[1:] == ids[:-1]
    assert torch.equal(batch["observation"][1:][same], batch["next", "observation"][:-1][same])
    # a trajectory that goes on from one frame to the next is never reset in between
    assert (batch["observation"][1:, 0][same] == batch["observation"][:-1, 0][same] + 1).all()


class Continuity:
    """Per worker, the batches in delivery order: checks that consecutive batches of a worker join
    (same env, never reset at a batch boundary) and sums the env steps no delivered batch holds."""

    def __init__(self) -> None:
        self.last: dict[int, torch.Tensor] = {}  # worker -> last frame's ("next", "observation")
        self.last_id: dict[int, int] = {}
        self.ids: set[int] = set()
        self.gaps = 0

    def add(self, batch) -> None:
        worker = int(batch["collector", "worker_id"][0])
        first = batch["observation"][0]
        ids = batch["collector", "traj_ids"]
        previous = self.last.get(worker, torch.zeros(2))
        gap = int(first[1] - previous[1])
        assert gap >= 0
        self.gaps += gap
        # the env went on from where the last batch left it (never reset for a restart): `gap` steps on
        # (an episode is truncated, and the env reset, after 50 steps)
        assert int(first[0]) == (int(previous[0]) % 50 + gap) % 50
        if gap:  # frames are missing in between: the trajectory goes on under a fresh id
            assert int(ids[0]) != self.last_id.get(worker, -1)
        ended = set(self.last_id.values()) | self.ids
        assert not (set(ids.unique().tolist()) - {self.last_id.get(worker, -1)}) & ended, (
            "a trajectory id came back after its trajectory was left"
        )
        self.ids |= set(ids.unique().tolist())
        self.last[worker] = batch["next", "observation"][-1]
        self.last_id[worker] = int(ids[-1])


@pytest.mark.parametrize("workers", [1, 2])
async def test_flush_delivers_only_the_new_version(workers):
    policy = ConstantPolicy(0.0)
    seen = Continuity()
    with anyio.fail_after(60):
        async with MultiAsyncCollector(
            [counter_env] * workers, policy, frames_per_batch=20, track_policy_version=True
        ) as c:
            batch = await c.__anext__()
            check_batch(batch, 0)
            seen.add(batch)
            for version in range(1, 5):
                set_value(policy, float(version))
                assert await c.update_weights(policy, flush=True) == version
                for _ in range(2 * workers):
                    batch = await c.__anext__()
                    check_batch(batch, version)
                    seen.add(batch)
            # every worker delivered after the last flush: whatever was discarded lies between batches
            stats = c.statistics()
    assert stats.frames_discarded > 0  # 20-step rollouts of 2 ms steps were in flight at each update
    assert stats.frames_discarded == seen.gaps
    assert stats.frames == 20 * (1 + 8 * workers)


async def test_flush_restarts_a_rollout_in_flight_without_resetting_the_env():
    """One worker, a slow env: the update lands mid-rollout; the next batch starts on the new weights
    where the env stood (not reset), after exactly the steps that were discarded."""
    policy = ConstantPolicy(0.0)
    seen = Continuity()
    with anyio.fail_after(60):
        async with MultiAsyncCollector(
            [counter_env], policy, frames_per_batch=30, track_policy_version=True
        ) as c:
            seen.add(await c.__anext__())
            # the worker's next batch waits in its slot: it is on its next-but-one, whose frames and the
            # waiting batch's the flush discards
            await wait_until(lambda: c._pool.deliveries.statistics().current_buffer_used > 0)
            set_value(policy, 1.0)
            await c.update_weights(policy, flush=True)
            batch = await c.__anext__()
            check_batch(batch, 1)
            seen.add(batch)
            assert c.statistics().frames_discarded == seen.gaps > 0
            assert 0 < int(batch["observation"][0, 0]) < 50 or seen.gaps >= 20  # carried on, not reset


@pytest.mark.parametrize("workers", [1, 2])
async def test_max_policy_lag_zero_flushes_every_update(workers):
    """Every batch on the newest weights, in a training loop; the workers wait while the trainer
    trains (one slot each, handed back when the next batch is asked for), so one worker wastes
    nothing, and several waste at most what was in flight when the trainer stopped asking."""
    policy = ConstantPolicy(0.0)
    seen = Continuity()
    with anyio.fail_after(60):
        async with MultiAsyncCollector(
            [counter_env] * workers,
            policy,
            frames_per_batch=10,
            track_policy_version=True,
            max_policy_lag=0,
            total_frames=10 * 12,
        ) as c:
            async for batch in c:
                check_batch(batch, c.policy_version)
                seen.add(batch)
                await anyio.sleep(0.05)  # training: 25 steps' worth (the trainer's pace, under test)
                set_value(policy, float(c.policy_version + 1))
                await c.update_weights(policy)
            stats = c.statistics()
    assert stats.frames == 120 and stats.policy_version == 12
    if workers == 1:
        assert stats.frames_discarded == seen.gaps == 0
    else:  # the other worker's batch, at most, per update
        assert 0 < stats.frames_discarded <= 10 * 12
        assert stats.frames_discarded >= seen.gaps


async def test_max_policy_lag_zero_serial_workers():
    """The same worker code as threads (``worker_backend="serial"``)."""
    policy = ConstantPolicy(0.0)
    seen = Continuity()
    with anyio.fail_after(60):
        async with MultiAsyncCollector(
            [counter_env] * 2,
            policy,
            frames_per_batch=10,
            track_policy_version=True,
            max_policy_lag=0,
            total_frames=10 * 8,
            worker_backend="serial",
        ) as c:
            async for batch in c:
                check_batch(batch, c.policy_version)
                seen.add(batch)
                set_value(policy, float(c.policy_version + 1))
                await c.update_weights(policy)
            assert c.statistics().frames_discarded >= seen.gaps


async def test_max_policy_lag_one_allows_one_version_behind():
    policy = ConstantPolicy(0.0)
    with anyio.fail_after(60):
        async with MultiAsyncCollector(
            [counter_env] * 2, policy, frames_per_batch=10, track_policy_version=True, max_policy_lag=1
        ) as c:
            for _ in range(10):
                batch = await c.__anext__()
                (version,) = batch["collector", "policy_version"].unique().tolist()
                assert c.policy_version - version <= 1
                check_batch(batch, version)
                set_value(policy, float(c.policy_version + 1))
                await c.update_weights(policy)


async def test_flush_over_the_pipe_scheme_and_a_subset_of_workers():
    policy = ConstantPolicy(0.0)
    with anyio.fail_after(60):
        async with MultiAsyncCollector(
            [counter_env] * 2,
            policy,
            frames_per_batch=10,
            track_policy_version=True,
            weight_sync=PipeWeightSync(),
        ) as c:
            set_value(policy, 1.0)
            await c.update_weights(policy, worker_ids=[1], flush=True)
            workers_seen = set()
            for _ in range(8):
                batch = await c.__anext__()
                worker = int(batch["collector", "worker_id"][0])
                workers_seen.add(worker)
                if worker == 1:
                    check_batch(batch, 1)
                else:  # not targeted: it goes on with version 0
                    check_batch(batch, 0)
            assert workers_seen == {0, 1}


async def test_cancelled_flush_leaves_the_collector_consistent():
    """A flush cancelled at any point: no slot is lost (every worker keeps delivering), no batch below a
    floor that was raised is delivered, and nothing is left behind on exit (the leak check)."""
    policy = ConstantPolicy(0.0)
    with anyio.fail_after(60):
        async with MultiAsyncCollector(
            [counter_env] * 2, policy, frames_per_batch=10, track_policy_version=True
        ) as c:
            values = {0: 0.0}  # version -> the weight its batches ran (an update's weight is its attempt)
            for attempt, delay in enumerate((0.0, 0.0005, 0.001, 0.003, 0.01, 1.0), start=1):
                set_value(policy, float(attempt))
                with anyio.move_on_after(delay):
                    await c.update_weights(policy, flush=True)
                floor = c.policy_version  # the last version whose update completed
                counts = {0: 0, 1: 0}
                while min(counts.values()) < 2:
                    batch = await c.__anext__()
                    (got,) = batch["collector", "policy_version"].unique().tolist()
                    assert got >= floor
                    (weight,) = batch["action"].unique().tolist()
                    assert values.setdefault(got, weight) == weight <= attempt
                    check_batch(batch, got, weight)
                    counts[int(batch["collector", "worker_id"][0])] += 1
            assert list(values.values()) == sorted(values.values())
            assert c.policy_version >= 1  # the last, uncancelled one completed
    assert not children()


async def test_cancelled_consumer_during_flush():
    """A consumer cancelled while it waits for a batch that a flush is dropping: the next one still
    comes, on the new weights."""
    policy = ConstantPolicy(0.0)
    with anyio.fail_after(60):
        async with MultiAsyncCollector(
            [counter_env] * 2, policy, frames_per_batch=20, track_policy_version=True
        ) as c:
            async with anyio.create_task_group() as tg:

                async def flush() -> None:
                    set_value(policy, 1.0)
                    await c.update_weights(policy, flush=True)

                with anyio.move_on_after(0.01):
                    tg.start_soon(flush)
                    await c.__anext__()
            for _ in range(4):
                check_batch(await c.__anext__(), 1)


async def test_flush_checks_its_argument_and_needs_weights():
    async with MultiAsyncCollector([cartpole], frames_per_batch=8, worker_backend="serial") as c:
        with pytest.raises(TypeError, match=r"update_weights needs an nn\.Module"):
            await c.update_weights(flush=True)
    policy = ConstantPolicy(0.0)
    async with MultiAsyncCollector([counter_env], policy, frames_per_batch=8, worker_backend="serial") as c:
        with pytest.raises(TypeError, match="flush must be True or False"):
            await c.update_weights(policy, flush=1)  # type: ignore[arg-type]


async def test_multisync_flush_keeps_batches_whole():
    """On MultiSyncCollector a flush between batches changes nothing (each batch is asked for after the
    update); every batch stays whole and on the newest weights."""
    policy = ConstantPolicy(0.0)
    async with MultiSyncCollector(
        [counter_env] * 2, policy, frames_per_batch=20, track_policy_version=True, worker_backend="serial"
    ) as c:
        for version in range(1, 4):
            set_value(policy, float(version))
            await c.update_weights(policy, flush=True)
            batch = await c.__anext__()
            assert batch.batch_size == (2, 10)
            assert (batch["collector", "policy_version"] == version).all()
        assert c.statistics().frames_discarded == 0


# -- per-worker frames_per_batch (issue 18) ------------------------------------------------------------
async def test_per_worker_frames_per_batch():
    with anyio.fail_after(60):
        async with MultiAsyncCollector(
            [cartpole, lambda: GymEnv("CartPole-v1", num_envs=2)], frames_per_batch=[8, 24]
        ) as c:
            assert c.frames_per_batch == 24
            sizes: dict[int, list] = {0: [], 1: []}
            async for batch in c:
                sizes[int(batch["collector", "worker_id"].flatten()[0])].append(tuple(batch.batch_size))
                if min(len(v) for v in sizes.values()) >= 2:
                    break
            assert c.statistics().frames == sum(8 if w == 0 else 24 for w, v in sizes.items() for _ in v)
    assert set(sizes[0]) == {(8,)} and set(sizes[1]) == {(2, 12)}


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ([8], ValueError, r"frames_per_batch has 1 values for 2 workers"),
        ([8, 8, 8], ValueError, r"frames_per_batch has 3 values for 2 workers"),
        ([8, 0], ValueError, r"frames_per_batch\[1\] must be a positive int"),
        ([8, 2.5], TypeError, r"frames_per_batch\[1\]"),
        ([], ValueError, "frames_per_batch is an empty list"),
    ],
)
async def test_per_worker_frames_per_batch_checked_before_start(value, error, match):
    before = children()
    with pytest.raises(error, match=match):
        MultiAsyncCollector([cartpole, cartpole], frames_per_batch=value)
    assert children() == before


class JitteryCounterEnv(CounterEnv):
    """:class:`CounterEnv` whose steps take a random 0-0.5 ms: batches finish in no set order."""

    def step(self, action):
        self.delay = random.random() * 0.0005
        return super().step(action)


def jittery_counter_env() -> GymEnv:
    return GymEnv(JitteryCounterEnv())


@pytest.mark.parametrize("anyio_backend", [("asyncio", {"use_uvloop": False})])
@pytest.mark.parametrize(
    ("lag", "flush"), [(1, False), (2, False), (None, True)], ids=["lag1", "lag2", "flush"]
)
async def test_no_trajectory_id_spans_a_dropped_batch(lag, flush):
    """Many updates while the workers collect ahead: whenever a batch is dropped as stale (or a rollout
    restarted), the trajectories it continued go on under fresh ids, even in a batch of that worker
    collected (or sent) before the drop, and those ids are nobody else's."""
    policy = ConstantPolicy(0.0)
    seen = Continuity()
    with anyio.fail_after(60):
        async with MultiAsyncCollector(
            [jittery_counter_env] * 2, policy, frames_per_batch=16, max_policy_lag=lag
        ) as c:
            for _ in range(150):
                seen.add(await c.__anext__())  # asserts: a gap in the frames -> a fresh id
                await anyio.sleep(random.random() * 0.01)  # a trainer at random paces (under test)
                await c.update_weights(policy, flush=flush)
            stats = c.statistics()
    assert stats.frames_discarded > 0  # batches were dropped: the case under test happened
    assert seen.gaps > 0


# -- the distributed async collector (nodes over torch.distributed) -------------------------------------
class TestDistributed:
    """The nodes hold torch.distributed's process-wide resources (the store's threads and sockets) after
    they are reaped, as in tests/test_distributed.py: no fd baseline here (the nodes' reaping is checked
    there)."""

    @pytest.fixture
    def leaks(self) -> None:
        return None

    @pytest.mark.distributed
    @pytest.mark.timeout(180)
    @pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
    async def test_distributed_async_flush(self, monkeypatch):
        """DistributedCollector(sync=False): after update_weights(flush=True) every batch runs the new
        weights; the stale ones the nodes had collected ahead are dropped and counted, not delivered."""
        from aiocollect import DistributedCollector
        from support import pendulum

        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
        monkeypatch.setenv("TP_SOCKET_IFNAME", "lo")
        policy = ConstantPolicy(0.0)
        with anyio.fail_after(120):
            async with DistributedCollector(
                pendulum,
                policy,
                frames_per_batch=32,
                total_frames=32 * 10,
                num_collectors=2,
                collector_kwargs={"track_policy_version": True},
            ) as c:
                batches = []
                async for batch in c:
                    batches.append(batch)
                    if len(batches) == 2:
                        set_value(policy, 1.0)
                        assert await c.update_weights(flush=True) == 1
                stats = c.statistics()
        assert stats.frames == 320 and len(batches) == 10
        assert all(bool((b["action"] == 1.0).all()) for b in batches[2:])
        assert all(bool((b["collector", "policy_version"] == 1).all()) for b in batches[2:])
        assert stats.frames_discarded % 32 == 0
        assert not children()  # every node reaped

    @pytest.mark.distributed
    @pytest.mark.timeout(180)
    @pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
    async def test_distributed_async_flush_never_spans_a_gap(self, monkeypatch, support_by_value):
        """DistributedCollector(sync=False): a trajectory that goes on after a batch the trainer dropped is
        delivered under a fresh id (before: with the old id, across the dropped frames)."""
        import sys

        import cloudpickle

        from aiocollect import DistributedCollector

        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
        monkeypatch.setenv("TP_SOCKET_IFNAME", "lo")
        module = sys.modules[__name__]
        cloudpickle.register_pickle_by_value(module)  # the nodes cannot import this test module
        policy = ConstantPolicy(0.0)
        seen = Continuity()
        try:
            with anyio.fail_after(150):
                async with DistributedCollector(
                    counter_env,
                    policy,
                    frames_per_batch=16,
                    total_frames=16 * 40,
                    num_collectors=2,
                    collector_kwargs={"track_policy_version": True},
                ) as c:
                    async for batch in c:
                        per_node = batch.clone()  # Continuity tells workers apart: here, the nodes
                        per_node.set(("collector", "worker_id"), batch["collector", "node_id"])
                        seen.add(per_node)
                        await anyio.sleep(random.random() * 0.02)
                        set_value(policy, policy.value.item() + 1.0)
                        await c.update_weights(flush=True)
                    discarded = c.statistics().frames_discarded
        finally:
            cloudpickle.unregister_pickle_by_value(module)
        assert discarded > 0  # batches were dropped: the case was met
        assert seen.gaps <= discarded
