"""torchrl's collector keywords mapped onto aiocollect's: refused, accepted-only-as, ignored, renamed;
the env and policy factories that travel to the workers."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tensordict import TensorDictBase

from .._core._options import RolloutOptions

__all__ = [
    "IGNORED",
    "ONLY",
    "REFUSED",
    "BuiltInWorker",
    "InitThenCreate",
    "check_keywords",
    "normalise",
    "one_device",
    "policy_arg",
    "torchrl_rollout",
    "with_kwargs",
]

# -- keyword mapping -------------------------------------------------------------------------------
#: torchrl keywords that are refused whatever their value, with what to do instead
REFUSED: dict[str, str] = {
    "weight_updater": "aiocollect publishes weights itself: call `await collector.update_policy_weights_()`",
    "weight_sync_schemes": (
        "aiocollect publishes weights through shared memory with a version counter; call "
        "`await collector.update_policy_weights_(policy_or_weights)`"
    ),
    "weight_recv_schemes": "a collector is never a weight receiver in aiocollect; drop the keyword",
    "interruptor": "use MultiSyncCollector(preemptive_threshold=...) for preemption",
    "worker_idx": "worker indices are set by the multi-process collectors; drop the keyword",
    "collector_class": (
        "workers always run aiocollect's rollout; drop collector_class (multi-level collectors are not "
        "implemented)"
    ),
    "backend_options": "Collector does not dispatch; build MultiSyncCollector or MultiAsyncCollector",
    "num_collectors": (
        "Collector does not dispatch to other classes (no metaclass): use "
        "MultiSyncCollector([env_fn] * n, ...) or MultiAsyncCollector([env_fn] * n, ...)"
    ),
    "sync": "Collector does not dispatch: use MultiSyncCollector (sync=True) or MultiAsyncCollector",
}

#: torchrl keywords accepted only with these values (torchrl's default, or what aiocollect always does)
ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "reset_when_done": ((True,), "reset_when_done is deprecated in torchrl and always True"),
    "extend_buffer": ((True,), "the whole batch is extended into the replay buffer; drop extend_buffer"),
    "track_traj_ids": (
        (True,),
        "trajectory ids are always written; drop them with batch.exclude(('collector', 'traj_ids'))",
    ),
    "compact_obs": ((False,), "drop the ('next', obs) keys in a postproc (batch.exclude(...))"),
    "cudagraph_policy": (
        (None, False),
        "wrap the policy in tensordict.nn.CudaGraphModule yourself, or use compile_policy",
    ),
}

#: torchrl keywords that change nothing in aiocollect (any value is accepted)
IGNORED = frozenset(
    {
        # batches are never reused: each one is a fresh TensorDict, so there is no buffer to share
        "return_same_td",
        # a recurrent policy's state and "is_init" are carried by the collector where the env lacks
        # InitTracker / TensorDictPrimer: the batches are those of an env with the transforms appended
        "auto_register_policy_transforms",
        # batches are always preallocated
        "use_buffers",
        # the policy is wrapped by type (TensorDictModule / nn.Module / callable), never checked further
        "trust_policy",
        # aiocollect never calls torch.cuda.synchronize()
        "no_cuda_sync",
    }
)


def check_keywords(kwargs: dict[str, Any], owner: str) -> dict[str, Any]:
    """Drop the ignored keywords, refuse the unsupported ones; the rest go to aiocollect."""
    out = {}
    for name, value in kwargs.items():
        if name in REFUSED:
            raise TypeError(f"{owner}: torchrl's {name}= is not supported: {REFUSED[name]}")
        if name in ONLY:
            allowed, fix = ONLY[name]
            if not any(value is a or (value == a and type(value) is type(a)) for a in allowed):
                raise (ValueError if name == "reset_when_done" else TypeError)(
                    f"{owner}: {name}={value!r} is not supported: {fix}"
                )
            continue
        if name in IGNORED:
            continue
        out[name] = value
    return out


def normalise(kwargs: dict[str, Any]) -> dict[str, Any]:
    """torchrl's spellings of "off" (``-1``, ``0``, ``None``) -> aiocollect's."""
    if "total_frames" in kwargs and (kwargs["total_frames"] is None or _negative(kwargs["total_frames"])):
        kwargs["total_frames"] = -1
    for name in ("max_frames_per_traj", "init_random_frames"):
        value = kwargs.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
            kwargs[name] = None
    if kwargs.get("split_trajs", False) is None:
        kwargs["split_trajs"] = False
    _trajectory_format(kwargs)
    if kwargs.get("compile_policy", False) is None:
        kwargs["compile_policy"] = False
    version = kwargs.get("track_policy_version", False)
    if not isinstance(version, bool):
        raise TypeError(
            "track_policy_version takes True or False (aiocollect writes ('collector', 'policy_version') "
            f"itself); got {version!r}"
        )
    return kwargs


def _trajectory_format(kwargs: dict[str, Any]) -> None:
    """TorchRL's ``traj_format`` (``"padded"``: ``[N, T]`` with a mask, its default without a replay
    buffer; ``"cat"``: flat over frames) as ``split_trajs``; ``trajs_per_write`` may only be ``None``."""
    fmt = kwargs.pop("traj_format", None)
    per_write = kwargs.pop("trajs_per_write", None)
    if kwargs.get("trajs_per_batch") is None:
        if fmt is not None or per_write is not None:
            name = "traj_format" if fmt is not None else "trajs_per_write"
            raise ValueError(f"{name}= needs trajs_per_batch=N (it says how trajectory batches are laid out)")
        return
    if fmt not in (None, "padded", "cat"):
        raise ValueError(f"traj_format must be 'padded' or 'cat', got {fmt!r}")
    if per_write is not None:
        raise TypeError(
            f"trajs_per_write={per_write!r} is not supported: each batch of trajs_per_batch trajectories is "
            "one replay_buffer.extend; drop trajs_per_write (or set trajs_per_batch to it)"
        )
    if fmt == "padded" or (fmt is None and kwargs.get("replay_buffer") is None):
        kwargs["split_trajs"] = True


_ROLLOUT_FIELDS = frozenset(f.name for f in dataclasses.fields(RolloutOptions))


def torchrl_rollout(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The rollout keywords as one ``rollout=RolloutOptions(...)`` with TorchRL's leniencies on: lossless
    action casts, and ``"step_count"`` where ``max_frames_per_traj`` is set (TorchRL's ``StepCounter``)."""
    if kwargs.get("frames_per_batch") is None or "rollout" in kwargs:
        return kwargs  # the native collector says what is wrong
    out = {k: v for k, v in kwargs.items() if k not in _ROLLOUT_FIELDS}
    rollout = {k: v for k, v in kwargs.items() if k in _ROLLOUT_FIELDS}
    rollout["lossless_action_casts"] = True
    rollout["step_count"] = rollout.get("max_frames_per_traj") is not None
    out["rollout"] = RolloutOptions(**rollout)
    return out


