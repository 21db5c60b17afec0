"""The arguments of the remote collectors (``DistributedCollector``, ``RPCCollector``, ``RayCollector``),
checked once on the trainer, before any node or actor starts.

One meaning per keyword across the remote collectors (and the multi-process ones), from
:class:`~aiocollect.WeightSchedule`: ``update_at_each_batch`` (``update_after_each_batch`` is its
deprecated alias) and ``max_weight_update_interval`` (``None``: off; ``0`` and ``-1`` are deprecated
spellings of ``None``). The rollout keywords of ``collector_kwargs`` become one
:class:`~aiocollect.RolloutOptions` per member, checked here and sent typed.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import cloudpickle
import torch
from tensordict import TensorDictBase

from .._core._mistakes import warn_user
from .._core._options import RolloutOptions, WeightSchedule
from .._core._restart import RestartPolicy
from .._core._validation import positive_int, seed_arg
from .._policies._runners import as_policy
from .._policies._weights import flat_weights

#: keywords a remote collector sets on every hosted collector itself
RESERVED = (
    "frames_per_batch",
    "total_frames",
    "progress",
    "replay_buffer",
    "traj_id_start",
    "traj_id_stride",
)
UNSET: Any = object()


@dataclass(frozen=True)
class WeightPlan:
    """When a remote collector sends weights by itself, and what they look like."""

    at_each_batch: bool
    #: ``None``: no forced updates; else a member that delivered this many batches without an update
    #: gets one before its next batch
    interval: int | None
    #: the policy's flat weights (``None``: the policy has none)
    template: TensorDictBase | None


def weight_plan(policy: Any, keywords: Mapping[str, Any]) -> WeightPlan:
    """The checked weight keywords of a remote collector (``update_at_each_batch``,
    ``max_weight_update_interval``, ``update_after_each_batch``: its deprecated spelling, or ``weights=``)
    as one :class:`~aiocollect.WeightSchedule`."""
    at_each_batch, interval = keywords["update_at_each_batch"], keywords["max_weight_update_interval"]
    after_each_batch = keywords["update_after_each_batch"]
    if (at_each_batch is True or after_each_batch is True) and (
        isinstance(interval, int) and not isinstance(interval, bool) and interval > 0
    ):
        raise ValueError(
            "update_at_each_batch and max_weight_update_interval exclude each other: "
            "update_at_each_batch=True sends weights before every batch already, drop "
            "max_weight_update_interval"
        )
    schedule = WeightSchedule.from_kwargs(
        keywords["weights"],
        update_after_each_batch=None if after_each_batch is UNSET else after_each_batch,
        update_at_each_batch=at_each_batch,
        max_weight_update_interval=interval,
    )
    if schedule.max_policy_lag is not None or schedule.track_policy_version:
        raise ValueError(
            "weights=WeightSchedule(...): max_policy_lag and track_policy_version are set on each "
            "member's collector (collector_kwargs), not on a remote collector"
        )
    template = flat_weights(policy) if isinstance(policy, torch.nn.Module) else None
    if schedule.sends_weights and template is None:
        raise TypeError(
            "update_at_each_batch and max_weight_update_interval send the policy's weights: they need "
            f"an nn.Module policy, got {type(policy).__name__}"
        )
    return WeightPlan(schedule.update_at_each_batch, schedule.max_weight_update_interval, template)


#: the keywords of collector_kwargs that are rollout options (checked on the trainer, sent typed)
ROLLOUT_KEYS = frozenset(f.name for f in fields(RolloutOptions))


def member_rollouts(per_member: list[dict[str, Any]], frames_per_batch: int) -> list[RolloutOptions]:
    """Each member's :class:`~aiocollect.RolloutOptions` (its collector is built with ``rollout=``),
    built and so checked here from its collector keywords, which lose them. Member ``i`` of ``n`` takes
    trajectory ids ``i, i + n, ...``."""
    out = []
    n = len(per_member)
    for i, kwargs in enumerate(per_member):
        given = {k: kwargs.pop(k) for k in list(kwargs) if k in ROLLOUT_KEYS}
        options = RolloutOptions(frames_per_batch=frames_per_batch, total_frames=-1, **given)
        out.append(options.for_member(i, n))
    return out


def check_policy(policy: Any) -> Any:
    """The checked policy (a dict ``{group: module}`` becomes a ``GroupPolicy``)."""
    policy = as_policy(policy)
    if policy is not None and not callable(policy):
        raise TypeError(
            f"policy must be a TensorDictModule, an nn.Module, a callable td -> td or None, got {policy!r}"
        )
    return policy


def per_member(name: str, value: Any, n: int, kind: type | tuple[type, ...], noun: str) -> list[Any]:
    """``value`` for every member, or a sequence of ``n`` values, one per member."""
    if isinstance(value, kind):
        return [value] * n
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for num_collectors={n}: give one per {noun}")
        return list(value)
    raise TypeError(f"{name} must be a {getattr(kind, '__name__', kind)} or a list of one per {noun}")


def split_frames(frames_per_batch: Any, n: int, sync: bool, noun: str, stacklevel: int = 4) -> int:
    """Each member's ``frames_per_batch``: the whole for ``sync=False``, a ``1/n`` share for ``sync=True``."""
    fpb = positive_int("frames_per_batch", frames_per_batch)
    if not sync:
        return fpb
    if fpb % n:
        warn_user(
            f"frames_per_batch={fpb} is not divisible by {n} {noun}s: each collects {math.ceil(fpb / n)}"
        )
    return math.ceil(fpb / n)


