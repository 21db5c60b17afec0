"""``group_size``: rollouts in groups from one initial state, delivered whole; ``on_update``: what happens to
the episodes in flight at a weight update."""

from __future__ import annotations

import itertools
from typing import Any

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from aiocollect import (
    AsyncEnvCollector,
    Collector,
    GymEnv,
    MultiAsyncCollector,
    MultiAsyncEnvCollector,
    MultiSyncCollector,
    RestartPolicy,
    ThreadedAsyncEnv,
)
from aiocollect._episodes._assembler import TrajectoryAssembler
from episode_envs import trajectories

pytestmark = pytest.mark.anyio

GROUP = ("collector", "group_id")


class Walk(gym.Env[np.ndarray, np.int64]):
    """``observation = [start, step, length]``: ``start`` and ``length`` (1 to ``max_length``) drawn at the
    reset from its seed, and nothing drawn at a step: an episode is a function of its reset seed alone.
    ``seeds`` records the seed of every reset."""

    observation_space = gym.spaces.Box(-1.0, 1e9, (3,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, max_length: int = 12, seeds: list[Any] | None = None) -> None:
        self._max = max_length
        self.seeds = seeds if seeds is not None else []
        self._start = self._step = self._length = 0

    def _obs(self) -> np.ndarray:
        return np.array([self._start, self._step, self._length], np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.seeds.append(seed)
        self._start = int(self.np_random.integers(0, 1_000_000))
        self._length = int(self.np_random.integers(1, self._max + 1))
        self._step = 0
        return self._obs(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        self._step += 1
        return self._obs(), float(self._start % 7), self._step >= self._length, False, {}


def walks(n: int, **kwargs: Any) -> GymEnv:
    return GymEnv(gym.vector.SyncVectorEnv([lambda: Walk(**kwargs)] * n))


def check_groups(batch: Any, n: int, size: int) -> list[int]:
    """``batch`` holds ``n`` whole trajectories in whole groups of ``size`` one after the other; the
    members of a group have one group id and the same episode (``Walk``: a function of the reset seed);
    returns the group ids in order."""
    trajs = trajectories(batch)
    assert len(trajs) == n
    ids = []
    for k in range(0, n, size):
        group = trajs[k : k + size]
        first = group[0]
        for traj in group:
            assert traj[GROUP].unique().tolist() == [int(first[GROUP][0])], "one group id per group"
            assert traj["observation"][0, 1] == 0, "starts at a reset"
            assert bool(traj["next", "done"][-1].all())
            assert torch.equal(traj["observation"], first["observation"]), "the same episode"
            assert torch.equal(traj["next", "reward"], first["next", "reward"])
        ids.append(int(first[GROUP][0]))
    return ids


async def collect_groups(collector: Any, n: int, size: int) -> list[int]:
    ids: list[int] = []
    with anyio.fail_after(60):
        async with collector:
            async for batch in collector:
                ids += check_groups(batch, n, size)
    assert len(set(ids)) == len(ids), "no group delivered twice"
    return ids


def async_walks(n: int) -> list[Any]:
    return [lambda: ThreadedAsyncEnv(Walk())] * n


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda **kw: Collector(walks(4), **kw), id="Collector"),
        pytest.param(
            lambda **kw: MultiSyncCollector([lambda: walks(2)] * 2, worker_backend="serial", **kw),
            id="MultiSyncCollector",
        ),
        pytest.param(
            lambda **kw: MultiAsyncCollector([lambda: walks(2)] * 2, worker_backend="serial", **kw),
            id="MultiAsyncCollector",
        ),
        pytest.param(lambda **kw: AsyncEnvCollector(async_walks(4), **kw), id="AsyncEnvCollector"),
        pytest.param(
            lambda **kw: MultiAsyncEnvCollector([async_walks(2)] * 2, worker_backend="serial", **kw),
            id="MultiAsyncEnvCollector",
        ),
    ],
)
async def test_groups_share_their_initial_state(make):
    """Every batch holds whole groups; the members of a group run the same episode from the same reset
    seed (on a deterministic env, the whole trajectory); groups differ from one another."""
    ids = await collect_groups(make(trajs_per_batch=4, group_size=2, total_frames=400, seed=1), 4, 2)
    assert len(ids) >= 10


