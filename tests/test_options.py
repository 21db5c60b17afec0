"""``RolloutOptions`` and ``WeightSchedule``: checked once, normalised, picklable, built from keywords."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from tensordict.nn import InteractionType

from aiocollect import RolloutOptions, WeightSchedule

BAD_ROLLOUT = [
    ({"frames_per_batch": 0}, ValueError, "frames_per_batch"),
    ({"frames_per_batch": 2.5}, TypeError, "frames_per_batch"),
    ({"frames_per_batch": "16"}, TypeError, "frames_per_batch"),
    ({"frames_per_batch": True}, TypeError, "frames_per_batch"),
    ({"frames_per_batch": []}, ValueError, "frames_per_batch"),
    ({"frames_per_batch": [4, 0]}, ValueError, r"frames_per_batch\[1\]"),
    ({"total_frames": 0}, ValueError, "total_frames"),
    ({"total_frames": -5}, ValueError, "total_frames"),
    ({"total_frames": 10.0}, TypeError, "total_frames"),
    ({"max_frames_per_traj": 0}, ValueError, "max_frames_per_traj"),
    ({"max_frames_per_traj": 1.5}, TypeError, "max_frames_per_traj"),
    ({"init_random_frames": -1}, ValueError, "init_random_frames"),
    ({"init_random_frames": "10"}, TypeError, "init_random_frames"),
    ({"reset_at_each_iter": 1}, TypeError, "reset_at_each_iter"),
    ({"split_trajs": None}, TypeError, "split_trajs"),
    ({"set_truncated": "yes"}, TypeError, "set_truncated"),
    ({"exploration_type": "sideways"}, ValueError, "exploration_type"),
    ({"exploration_type": 3}, ValueError, "exploration_type"),
    ({"seed": "0"}, TypeError, "seed"),
    ({"device": "not-a-device"}, ValueError, "device"),
    ({"storing_device": 3.5}, ValueError, "storing_device"),
    ({"compile_policy": "max-autotune"}, TypeError, "compile_policy"),
    ({"traj_id_start": -1}, ValueError, "traj_id_start"),
    ({"traj_id_stride": 0}, ValueError, "traj_id_stride"),
]


@pytest.mark.parametrize(("kwargs", "error", "name"), BAD_ROLLOUT, ids=[str(k) for k, *_ in BAD_ROLLOUT])
def test_rollout_options_refuse_bad_values(kwargs, error, name):
    with pytest.raises(error, match=name):
        RolloutOptions(**{"frames_per_batch": 16, **kwargs})


def test_rollout_options_are_normalised():
    options = RolloutOptions(
        frames_per_batch=[8, 8],
        total_frames=None,
        init_random_frames=None,
        exploration_type="Mode",
        device="cpu",
        compile_policy={"mode": "reduce-overhead"},
    )
    assert options.frames_per_batch == (8, 8)
    assert options.batch_frames() == 16
    assert options.total_frames == -1 and options.endless
    assert options.init_random_frames == 0
    assert options.exploration_type is InteractionType.MODE
    assert options.device == torch.device("cpu")
    assert options.devices.policy == options.devices.env == options.devices.storing == torch.device("cpu")


def test_options_are_frozen_and_picklable():
    options = RolloutOptions(frames_per_batch=32, seed=3, storing_device="cpu")
    schedule = WeightSchedule(update_at_each_batch=True, max_policy_lag=2)
    assert pickle.loads(pickle.dumps(options)) == options
    assert pickle.loads(pickle.dumps(schedule)) == schedule
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.seed = 4  # type: ignore[misc]
    # replace() checks the new values as the constructor does
    with pytest.raises(ValueError, match="frames_per_batch"):
        dataclasses.replace(options, frames_per_batch=0)


def test_for_member_splits_the_trajectory_ids():
    options = RolloutOptions(frames_per_batch=[4, 6], traj_id_start=1, traj_id_stride=2)
    first = options.for_member(0, 2, frames_per_batch=4)
    second = options.for_member(1, 2, frames_per_batch=6)
    assert (first.traj_id_start, first.traj_id_stride, first.frames_per_batch) == (1, 4, 4)
    assert (second.traj_id_start, second.traj_id_stride, second.frames_per_batch) == (3, 4, 6)
    with pytest.raises(ValueError, match="member index"):
        options.for_member(2, 2)


def test_from_kwargs_builds_or_passes_the_object():
    built = RolloutOptions.from_kwargs(frames_per_batch=16, total_frames=64, seed=1)
    assert built == RolloutOptions(frames_per_batch=16, total_frames=64, seed=1)
    given = RolloutOptions(frames_per_batch=8, total_frames=32)
    # flat keywords at their defaults do not conflict with the object
    assert RolloutOptions.from_kwargs(given, frames_per_batch=None, total_frames=-1, seed=None) is given


def test_from_kwargs_refuses_an_object_and_the_same_keyword():
    given = RolloutOptions(frames_per_batch=8)
    with pytest.raises(TypeError, match=r"rollout=RolloutOptions.*total_frames"):
        RolloutOptions.from_kwargs(given, frames_per_batch=None, total_frames=64)
    with pytest.raises(TypeError, match=r"rollout=RolloutOptions.*frames_per_batch"):
        RolloutOptions.from_kwargs(given, frames_per_batch=8)
    with pytest.raises(TypeError, match="frames_per_batch is required"):
        RolloutOptions.from_kwargs(None, frames_per_batch=None)
    with pytest.raises(TypeError, match="rollout must be a RolloutOptions"):
        RolloutOptions.from_kwargs({"frames_per_batch": 8}, frames_per_batch=None)  # type: ignore[arg-type]
    schedule = WeightSchedule(max_policy_lag=1)
    with pytest.raises(TypeError, match=r"weights=WeightSchedule.*update_at_each_batch"):
        WeightSchedule.from_kwargs(schedule, update_at_each_batch=True)
    assert WeightSchedule.from_kwargs(schedule, update_at_each_batch=False) is schedule


BAD_SCHEDULE = [
    ({"update_at_each_batch": 1}, TypeError, "update_at_each_batch"),
    ({"track_policy_version": 0}, TypeError, "track_policy_version"),
    ({"max_policy_lag": -1}, ValueError, "max_policy_lag"),
    ({"max_policy_lag": 0.5}, TypeError, "max_policy_lag"),
    ({"max_weight_update_interval": -2}, ValueError, "max_weight_update_interval"),
    ({"max_weight_update_interval": 2.0}, TypeError, "max_weight_update_interval"),
    ({"max_weight_update_interval": True}, TypeError, "max_weight_update_interval"),
    ({"update_at_each_batch": True, "max_weight_update_interval": 3}, ValueError, "drop max_weight_update"),
]


@pytest.mark.parametrize(("kwargs", "error", "name"), BAD_SCHEDULE, ids=[str(k) for k, *_ in BAD_SCHEDULE])
def test_weight_schedule_refuses_bad_values(kwargs, error, name):
    with pytest.raises(error, match=name):
        WeightSchedule(**kwargs)


@pytest.mark.parametrize("interval", [0, -1])
def test_interval_zero_is_a_deprecated_none(interval):
    with pytest.warns(DeprecationWarning, match="max_weight_update_interval=None") as record:
        schedule = WeightSchedule(max_weight_update_interval=interval)
    assert schedule.max_weight_update_interval is None
    assert not schedule.sends_weights
    assert record[0].filename == __file__  # attributed to the caller's line


def test_update_after_each_batch_is_a_deprecated_alias():
    with pytest.warns(DeprecationWarning, match="update_at_each_batch"):
        schedule = WeightSchedule.from_kwargs(update_after_each_batch=True)
    assert schedule.update_at_each_batch and schedule.sends_weights
    with pytest.raises(TypeError, match=r"update_after_each_batch.*update_at_each_batch"):
        WeightSchedule.from_kwargs(update_at_each_batch=True, update_after_each_batch=True)


def test_worker_backend_and_its_deprecated_spelling():
    from aiocollect._core._options import worker_backend_arg

    assert worker_backend_arg("serial") == "serial"
    with pytest.warns(DeprecationWarning, match="worker_backend="):
        assert worker_backend_arg("process", "serial") == "serial"
    with pytest.raises(TypeError, match=r"backend.*worker_backend"):
        worker_backend_arg("serial", "serial")
    with pytest.raises(ValueError, match="worker_backend"):
        worker_backend_arg("threads")


def test_multi_collectors_take_the_options_objects_and_the_old_backend_spelling():
    from aiocollect import MultiAsyncCollector, MultiSyncCollector, ProcessCollector

    def env():
        raise AssertionError("not built in the constructor")

    options = RolloutOptions(frames_per_batch=8, total_frames=16, seed=0)
    c = MultiSyncCollector([env, env], rollout=options, weights=WeightSchedule(update_at_each_batch=True))
    assert (c.frames_per_batch, c.total_frames) == (8, 16)
    with pytest.raises(TypeError, match=r"rollout=RolloutOptions.*seed"):
        MultiAsyncCollector([env], rollout=options, seed=1)
    with pytest.warns(DeprecationWarning, match="worker_backend="):
        ProcessCollector(env, frames_per_batch=8, backend="serial")
    with pytest.raises(ValueError, match="max_weight_update_interval"):
        MultiSyncCollector([env], frames_per_batch=8, weights=WeightSchedule(max_weight_update_interval=2))


def test_collector_takes_the_options_objects():
    from aiocollect import Collector, GymEnv

    options = RolloutOptions(frames_per_batch=16, total_frames=32, max_frames_per_traj=5, seed=0)
    collector = Collector(
        lambda: GymEnv("CartPole-v1"), rollout=options, weights=WeightSchedule(max_policy_lag=1)
    )
    assert (collector.frames_per_batch, collector.total_frames) == (16, 32)
    flat = Collector(
        lambda: GymEnv("CartPole-v1"), frames_per_batch=16, total_frames=32, max_frames_per_traj=5
    )
    assert flat.frames_per_batch == collector.frames_per_batch
    with pytest.raises(TypeError, match=r"rollout=RolloutOptions.*max_frames_per_traj"):
        Collector(lambda: GymEnv("CartPole-v1"), rollout=options, max_frames_per_traj=7)
    with pytest.raises(TypeError, match="frames_per_batch is required"):
        Collector(lambda: GymEnv("CartPole-v1"))
    with pytest.raises(TypeError, match="one frames_per_batch"):
        Collector(lambda: GymEnv("CartPole-v1"), frames_per_batch=[8, 8])
    with pytest.raises(ValueError, match="update_at_each_batch"):
        Collector(
            lambda: GymEnv("CartPole-v1"),
            frames_per_batch=8,
            weights=WeightSchedule(update_at_each_batch=True),
        )


def test_options_reach_the_workers():
    import anyio

    from aiocollect import GymEnv, MultiSyncCollector

    async def main() -> list[int]:
        options = RolloutOptions(frames_per_batch=16, total_frames=16, max_frames_per_traj=3, traj_id_start=5)
        async with MultiSyncCollector(
            [lambda: GymEnv("CartPole-v1")] * 2,
            rollout=options,
            weights=WeightSchedule(track_policy_version=True),
            worker_backend="serial",
        ) as c:
            (batch,) = [b async for b in c]
        assert ("collector", "policy_version") in batch.keys(include_nested=True)
        return sorted(set(batch["collector", "traj_ids"].flatten().tolist()))

    ids = anyio.run(main)
    # max_frames_per_traj=3: every 8-step rollout holds 3 trajectories; worker i's ids are 5 + i + 2k
    assert ids == [5, 6, 7, 8, 9, 10]


@pytest.mark.parametrize("cls", ["MultiSyncCollector", "MultiAsyncCollector"])
@pytest.mark.parametrize("cut", ["reset_at_each_iter", "set_truncated"])
def test_trajectory_cuts_given_as_options_are_refused_with_trajs_per_batch(cls, cut):
    """The multi-process collectors refuse a cut given through ``rollout=RolloutOptions(...)`` as they
    refuse the keyword, before any worker starts."""
    import aiocollect

    def never():
        raise AssertionError("no env is built")

    collector = getattr(aiocollect, cls)
    with pytest.raises(ValueError, match=f"drop {cut}"):
        collector([never] * 2, trajs_per_batch=2, rollout=RolloutOptions(64, **{cut: True}))
    with pytest.raises(ValueError, match=f"drop {cut}"):  # the keyword, checked in the same place
        collector([never] * 2, trajs_per_batch=2, **{cut: True})
