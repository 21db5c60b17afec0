"""``Collector`` control: replay buffer, background collection, pause, seeds, reset, state dicts, weights,
statistics."""

from __future__ import annotations

import dataclasses
import itertools
import json

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest
import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from aiocollect import Collector, CollectorStatistics, GymEnv
from support import EnvFactory, ListBuffer, take, threads_in_package_code

pytestmark = pytest.mark.anyio


def assert_same_batches(a: list[TensorDictBase], b: list[TensorDictBase], *, skip=()) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        keys = set(x.keys(include_nested=True, leaves_only=True))
        assert keys == set(y.keys(include_nested=True, leaves_only=True))
        for key in keys - set(skip):
            assert torch.equal(x.get(key), y.get(key)), key


def cartpole(num_envs: int | None = None):
    return lambda: GymEnv("CartPole-v1", num_envs=num_envs)


class CategoricalPolicy(nn.Module):
    """A stochastic CartPole policy: samples its action from torch's (global) RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)
        with torch.no_grad():
            self.net.weight.mul_(0.01)  # close to uniform: both actions are sampled

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.distributions.Categorical(logits=self.net(obs)).sample()


class ParameterAction(nn.Module):
    """A Pendulum policy whose action is ``value + offset``: a parameter plus a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.value = nn.Parameter(torch.zeros(1))
        self.register_buffer("offset", torch.zeros(1))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return (self.value + self.offset).expand(*obs.shape[:-1], 1)


def pendulum_collector(policy: nn.Module, **kwargs) -> Collector:
    return Collector(lambda: GymEnv("Pendulum-v1", num_envs=2), policy, frames_per_batch=8, **kwargs)


def actions(batch: TensorDictBase) -> set[float]:
    return set(batch["action"].unique().tolist())


# -- replay buffer, start(), pause() -----------------------------------------------------------------
async def test_replay_buffer_gets_every_batch(anyio_backend):
    rb = ListBuffer()
    async with Collector(
        cartpole(), frames_per_batch=16, total_frames=48, replay_buffer=rb, seed=0
    ) as collector:
        with anyio.fail_after(30):
            yielded = [frames async for frames in collector.fill()]
    assert yielded == [16, 16, 16]  # the frames of each batch written
    assert [b.batch_size for b in rb.batches] == [torch.Size([16])] * 3
    # three different, consecutive batches
    for prev, batch in itertools.pairwise(rb.batches):
        if not prev["next", "done"][-1]:
            assert torch.equal(batch["observation"][0], prev["next", "observation"][-1])
        assert batch["collector", "traj_ids"][0] >= prev["collector", "traj_ids"][-1]


async def test_replay_buffer_gets_postprocessed_batches(anyio_backend):
    rb = ListBuffer()

    def postproc(td):
        td["seen"] = torch.ones(td.batch_size, dtype=torch.bool)
        return td

    async with Collector(
        cartpole(), frames_per_batch=8, total_frames=16, replay_buffer=rb, postproc=postproc
    ) as collector:
        with anyio.fail_after(30):
            async for _ in collector.fill():
                pass
    assert all(b["seen"].all() for b in rb.batches)


async def test_plain_iteration_with_a_replay_buffer_warns_and_yields_none(anyio_backend):
    rb = ListBuffer()
    async with Collector(cartpole(), frames_per_batch=8, total_frames=16, replay_buffer=rb) as collector:
        with pytest.warns(DeprecationWarning, match=r"collector\.fill\(\)"), anyio.fail_after(30):
            yielded = await take(collector)
    assert yielded == [None, None]
    assert len(rb.batches) == 2


async def test_fill_needs_a_replay_buffer(anyio_backend):
    async with Collector(cartpole(), frames_per_batch=8, total_frames=16) as collector:
        with pytest.raises(RuntimeError, match="fill\\(\\) needs a replay_buffer"):
            collector.fill()


async def test_start_collects_in_background_until_aclose(anyio_backend):
    rb = ListBuffer()
    async with Collector(cartpole(), frames_per_batch=16, replay_buffer=rb) as collector:
        await collector.start()
        with anyio.fail_after(20):
            await rb.wait_for(3)
        await collector.aclose()
        assert collector.closed
        assert threads_in_package_code() == []
        written = len(rb.batches)
        # every batch written was counted (also one that was written just as aclose() cancelled)
        assert collector.statistics().frames == 16 * written
    assert len(rb.batches) == written