def collector_kwargs_arg(
    collector_kwargs: Any, n: int, owner: str, noun: str, *, list_seeds: bool = False
) -> tuple[list[dict[str, Any]], int | None]:
    """One checked dict of collector keywords per member and the seed that seeds them in a chain
    (taken out of them). ``list_seeds``: a list of dicts keeps each member's own ``seed``."""
    shared = collector_kwargs is None or isinstance(collector_kwargs, Mapping)
    per = per_member("collector_kwargs", collector_kwargs or {}, n, Mapping, noun)
    per = [dict(k) if isinstance(k, Mapping) else k for k in per]
    seeds: set[Any] = set()
    for i, kwargs in enumerate(per):
        if not isinstance(kwargs, dict):
            raise TypeError(f"collector_kwargs[{i}] must be a dict, got {kwargs!r}")
        bad = sorted(set(kwargs) & set(RESERVED))
        if bad:
            raise ValueError(
                f"collector_kwargs cannot set {bad}: {owner} sets them on every {noun} (give "
                f"frames_per_batch, total_frames, replay_buffer and progress to {owner})"
            )
        seeds.add(kwargs.pop("seed", None) if shared or not list_seeds else None)
        if "worker_timeout" in kwargs:  # checked here, not only once the nodes started
            seconds_or_none("collector_kwargs['worker_timeout']", kwargs["worker_timeout"])
    if len(seeds) > 1:
        raise ValueError(
            f"collector_kwargs: give one seed for all {noun}s (each {noun} gets its own from it)"
        )
    return per, seed_arg(seeds.pop())


def accepted_keywords(cls: type) -> frozenset[str] | None:
    """The keywords ``cls(...)`` takes, following ``**kwargs`` up the classes that forward them (``None``:
    open-ended, nothing can be checked)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        names |= {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return frozenset(names)
    return None


def check_keywords(collector_class: type, per_member: Sequence[Mapping[str, Any]]) -> None:
    """``TypeError`` naming a keyword of ``collector_kwargs`` that ``collector_class`` does not take, on
    the trainer, before any node or actor starts."""
    accepted = accepted_keywords(collector_class)
    if accepted is None:
        return
    for kwargs in per_member:
        unknown = sorted(set(kwargs) - accepted)
        if unknown:
            raise TypeError(
                f"collector_kwargs: {collector_class.__name__} takes no keyword {unknown[0]!r} (its "
                f"keywords: {', '.join(sorted(accepted - {'self', 'create_env_fn', 'policy'}))})"
            )


def payloads(
    env_args: Sequence[Any], collector_class: type, per: Sequence[Mapping[str, Any]], noun: str
) -> list[bytes]:
    """Each member's pickled ``(env argument, collector class, collector keywords)``: small, pickled
    here so that a bad one fails in the constructor."""
    out = []
    for i, (env_arg, kwargs) in enumerate(zip(env_args, per, strict=True)):
        try:
            out.append(cloudpickle.dumps((env_arg, collector_class, dict(kwargs))))
        except Exception as exc:
            raise TypeError(
                f"the env constructor or collector_kwargs of {noun} {i} do not pickle: {exc}"
            ) from exc
    return out


def with_restart(per: list[dict[str, Any]], restart: Any) -> list[dict[str, Any]]:
    """Each member's collector keywords with ``restart`` (a node or actor collector's ``restart=``) for
    its envs, where they give none of their own; ``TypeError`` unless it is a ``RestartPolicy`` or
    ``None``."""
    if restart is None:
        return per
    if not isinstance(restart, RestartPolicy):
        raise TypeError(
            f"restart must be a RestartPolicy or None, got {restart!r}: e.g. "
            "restart=RestartPolicy(max_restarts=3, window=60.0)"
        )
    return [{"restart": restart, **kwargs} for kwargs in per]


def seconds_or_none(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive number of seconds or None (no limit), got {value!r}")
    return float(value)


__all__ = [
    "RESERVED",
    "UNSET",
    "WeightPlan",
    "accepted_keywords",
    "check_keywords",
    "check_policy",
    "collector_kwargs_arg",
    "ROLLOUT_KEYS",
    "member_rollouts",
    "payloads",
    "per_member",
    "seconds_or_none",
    "split_frames",
    "weight_plan",
    "with_restart",
]
