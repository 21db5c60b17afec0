"""``trajs_per_batch``: batches of whole trajectories, in admission order, from every collector."""

from __future__ import annotations

from typing import Any

import anyio
import gymnasium as gym
import pytest
import torch
from tensordict import TensorDict

from aiocollect import (
    AsyncEnvCollector,
    Collector,
    GymEnv,
    MultiAsyncCollector,
    MultiAsyncEnvCollector,
    MultiSyncCollector,
    ThreadedAsyncEnv,
)
from aiocollect._episodes._assembler import TrajectoryAssembler
from episode_envs import Stamped, Stamps, check_trajectories, trajectories

pytestmark = pytest.mark.anyio


def vector(stamps: Any, lengths: dict[int, int], n: int = 4, max_length: int = 30) -> GymEnv:
    return GymEnv(gym.vector.SyncVectorEnv([lambda: Stamped(stamps, lengths, max_length)] * n))


async def collect(collector: Any, n: int, max_frames_per_traj: int | None = None) -> list[tuple[int, int]]:
    """Every batch checked; each trajectory's (stamp, length). No trajectory id is delivered twice."""
    got: list[tuple[int, int]] = []
    ids: list[int] = []
    with anyio.fail_after(60):
        async with collector:
            async for batch in collector:
                got += check_trajectories(batch, n, max_frames_per_traj)
                ids += batch["collector", "traj_ids"].reshape(-1).unique().tolist()
    assert len(set(ids) - {-1}) == len(got)
    return got


@pytest.mark.parametrize("split_trajs", [False, True])
@pytest.mark.parametrize("max_frames_per_traj", [None, 7])
async def test_collector_whole_trajectories_in_admission_order(split_trajs, max_frames_per_traj):
    """Every batch holds N whole trajectories; over the run they are exactly the first episodes started,
    in the order they started (no length bias), and total_frames counts their frames."""
    stamps, lengths = Stamps(), {}
    collector = Collector(
        vector(stamps, lengths),
        trajs_per_batch=5,
        total_frames=600,
        max_frames_per_traj=max_frames_per_traj,
        split_trajs=split_trajs,
        seed=3,
    )
    got = await collect(collector, 5, max_frames_per_traj)
    order = [s for s, _ in got]
    if max_frames_per_traj is None:
        assert order == list(range(len(got)))  # admission order, none skipped
    else:  # a truncated episode's reset is stamped after the autoresets of the same step: same step
        assert all(abs(s - i) < 4 for i, s in enumerate(order)) and len(set(order)) == len(order)
    cap = max_frames_per_traj or 10**9
    assert [n for _, n in got] == [min(lengths[s], cap) for s in order]  # the env's lengths
    frames = sum(n for _, n in got)
    assert frames >= 600 and frames - max(n for _, n in got[-5:]) * 5 < 600
    stats = collector.episode_statistics()
    assert stats is not None
    assert (stats.delivered, stats.frames_delivered) == (len(got), frames)
    assert collector.statistics().frames == frames
    assert stats.max_length == max(n for _, n in got)


async def test_admission_order_is_not_finish_order():
    """One slot's episodes are long, the other's short: a batch waits for the long one admitted first
    instead of filling up with short ones."""
    lengths: dict[int, int] = {}
    stamps = Stamps()

    class LongShort(Stamped):
        def reset(self, *, seed=None, options=None):
            _obs, info = super().reset(seed=seed)
            self._length = 40 if self._stamp == 0 else 2
            self.lengths[self._stamp] = self._length
            return self._obs(), info

    env = GymEnv(gym.vector.SyncVectorEnv([lambda: LongShort(stamps, lengths)] * 2))
    got = await collect(Collector(env, trajs_per_batch=2, total_frames=60), 2)
    assert got[0] == (0, 40)  # the first batch waited for the long episode
    assert [s for s, _ in got] == list(range(len(got)))


@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector])
@pytest.mark.parametrize("split_trajs", [False, True])
async def test_multi_collectors_whole_trajectories(cls, split_trajs):
    stamps, lengths = Stamps(), {}
    collector = cls(
        [lambda: vector(stamps, lengths, 2)] * 2,
        trajs_per_batch=4,
        total_frames=400,
        split_trajs=split_trajs,
        max_frames_per_traj=12,
        worker_backend="serial",
        seed=0,
    )
    got = await collect(collector, 4, 12)  # (the workers' envs count their stamps each on their own)
    assert collector.statistics().frames == sum(n for _, n in got) >= 400
    assert collector.episode_statistics().delivered == len(got)


