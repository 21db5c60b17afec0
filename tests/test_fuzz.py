"""Bad input: hypothesis over the collectors' constructor arguments, and malformed policies.

* every invalid combination raises ``ValueError`` / ``TypeError`` naming an invalid argument, in the
  constructor: no process starts and no env is left open;
* every valid small combination (in-process ``Collector``, ``worker_backend="serial"`` multi collectors)
  collects the promised number of frames with the promised shapes;
* a malformed policy (no ``"action"``, wrong shape or dtype, values outside the space) fails with an error
  naming ``'action'`` and what the action space needs, at construction or on the first batch.

Each example runs under a backend drawn from asyncio, asyncio+uvloop and trio (``anyio.run``), so the
anyio_backend fixture is not used here.
"""

from __future__ import annotations

import math
import traceback
import warnings
from typing import Any

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict.nn import TensorDictModule

from aiocollect import (
    Collector,
    GymEnv,
    MultiAsyncCollector,
    MultiSyncCollector,
    ProcessCollector,
    RandomPolicy,
)
from support import cartpole, cartpole3, children, pendulum

FAST = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
COLLECTING = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))

BACKENDS = st.sampled_from(
    [("asyncio", {"use_uvloop": False}), ("asyncio", {"use_uvloop": True}), ("trio", {})]
)

#: envs built by ``tracked`` and not closed yet
OPEN: set[int] = set()


class TrackedEnv(GymEnv):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        OPEN.add(id(self))

    def close(self) -> None:
        OPEN.discard(id(self))
        super().close()


def tracked() -> GymEnv:
    return TrackedEnv("CartPole-v1")


# -- invalid arguments --------------------------------------------------------------------------------
def bad(*values: Any) -> st.SearchStrategy[Any]:
    return st.sampled_from(values)


FLAG = bad(0, 1, "yes", None)
DEVICE = bad("cuda:99", "gpu", "mps", 3.5, "cpu:x")

#: invalid values of the arguments every collector takes
INVALID: dict[str, st.SearchStrategy[Any]] = {
    "frames_per_batch": bad(0, -1, 2.5, True, "8", None),
    "total_frames": bad(0, -2, 1.5, True, "100"),
    "max_frames_per_traj": bad(0, -1, 2.5, True, "5"),
    "init_random_frames": bad(-1, 1.5, True, "5"),
    "worker_timeout": bad(0, -1.0, True, "1", float("nan")),
    "max_policy_lag": bad(-1, 1.5, True, "1"),
    "reset_at_each_iter": FLAG,
    "split_trajs": FLAG,
    "set_truncated": FLAG,
    "track_policy_version": FLAG,
    "device": DEVICE,
    "env_device": DEVICE,
    "policy_device": DEVICE,
    "storing_device": DEVICE,
    "exploration_type": bad("greedy", 3, None),
    "seed": bad(1.5, "1", True),
    "compile_policy": bad("yes", 1, None),
    "replay_buffer": bad(3, "rb", object()),
    "postproc": bad(3, "f"),
    "traj_id_start": bad(-1, 1.5, True),
    "traj_id_stride": bad(0, -1, 1.5),
    "weight_sync": bad("shm", 3, object()),
    "progress": bad(3, "bar", object()),
    "policy": bad(3, "random", object()),
}
MULTI_INVALID = {
    "worker_backend": bad("thread", None, 1),
    "start_method": bad("nope", 3),
    "num_threads": bad(0, -1, 1.5, True),
    "num_sub_threads": bad(0, -1, 1.5, None),
    "update_at_each_batch": FLAG,
}
SYNC_INVALID = {
    "preemptive_threshold": bad(0, -0.5, 1.5, True, "0.5", float("nan")),
    "cat_results": bad(1, 2, "cat", None, False, True),
}
VALID = {"frames_per_batch": 8, "total_frames": 32}