async def test_start_stops_at_async_with_exit(anyio_backend):
    rb = ListBuffer()
    async with Collector(cartpole(2), frames_per_batch=16, replay_buffer=rb) as collector:
        await collector.start()
        with anyio.fail_after(20):
            await rb.wait_for(2)
    assert collector.closed
    assert threads_in_package_code() == []
    written = len(rb.batches)
    assert collector.statistics().frames == 16 * written


async def test_start_needs_a_replay_buffer_and_async_with(anyio_backend):
    async with Collector(cartpole(), frames_per_batch=8) as collector:
        with pytest.raises(RuntimeError, match="replay_buffer"):
            await collector.start()
    collector = Collector(cartpole(), frames_per_batch=8, replay_buffer=ListBuffer())
    try:
        with pytest.raises(RuntimeError, match="async with"):
            await collector.start()
    finally:
        await collector.aclose()


async def test_pause_stops_writes_for_its_duration(anyio_backend):
    rb = ListBuffer()
    factory = EnvFactory(step_delay=0.002)  # batches of 16 steps take > 32 ms
    async with Collector(factory, frames_per_batch=16, replay_buffer=rb) as collector:
        (env,) = factory.hooks
        in_flight = anyio.Event()
        token = anyio.lowlevel.current_token()

        def on_step(n: int) -> None:  # in the collector's rollout thread
            if n == 16 + 4:  # the second batch is in flight
                anyio.from_thread.run_sync(in_flight.set, token=token)

        env.on_step = on_step
        await collector.start()
        with anyio.fail_after(20):
            await in_flight.wait()
        async with collector.pause():  # waits for the batch in flight to be written
            assert len(rb.batches) == 2
            rb.paused = True  # any extend from now on is a violation
            with anyio.move_on_after(0.3):  # a window in which an unpaused collector writes batches
                await rb.wait_for(3)
            assert len(rb.batches) == 2
            rb.paused = False
        with anyio.fail_after(20):
            await rb.wait_for(4)  # writes resume after the pause
    assert rb.violations == 0


async def test_pause_holds_a_consumer(anyio_backend):
    async with Collector(cartpole(), frames_per_batch=8) as collector:
        got: list[TensorDictBase] = []

        async def consume() -> None:
            got.extend(await take(collector, 1))

        async with collector.pause(), anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.wait_all_tasks_blocked()
            assert got == []
            tg.cancel_scope.cancel()
        with anyio.fail_after(20):
            await consume()
    assert len(got) == 1


# -- seeds, reset --------------------------------------------------------------------------------
async def collect_seeded(
    seed: int, *, policy: str, num_envs: int | None = None, n: int = 2
) -> list[TensorDictBase]:
    torch.manual_seed(0)
    module = CategoricalPolicy() if policy == "categorical" else None  # the same weights every time
    torch.seed()  # torch's global RNG differs from one call to the next...
    async with Collector(
        cartpole(num_envs), module, frames_per_batch=32, total_frames=32 * n, seed=seed
    ) as collector:
        batches: list[TensorDictBase] = []
        async for batch in collector:
            batches.append(batch)
            torch.rand(7)  # ...and the caller draws from it between batches: neither matters
    return batches


@pytest.mark.parametrize("policy", ["categorical", "random"])
@pytest.mark.parametrize("num_envs", [None, 2])
async def test_same_seed_same_batches(anyio_backend, num_envs, policy):
    a = await collect_seeded(1, policy=policy, num_envs=num_envs)
    b = await collect_seeded(1, policy=policy, num_envs=num_envs)
    c = await collect_seeded(2, policy=policy, num_envs=num_envs)
    assert_same_batches(a, b)
    assert actions(a[0]) == {0, 1}  # the policy does sample
    assert not torch.equal(a[0]["action"], c[0]["action"])
    assert not torch.equal(a[0]["observation"], c[0]["observation"])


