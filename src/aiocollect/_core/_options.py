"""The collectors' options as two frozen objects, each checked once, here.

:class:`RolloutOptions` says what a batch is (frames, budget, resets, truncation, random frames, seeds,
devices, trajectory ids, exploration); :class:`WeightSchedule` says when weights move and how stale a
batch may be. Collectors keep their flat keywords (``frames_per_batch=...``) and build these objects from
them once (:meth:`RolloutOptions.from_kwargs`); users may pass the objects instead
(``rollout=RolloutOptions(...)``, ``weights=WeightSchedule(...)``). The objects are picklable and travel
as they are to worker processes, nodes and actors.

A value of the wrong type raises ``TypeError``, a value out of range ``ValueError``; both name the keyword.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, Literal, TypeVar

import torch
from tensordict.nn import InteractionType

from ._mistakes import warn_user
from ._restart import RestartPolicy
from ._validation import (
    MIN_FRAME_BYTES,
    Devices,
    batch_memory,
    compile_arg,
    device_arg,
    exploration_type_arg,
    flag,
    init_random_frames_arg,
    int_type,
    lag_arg,
    optional_positive_int,
    positive_int,
    seed_arg,
    total_frames_arg,
    traj_ids_arg,
)

__all__ = [
    "RolloutOptions",
    "WeightSchedule",
    "refuse_schedule",
    "renamed_keyword",
    "warn_deprecated",
    "worker_backend_arg",
]

_O = TypeVar("_O", "RolloutOptions", "WeightSchedule")


def warn_deprecated(message: str) -> None:
    """A ``DeprecationWarning`` attributed to the first caller outside aiocollect (the user's line)."""
    warn_user(message, DeprecationWarning)


def renamed_keyword(new: str, new_value: Any, old: str, old_value: Any, *, default: Any = None) -> Any:
    """The value of keyword ``new``, taken from its deprecated spelling ``old`` when that was given.

    ``old_value is None`` means ``old`` was not given. Giving both (``new_value`` other than ``default``)
    raises ``TypeError``; ``old`` alone warns ``DeprecationWarning`` naming ``new``.
    """
    if old_value is None:
        return new_value
    if new_value is not default and new_value != default:
        raise TypeError(f"{old}= is the deprecated spelling of {new}=: give {new}= only, not both")
    warn_deprecated(f"{old}= is deprecated; use {new}= (same meaning)")
    return old_value


def worker_backend_arg(worker_backend: Any, backend: Any = None) -> Literal["process", "serial"]:
    """``worker_backend`` (``"process"`` or ``"serial"``); ``backend=`` is its deprecated spelling on the
    multi-process collectors."""
    for name, value in (("worker_backend", worker_backend), ("backend", backend)):
        if value is None and name == "backend":
            continue
        if not isinstance(value, str):
            raise TypeError(f"{name} must be 'process' or 'serial', got {value!r}")
        if value not in ("process", "serial"):
            raise ValueError(f"{name} must be 'process' or 'serial', got {value!r}")
    value = renamed_keyword("worker_backend", worker_backend, "backend", backend, default="process")
    return "process" if value == "process" else "serial"


def _from_kwargs(cls: type[_O], keyword: str, options: Any, kwargs: dict[str, Any], probe: _O) -> _O:
    """``options`` when given and no flat keyword differs from its default, else ``cls(**kwargs)``."""
    if options is None:
        return cls(**kwargs)
    if not isinstance(options, cls):
        raise TypeError(f"{keyword} must be a {cls.__name__} or None, got {options!r}")
    default = cls(**{k: getattr(probe, k) for k in _required(cls)})
    given = [k for k in kwargs if getattr(probe, k) != getattr(default, k)]
    if given:
        raise TypeError(
            f"{keyword}={cls.__name__}(...) and {given[0]}= are both given: set {given[0]} in the "
            f"{cls.__name__} or drop {keyword}="
        )
    return options


def _required(cls: type) -> list[str]:
    return [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]


@dataclass(frozen=True)
class RolloutOptions:
    """What a batch is: checked once, then read by the collector and the rollout in every worker.

    The fields are the collectors' keywords of the same names, normalised: ``total_frames=None`` becomes
    ``-1`` (endless), ``init_random_frames=None`` becomes ``0``, ``exploration_type`` an
    ``InteractionType``, devices ``torch.device`` (or ``None``), a list ``frames_per_batch`` (one value
    per worker, ``MultiSyncCollector``) a tuple.

    Args:
        frames_per_batch: frames per batch; an env of batch ``[B]`` steps ``ceil(frames_per_batch / B)``
            times, giving batches ``[B, T]``. A multi-worker collector splits it over its workers
            (``MultiSyncCollector`` also takes one value per worker).
        total_frames: frames to collect before ``async for`` ends; ``-1`` (or ``None``) for endless.
        max_frames_per_traj: truncate (and reset) episodes after this many steps.
        init_random_frames: collect this many frames (rounded up to whole batches) with random actions.
        reset_at_each_iter: reset the env at the start of every batch.
        split_trajs: yield ``[n_traj, max_len]`` zero-padded trajectories (see :func:`split_trajectories`).
        exploration_type: ``"random"`` (default), ``"deterministic"``, ``"mode"``, ``"mean"``, ``"median"``
            or a ``tensordict.nn.InteractionType``, set around every policy call.
        set_truncated: mark the last step of every batch truncated (and done), without resetting.
        seed: seeds the env, the random policy and the policy's sampling, for reproducible batches. The
            policy samples from torch's global CPU generator, so each batch (and the construction's dry
            policy call) runs with the collector's own generator state swapped in, and the caller's state
            back afterwards. torch has one such generator per process: random draws made by other threads
            *while* a batch runs (another seeded collector, a trainer drawing during ``start()``) share
            it, and the batches are then not reproducible.
        device, env_device, policy_device, storing_device: where things run / are stored (``device``
            fills the others).
        compile_policy: ``True`` or a dict of ``torch.compile`` kwargs.
        traj_id_start, traj_id_stride: trajectory ids are ``traj_id_start + k * traj_id_stride`` for
            ``k = 0, 1, ...``: collectors given the same stride and distinct starts below it never share
            an id (``RayCollector`` gives its remote collector ``i`` of ``n`` start ``i``, stride ``n``).
        lossless_action_casts: TorchRL's leniency (``aiocollect.compat`` sets it): a policy action whose
            dtype or shape differs from the action spec is cast for the env where nothing is lost
            (integral values in range for an integer or binary spec; a dim of size 1 more or less), with
            a warning naming the output key; the batch keeps what the policy wrote, as TorchRL's does. A
            lossy one is refused as without it.
        step_count: with ``max_frames_per_traj``, write ``"step_count"`` and ``("next", "step_count")``
            (int64, steps since the episode's reset), the keys TorchRL's ``StepCounter`` adds
            (``aiocollect.compat`` sets it).
        restart: a :class:`RestartPolicy`: an env that raises is closed, rebuilt from its factory and
            reset, within the policy's budget (see docs/faults.md); ``None`` (default) fails at once.
        group_size: episodes in groups of this many that start from the same initial state (the same
            reset seed), each frame with its ``("collector", "group_id")``: the collectors' keyword
            (with ``trajs_per_batch``, see docs/episodes.md, "Groups").
        on_update: ``"continue"`` or ``"restart"``: the episodes in flight when the rollout's policy
            version changes start again from their initial state (``MultiAsyncCollector``'s keyword).

    Example:
        >>> from aiocollect import RolloutOptions
        >>> options = RolloutOptions(frames_per_batch=64, total_frames=None, exploration_type="mode")
        >>> options.total_frames, options.exploration_type.value
        (-1, 'mode')
        >>> RolloutOptions(frames_per_batch=0)
        Traceback (most recent call last):
        ...
        ValueError: frames_per_batch must be a positive int, got 0
    """

    frames_per_batch: int | tuple[int, ...]
    total_frames: int = -1
    max_frames_per_traj: int | None = None
    init_random_frames: int = 0
    reset_at_each_iter: bool = False
    split_trajs: bool = False
    set_truncated: bool = False
    exploration_type: InteractionType = InteractionType.RANDOM
    seed: int | None = None
    device: torch.device | None = None
    env_device: torch.device | None = None
    policy_device: torch.device | None = None
    storing_device: torch.device | None = None
    #: ``True`` or the keyword arguments of ``torch.compile`` (a dict)
    compile_policy: bool | dict[str, Any] = field(default=False, hash=False)
    #: trajectory ids are ``traj_id_start + k * traj_id_stride``
    traj_id_start: int = 0
    traj_id_stride: int = 1
    lossless_action_casts: bool = False
    step_count: bool = False
    restart: RestartPolicy | None = None
    group_size: int | None = None
    on_update: str = "continue"

    def __post_init__(self) -> None:
        fpb = self.frames_per_batch
        if isinstance(fpb, Sequence) and not isinstance(fpb, (str, bytes)):
            if not fpb:
                raise ValueError("frames_per_batch is an empty list: give an int, or one int per worker")
            fpb = tuple(positive_int(f"frames_per_batch[{i}]", f) for i, f in enumerate(fpb))
        else:
            fpb = positive_int("frames_per_batch", fpb)
        total = sum(fpb) if isinstance(fpb, tuple) else fpb
        batch_memory(total, total * MIN_FRAME_BYTES, "the rewards, done flags and trajectory ids alone")
        compile_option = compile_arg(self.compile_policy)
        start, stride = traj_ids_arg(self.traj_id_start, self.traj_id_stride)
        normal: dict[str, Any] = {
            "frames_per_batch": fpb,
            "total_frames": total_frames_arg(self.total_frames),
            "max_frames_per_traj": optional_positive_int("max_frames_per_traj", self.max_frames_per_traj),
            "init_random_frames": init_random_frames_arg(self.init_random_frames),
            "reset_at_each_iter": flag("reset_at_each_iter", self.reset_at_each_iter),
            "split_trajs": flag("split_trajs", self.split_trajs),
            "set_truncated": flag("set_truncated", self.set_truncated),
            "lossless_action_casts": flag("lossless_action_casts", self.lossless_action_casts),
            "step_count": flag("step_count", self.step_count),
            "exploration_type": exploration_type_arg(self.exploration_type),
            "seed": seed_arg(self.seed),
            "compile_policy": dict(compile_option) if isinstance(compile_option, Mapping) else compile_option,
            "traj_id_start": start,
            "traj_id_stride": stride,
            "group_size": optional_positive_int("group_size", self.group_size),
            "on_update": self.on_update,
        }
        for name in ("device", "env_device", "policy_device", "storing_device"):
            normal[name] = device_arg(name, getattr(self, name))
        if self.restart is not None and not isinstance(self.restart, RestartPolicy):
            raise TypeError(
                f"restart must be a RestartPolicy or None, got {self.restart!r}: "
                "e.g. restart=RestartPolicy(max_restarts=3, window=60.0)"
            )
        if self.on_update not in ("continue", "restart"):
            raise ValueError(f"on_update must be 'continue' or 'restart', got {self.on_update!r}")
        if self.restart is not None and (normal["group_size"] is not None or self.on_update == "restart"):
            raise ValueError(
                "group_size and on_update='restart' are not taken with restart= (a rebuilt env would start "
                "its episode anew, outside its group): drop one of them"
            )
        if normal["step_count"] and normal["max_frames_per_traj"] is None:
            raise ValueError(
                "step_count=True counts the steps max_frames_per_traj truncates at: give "
                "max_frames_per_traj, or drop step_count (add a StepCounter to a TorchRL env)"
            )
        for name, value in normal.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_kwargs(cls, rollout: RolloutOptions | None = None, /, **kwargs: Any) -> RolloutOptions:
        """The options from a collector's flat keywords, or ``rollout`` itself when given.

        ``frames_per_batch=None`` means not given (it is required unless ``rollout`` is). Giving
        ``rollout`` and a flat keyword with a value other than its default raises ``TypeError`` naming
        both.
        """
        if kwargs.get("frames_per_batch", 0) is None:
            if rollout is None:
                raise TypeError(
                    "frames_per_batch is required: give frames_per_batch=N or rollout=RolloutOptions(...)"
                )
            del kwargs["frames_per_batch"]
        elif rollout is not None and "frames_per_batch" in kwargs:
            raise TypeError(
                "rollout=RolloutOptions(...) and frames_per_batch= are both given: set frames_per_batch "
                "in the RolloutOptions or drop rollout="
            )
        if rollout is None:
            return cls(**kwargs)
        probe = cls(**{"frames_per_batch": 1, **kwargs})  # the flat values, checked too
        return _from_kwargs(cls, "rollout", rollout, kwargs, probe)

    @property
    def devices(self) -> Devices:
        """Where the env steps, the policy runs and batches are stored (``device`` fills the others)."""
        return Devices(
            env=self.env_device or self.device,
            policy=self.policy_device or self.device,
            storing=self.storing_device or self.device,
        )

    @property
    def endless(self) -> bool:
        return self.total_frames < 0

    def for_member(self, index: int, count: int, *, frames_per_batch: int | None = None) -> RolloutOptions:
        """The options of member ``index`` of ``count`` (a worker, node or actor): trajectory ids
        ``traj_id_start + traj_id_stride * (index + count * k)``, disjoint over members, and its own
        ``frames_per_batch`` when given."""
        if not 0 <= index < count:
            raise ValueError(f"member index {index} is not in [0, {count})")
        changes: dict[str, Any] = {
            "traj_id_start": self.traj_id_start + index * self.traj_id_stride,
            "traj_id_stride": self.traj_id_stride * count,
        }
        if frames_per_batch is not None:
            changes["frames_per_batch"] = frames_per_batch
        return replace(self, **changes)

    def batch_frames(self) -> int:
        """``frames_per_batch`` as one int (the sum of a per-worker tuple)."""
        fpb = self.frames_per_batch
        return fpb if isinstance(fpb, int) else sum(fpb)


@dataclass(frozen=True)
class WeightSchedule:
    """When weights reach the workers and how far a batch may lag behind them.

    Args:
        update_at_each_batch: publish the trainer's policy weights before every batch.
        max_weight_update_interval: a worker (node, actor) that delivered this many batches without
            new weights is sent them; ``None``: never on a schedule. ``0`` and ``-1`` are deprecated
            spellings of ``None``.
        max_policy_lag: a worker waits for newer weights while it is more than this many versions
            behind the published ones; ``None``: no limit.
        track_policy_version: write ``("collector", "policy_version")`` in every frame.

    Example:
        >>> from aiocollect import WeightSchedule
        >>> WeightSchedule(update_at_each_batch=True, track_policy_version=True).max_weight_update_interval
        >>> WeightSchedule(max_policy_lag=-1)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: max_policy_lag must be an int >= 0 (...), got -1
    """

    update_at_each_batch: bool = False
    max_weight_update_interval: int | None = None
    max_policy_lag: int | None = None
    track_policy_version: bool = False

    def __post_init__(self) -> None:
        flag("update_at_each_batch", self.update_at_each_batch)
        flag("track_policy_version", self.track_policy_version)
        lag_arg(self.max_policy_lag)
        interval = self.max_weight_update_interval
        if interval is not None:
            what = "a positive int (batches) or None (no scheduled updates)"
            int_type("max_weight_update_interval", interval, what)
            if interval in (0, -1):
                warn_deprecated(
                    f"max_weight_update_interval={interval} is deprecated; use max_weight_update_interval="
                    "None (no scheduled updates, the same meaning)"
                )
                interval = None
            elif interval < 0:
                raise ValueError(f"max_weight_update_interval must be {what}, got {interval!r}")
            object.__setattr__(self, "max_weight_update_interval", interval)
        if self.update_at_each_batch and interval is not None:
            raise ValueError(
                "update_at_each_batch=True sends weights before every batch already: drop "
                "max_weight_update_interval (or set it to None)"
            )

    @classmethod
    def from_kwargs(
        cls,
        weights: WeightSchedule | None = None,
        /,
        *,
        update_after_each_batch: bool | None = None,
        **kwargs: Any,
    ) -> WeightSchedule:
        """The schedule from a collector's flat keywords, or ``weights`` itself when given.

        ``update_after_each_batch`` is the deprecated spelling of ``update_at_each_batch`` (it warns).
        Giving ``weights`` and a flat keyword with a value other than its default raises ``TypeError``.
        """
        if update_after_each_batch is not None:
            kwargs["update_at_each_batch"] = renamed_keyword(
                "update_at_each_batch",
                kwargs.get("update_at_each_batch", False),
                "update_after_each_batch",
                update_after_each_batch,
                default=False,
            )
        if weights is None:
            return cls(**kwargs)
        probe = cls(**kwargs)
        return _from_kwargs(cls, "weights", weights, kwargs, probe)

    @property
    def sends_weights(self) -> bool:
        """Whether the schedule sends weights on its own (each batch or on an interval)."""
        return self.update_at_each_batch or self.max_weight_update_interval is not None


def refuse_schedule(schedule: WeightSchedule, collector: str, *, update_at_each_batch: bool = False) -> None:
    """``ValueError`` for a part of ``schedule`` that ``collector`` does not carry out
    (``update_at_each_batch``: whether it does that one)."""
    if schedule.update_at_each_batch and not update_at_each_batch:
        raise ValueError(
            f"{collector} runs its policy in this process: update_weights() reaches the next batch "
            "without a schedule; drop update_at_each_batch"
        )
    if schedule.max_weight_update_interval is not None:
        raise ValueError(
            f"{collector} workers load published weights at every batch boundary: drop "
            "max_weight_update_interval (it is DistributedCollector's and RayCollector's) and call "
            "update_weights(), or set update_at_each_batch=True"
        )