CLASSES = {
    "Collector": (Collector, INVALID),
    "ProcessCollector": (ProcessCollector, {**INVALID, **MULTI_INVALID}),
    "MultiSyncCollector": (MultiSyncCollector, {**INVALID, **MULTI_INVALID, **SYNC_INVALID}),
    "MultiAsyncCollector": (MultiAsyncCollector, {**INVALID, **MULTI_INVALID}),
}


@st.composite
def invalid_arguments(draw: st.DrawFn, table: dict[str, st.SearchStrategy[Any]]) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(sorted(table)), min_size=1, max_size=3, unique=True))
    return {name: draw(table[name]) for name in names}


@pytest.mark.parametrize("name", list(CLASSES))
@FAST
@given(data=st.data())
def test_invalid_arguments_raise_naming_one_before_anything_starts(name, data):
    cls, table = CLASSES[name]
    kwargs = data.draw(invalid_arguments(table))
    before = children()
    policy = kwargs.pop("policy", None)
    env = tracked if cls in (Collector, ProcessCollector) else [tracked, tracked]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises((ValueError, TypeError)) as info:
            cls(env, policy, **{**VALID, **kwargs})
    names = [*kwargs, "policy"] if policy is not None else list(kwargs)
    assert any(n in str(info.value) for n in names), (names, info.value)
    assert children() == before  # no process started
    assert not OPEN  # the in-process Collector closed the env it had built


@pytest.mark.parametrize(("name", "value"), [("worker_timeout", 0), ("progress", 3)])
def test_collector_checks_every_argument_before_building_its_env(name, value):
    """These two were checked after the env was built, which then stayed open."""
    with pytest.raises((ValueError, TypeError), match=name):
        Collector(tracked, frames_per_batch=8, **{name: value})
    assert not OPEN


def test_multi_sync_cat_results_false_is_not_zero():
    """``False == 0`` in Python: a bool must not pass as the int ``0``."""
    with pytest.raises(ValueError, match="cat_results"):
        MultiSyncCollector([tracked], frames_per_batch=8, cat_results=False)


# -- valid small configurations -----------------------------------------------------------------------
def make_cartpole(num_envs: int | None) -> Any:
    def make() -> GymEnv:
        return GymEnv("CartPole-v1", num_envs=num_envs)

    return make


@st.composite
def valid_config(draw: st.DrawFn, kind: str) -> dict[str, Any]:
    config: dict[str, Any] = {
        "frames_per_batch": draw(st.integers(1, 24)),
        "total_frames": draw(st.integers(1, 60)),
        "max_frames_per_traj": draw(st.none() | st.integers(1, 12)),
        "init_random_frames": draw(st.none() | st.integers(0, 40)),
        "reset_at_each_iter": draw(st.booleans()),
        "split_trajs": draw(st.booleans()),
        "set_truncated": draw(st.booleans()),
        "track_policy_version": draw(st.booleans()),
        "seed": draw(st.none() | st.integers(0, 2**16)),
        "exploration_type": draw(st.sampled_from(["random", "deterministic", "mode"])),
        "storing_device": draw(st.sampled_from([None, "cpu"])),
    }
    if kind != "Collector":
        config["worker_backend"] = "serial"
        config["worker_timeout"] = draw(st.none() | st.just(30.0))
    if kind == "MultiSyncCollector":
        config["cat_results"] = draw(st.sampled_from(["stack", 0, -1]))
        config["preemptive_threshold"] = draw(st.none() | st.floats(0.01, 1.0))
    return config


def expected_layout(kind: str, config: dict[str, Any], num_envs: int | None, n: int) -> tuple[int, Any]:
    """(frames per full batch, batch size of a full batch)."""
    b = num_envs or 1
    env = () if num_envs is None else (num_envs,)
    fpb = config["frames_per_batch"]
    if kind != "MultiSyncCollector":
        steps = math.ceil(fpb / b)
        return steps * b, (*env, steps)
    steps = math.ceil(math.ceil(fpb / n) / b)
    cat = config["cat_results"]
    if cat == "stack":
        shape: tuple[int, ...] = (n, *env, steps)
    elif cat == 0:
        shape = (n * b, steps) if env else (n * steps,)
    else:
        shape = (*env, n * steps)
    return n * steps * b, shape


