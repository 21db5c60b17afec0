"""The options of the async-env collectors, one frozen object checked once.

``AsyncEnvCollector`` and ``MultiAsyncEnvCollector`` keep their flat keywords and turn them into an
:class:`AsyncEnvOptions` with :meth:`AsyncEnvOptions.of`, before any env is built or process started; it
travels as it is to the worker processes of ``MultiAsyncEnvCollector`` (pickled with the worker's body),
where :meth:`AsyncEnvOptions.for_member` derives each worker's view (its ``frames_per_batch``, its share of
``init_random_frames``) instead of repacking it, and the worker's collector runs on that view unchecked.

A value of the wrong type raises ``TypeError``, a value out of range ``ValueError``; both name the keyword
(the checks of one argument each are the ``*_arg`` functions here). ``UNSUPPORTED``: the keywords of
``MultiAsyncCollector`` that ``MultiAsyncEnvCollector`` refuses, each with its fix (raised by
``explicit_keywords(refused=UNSUPPORTED)`` on its constructor).

Example:
    >>> options = AsyncEnvOptions.of("AsyncEnvCollector", [8], frames_per_batch=64, total_frames=640)
    >>> options.frames_per_batch, options.target()
    (64, 640)
    >>> AsyncEnvOptions.of("AsyncEnvCollector", [8], frames_per_batch=64, max_wait=-1.0)
    Traceback (most recent call last):
    ...
    ValueError: max_wait must be >= 0 and finite (seconds the oldest ready env may wait), got -1.0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from math import ceil
from typing import Any

from tensordict.nn import InteractionType

from .._core._mistakes import keyword_list, warn_user
from .._core._restart import RestartPolicy
from .._core._validation import (
    exploration_type_arg,
    flag,
    frames_per_batch_arg,
    init_random_frames_arg,
    non_negative_int,
    optional_positive_int,
    seed_arg,
    total_frames_arg,
)
from .._episodes._args import async_chunk, episode_args, trajs_per_batch_arg
from ._envset import env_fns_arg
from ._keywords import AsyncEnvKeywords, MultiAsyncEnvKeywords
from ._policy import is_async_policy

__all__ = [
    "UNSUPPORTED",
    "AsyncEnvOptions",
    "fused_arg",
    "groups_arg",
    "loop_arg",
    "max_wait_arg",
    "on_env_error_arg",
    "per_worker_arg",
    "shares_arg",
]


_LOOPS = ("asyncio", "uvloop", "trio")

_DEVICE = (
    "a worker's torch policy runs where its parameters are (move the module, e.g. policy.to('cuda'), "
    "before passing it) and its envs are async envs: drop {name} (storing_device= says where batches "
    "are delivered)"
)

#: MultiAsyncCollector's arguments that MultiAsyncEnvCollector does not take: why, and what to do
UNSUPPORTED: dict[str, str] = {
    "create_env_fns": "MultiAsyncEnvCollector takes env_fns_per_worker: one list of async env fns per worker",
    "reset_at_each_iter": (
        "async envs are reset at the start and at the end of each episode only, never between batches "
        "(a batch interleaves the envs): drop reset_at_each_iter"
    ),
    "set_truncated": (
        "a batch interleaves the envs' steps, so it has no last step to mark: drop set_truncated "
        "(trajectories go on across batches under their trajectory ids; split_trajs=True cuts them)"
    ),
    "device": _DEVICE.format(name="device"),
    "env_device": _DEVICE.format(name="env_device"),
    "policy_device": _DEVICE.format(name="policy_device"),
    "compile_policy": "the workers run the policy as given: drop compile_policy",
    "rollout": "give the rollout options as keywords (frames_per_batch=..., total_frames=...)",
    "weights": "give the weight schedule as keywords (max_policy_lag=..., update_at_each_batch=...)",
    "max_weight_update_interval": (
        "workers load published weights after each batch: drop max_weight_update_interval and call "
        "update_weights()"
    ),
    "backend": "backend= is the deprecated spelling of worker_backend=: use worker_backend",
}


#: each collector's keyword defaults (``MultiAsyncEnvCollector``'s: ``True``), read from its keyword list once
#: (``typing.get_type_hints`` at each construction would churn typing's caches)
_DEFAULTS = {
    multi: keyword_list(MultiAsyncEnvKeywords if multi else AsyncEnvKeywords).defaults
    for multi in (False, True)
}


@dataclass(frozen=True)
class AsyncEnvOptions:
    """What an async-env collector runs, checked (the keywords of the same names, normalised).

    ``frames_per_batch`` is the collector's (with ``trajs_per_batch``, the chunk its envs are collected
    in); ``MultiAsyncEnvCollector``'s also holds one value per worker (``per_worker``), the workers'
    ``loop``, ``init_random_frames`` over all workers (``random_frames``), ``pause_when_held``
    (``max_policy_lag=0``: a worker's envs wait while the trainer holds its batch) and the trajectory
    ids' ``traj_id_start``/``traj_id_stride``; a worker's view (:meth:`for_member`) has its own.
    """

    frames_per_batch: int
    total_frames: int = -1
    trajs_per_batch: int | None = None
    group_size: int | None = None
    on_update: str = "continue"
    #: counted in (sub-)envs; ``None``: half of them (known once the envs are built)
    min_batch: int | None = None
    max_wait: float = 0.002
    max_frames_per_traj: int | None = None
    split_trajs: bool = False
    exploration_type: InteractionType = InteractionType.RANDOM
    seed: int | None = None
    track_policy_version: bool = False
    on_env_error: str = "raise"
    prefetch: int = 1
    restart: RestartPolicy | None = None
    fused: bool | None = None
    per_worker: tuple[int, ...] = ()
    loop: str = "asyncio"
    random_frames: int = 0
    pause_when_held: bool = False
    traj_id_start: int = 0
    traj_id_stride: int = 1
    #: a worker's view: its index, and how many times it was replaced before (``restart=``; its seeds
    #: derive from it)
    member: int | None = None
    generation: int = 0

    @classmethod
    def of(cls, collector: str, envs: list[int], **given: Any) -> AsyncEnvOptions:
        """The options of ``collector`` over ``envs`` env fns (one count per worker process; one count for
        ``AsyncEnvCollector``) from its keywords ``given`` (its keyword list of ``_keywords.py``, the ones
        not given at their defaults there; ``policy`` too), every one checked here and nowhere else
        (``restart``: by the caller, against the env fns). Warns where fewer frames may be in flight than a
        worker has envs."""
        multi = collector != "AsyncEnvCollector"
        kw = {**_DEFAULTS[multi], **given}
        lag, restart, drop = kw.get("max_policy_lag"), kw["restart"], kw["on_env_error"] == "drop"
        fused = None if multi else fused_arg(kw["fused"], kw.get("policy"), restart)
        cuts: dict[str, Any] = {"on_env_error": drop}
        if multi:
            cuts = {"max_policy_lag": lag, "on_env_error": "drop" if drop else None}
        trajs = trajs_per_batch_arg(collector, kw["trajs_per_batch"], kw["frames_per_batch"], **cuts)
        group, update = episode_args(collector, trajs, kw["group_size"], kw["on_update"], restart)
        if multi:
            groups_arg(envs, group)
        chunk = async_chunk(kw["frames_per_batch"], trajs, max(envs))
        per_worker = per_worker_arg(chunk, len(envs)) if multi else [frames_per_batch_arg(chunk)]
        prefetch = kw["prefetch"]
        if prefetch is None:  # on-policy: what a worker collects ahead is dropped at the next update
            prefetch = 0 if lag == 0 else 1
        options = cls(
            frames_per_batch=max(per_worker),
            total_frames=total_frames_arg(kw["total_frames"]),
            trajs_per_batch=trajs,
            group_size=group,
            on_update=update,
            min_batch=optional_positive_int(
                "min_batch",
                kw["min_batch"],
                fix="None: half of a worker's envs" if multi else "None: half of the envs",
            ),
            max_wait=max_wait_arg(kw["max_wait"]),
            max_frames_per_traj=optional_positive_int("max_frames_per_traj", kw["max_frames_per_traj"]),
            split_trajs=flag("split_trajs", kw["split_trajs"]),
            exploration_type=exploration_type_arg(kw["exploration_type"]),
            seed=seed_arg(kw["seed"]),
            track_policy_version=flag("track_policy_version", kw["track_policy_version"]),
            on_env_error=on_env_error_arg(kw["on_env_error"]),
            prefetch=non_negative_int("prefetch", prefetch, fix="0: a batch is collected when asked for"),
            restart=restart,
            fused=fused,
            per_worker=tuple(per_worker) if multi else (),
            loop=loop_arg(kw.get("loop", "asyncio")),
            random_frames=init_random_frames_arg(kw.get("init_random_frames")),
            pause_when_held=lag == 0,
            traj_id_start=kw.get("traj_id_start", 0),
            traj_id_stride=kw.get("traj_id_stride", 1),
        )
        options._warn(collector, envs)
        return options

    def _warn(self, collector: str, envs: list[int]) -> None:
        for n, frames in zip(envs, self.per_worker or (self.frames_per_batch,), strict=True):
            where = (
                f" in a worker, fewer than its {n} envs" if self.per_worker else f", fewer than the {n} envs"
            )
            if self.warn_ahead(n, frames, where):
                return
        uneven = self.total_frames > 0 and self.total_frames % self.frames_per_batch
        if uneven and not self.per_worker and self.trajs_per_batch is None:
            warn_user(
                f"total_frames={self.total_frames} is not a multiple of frames_per_batch="
                f"{self.frames_per_batch}: the last batch is not cut, {self.target()} frames are collected"
            )

    def warn_ahead(self, n: int, frames: int, fewer_than: str) -> bool:
        """Warn (and return ``True``) when fewer frames than ``n`` (sub-)envs may be in flight at once in
        batches of ``frames`` (``fewer_than``: which envs, in the warning)."""
        ahead = (1 + self.prefetch) * frames
        if ahead < n:
            warn_user(
                f"(1 + prefetch) * frames_per_batch = {ahead} frames may be collected or stepping at once"
                f"{fewer_than}: the others wait. Raise frames_per_batch or prefetch"
            )
        return ahead < n

    @property
    def drop_failed(self) -> bool:
        """``on_env_error="drop"``."""
        return self.on_env_error == "drop"

    def target(self) -> int:
        """The frames to collect, in whole batches; ``-1``: endless (with ``trajs_per_batch``, the budget
        is the frames delivered: the collector counts it)."""
        if self.total_frames < 0 or self.trajs_per_batch is not None:
            return -1
        return ceil(self.total_frames / self.frames_per_batch) * self.frames_per_batch

    def min_batch_of(self, rows: int) -> int:
        """``min_batch`` over ``rows`` (sub-)envs: by default half of them."""
        return max(1, rows // 2) if self.min_batch is None else min(self.min_batch, rows)

    def for_member(self, index: int, *, generation: int = 0) -> AsyncEnvOptions:
        """The options of ``MultiAsyncEnvCollector``'s worker ``index``, replaced ``generation`` times
        before: its own ``frames_per_batch``, its share of ``init_random_frames`` in whole batches of its
        own (none for a replacement: its predecessor took them), every frame's version tracked (the
        trainer's floors), endless, frames only (the trainer assembles trajectories and splits them)."""
        frames = self.per_worker[index]
        share = ceil(self.random_frames / len(self.per_worker))
        return replace(
            self,
            frames_per_batch=frames,
            random_frames=0 if generation else ceil(share / frames) * frames,
            total_frames=-1,
            trajs_per_batch=None,
            split_trajs=False,
            track_policy_version=True,
            per_worker=(),
            member=index,
            generation=generation,
        )


def max_wait_arg(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"max_wait must be a number of seconds (e.g. 0.002), got {value!r}")
    if not value >= 0 or value == float("inf"):
        raise ValueError(
            f"max_wait must be >= 0 and finite (seconds the oldest ready env may wait), got {value!r}"
        )
    return float(value)


def on_env_error_arg(value: Any) -> str:
    """``on_env_error``: ``"raise"`` or ``"drop"`` (also ``MultiAsyncEnvCollector``'s, per worker)."""
    if value not in ("raise", "drop"):
        raise ValueError(
            f"on_env_error must be 'raise' (an env's error ends the collector) or 'drop' (the env is closed "
            f"and dropped, the others go on), got {value!r}"
        )
    return str(value)


def fused_arg(value: Any, policy: Any, restart: Any) -> bool | None:
    """``fused``: ``None`` (``False`` where an async policy or ``restart`` rules the fused engine out),
    ``True`` (what rules it out is refused here) or ``False``."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"fused must be None (when possible), True or False, got {value!r}")
    async_policy = is_async_policy(policy)
    if value is None:  # the engine on the loop it is, for an async policy or restart=
        return False if async_policy or restart is not None else None
    if value:
        if async_policy:
            raise ValueError(
                "fused=True needs a torch policy (it runs in the collector's thread); an async policy is "
                "awaited on the loop: pass fused=None"
            )
        if restart is not None:
            raise ValueError(
                "fused=True cannot restart envs (restart= rebuilds them on the loop): drop restart= or pass "
                "fused=None"
            )
    return value


def loop_arg(value: Any) -> str:
    """``loop``: the workers' event loop."""
    if value not in _LOOPS:
        raise ValueError(f"loop must be one of {_LOOPS} (the workers' event loop), got {value!r}")
    return str(value)


def shares_arg(value: Any) -> list[list[Any]]:
    """``env_fns_per_worker``: one non-empty list of env fns per worker."""
    flat = isinstance(value, Sequence) and any(not isinstance(v, Sequence) for v in value)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value or flat:
        raise TypeError(
            "env_fns_per_worker must be a non-empty list with one list of env fns per worker process, e.g. "
            f"[[make_env] * 500, [make_env] * 500] for 2 processes of 500 envs; got {value!r}"
        )
    shares = []
    for i, share in enumerate(value):
        try:
            shares.append(env_fns_arg(share))
        except TypeError as exc:
            raise TypeError(f"env_fns_per_worker[{i}]: {exc}") from None
    return shares


def per_worker_arg(value: Any, workers: int) -> list[int]:
    """``frames_per_batch``: an int (every worker's batches), or one int per worker."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != workers:
            raise ValueError(
                f"frames_per_batch has {len(value)} values for {workers} workers: give one per worker "
                "(worker i's batches hold frames_per_batch[i] frames) or one int for all"
            )
        return [frames_per_batch_arg(v, f"frames_per_batch[{i}]") for i, v in enumerate(value)]
    return [frames_per_batch_arg(value)] * workers


def groups_arg(shares: list[int], group_size: int | None) -> None:
    """``group_size``: each worker's envs (``shares``: their counts) in whole groups (a group's envs run
    in one worker)."""
    if group_size is None:
        return
    for i, share in enumerate(shares):
        if share % group_size:
            fix = -(-share // group_size) * group_size
            raise ValueError(
                f"group_size={group_size} needs each worker's envs in whole groups (a group runs in one "
                f"worker): env_fns_per_worker[{i}] has {share} env fns; give a multiple of "
                f"{group_size} per worker (e.g. {fix})"
            )