async def test_groups_padded_and_truncated():
    """``split_trajs`` pads whole groups (with their group ids); ``max_frames_per_traj`` truncates the
    members of a group alike."""
    collector = Collector(
        walks(6, max_length=30),
        trajs_per_batch=6,
        group_size=3,
        total_frames=500,
        max_frames_per_traj=5,
        split_trajs=True,
        seed=0,
    )
    with anyio.fail_after(60):
        async with collector:
            async for batch in collector:
                assert batch.batch_dims == 2 and batch.shape[0] == 6
                check_groups(batch, 6, 3)
                assert batch["collector", "mask"].sum(-1).max() <= 5


async def test_cartpole_groups_share_their_first_observation():
    """A gymnasium vector env, autoreset by gymnasium: every member of a group starts from one state."""
    collector = Collector(
        lambda: GymEnv("CartPole-v1", num_envs=4), trajs_per_batch=8, group_size=4, total_frames=600, seed=3
    )
    firsts = []
    with anyio.fail_after(60):
        async with collector:
            async for batch in collector:
                for k, traj in enumerate(trajectories(batch)):
                    if k % 4 == 0:
                        first = traj["observation"][0]
                        firsts.append(first)
                    assert torch.equal(traj["observation"][0], first)
    assert len({tuple(f.tolist()) for f in firsts}) == len(firsts), "each group its own initial state"


async def test_seeded_groups_are_reproducible():
    async def firsts(collector: Any) -> list[list[float]]:
        out = []
        with anyio.fail_after(60):
            async with collector:
                async for batch in collector:
                    out += [t["observation"][0].tolist() for t in trajectories(batch)]
        return out

    def make(seed: int = 7) -> Collector:
        return Collector(walks(4), trajs_per_batch=4, group_size=2, total_frames=200, seed=seed)

    expected = await firsts(make())
    assert await firsts(make()) == expected
    reseeded = Collector(walks(4), trajs_per_batch=4, group_size=2, total_frames=-1, seed=3)
    got: list[list[float]] = []
    with anyio.fail_after(60):
        async with reseeded:  # set_seed(7) after a batch: then the groups of a collector seeded 7
            async for _ in reseeded:
                break
            await reseeded.set_seed(7)
            async for batch in reseeded:  # (after the groups complete before set_seed, still delivered)
                got += [t["observation"][0].tolist() for t in trajectories(batch)]
                if expected[0] in got and len(got) - got.index(expected[0]) >= 8:
                    break
    start = got.index(expected[0])
    assert got[start : start + 8] == expected[:8]


async def test_reset_discards_the_groups_it_cuts():
    """``reset()`` cuts the episodes in flight: their groups are discarded whole, the next are whole."""
    collector = Collector(walks(4, max_length=40), trajs_per_batch=2, group_size=2, total_frames=-1, seed=0)
    seen: list[int] = []
    with anyio.fail_after(60):
        async with collector:
            async for batch in collector:
                seen += check_groups(batch, 2, 2)
                await collector.reset()
                if collector.episode_statistics().frames_discarded and len(seen) > 6:
                    break
    assert len(set(seen)) == len(seen)


async def test_resume_starts_new_groups():
    """A collector resumed from ``state_dict`` goes on with group ids no group before the checkpoint had,
    in whole groups."""
    first = Collector(walks(4), trajs_per_batch=4, group_size=2, total_frames=400, seed=0)
    before: list[int] = []
    with anyio.fail_after(60):
        async with first:
            async for batch in first:
                before += check_groups(batch, 4, 2)
                if len(before) >= 4:
                    break
            state = await first.state_dict()
    second = Collector(walks(4), trajs_per_batch=4, group_size=2, total_frames=400, seed=0)
    after = []
    with anyio.fail_after(60):
        async with second:
            await second.load_state_dict(state)
            async for batch in second:
                after += check_groups(batch, 4, 2)
    assert after and not set(after) & set(before)