async def test_multi_process_worker_batches(leaks):
    from support import cartpole

    async with MultiSyncCollector([cartpole] * 2, trajs_per_batch=3, total_frames=300, seed=1) as c:
        with anyio.fail_after(60):
            async for batch in c:
                assert batch["collector", "traj_ids"].unique_consecutive().numel() == 3
                done = batch["next", "done"].reshape(-1)
                assert int(done.sum()) == 3 and bool(done[-1])


def _async_env(stamps: Any, lengths: dict[int, int]) -> Any:
    return lambda: ThreadedAsyncEnv(Stamped(stamps, lengths))


@pytest.mark.parametrize("split_trajs", [False, True])
async def test_async_env_collector(split_trajs):
    stamps, lengths = Stamps(), {}
    collector = AsyncEnvCollector(
        [_async_env(stamps, lengths)] * 4, trajs_per_batch=3, total_frames=300, split_trajs=split_trajs
    )
    got = await collect(collector, 3)
    assert len({s for s, _ in got}) == len(got)
    assert [n for s, n in got] == [lengths[s] for s, _ in got]
    assert collector.statistics().frames == sum(n for _, n in got)


async def test_multi_async_env_collector():
    stamps, lengths = Stamps(), {}
    collector = MultiAsyncEnvCollector(
        [[_async_env(stamps, lengths)] * 2] * 2,
        trajs_per_batch=3,
        total_frames=200,
        split_trajs=True,
        worker_backend="serial",
    )
    got = await collect(collector, 3)
    assert len({s for s, _ in got}) == len(got)


async def test_fill_writes_whole_trajectories():
    from support import ListBuffer

    stamps, lengths = Stamps(), {}
    buffer = ListBuffer()
    collector = Collector(vector(stamps, lengths), trajs_per_batch=2, total_frames=200, replay_buffer=buffer)
    with anyio.fail_after(60):
        async with collector:
            async for frames in collector.fill():
                assert frames == len(buffer.batches[-1])
    for batch in buffer.batches:
        check_trajectories(batch, 2)


async def test_resume_keeps_the_episode_accounting():
    stamps, lengths = Stamps(), {}
    first = Collector(vector(stamps, lengths), trajs_per_batch=2, total_frames=300, seed=0)
    with anyio.fail_after(60):
        async with first:
            async for _ in first:
                break
            state = await first.state_dict()
    delivered = first.episode_statistics()
    second = Collector(vector(stamps, lengths), trajs_per_batch=2, total_frames=300, seed=0)
    async with second:
        await second.load_state_dict(state)
        assert second.episode_statistics().delivered == delivered.delivered
        frames = delivered.frames_delivered
        with anyio.fail_after(60):
            async for batch in second:
                check_trajectories(batch, 2)
                frames += batch.numel()
    assert second.statistics().frames == frames >= 300
    assert second.episode_statistics().frames_delivered == frames


async def test_reset_discards_the_cut_trajectories():
    stamps, lengths = Stamps(), {}
    collector = Collector(vector(stamps, lengths, max_length=200), trajs_per_batch=2, total_frames=-1)
    with anyio.fail_after(60):
        async with collector:
            async for batch in collector:
                check_trajectories(batch, 2)
                await collector.reset()
                if collector.episode_statistics().frames_discarded:
                    break
            async for batch in collector:
                check_trajectories(batch, 2)
                break


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (Collector, {"frames_per_batch": 100}, "give one of them, not both"),
        (Collector, {"trajs_per_batch": 0}, "positive int"),
        (Collector, {"reset_at_each_iter": True}, "drop reset_at_each_iter"),
        (Collector, {"set_truncated": True}, "drop set_truncated"),
        (MultiSyncCollector, {"preemptive_threshold": 0.5}, "drop preemptive_threshold"),
        (MultiSyncCollector, {"cat_results": -1}, "drop cat_results"),
        (MultiSyncCollector, {"max_policy_lag": 1}, "drop max_policy_lag"),
        (MultiAsyncCollector, {"max_policy_lag": -1}, "max_policy_lag"),
        (AsyncEnvCollector, {"on_env_error": "drop"}, "on_env_error='raise'"),
    ],
)
def test_bad_input_is_refused_before_anything_starts(cls, kwargs, match):
    def never() -> Any:
        raise AssertionError("no env is built")

    fns: Any = never if cls is Collector else [never] * 2
    args = {"trajs_per_batch": 2, **kwargs}
    with pytest.raises((TypeError, ValueError), match=match):
        cls(fns, **args)