def valid_frames(batch: Any) -> int:
    if ("collector", "mask") in batch.keys(include_nested=True):
        return int(batch["collector", "mask"].sum())
    return batch.numel()


async def collect(kind: str, config: dict[str, Any], num_envs: int | None, n: int) -> tuple[list[Any], Any]:
    make = make_cartpole(num_envs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # batch sizes rounded, total_frames not a multiple: warned
        if kind == "Collector":
            collector: Any = Collector(make, **config)
        elif kind == "ProcessCollector":
            collector = ProcessCollector(make, **config)
        else:
            cls = MultiSyncCollector if kind == "MultiSyncCollector" else MultiAsyncCollector
            collector = cls([make] * n, **config)
        with anyio.fail_after(60):
            async with collector:
                batches = [b async for b in collector]
    return batches, collector


@pytest.mark.parametrize(
    "kind", ["Collector", "ProcessCollector", "MultiSyncCollector", "MultiAsyncCollector"]
)
@COLLECTING
@given(data=st.data(), backend=BACKENDS)
def test_valid_configurations_collect_what_they_promise(kind, data, backend):
    config = data.draw(valid_config(kind), label="config")
    num_envs = data.draw(st.sampled_from([None, 1, 3]), label="num_envs")
    n = 1 if kind in ("Collector", "ProcessCollector") else data.draw(st.integers(1, 3), label="workers")
    if config.get("cat_results") == 0 and config.get("preemptive_threshold") and num_envs is not None:
        with pytest.raises(ValueError, match="cat_results=0 with preemptive_threshold"):
            anyio.run(collect, kind, config, num_envs, n, backend=backend[0], backend_options=backend[1])
        return  # said at start-up: a preempted batch of batched envs cannot be concatenated on dim 0
    batches, collector = anyio.run(
        collect, kind, config, num_envs, n, backend=backend[0], backend_options=backend[1]
    )
    full, shape = expected_layout(kind, config, num_envs, n)
    total = config["total_frames"]
    frames = [valid_frames(b) for b in batches]
    preempted = config.get("preemptive_threshold") is not None
    # the budget: enough frames, and no batch past the one that reached it
    assert sum(frames) >= total
    assert sum(frames[:-1]) < total
    assert collector.statistics().frames == sum(frames)
    if not preempted:
        assert frames == [full] * math.ceil(total / full)
    for batch in batches:
        if config["split_trajs"]:
            assert batch.ndim == 2  # [trajectories, max length], zero-padded, with a mask
            assert ("collector", "mask") in batch.keys(include_nested=True)
        elif preempted and config["cat_results"] != "stack":
            assert batch.numel() <= full  # late workers' missing steps are cut out
        else:
            assert tuple(batch.batch_size) == shape
            assert batch.names[-1] == "time"
        if config["track_policy_version"]:
            assert ("collector", "policy_version") in batch.keys(include_nested=True)
        if kind in ("MultiAsyncCollector", "ProcessCollector"):
            assert ("collector", "worker_id") in batch.keys(include_nested=True)
        if config["set_truncated"] and not config["split_trajs"] and not preempted:
            assert batch["next", "truncated"][..., -1, :].all()
        assert batch["action"].dtype == torch.int64
        valid = batch["collector", "traj_ids"] != -1  # a late worker's missing frames hold garbage
        action = batch["action"][valid]
        assert ((action == 0) | (action == 1)).all()


# -- malformed policies -------------------------------------------------------------------------------
class Fixed(torch.nn.Module):
    """``forward`` returns ``make(observation, call)`` (call counts from 1, the dry call)."""

    def __init__(self, make: Any) -> None:
        super().__init__()
        self.make = make
        self.calls = 0

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.make(observation, self.calls)


def no_action() -> Any:
    net = Fixed(lambda o, _: o.sum(-1))
    return TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])