async def test_async_env_groups_after_reset_are_reproducible():
    """``AsyncEnvCollector.reset()`` with ``group_size``: the groups after it are seeded from the
    collector's seed (the same in every run, whenever the reset comes), and none repeats a group before."""

    async def run() -> tuple[dict[tuple[int, int], list[float]], set[tuple[float, ...]]]:
        collector = AsyncEnvCollector(
            async_walks(4), trajs_per_batch=4, group_size=2, total_frames=-1, seed=0
        )
        before: set[tuple[float, ...]] = set()
        after: dict[int, list[float]] = {}
        with anyio.fail_after(60):
            async with collector:
                async for batch in collector:
                    check_groups(batch, 4, 2)
                    before |= {tuple(t["observation"][0].tolist()) for t in trajectories(batch)}
                    break
                await collector.reset()
                async for batch in collector:
                    for group in check_groups(batch, 4, 2):
                        first = batch["observation"][batch[GROUP] == group][0]
                        after[group] = first.tolist()
                    if len(after) >= 12:
                        break
        first_round = min(after) // 2  # group id = 2 * round + block (2 blocks of 2 envs)
        return {(g % 2, g // 2 - first_round): obs for g, obs in after.items()}, before

    (one, before), (two, _) = await run(), await run()
    common = set(one) & set(two)
    assert len(common) >= 6
    assert all(one[k] == two[k] for k in common)
    assert not {tuple(v) for v in one.values()} & before


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda **kw: AsyncEnvCollector(async_walks(4), **kw), id="AsyncEnvCollector"),
        pytest.param(
            lambda **kw: MultiAsyncEnvCollector([async_walks(2)] * 2, worker_backend="serial", **kw),
            id="MultiAsyncEnvCollector",
        ),
    ],
)
async def test_async_env_resume_starts_new_groups(make):
    """A fresh async-env collector that loads a checkpoint goes on with group ids no group before the
    checkpoint had (it does not start again from 0)."""
    first = make(trajs_per_batch=4, group_size=2, total_frames=-1, seed=0)
    before: list[int] = []
    with anyio.fail_after(60):
        async with first:
            async for batch in first:
                before += check_groups(batch, 4, 2)
                if len(before) >= 6:
                    break
            state = await first.state_dict()
    second = make(trajs_per_batch=4, group_size=2, total_frames=-1, seed=0)
    after: list[int] = []
    with anyio.fail_after(60):
        async with second:
            await second.load_state_dict(state)
            async for batch in second:
                after += check_groups(batch, 4, 2)
                if len(after) >= 6:
                    break
    assert len(set(after)) == len(after) and not set(after) & set(before)


@pytest.mark.parametrize(
    ("cls", "kwargs", "error", "match"),
    [
        (
            Collector,
            {"trajs_per_batch": 6, "group_size": 4},
            ValueError,
            "trajs_per_batch=6 must be a multiple",
        ),
        (MultiSyncCollector, {"trajs_per_batch": 3, "group_size": 2}, ValueError, "group_size=2"),
        (MultiAsyncCollector, {"trajs_per_batch": 3, "group_size": 2}, ValueError, "group_size=2"),
        (AsyncEnvCollector, {"trajs_per_batch": 3, "group_size": 2}, ValueError, "group_size=2"),
        (Collector, {"frames_per_batch": 8, "group_size": 2}, TypeError, "give trajs_per_batch too"),
        (Collector, {"trajs_per_batch": 4, "group_size": 0}, ValueError, "positive int"),
        (Collector, {"trajs_per_batch": 4, "group_size": 2.0}, TypeError, "positive int"),
        (AsyncEnvCollector, {"trajs_per_batch": 4, "on_update": "again"}, ValueError, "'continue'"),
        (MultiAsyncCollector, {"frames_per_batch": 8, "on_update": "restart"}, TypeError, "trajs_per_batch"),
        (
            AsyncEnvCollector,
            {"trajs_per_batch": 4, "group_size": 2, "restart": RestartPolicy()},
            ValueError,
            "restart=",
        ),
        (MultiAsyncEnvCollector, {"trajs_per_batch": 3, "group_size": 2}, ValueError, "group_size=2"),
        (
            MultiAsyncEnvCollector,
            {"frames_per_batch": 8, "on_update": "restart"},
            TypeError,
            "trajs_per_batch",
        ),
        (
            MultiAsyncEnvCollector,
            {"trajs_per_batch": 4, "group_size": 2, "restart": RestartPolicy()},
            ValueError,
            "restart=",
        ),
        (
            MultiAsyncEnvCollector,
            {"trajs_per_batch": 6, "group_size": 3},
            ValueError,
            r"env_fns_per_worker\[0\] has 2 env fns",
        ),
    ],
)
def test_bad_input_is_refused_before_anything_starts(cls, kwargs, error, match):
    def never() -> Any:
        raise AssertionError("no env is built")

    fns: Any = {Collector: never, MultiAsyncEnvCollector: [[never] * 2] * 2}.get(cls, [never] * 2)
    with pytest.raises(error, match=match):
        cls(fns, **kwargs)


