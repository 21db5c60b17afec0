"""The arguments of ``trajs_per_batch`` (whole trajectories per batch, see ``_episodes/_assembler.py``) and of
its groups and weight-update rule (``group_size``, ``on_update``, see ``_episodes/_groups.py``), checked
before any env is built or process started, and the frame chunk an episode collector steps at a time."""

from __future__ import annotations

from typing import Any

from .._core._options import RolloutOptions

__all__ = [
    "CHUNK_FRAMES",
    "async_chunk",
    "check_async_envs",
    "chunk_frames",
    "episode_args",
    "group_size_arg",
    "on_update_arg",
    "refuse_cuts",
    "refuse_with_episodes",
    "trajs_per_batch_arg",
]


def trajs_per_batch_arg(collector: str, value: Any, frames_per_batch: Any, **cuts: Any) -> int | None:
    """``trajs_per_batch`` checked against ``frames_per_batch`` (one of the two sizes a batch) and
    against the options that would cut trajectories (``cuts``, see :func:`refuse_with_episodes`).

    Example:
        >>> trajs_per_batch_arg("Collector", 4, None, reset_at_each_iter=False)
        4
        >>> trajs_per_batch_arg("Collector", 4, 200)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: Collector(trajs_per_batch=4) sizes a batch in trajectories; ...: give one of them, not both
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"trajs_per_batch must be a positive int (trajectories per batch), got {value!r}")
    if value <= 0:
        raise ValueError(f"trajs_per_batch must be a positive int (trajectories per batch), got {value!r}")
    if frames_per_batch is not None:
        raise TypeError(
            f"{collector}(trajs_per_batch={value}) sizes a batch in trajectories; "
            f"frames_per_batch={frames_per_batch!r} sizes it in frames: give one of them, not both"
        )
    refuse_with_episodes(collector, value, **cuts)
    return value


def refuse_with_episodes(collector: str, trajs_per_batch: int, **given: Any) -> None:
    """Options that cut trajectories, refused with ``trajs_per_batch`` (each named with its fix)."""
    fixes = {
        "reset_at_each_iter": "episodes run to their end; drop reset_at_each_iter",
        "set_truncated": "a trajectory ends at its own done; drop set_truncated (max_frames_per_traj "
        "truncates long episodes)",
        "preemptive_threshold": "preemption cuts trajectories; drop preemptive_threshold",
        "max_policy_lag": "dropping stale frames would cut trajectories; drop max_policy_lag",
        "cat_results": "batches of whole trajectories are flat over frames; drop cat_results",
        "on_env_error": "a dropped env's episode would never end; use on_env_error='raise'",
    }
    for name, value in given.items():
        if value not in (None, False):
            call = f"{collector}(trajs_per_batch={trajs_per_batch})"
            raise ValueError(f"{call} does not take {name}={value!r}: {fixes[name]}")


#: frames per chunk an episode collector steps between looks at its trajectories (see chunk_frames)
CHUNK_FRAMES = 256


def chunk_frames(env_numel: int, per: int = CHUNK_FRAMES) -> int:
    """The frame batch an episode collector collects at a time: about ``per`` frames, a whole number of
    steps of every env slot (at least 4 steps), so that the per-batch hand-off stays small per frame."""
    envs = max(env_numel, 1)
    return envs * max(4, -(-per // envs))


def async_chunk(frames_per_batch: Any, trajs_per_batch: int | None, envs: int) -> Any:
    """The async-env collectors' ``frames_per_batch``: the user's, or with ``trajs_per_batch`` a chunk of
    :data:`CHUNK_FRAMES` frames (4 per env at least, so that every env has steps in flight)."""
    if trajs_per_batch is not None:
        return max(CHUNK_FRAMES, 4 * envs)
    if frames_per_batch is None:
        raise TypeError(
            "frames_per_batch is required (or trajs_per_batch=N for batches of whole trajectories)"
        )
    return frames_per_batch


def refuse_cuts(collector: str, trajs_per_batch: int | None, options: RolloutOptions) -> None:
    """:func:`refuse_with_episodes` on the rollout options that would cut trajectories."""
    if trajs_per_batch is not None:
        refuse_with_episodes(
            collector,
            trajs_per_batch,
            reset_at_each_iter=options.reset_at_each_iter,
            set_truncated=options.set_truncated,
        )


def group_size_arg(collector: str, group_size: Any, trajs_per_batch: int | None) -> int | None:
    """``group_size`` checked: a positive int, with ``trajs_per_batch`` a multiple of it.

    Example:
        >>> group_size_arg("Collector", 4, 8)
        4
        >>> group_size_arg("Collector", 4, 6)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Collector(group_size=4) ...: trajs_per_batch=6 must be a multiple of group_size=4 (...)
    """
    if group_size is None:
        return None
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be a positive int (rollouts per group), got {group_size!r}")
    if group_size <= 0:
        raise ValueError(f"group_size must be a positive int (rollouts per group), got {group_size!r}")
    if trajs_per_batch is None:
        raise TypeError(
            f"{collector}(group_size={group_size}) delivers whole groups of trajectories: give "
            f"trajs_per_batch too (a multiple of {group_size})"
        )
    if trajs_per_batch % group_size:
        fix = -(-trajs_per_batch // group_size) * group_size
        raise ValueError(
            f"{collector}(group_size={group_size}) delivers whole groups: trajs_per_batch={trajs_per_batch} "
            f"must be a multiple of group_size={group_size} (e.g. trajs_per_batch={fix})"
        )
    return group_size


def on_update_arg(collector: str, on_update: Any, trajs_per_batch: int | None) -> str:
    """``on_update`` checked: ``"continue"`` or ``"restart"`` (which needs ``trajs_per_batch``).

    Example:
        >>> on_update_arg("AsyncEnvCollector", "again", 4)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: on_update must be 'continue' (...) or 'restart' (...), got 'again'
    """
    if on_update not in ("continue", "restart"):
        raise ValueError(
            "on_update must be 'continue' (episodes go on with the new weights) or 'restart' (episodes "
            f"in flight start again from their initial state), got {on_update!r}"
        )
    if on_update == "restart" and trajs_per_batch is None:
        raise TypeError(
            f"{collector}(on_update='restart') discards the episodes in flight at a weight update, which "
            "only batches of whole trajectories can do: give trajs_per_batch"
        )
    return str(on_update)


def episode_args(
    collector: str, trajs_per_batch: int | None, group_size: Any, on_update: Any, restart: Any = None
) -> tuple[int | None, str]:
    """``group_size`` and ``on_update`` of a collector of async envs, checked (:func:`group_size_arg`,
    :func:`on_update_arg`); neither is taken with ``restart=`` (a rebuilt env starts its episode anew)."""
    group = group_size_arg(collector, group_size, trajs_per_batch)
    update = on_update_arg(collector, on_update, trajs_per_batch)
    if restart is not None and (group is not None or update == "restart"):
        what = f"group_size={group}" if group is not None else "on_update='restart'"
        raise ValueError(
            f"{collector}({what}) and restart= are not taken together (a rebuilt env would start its "
            "episode anew, outside its group): drop one of them"
        )
    return group, update


def check_async_envs(rows: int, has_vector: bool, group_size: int | None, on_update: str) -> None:
    """What seeded episodes need of an async-env collector's envs (checked once they are built)."""
    if group_size is None and on_update != "restart":
        return
    what = f"group_size={group_size}" if group_size is not None else "on_update='restart'"
    if has_vector:
        raise ValueError(
            f"{what} resets each env with a seed of its own, which an async vector env cannot do (it resets "
            "its sub-envs itself, same-step autoreset): give single async envs (e.g. ThreadedAsyncEnv)"
        )
    if group_size is not None and rows % group_size:
        raise ValueError(
            f"group_size={group_size} needs the envs in whole groups: {rows} envs is not a multiple of "
            f"{group_size}; give a multiple of {group_size} env fns"
        )