async def test_seeded_collector_leaves_the_callers_rng_alone(anyio_backend):
    policy = CategoricalPolicy()
    torch.manual_seed(123)
    expected = torch.rand(5)
    torch.manual_seed(123)
    async with Collector(cartpole(), policy, frames_per_batch=16, total_frames=32, seed=4) as collector:
        batches = await take(collector)
    assert actions(batches[0]) == {0, 1}  # the policy did sample, from the collector's own RNG
    assert torch.equal(torch.rand(5), expected)


async def test_set_seed(anyio_backend):
    torch.manual_seed(0)
    policy = CategoricalPolicy()
    batches = []
    for first_seed in (10, 11):
        async with Collector(cartpole(), policy, frames_per_batch=24, seed=first_seed) as collector:
            last = await collector.set_seed(5)
            assert isinstance(last, int)
            batches.append(await take(collector, 2))
    assert_same_batches(batches[0], batches[1])
    async with Collector(cartpole(), policy, frames_per_batch=24, seed=10) as collector:
        await collector.set_seed(6)
        other = await take(collector, 2)
    assert not torch.equal(other[0]["observation"], batches[0][0]["observation"])


async def test_reset_starts_new_episodes(anyio_backend):
    async with Collector(cartpole(), frames_per_batch=8, max_frames_per_traj=200) as collector:
        (before,) = await take(collector, 1)
        await collector.reset()
        (after,) = await take(collector, 1)
    assert (after["observation"][0].abs() <= 0.05).all()  # a reset observation
    assert not torch.equal(after["observation"][0], before["next", "observation"][-1])
    assert after["collector", "traj_ids"][0] > before["collector", "traj_ids"].max()


# -- state_dict / load_state_dict ----------------------------------------------------------------
async def test_state_dict_resumes_the_budget(anyio_backend):
    torch.manual_seed(0)
    policy = CategoricalPolicy()
    async with Collector(cartpole(), policy, frames_per_batch=16, total_frames=64, seed=0) as first:
        seen = await take(first, 2)
        with torch.no_grad():
            policy.net.bias.fill_(0.5)
        assert await first.update_weights(policy) == 1
        state = await first.state_dict()
    assert state["frames"] == 32
    assert state["batches"] == 2
    assert state["policy_version"] == 1
    last_id = int(torch.cat([b["collector", "traj_ids"] for b in seen]).max())
    assert state["next_traj_id"] > last_id

    torch.manual_seed(1)
    async with Collector(cartpole(), CategoricalPolicy(), frames_per_batch=16, total_frames=64) as second:
        await second.load_state_dict(state)
        assert second.policy_version == 1
        assert torch.equal(second.policy.net.bias, torch.full((2,), 0.5))
        assert torch.equal(second.policy.net.weight, policy.net.weight)
        stats = second.statistics()
        assert (stats.frames, stats.batches, stats.policy_version) == (32, 2, 1)
        rest = await take(second)
        assert len(rest) == 2  # the budget goes on from 32 frames: two batches left, not four
        assert second.statistics().frames == 64
    assert int(rest[0]["collector", "traj_ids"].min()) > last_id  # ids stay unique across the resume


async def test_load_state_dict_rejects_mismatched_weights(anyio_backend):
    async with Collector(cartpole(), CategoricalPolicy(), frames_per_batch=8) as collector:
        state = await collector.state_dict()
        state["policy"]["net"]["weight"] = torch.zeros(3, 4)
        with pytest.raises(ValueError, match=r"net\.weight"):
            await collector.load_state_dict(state)
        with pytest.raises(KeyError, match="frames"):
            await collector.load_state_dict({})


# -- update_weights ------------------------------------------------------------------------------
async def test_update_weights_returns_increasing_versions(anyio_backend):
    async with Collector(cartpole(), CategoricalPolicy(), frames_per_batch=8) as collector:
        assert collector.policy_version == 0
        assert await collector.update_weights() == 1
        assert await collector.update_weights() == 2
        assert collector.policy_version == 2
        assert collector.statistics().policy_version == 2


async def test_track_policy_version(anyio_backend):
    policy = ParameterAction()
    async with pendulum_collector(policy, track_policy_version=True) as collector:
        (first,) = await take(collector, 1)
        await collector.update_weights(policy)
        (second,) = await take(collector, 1)
    for batch, version in ((first, 0), (second, 1)):
        stamp = batch["collector", "policy_version"]
        assert stamp.shape == batch.batch_size
        assert stamp.dtype == torch.int64
        assert (stamp == version).all()