def discrete(value: int, from_call: int = 1) -> Any:
    return Fixed(lambda o, c: torch.full(o.shape[:-1], value if c >= from_call else 0, dtype=torch.int64))


MALFORMED = {
    # name: (env, policy, error type, pieces of the message and traceback)
    "no-action-key": (cartpole, no_action, KeyError, ["'action'", "logits", "Discrete(2) needs"]),
    "wrong-shape": (
        cartpole,
        lambda: Fixed(lambda o, _: torch.zeros(*o.shape[:-1], 3, dtype=torch.int64)),
        ValueError,
        ["'action'", "shape (3,)", "needs shape ()"],
    ),
    "wrong-batch": (
        cartpole3,
        lambda: Fixed(lambda o, _: torch.zeros(2, dtype=torch.int64)),
        ValueError,
        ["'action'", "(3,)"],
    ),
    "float-for-discrete": (
        cartpole,
        lambda: Fixed(lambda o, _: torch.full(o.shape[:-1], 0.7)),
        TypeError,
        ["'action'", "torch.float32", "integer dtype", "Discrete(2)"],
    ),
    "int-for-box": (
        pendulum,
        lambda: Fixed(lambda o, _: torch.zeros(*o.shape[:-1], 1, dtype=torch.int64)),
        TypeError,
        ["'action'", "torch.int64", "floating dtype", "Box("],
    ),
    "outside-discrete": (
        cartpole,
        lambda: discrete(5, from_call=3),  # valid at the dry call, then out of range
        ValueError,
        ["'action'", "Discrete(2)", "[5]", "[0, 1]"],
    ),
    "negative-discrete-batched": (
        cartpole3,
        lambda: discrete(-1),
        ValueError,
        ["'action'", "Discrete(2)", "[-1]"],
    ),
}


async def first_batch(kind: str, env: Any, policy: Any) -> Any:
    if kind == "Collector":
        collector: Any = Collector(env, policy, frames_per_batch=6)
    elif kind == "MultiSyncCollector":
        collector = MultiSyncCollector([env, env], policy, frames_per_batch=12, worker_backend="serial")
    else:
        collector = ProcessCollector(env, policy, frames_per_batch=6)
    with anyio.fail_after(60):
        async with collector:
            return await collector.__anext__()


@pytest.mark.parametrize("kind", ["Collector", "MultiSyncCollector", "ProcessCollector"])
@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_policy_fails_naming_the_action_and_its_spec(case, kind):
    env, make_policy, error, pieces = MALFORMED[case]
    with pytest.raises(error) as info:
        anyio.run(first_batch, kind, env, make_policy())
    text = "".join(traceback.format_exception(info.value))
    for piece in pieces:
        assert piece in text, (piece, text)


def test_continuous_actions_outside_the_box_go_to_the_env():
    """Documented: a Box action out of bounds is not an error (the env clips, as Pendulum does); the
    batch keeps what the policy chose."""
    policy = Fixed(lambda o, _: torch.full((*o.shape[:-1], 1), 10.0))
    batch = anyio.run(first_batch, "Collector", pendulum, policy)
    assert (batch["action"] == 10.0).all()


def test_random_policy_of_every_space_stays_inside():
    """The random policy (init_random_frames, policy=None) never trips the range check."""
    from aiocollect._envs._spaces import action_bounds

    for space in (
        gym.spaces.Discrete(3, start=-1),
        gym.spaces.MultiDiscrete([2, 5], start=[1, -2]),
        gym.spaces.MultiBinary(4),
    ):
        samples = RandomPolicy(space, seed=0).sample((256,)).numpy()
        low, high = action_bounds(space)
        assert (samples >= np.asarray(low)).all() and (samples <= np.asarray(high)).all()


@pytest.fixture(autouse=True)
def _no_open_envs():
    OPEN.clear()
    yield
    OPEN.clear()