def test_assembler_discards_torn_trajectories():
    """A slot that starts a new trajectory while its previous one is open had that one cut; after
    dropped frames (taint), each slot's next new trajectory is torn and discarded too."""
    ids = torch.tensor([[0, 0, 2, 2]])
    done = torch.zeros(1, 4, 1, dtype=torch.bool)
    frames = TensorDict({("collector", "traj_ids"): ids, ("next", "done"): done}, batch_size=[1, 4])
    assembler = TrajectoryAssembler(1)
    assembler.push(frames)
    assert assembler.frames_discarded == 2 and assembler.in_flight == 1
    assembler.taint()
    later = frames.clone()
    later["collector", "traj_ids"] = torch.tensor([[3, 3, 3, 4]])
    later["next", "done"][0, 2] = True
    assembler.push(later)
    # 2 was cut by 3, 3 was torn (it began in dropped frames), 4 starts clean
    assert assembler.frames_discarded == 2 + 2 + 3 and assembler.in_flight == 1
    assert not assembler.ready()


def test_assembler_lets_go_of_delivered_frames():
    ids = torch.tensor([[0, 0, 1, 1]])
    done = torch.tensor([[[False], [True], [False], [True]]])
    assembler = TrajectoryAssembler(2)
    for _ in range(3):
        frames = TensorDict({("collector", "traj_ids"): ids, ("next", "done"): done}, batch_size=[1, 4])
        assembler.push(frames)
        ids = ids + 2
        assert assembler.ready()
        assert assembler.pop().lengths == [2, 2]
        assert not assembler._batches and not assembler._refs and assembler.in_flight == 0


@pytest.mark.parametrize(("traj_format", "padded"), [(None, True), ("padded", True), ("cat", False)])
async def test_compat_takes_torchrl_trajs_per_batch(traj_format, padded):
    """TorchRL's spelling: frames_per_batch is then the chunk the env steps at a time."""
    from aiocollect.compat import SyncDataCollector

    stamps, lengths = Stamps(), {}
    kwargs = {} if traj_format is None else {"traj_format": traj_format}
    collector = SyncDataCollector(
        vector(stamps, lengths), None, frames_per_batch=16, trajs_per_batch=3, total_frames=100, **kwargs
    )
    with anyio.fail_after(60):
        async with collector:
            async for batch in collector:
                assert (batch.ndim == 2) is padded
                check_trajectories(batch, 3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"traj_format": "cat"}, "needs trajs_per_batch"),
        ({"trajs_per_batch": 2, "traj_format": "nested"}, "'padded' or 'cat'"),
        ({"trajs_per_batch": 2, "trajs_per_write": 1}, "drop trajs_per_write"),
    ],
)
def test_compat_refuses_what_it_cannot_honour(kwargs, match):
    from aiocollect.compat import SyncDataCollector

    with pytest.raises((TypeError, ValueError), match=match):
        SyncDataCollector(vector(Stamps(), {}), None, frames_per_batch=16, **kwargs)


@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector])
async def test_multi_fill_writes_whole_trajectories(cls):
    from support import ListBuffer

    buffer = ListBuffer()
    collector = cls(
        [lambda: vector(Stamps(), {}, 2)] * 2,
        trajs_per_batch=2,
        total_frames=120,
        replay_buffer=buffer,
        worker_backend="serial",
    )
    with anyio.fail_after(60):
        async with collector:
            async for frames in collector.fill():
                assert frames == len(buffer.batches[-1])
    assert buffer.batches
    for batch in buffer.batches:
        check_trajectories(batch, 2)


def test_assembler_keeps_non_tensor_entries():
    ids = torch.tensor([[0, 0, 1, 1], [2, 2, 2, 2]])
    done = torch.tensor([[[False], [True], [False], [True]], [[False], [False], [False], [True]]])
    frames = TensorDict({("collector", "traj_ids"): ids, ("next", "done"): done}, batch_size=[2, 4])
    frames.set_non_tensor("task", "balance")
    assembler = TrajectoryAssembler(3)
    assembler.push(frames)
    out = assembler.pop().batch
    assert out["collector", "traj_ids"].tolist() == [0, 0, 2, 2, 2, 2, 1, 1]  # started at t=0: 0, 2; then 1
    assert out.get_non_tensor("task") == "balance"