async def test_no_policy_version_key_by_default(anyio_backend):
    async with pendulum_collector(ParameterAction()) as collector:
        (batch,) = await take(collector, 1)
    assert ("collector", "policy_version") not in batch.keys(include_nested=True)


async def test_weights_change_only_on_update_weights(anyio_backend):
    policy = ParameterAction()
    async with pendulum_collector(policy) as collector:
        (batch,) = await take(collector, 1)
        assert actions(batch) == {0.0}
        with torch.no_grad():
            policy.value.fill_(1.5)  # the trainer's copy changes...
        (batch,) = await take(collector, 1)
        assert actions(batch) == {0.0}  # ...the collector's does not
        await collector.update_weights(policy)
        (batch,) = await take(collector, 1)
        assert actions(batch) == {1.5}
        with torch.no_grad():
            policy.value.fill_(-1.0)
        await collector.update_weights()  # None: the policy the collector was built with
        (batch,) = await take(collector, 1)
        assert actions(batch) == {-1.0}


@pytest.mark.parametrize("form", ["state_dict", "tensordict"])
async def test_update_weights_from_weights(anyio_backend, form):
    policy = ParameterAction()
    async with pendulum_collector(policy) as collector:
        trained = ParameterAction()
        with torch.no_grad():
            trained.value.fill_(0.75)
        weights = trained.state_dict() if form == "state_dict" else TensorDict.from_module(trained)
        assert await collector.update_weights(weights) == 1
        (batch,) = await take(collector, 1)
    assert actions(batch) == {0.75}


async def test_update_weights_syncs_buffers(anyio_backend):
    policy = ParameterAction()
    async with pendulum_collector(policy) as collector:
        policy.offset.fill_(0.25)
        await collector.update_weights(policy)
        (batch,) = await take(collector, 1)
    assert actions(batch) == {0.25}


@pytest.mark.parametrize(
    ("weights", "key"),
    [
        ({"value": torch.zeros(2), "offset": torch.zeros(1)}, "value"),  # wrong shape
        ({"value": torch.zeros(1)}, "offset"),  # missing
        ({"value": torch.zeros(1), "offset": torch.zeros(1), "bias": torch.zeros(1)}, "bias"),  # extra
    ],
)
async def test_update_weights_rejects_mismatched_weights(anyio_backend, weights, key):
    async with pendulum_collector(ParameterAction()) as collector:
        with pytest.raises(ValueError, match=key):
            await collector.update_weights(weights)
        assert collector.policy_version == 0
        (batch,) = await take(collector, 1)  # still usable, weights untouched
    assert actions(batch) == {0.0}


# -- statistics ----------------------------------------------------------------------------------
@pytest.mark.parametrize("num_envs", [None, 3])
async def test_statistics(anyio_backend, num_envs):
    fpb = 60 if num_envs else 64
    async with Collector(cartpole(num_envs), frames_per_batch=fpb, total_frames=4 * fpb, seed=0) as collector:
        assert collector.statistics().frames == 0
        batches = await take(collector)
        stats = collector.statistics()
    assert isinstance(stats, CollectorStatistics)
    assert stats.frames == 4 * fpb
    assert stats.batches == 4
    done = torch.cat([b["next", "done"].reshape(-1, b.batch_size[-1]) for b in batches], dim=-1)
    assert stats.episodes == int(done.sum()) > 0
    # CartPole's return is the episode length; every episode started in the collected frames
    lengths = []
    for row in done:
        ends = torch.nonzero(row).flatten()
        lengths += torch.diff(ends, prepend=torch.tensor([-1])).tolist()
    assert stats.mean_return == pytest.approx(sum(lengths) / len(lengths))
    assert stats.mean_length == pytest.approx(sum(lengths) / len(lengths))
    assert stats.frames_per_second > 0
    assert stats.policy_version == 0
    record = json.loads(json.dumps(stats.to_dict()))
    assert record["frames"] == 4 * fpb
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.frames = 0  # type: ignore[misc]
