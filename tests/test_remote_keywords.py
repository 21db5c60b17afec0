"""The remote collectors' weight keywords mean the same thing everywhere (checked by the constructors:
nothing starts, no ray import): ``update_at_each_batch`` (``update_after_each_batch`` deprecated),
``max_weight_update_interval`` (``None`` off; ``0``/``-1`` deprecated spellings of ``None``), a policy
without weights -> ``TypeError``; ``collector_kwargs`` are checked on the trainer."""

from __future__ import annotations

import pytest
import torch

from aiocollect import DistributedCollector, GymEnv, RayCollector, RPCCollector, WeightSchedule

ENGINES = [DistributedCollector, RPCCollector, RayCollector]


class ConstantPolicy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.value = torch.nn.Parameter(torch.zeros(1))

    def forward(self, observation):
        return self.value.expand(*observation.shape[:-1], 1).clone()


def pendulum():
    return GymEnv("Pendulum-v1")


def make(cls, policy=None, **kwargs):
    return cls(pendulum, policy, frames_per_batch=8, num_collectors=2, **kwargs)


def schedule(c):
    """The weight plan the collector's transport follows."""
    return c._transport.plan.weights


@pytest.mark.parametrize("cls", ENGINES)
def test_update_after_each_batch_is_a_deprecated_alias(cls):
    with pytest.warns(DeprecationWarning, match="use update_at_each_batch"):
        c = make(cls, ConstantPolicy(), update_after_each_batch=True)
    assert schedule(c).at_each_batch
    with pytest.raises(TypeError, match="not both"):
        make(cls, ConstantPolicy(), update_at_each_batch=True, update_after_each_batch=True)


@pytest.mark.parametrize("cls", ENGINES)
@pytest.mark.parametrize("old", [0, -1])
def test_interval_zero_and_minus_one_mean_none(cls, old):
    with pytest.warns(DeprecationWarning, match="max_weight_update_interval=None"):
        c = make(cls, ConstantPolicy(), max_weight_update_interval=old)
    assert schedule(c).interval is None
    with pytest.raises(ValueError, match="max_weight_update_interval"):
        make(cls, ConstantPolicy(), max_weight_update_interval=-2)
    assert schedule(make(cls, ConstantPolicy(), max_weight_update_interval=None)).interval is None
    assert schedule(make(cls, ConstantPolicy(), max_weight_update_interval=3)).interval == 3


@pytest.mark.parametrize("cls", ENGINES)
def test_weights_keywords_need_a_module_policy_and_exclude_each_other(cls):
    with pytest.raises(TypeError, match=r"nn\.Module"):
        make(cls, lambda td: td, update_at_each_batch=True)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        make(cls, lambda td: td, max_weight_update_interval=2)
    with pytest.raises(ValueError, match="exclude each other"):
        make(cls, ConstantPolicy(), update_at_each_batch=True, max_weight_update_interval=2)


@pytest.mark.parametrize("cls", ENGINES)
def test_collector_kwargs_are_checked_on_the_trainer(cls):
    with pytest.raises(ValueError, match="cannot set"):
        make(cls, collector_kwargs={"total_frames": 10})
    with pytest.raises(ValueError, match="worker_timeout"):
        make(cls, collector_kwargs={"worker_timeout": -1})
    with pytest.raises(TypeError, match="takes no keyword 'max_frame_per_traj'"):
        make(cls, collector_kwargs={"max_frame_per_traj": 3})
    with pytest.raises(ValueError, match="max_frames_per_traj"):
        make(cls, collector_kwargs={"max_frames_per_traj": -3})
    with pytest.raises(TypeError, match="split_trajs"):
        make(cls, collector_kwargs=[{}, {"split_trajs": "yes"}])


@pytest.mark.parametrize("cls", ENGINES)
def test_a_weight_schedule_object_is_accepted(cls):
    c = make(cls, ConstantPolicy(), weights=WeightSchedule(max_weight_update_interval=2))
    assert schedule(c).interval == 2
    with pytest.raises(TypeError, match="both given"):
        make(cls, ConstantPolicy(), weights=WeightSchedule(), max_weight_update_interval=2)


@pytest.mark.parametrize("cls", ENGINES)
def test_rollout_keywords_travel_typed_and_leave_the_pickled_keywords(cls):
    """``collector_kwargs``' rollout keywords become each member's ``RolloutOptions`` and are taken out of
    the keywords pickled for it (the member's collector is built with ``rollout=``, which refuses both)."""
    import cloudpickle

    c = make(cls, collector_kwargs={"max_frames_per_traj": 5, "track_policy_version": True})
    plan = c._transport.plan
    assert [r.max_frames_per_traj for r in plan.rollouts] == [5, 5]
    for payload in plan.payloads:
        _, _, kwargs = cloudpickle.loads(payload)
        assert kwargs == {"track_policy_version": True}