class Linear(torch.nn.Module):
    """observation -> action 0 or 1, with weights to update."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Linear(3, 1)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return (self.w(observation).squeeze(-1) > 0).long()


async def test_version_span_of_episodes_across_updates():
    """Async envs: an episode in flight at a weight update goes on with the new weights; each frame
    keeps its policy version, and the statistics give each trajectory's oldest and newest."""
    stamps, lengths = Stamps(), {}
    policy = Linear()
    collector = AsyncEnvCollector(
        [lambda: ThreadedAsyncEnv(Stamped(stamps, lengths, max_length=300))] * 4,
        policy,
        trajs_per_batch=2,
        total_frames=3000,
        track_policy_version=True,
    )
    spans = []
    with anyio.fail_after(60):
        async with collector:
            async for batch in collector:
                check_trajectories(batch, 2)
                for traj in trajectories(batch):
                    version = traj["collector", "policy_version"]
                    spans.append((int(version.min()), int(version.max())))
                    assert bool((version.diff() >= 0).all())  # frames in order, versions never go back
                stats = collector.episode_statistics()
                assert list(stats.version_spans) == spans[-2:]
                await collector.update_weights(policy)
    assert stats.max_version_span == max(b - a for a, b in spans) >= 1
    assert stats.in_flight >= 0 and stats.delivered == len(spans)


#: the workers' loop for the test's own backend (asyncio, asyncio+uvloop, trio)
LOOPS = {"asyncio": "asyncio", "asyncio+uvloop": "uvloop", "trio": "trio"}


def stamped_vector() -> GymEnv:
    return vector(Stamps(), {}, 2)


def stamped_async() -> Any:
    return ThreadedAsyncEnv(Stamped(Stamps(), {}))


@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector])
async def test_worker_processes(cls, leaks):
    """The same invariants with the workers in processes (each counts its own stamps)."""
    collector = cls([stamped_vector] * 2, trajs_per_batch=3, total_frames=300, max_frames_per_traj=20)
    got = await collect(collector, 3, 20)
    assert collector.statistics().frames == sum(n for _, n in got) >= 300


async def test_async_env_worker_processes(request, leaks):
    collector = MultiAsyncEnvCollector(
        [[stamped_async] * 3] * 2, trajs_per_batch=4, total_frames=300, loop=LOOPS[request.node.callspec.id]
    )
    got = await collect(collector, 4)
    assert collector.statistics().frames == sum(n for _, n in got) >= 300


async def test_flush_discards_the_trajectories_it_tears():
    """update_weights(flush=True) drops batches collected ahead: the trajectories they cut are
    discarded (counted), and every delivered one is still whole."""
    policy = Linear()
    collector = MultiAsyncCollector(
        [lambda: vector(Stamps(), {}, 2, max_length=60)] * 2,
        policy,
        trajs_per_batch=2,
        total_frames=1500,
        worker_backend="serial",
    )
    with anyio.fail_after(60):
        async with collector:
            async for batch in collector:
                check_trajectories(batch, 2)
                await collector.update_weights(policy, flush=True)
    stats = collector.episode_statistics()
    assert stats.frames_discarded > 0  # torn ones, never delivered
    assert collector.statistics().frames == stats.frames_delivered >= 1500


async def test_flush_on_async_env_workers():  # worker processes, ~8 s each: CI's runs take one loop each
    policy = Linear()
    collector = MultiAsyncEnvCollector(
        [[lambda: ThreadedAsyncEnv(Stamped(Stamps(), {}, max_length=60))] * 2] * 2,
        policy,
        trajs_per_batch=2,
        total_frames=1500,
        worker_backend="serial",
    )
    with anyio.fail_after(60):
        async with collector:
            async for batch in collector:
                check_trajectories(batch, 2)
                await collector.update_weights(policy, flush=True)
    assert collector.statistics().frames == collector.episode_statistics().frames_delivered >= 1500


@pytest.mark.parametrize("lag", [0, 1])
async def test_max_policy_lag_bounds_each_episodes_oldest_frame(lag):
    """MultiAsyncCollector(trajs_per_batch, max_policy_lag=k): an episode whose oldest frame is more
    than k versions behind the newest weights is discarded (counted), never delivered."""
    policy = Linear()
    collector = MultiAsyncCollector(
        [lambda: vector(Stamps(), {}, 2, max_length=40)] * 2,
        policy,
        trajs_per_batch=2,
        total_frames=1200,
        max_policy_lag=lag,
        track_policy_version=True,
        worker_backend="serial",
    )
    with anyio.fail_after(60):
        async with collector:
            async for batch in collector:
                check_trajectories(batch, 2)
                assert int(batch["collector", "policy_version"].min()) >= collector.policy_version - lag
                await collector.update_weights(policy)
    assert collector.episode_statistics().frames_discarded > 0


async def test_no_len_for_batches_that_vary():
    async with Collector(vector(Stamps(), {}), trajs_per_batch=2, total_frames=100) as collector:
        with pytest.raises(TypeError, match="no len"):
            len(collector)
