"""The arguments of the async-env collectors checked one by one (``_options.py`` builds the options from
them), and the keywords of ``MultiAsyncCollector`` that ``MultiAsyncEnvCollector`` refuses, each with its
fix (raised by ``explicit_keywords(refused=UNSUPPORTED)`` on its constructor)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._core._validation import positive_int
from ._envset import env_fns_arg
from ._policy import is_async_policy

__all__ = [
    "UNSUPPORTED",
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
        return [positive_int(f"frames_per_batch[{i}]", v) for i, v in enumerate(value)]
    return [positive_int("frames_per_batch", value)] * workers


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
