"""``Collector`` batches: shapes, keys, dtypes, episode ends, trajectory ids, budgets and batch options."""

from __future__ import annotations

import itertools
from math import ceil

import anyio
import pytest
import torch
from tensordict import TensorDictBase
from torch import nn

from aiocollect import Collector, GymEnv
from support import take

pytestmark = pytest.mark.anyio

CARTPOLE_BOUNDS = (2.4, 12 * 2 * torch.pi / 360)  # |x| and |theta| beyond which CartPole terminates


def along_time(batches: list[TensorDictBase], key) -> torch.Tensor:
    """``key`` of consecutive batches concatenated along the time dim: ``[*B, sum T, ...]``."""
    dim = batches[0].batch_dims - 1
    return torch.cat([b.get(key) for b in batches], dim=dim)


def rows(x: torch.Tensor, batch_dims: int) -> torch.Tensor:
    """``[T, ...]`` -> ``[1, T, ...]`` so that one env and a batch of envs read the same."""
    return x.unsqueeze(0) if batch_dims == 1 else x


def is_reset_obs(obs: torch.Tensor) -> bool:
    """CartPole resets every state variable uniformly in [-0.05, 0.05]."""
    return bool(obs.abs().max() <= 0.05)


class ConstantAction(nn.Module):
    """CartPole policy that always pushes left (action 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(1, 1)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.zeros(obs.shape[:-1], dtype=torch.int64)


# -- shapes, keys and dtypes -------------------------------------------------------------------------
ENV_CASES = [
    # env id, num_envs, frames_per_batch, observation shape, action shape, action dtype
    pytest.param("CartPole-v1", None, 16, (4,), (), torch.int64, id="cartpole"),
    pytest.param("CartPole-v1", 4, 12, (4,), (), torch.int64, id="cartpole-x4"),
    pytest.param("Pendulum-v1", None, 8, (3,), (1,), torch.float32, id="pendulum"),
    pytest.param("Pendulum-v1", 3, 9, (3,), (1,), torch.float32, id="pendulum-x3"),
]


@pytest.mark.parametrize(("env_id", "num_envs", "fpb", "obs_shape", "act_shape", "act_dtype"), ENV_CASES)
async def test_batch_shapes_keys_and_dtypes(
    anyio_backend, env_id, num_envs, fpb, obs_shape, act_shape, act_dtype
):
    lead = () if num_envs is None else (num_envs,)
    T = fpb // (num_envs or 1)
    async with Collector(
        lambda: GymEnv(env_id, num_envs=num_envs), frames_per_batch=fpb, total_frames=2 * fpb, seed=0
    ) as collector:
        batches = await take(collector)
    assert len(batches) == 2
    for batch in batches:
        bt = (*lead, T)
        assert batch.batch_size == bt
        assert batch.names[-1] == "time"
        assert batch.numel() == fpb
        for key in ("observation", ("next", "observation")):
            assert batch.get(key).shape == (*bt, *obs_shape), key
            assert batch.get(key).dtype == torch.float32, key
        assert batch["action"].shape == (*bt, *act_shape)
        assert batch["action"].dtype == act_dtype
        for flag in ("done", "terminated", "truncated"):
            for key in (flag, ("next", flag)):
                assert batch.get(key).shape == (*bt, 1), key
                assert batch.get(key).dtype == torch.bool, key
        assert batch["next", "reward"].shape == (*bt, 1)
        assert batch["next", "reward"].dtype == torch.float32
        assert batch["collector", "traj_ids"].shape == bt
        assert batch["collector", "traj_ids"].dtype == torch.int64
        assert (batch["collector", "traj_ids"] >= 0).all()
        # root flags describe the observation acted on, which is never a finished episode's
        assert not batch["done"].any()


async def test_frames_per_batch_not_divisible_by_env_batch_warns_and_rounds_up(anyio_backend):
    with pytest.warns(UserWarning, match="frames_per_batch=10"):
        collector = Collector(lambda: GymEnv("CartPole-v1", num_envs=4), frames_per_batch=10)
    async with collector:
        assert collector.frames_per_batch == 12  # T = ceil(10 / 4) = 3
        (batch,) = await take(collector, 1)
    assert batch.batch_size == (4, ceil(10 / 4))


async def test_env_instance_instead_of_factory(anyio_backend):
    env = GymEnv("CartPole-v1")
    async with Collector(env, frames_per_batch=8, total_frames=8) as collector:
        (batch,) = await take(collector)
    assert batch.batch_size == (8,)


class CartPole(GymEnv):
    def __init__(self) -> None:
        super().__init__("CartPole-v1")


async def test_env_class_as_factory(anyio_backend):
    async with Collector(CartPole, frames_per_batch=8, total_frames=8) as collector:
        (batch,) = await take(collector)
        assert isinstance(collector.env, CartPole)
    assert batch.batch_size == (8,)


# -- episode ends and trajectory ids -----------------------------------------------------------------
@pytest.mark.parametrize("num_envs", [None, 3])
async def test_episode_end_final_and_reset_observations(anyio_backend, num_envs):
    fpb = 96 if num_envs else 64
    async with Collector(
        lambda: GymEnv("CartPole-v1", num_envs=num_envs), frames_per_batch=fpb, seed=1
    ) as collector:
        batches = await take(collector, 3)
    nb = batches[0].batch_dims
    obs = rows(along_time(batches, "observation"), nb)
    nxt = rows(along_time(batches, ("next", "observation")), nb)
    done = rows(along_time(batches, ("next", "done")), nb)[..., 0]
    term = rows(along_time(batches, ("next", "terminated")), nb)[..., 0]
    ids = rows(along_time(batches, ("collector", "traj_ids")), nb)
    assert done.sum() >= 2, "the test needs episode ends"
    for r in range(obs.shape[0]):
        for t in range(obs.shape[1] - 1):
            if done[r, t]:
                # the final observation is in "next"; the next frame starts from the reset observation
                assert not torch.equal(nxt[r, t], obs[r, t + 1]), (r, t)
                assert is_reset_obs(obs[r, t + 1]), (r, t)
                assert ids[r, t + 1] != ids[r, t], (r, t)
                if term[r, t]:
                    x, theta = float(nxt[r, t, 0]), float(nxt[r, t, 2])
                    assert abs(x) > CARTPOLE_BOUNDS[0] or abs(theta) > CARTPOLE_BOUNDS[1]
            else:
                assert torch.equal(nxt[r, t], obs[r, t + 1]), (r, t)
                assert ids[r, t + 1] == ids[r, t], (r, t)


def assert_unique_trajectory_ids(batches: list[TensorDictBase]) -> None:
    """Every id labels one contiguous run of frames in one env row, over all the batches."""
    nb = batches[0].batch_dims
    ids = rows(along_time(batches, ("collector", "traj_ids")), nb)
    seen: set[int] = set()
    for r in range(ids.shape[0]):
        run_ids = torch.unique_consecutive(ids[r]).tolist()
        assert len(run_ids) == len(set(run_ids)), f"an id comes back in row {r}: {run_ids}"
        assert not seen & set(run_ids), "an id is used by two env rows"
        seen |= set(run_ids)


@pytest.mark.parametrize("num_envs", [None, 3])
async def test_traj_ids_unique_over_the_collector_life(anyio_backend, num_envs):
    fpb = 48 if num_envs else 32
    async with Collector(
        lambda: GymEnv("CartPole-v1", num_envs=num_envs), frames_per_batch=fpb, seed=2
    ) as collector:
        first = await take(collector, 2)
        await collector.reset()
        second = await take(collector, 2)
    assert_unique_trajectory_ids(first + second)
    before = set(along_time(first, ("collector", "traj_ids")).unique().tolist())
    # reset() starts new trajectories even though no episode ended
    assert not before & set(second[0]["collector", "traj_ids"][..., 0].reshape(-1).tolist())
    assert is_reset_obs(second[0]["observation"][..., 0, :])


async def test_reset_at_each_iter(anyio_backend):
    async with Collector(
        lambda: GymEnv("CartPole-v1", num_envs=2),
        frames_per_batch=20,
        reset_at_each_iter=True,
        seed=3,
    ) as collector:
        batches = await take(collector, 3)
    assert_unique_trajectory_ids(batches)
    for prev, batch in itertools.pairwise(batches):
        assert is_reset_obs(batch["observation"][:, 0])
        assert not torch.equal(batch["observation"][:, 0], prev["next", "observation"][:, -1])
        assert not set(batch["collector", "traj_ids"].reshape(-1).tolist()) & set(
            prev["collector", "traj_ids"].reshape(-1).tolist()
        )


async def test_without_reset_at_each_iter_batches_continue(anyio_backend):
    async with Collector(
        lambda: GymEnv("CartPole-v1"), frames_per_batch=5, max_frames_per_traj=100, seed=3
    ) as collector:
        first, second = await take(collector, 2)
    assert not first["next", "done"][-1]
    assert torch.equal(second["observation"][0], first["next", "observation"][-1])
    assert second["collector", "traj_ids"][0] == first["collector", "traj_ids"][-1]


# -- frame budget --------------------------------------------------------------------------------
async def test_total_frames_divisible(anyio_backend):
    async with Collector(
        lambda: GymEnv("CartPole-v1", num_envs=2), frames_per_batch=16, total_frames=48
    ) as collector:
        assert len(collector) == 3
        batches = await take(collector)
        assert sum(b.numel() for b in batches) == 48
        assert collector.statistics().frames == 48
        # once the budget is spent, iterating again yields nothing, and says so
        with pytest.warns(UserWarning, match="yields nothing: it has collected its total_frames=48"):
            assert await take(collector) == []


async def test_total_frames_not_divisible_warns_and_keeps_last_batch_whole(anyio_backend):
    with pytest.warns(UserWarning, match="total_frames=40"):
        collector = Collector(lambda: GymEnv("CartPole-v1"), frames_per_batch=16, total_frames=40)
    async with collector:
        assert len(collector) == 3
        batches = await take(collector)
    assert [b.batch_size for b in batches] == [torch.Size([16])] * 3


async def test_budget_holds_with_concurrent_consumers(anyio_backend):
    async with Collector(lambda: GymEnv("CartPole-v1"), frames_per_batch=16, total_frames=48) as collector:
        got: list[TensorDictBase] = []

        async def consume() -> None:
            got.extend(await take(collector))

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            tg.start_soon(consume)
        assert len(got) == len(collector) == 3
        assert collector.statistics().frames == 48


async def test_endless_collector(anyio_backend):
    async with Collector(lambda: GymEnv("CartPole-v1"), frames_per_batch=8) as collector:
        with pytest.raises(TypeError, match="endless"):
            len(collector)
        batches = await take(collector, 5)
    assert len(batches) == 5


# -- max_frames_per_traj, set_truncated --------------------------------------------------------------
@pytest.mark.parametrize(("num_envs", "fpb"), [(None, 7), (3, 6)])
async def test_max_frames_per_traj(anyio_backend, num_envs, fpb):
    n = 5  # random CartPole episodes never terminate before step 8: every episode is cut at n
    async with Collector(
        lambda: GymEnv("CartPole-v1", num_envs=num_envs),
        frames_per_batch=fpb,
        max_frames_per_traj=n,
        seed=4,
    ) as collector:
        batches = await take(collector, 4)
    nb = batches[0].batch_dims
    obs = rows(along_time(batches, "observation"), nb)
    nxt = rows(along_time(batches, ("next", "observation")), nb)
    trunc = rows(along_time(batches, ("next", "truncated")), nb)[..., 0]
    done = rows(along_time(batches, ("next", "done")), nb)[..., 0]
    term = rows(along_time(batches, ("next", "terminated")), nb)[..., 0]
    ids = rows(along_time(batches, ("collector", "traj_ids")), nb)
    steps = obs.shape[1]
    expected = torch.tensor([(t + 1) % n == 0 for t in range(steps)]).expand_as(trunc)
    assert torch.equal(trunc, expected)  # the pattern carries over batch borders
    assert torch.equal(done, expected)
    assert not term.any()
    for t in range(n - 1, steps - 1, n):
        assert (ids[:, t + 1] != ids[:, t]).all()
        for r in range(obs.shape[0]):
            assert is_reset_obs(obs[r, t + 1])  # the env was reset...
            assert not is_reset_obs(nxt[r, t])  # ...after the 5th step's observation
    assert_unique_trajectory_ids(batches)


async def test_set_truncated_marks_last_step_without_reset(anyio_backend):
    def collector(**kwargs) -> Collector:
        return Collector(
            lambda: GymEnv("CartPole-v1", num_envs=2),
            frames_per_batch=12,
            total_frames=36,
            seed=5,
            **kwargs,
        )

    async with collector() as plain_collector:
        plain = await take(plain_collector)
    async with collector(set_truncated=True) as truncating_collector:
        marked = await take(truncating_collector)
    for p, m in zip(plain, marked, strict=True):
        assert m["next", "truncated"][:, -1].all()
        assert m["next", "done"][:, -1].all()
        # everything else is what the plain collector gives: same observations (no reset), same ids
        assert torch.equal(m["next", "terminated"], p["next", "terminated"])
        assert torch.equal(m["next", "truncated"][:, :-1], p["next", "truncated"][:, :-1])
        assert torch.equal(m["observation"], p["observation"])
        assert torch.equal(m["collector", "traj_ids"], p["collector", "traj_ids"])
    for i in range(1, len(marked)):
        ended = plain[i - 1]["next", "done"][:, -1, 0]
        ids, prev_ids = marked[i]["collector", "traj_ids"], marked[i - 1]["collector", "traj_ids"]
        carried = ids[:, 0] == prev_ids[:, -1]
        assert torch.equal(carried, ~ended)


# -- init_random_frames ------------------------------------------------------------------------------
async def test_init_random_frames_ignore_the_policy(anyio_backend):
    with pytest.warns(UserWarning, match="init_random_frames=20"):
        collector = Collector(
            lambda: GymEnv("CartPole-v1"),
            ConstantAction(),
            frames_per_batch=16,
            init_random_frames=20,  # rounded up to 2 batches
            seed=6,
        )
    async with collector:
        batches = await take(collector, 4)
    actions = [set(b["action"].unique().tolist()) for b in batches]
    assert actions == [{0, 1}, {0, 1}, {0}, {0}]


async def test_init_random_frames_with_extra_policy_outputs(anyio_backend):
    def policy(td):
        td["logits"] = torch.ones(*td.batch_size, 2)
        td["action"] = torch.zeros(td.batch_size, dtype=torch.int64)
        return td

    async with Collector(
        lambda: GymEnv("CartPole-v1", num_envs=2),
        policy,
        frames_per_batch=8,
        init_random_frames=8,
        seed=7,
    ) as collector:
        random_batch, policy_batch = await take(collector, 2)
    # the random batch has the policy's keys, zero-filled
    assert (random_batch["logits"] == 0).all()
    assert (policy_batch["logits"] == 1).all()
    assert (policy_batch["action"] == 0).all()


# -- split_trajs, postproc ---------------------------------------------------------------------------
@pytest.mark.parametrize(("num_envs", "fpb", "shape"), [(None, 32, (7, 5)), (2, 20, (4, 5))])
async def test_split_trajs(anyio_backend, num_envs, fpb, shape):
    async with Collector(
        lambda: GymEnv("CartPole-v1", num_envs=num_envs),
        frames_per_batch=fpb,
        max_frames_per_traj=5,
        split_trajs=True,
        seed=8,
    ) as collector:
        (batch,) = await take(collector, 1)
    assert batch.batch_size == shape
    mask = batch["collector", "mask"]
    assert mask.dtype == torch.bool
    assert int(mask.sum()) == fpb
    ids = batch["collector", "traj_ids"]
    row_ids = [set(ids[i][mask[i]].tolist()) for i in range(shape[0])]
    assert all(len(s) == 1 for s in row_ids)
    assert len(set().union(*row_ids)) == shape[0]
    assert (batch["observation"][~mask] == 0).all()
    # frames within a trajectory follow each other
    for i in range(shape[0]):
        n = int(mask[i].sum())
        assert torch.equal(batch["next", "observation"][i, : n - 1], batch["observation"][i, 1:n])


async def test_postproc_is_applied_to_each_batch(anyio_backend):
    seen = []

    def postproc(td):
        seen.append(td.batch_size)
        td["scaled_reward"] = td["next", "reward"] * 10
        return td

    async with Collector(
        lambda: GymEnv("CartPole-v1"),
        frames_per_batch=10,
        total_frames=20,
        max_frames_per_traj=4,
        split_trajs=True,
        postproc=postproc,
        seed=9,
    ) as collector:
        batches = await take(collector)
    assert seen == [b.batch_size for b in batches]
    assert seen[0][1] == 4  # postproc runs after split_trajs
    for b in batches:
        assert torch.equal(b["scaled_reward"], b["next", "reward"] * 10)
