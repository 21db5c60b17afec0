"""``Collector`` refuses bad input with an error naming the argument, before it builds the env."""

from __future__ import annotations

import pytest
import torch

from aiocollect import Collector, GymEnv
from support import EnvFactory


class NotABuffer:
    """Not a replay buffer (its repr names the test the same in every process: ``pytest -n``)."""

    def __repr__(self) -> str:
        return "NotABuffer()"


BAD_ARGUMENTS = [
    # (keyword arguments, exception type(s), the argument the message names)
    ({"frames_per_batch": 0}, ValueError, "frames_per_batch"),
    ({"frames_per_batch": -8}, ValueError, "frames_per_batch"),
    ({"frames_per_batch": 2.5}, (TypeError, ValueError), "frames_per_batch"),
    ({"frames_per_batch": "16"}, (TypeError, ValueError), "frames_per_batch"),
    ({"frames_per_batch": True}, (TypeError, ValueError), "frames_per_batch"),
    ({"total_frames": -5}, ValueError, "total_frames"),
    ({"total_frames": 0}, ValueError, "total_frames"),
    ({"total_frames": 10.0}, (TypeError, ValueError), "total_frames"),
    ({"exploration_type": "sideways"}, ValueError, "exploration_type"),
    ({"max_frames_per_traj": 0}, ValueError, "max_frames_per_traj"),
    ({"max_frames_per_traj": -1}, ValueError, "max_frames_per_traj"),
    ({"init_random_frames": -1}, ValueError, "init_random_frames"),
    ({"postproc": "double"}, TypeError, "postproc"),
    ({"replay_buffer": NotABuffer()}, TypeError, "replay_buffer"),
    ({"device": "not-a-device"}, ValueError, "device"),
    ({"policy_device": "not-a-device"}, ValueError, "policy_device"),
    ({"storing_device": 3.5}, ValueError, "storing_device"),
    ({"policy": 42}, TypeError, "policy"),
    ({"seed": "0"}, TypeError, "seed"),
    ({"reset_at_each_iter": 1}, TypeError, "reset_at_each_iter"),
    ({"set_truncated": "yes"}, TypeError, "set_truncated"),
    ({"split_trajs": None}, TypeError, "split_trajs"),
    ({"track_policy_version": 0}, TypeError, "track_policy_version"),
    ({"compile_policy": "max-autotune"}, TypeError, "compile_policy"),
]


@pytest.mark.parametrize(
    ("kwargs", "error", "name"), BAD_ARGUMENTS, ids=[str(kw) for kw, *_ in BAD_ARGUMENTS]
)
def test_bad_argument_raises_before_the_env_is_built(kwargs, error, name):
    factory = EnvFactory()
    with pytest.raises(error, match=name):
        Collector(factory, **{"frames_per_batch": 16, **kwargs})
    assert factory.calls == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("name", ["device", "env_device", "policy_device", "storing_device"])
def test_cuda_device_without_a_gpu(name):
    factory = EnvFactory()
    with pytest.raises(ValueError, match=f"{name}='cuda'"):
        Collector(factory, frames_per_batch=16, **{name: "cuda"})
    assert factory.calls == 0


@pytest.mark.parametrize("env_fn", [42, "CartPole-v1", None])
def test_env_fn_must_be_an_env_or_callable(env_fn):
    with pytest.raises(TypeError, match="create_env_fn"):
        Collector(env_fn, frames_per_batch=16)


def test_env_fn_must_return_an_env():
    with pytest.raises(TypeError, match="create_env_fn"):
        Collector(lambda: "CartPole-v1", frames_per_batch=16)


class NoTruncationEnv(GymEnv):
    has_truncated = False
    closed = False

    def close(self) -> None:
        self.closed = True
        super().close()


def test_set_truncated_needs_an_env_with_truncation():
    envs: list[NoTruncationEnv] = []

    def make() -> NoTruncationEnv:
        envs.append(NoTruncationEnv("CartPole-v1"))
        return envs[-1]

    with pytest.raises(ValueError, match="set_truncated"):
        Collector(make, frames_per_batch=16, set_truncated=True)
    assert envs[0].closed  # the env it had to build to find out is closed again
