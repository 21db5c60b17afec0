"""Arguments of ``MultiAsyncEnvCollector`` checked before any process starts: the env fns of each worker,
``frames_per_batch``, and the arguments of ``MultiAsyncCollector`` it refuses, each with its fix (raised by
``explicit_keywords(refused=UNSUPPORTED)`` on its constructor)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._core._mistakes import warn_user
from .._core._validation import positive_int
from ._envset import env_fns_arg

__all__ = [
    "UNSUPPORTED",
    "frames_arg",
    "groups_arg",
    "loop_arg",
    "shares_arg",
    "warn_envs_wait",
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


def frames_arg(value: Any, workers: int) -> list[int]:
    """``frames_per_batch``: an int (every worker's batches), or one int per worker."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != workers:
            raise ValueError(
                f"frames_per_batch has {len(value)} values for {workers} workers: give one per worker "
                "(worker i's batches hold frames_per_batch[i] frames) or one int for all"
            )
        return [positive_int(f"frames_per_batch[{i}]", v) for i, v in enumerate(value)]
    return [positive_int("frames_per_batch", value)] * workers


def groups_arg(shares: list[list[Any]], group_size: int | None) -> None:
    """``group_size``: each worker's envs in whole groups (a group's envs run in one worker)."""
    if group_size is None:
        return
    for i, share in enumerate(shares):
        if len(share) % group_size:
            fix = -(-len(share) // group_size) * group_size
            raise ValueError(
                f"group_size={group_size} needs each worker's envs in whole groups (a group runs in one "
                f"worker): env_fns_per_worker[{i}] has {len(share)} env fns; give a multiple of "
                f"{group_size} per worker (e.g. {fix})"
            )


def warn_envs_wait(shares: list[list[Any]], frames_per_batch: list[int], prefetch: int) -> None:
    """Warn when a worker may hold fewer frames in flight than it has envs (the others wait)."""
    for share, frames in zip(shares, frames_per_batch, strict=True):
        ahead = (1 + prefetch) * frames
        if ahead < len(share):
            warn_user(
                f"(1 + prefetch) * frames_per_batch = {ahead} frames may be collected or stepping at once "
                f"in a worker, fewer than its {len(share)} envs: the others wait. Raise frames_per_batch "
                "or prefetch"
            )
            return