async def test_env_slots_must_make_whole_groups():
    with pytest.raises(ValueError, match="env slots of each rollout in whole groups"):
        Collector(walks(3), trajs_per_batch=4, group_size=2)
    with pytest.raises(ValueError, match="whole groups"), anyio.fail_after(30):
        async with AsyncEnvCollector(async_walks(3), trajs_per_batch=4, group_size=2):
            pass
    vector = [lambda: gym.vector.SyncVectorEnv([lambda: Walk()] * 2)] * 2
    with pytest.raises(ValueError, match="async vector env"), anyio.fail_after(30):
        async with AsyncEnvCollector(vector, trajs_per_batch=4, group_size=2):
            pass


class Argmax(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.linear(observation).argmax(-1)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(
            lambda seeds, **kw: AsyncEnvCollector(
                [lambda k=k: ThreadedAsyncEnv(Walk(20, seeds[k])) for k in range(4)], Argmax(), **kw
            ),
            id="AsyncEnvCollector",
        ),
        pytest.param(
            lambda seeds, **kw: MultiAsyncCollector(
                [lambda: GymEnv(gym.vector.SyncVectorEnv([lambda: Walk(20)] * 4))] * 2,
                TensorDictModule(Argmax(), ["observation"], ["action"]),
                worker_backend="serial",
                **kw,
            ),
            id="MultiAsyncCollector",
        ),
        pytest.param(
            lambda seeds, **kw: MultiAsyncEnvCollector(
                [[lambda: ThreadedAsyncEnv(Walk(20))] * 4] * 2, Argmax(), worker_backend="serial", **kw
            ),
            id="MultiAsyncEnvCollector",
        ),
    ],
)
async def test_restart_on_update(make):
    """``on_update="restart"``: the episodes in flight at an update are discarded (counted) and run again
    from their own reset seed (so a group's members stay the same episode); every episode delivered ran
    one policy version."""
    seeds: list[list[Any]] = [[] for _ in range(4)]  # each env's resets (AsyncEnvCollector's: in process)
    collector = make(
        seeds,
        trajs_per_batch=4,
        group_size=2,
        total_frames=2_000,  # several chunks per worker: updates reach them mid-run
        seed=0,
        on_update="restart",
        track_policy_version=True,
    )
    ids: list[int] = []
    with anyio.fail_after(60):
        async with collector:
            async for batch in collector:
                ids += check_groups(batch, 4, 2)
                for traj in trajectories(batch):
                    versions = traj["collector", "policy_version"]
                    assert versions.min() == versions.max(), "one policy version per episode"
                await collector.update_weights()
    assert len(set(ids)) == len(ids)
    stats = collector.episode_statistics()
    assert stats.frames_discarded > 0 and stats.max_version_span == 0
    if isinstance(collector, (MultiAsyncCollector, MultiAsyncEnvCollector)):
        # started again, not skipped: every round of each of the 4 blocks (2 per worker) is delivered,
        # its group id (block b of worker w, round k: w + 2 * (2 * k + b)) 4 after the one before
        for block in range(4):
            got = sorted(i for i in ids if i % 4 == block)
            half = got[: len(got) // 2]
            assert len(half) > 2 and all(b - a == 4 for a, b in itertools.pairwise(half))
    if isinstance(collector, AsyncEnvCollector):
        again = [a == b for env in seeds for a, b in itertools.pairwise(env)]
        assert any(again), "some episodes started again"
        # from their own seed: the seeds an env resets with are those of its rounds without restarts
        plain: list[list[Any]] = [[] for _ in range(4)]
        with anyio.fail_after(60):
            async with make(plain, trajs_per_batch=4, group_size=2, total_frames=2_000, seed=0) as rerun:
                async for _ in rerun:
                    pass
        for restarted, rounds in zip(seeds, plain, strict=True):
            distinct = list(dict.fromkeys(restarted))
            n = min(len(distinct), len(rounds))
            assert n > 3 and distinct[:n] == rounds[:n]


async def test_multi_async_env_groups_across_worker_processes(leaks):
    """``MultiAsyncEnvCollector`` with worker processes: group ids unique over the workers (each worker's
    own: ``worker + 2 * k``), and a seeded run reproducible: each group id comes with the same episode."""

    async def run() -> dict[int, list[float]]:
        # no frame budget: until each worker delivered 6 groups (with a budget, one worker could deliver it
        # all first on a loaded machine); each worker delivers its groups in the order of their ids
        collector = MultiAsyncEnvCollector(
            [async_walks(4)] * 2, trajs_per_batch=4, group_size=2, total_frames=-1, seed=5
        )
        firsts: dict[int, list[float]] = {}
        with anyio.fail_after(60):
            async with collector:
                async for batch in collector:
                    check_groups(batch, 4, 2)
                    for traj in trajectories(batch):
                        group = int(traj[GROUP][0])
                        first = traj["observation"][0].tolist()
                        assert firsts.setdefault(group, first) == first
                    if min(sum(g % 2 == w for g in firsts) for w in (0, 1)) >= 6:
                        break
        return firsts

    one, two = await run(), await run()
    assert {g % 2 for g in one} == {0, 1}, "both workers' groups"
    common = set(one) & set(two)
    assert len(common) >= 10
    assert all(one[g] == two[g] for g in common)
    assert len({tuple(v) for v in one.values()}) == len(one), "each group its own initial state"


async def test_continue_is_the_default():
    """``on_update="continue"``: episodes go on across updates (a trajectory spans versions), none is
    discarded."""
    collector = AsyncEnvCollector(
        [lambda: ThreadedAsyncEnv(Walk(20))] * 4,
        Argmax(),
        trajs_per_batch=4,
        total_frames=600,
        seed=0,
        track_policy_version=True,
    )
    with anyio.fail_after(60):
        async with collector:
            async for _ in collector:
                await collector.update_weights()
    stats = collector.episode_statistics()
    assert stats.frames_discarded == 0 and stats.max_version_span > 0


def frames(ids: list[int], groups: list[int], done: list[bool], env: list[int]) -> TensorDict:
    return TensorDict(
        {
            ("collector", "traj_ids"): torch.tensor(ids),
            ("collector", "env_id"): torch.tensor(env),
            GROUP: torch.tensor(groups),
            ("next", "done"): torch.tensor(done)[:, None],
        },
        batch_size=[len(ids)],
    )


def test_assembler_groups():
    """A member cut and begun again under its group id keeps its group; one cut for good (its slot goes
    on with another group) discards its group, members still to come included; groups go out whole, in
    the order their first member came."""
    assembler = TrajectoryAssembler(2, group_size=2)
    # slots 0, 1: group 10 (traj 0 begun again as traj 2); slots 2, 3: group 11 (traj 3 cut by traj 4 of 12)
    assembler.push(frames([0, 1, 3, 0, 2], [10, 10, 11, 10, 10], [0, 1, 0, 0, 0], [0, 1, 2, 0, 0]))
    assembler.push(frames([4, 5, 2, 6], [12, 11, 10, 12], [0, 1, 1, 1], [2, 3, 0, 3]))
    assert assembler.frames_discarded == 4  # traj 0 (2 frames), traj 3, and traj 5 of the dead group 11
    out = assembler.pop()
    assert out.batch["collector", "traj_ids"].tolist() == [1, 2, 2]
    assert out.batch[GROUP].tolist() == [10, 10, 10]
    assert not assembler.ready()  # group 12 waits for traj 4
    assembler.push(frames([4], [12], [1], [2]))
    out = assembler.pop()
    assert out.batch["collector", "traj_ids"].tolist() == [4, 4, 6]