def _negative(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0


def one_device(name: str, value: Any) -> Any:
    """A per-worker device list with one device -> that device (aiocollect takes one per collector)."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        distinct = {str(v) for v in value}
        if len(distinct) > 1:
            raise TypeError(
                f"{name}={list(value)!r}: per-worker devices are not supported; give one device for all "
                "workers"
            )
        return value[0] if len(value) else None
    return value


def with_kwargs(fn: Any, kwargs: Mapping[str, Any] | None) -> Any:
    if not kwargs:
        return fn
    if hasattr(fn, "step") and not isinstance(fn, type):  # an env instance (a class is a constructor)
        raise TypeError("create_env_kwargs needs a callable create_env_fn; an env instance is already built")
    return functools.partial(fn, **kwargs)


def _build(factory: Callable[[], Any]) -> Any:
    return factory()


class BuiltInWorker:
    """Stands for ``policy_factory()`` in a multi-process collector: unpickling it in a worker builds the
    policy there (the policy itself is never pickled)."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self.factory = factory

    def __call__(self, td: TensorDictBase) -> TensorDictBase:  # pragma: no cover - never in the parent
        raise RuntimeError("a policy_factory policy runs in the workers only")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_build, (self.factory,))


class InitThenCreate:
    """torchrl's ``init_fn``: run first in the worker, then build the env."""

    def __init__(self, init_fn: Callable[[], Any], create_env_fn: Callable[[], Any]) -> None:
        self.init_fn = init_fn
        self.create_env_fn = create_env_fn

    def __call__(self) -> Any:
        self.init_fn()
        return self.create_env_fn()


def policy_arg(policy: Any, policy_factory: Any, owner: str, *, in_process: bool) -> Any:
    if policy_factory is None:
        return policy
    if policy is not None:
        raise TypeError(
            f"{owner}: policy and policy_factory are mutually exclusive (torchrl's weight_sync_schemes, "
            "which allow both, are not supported)"
        )
    if isinstance(policy_factory, Sequence):
        raise TypeError(f"{owner}: per-worker policy factories are not supported; give one callable")
    if not callable(policy_factory):
        raise TypeError(f"{owner}: policy_factory must be a callable, got {policy_factory!r}")
    return policy_factory() if in_process else BuiltInWorker(policy_factory)
