"""The rollout's per-batch work on numpy arrays: trajectory ids from the done flags, episode statistics,
stacking per-step lists, and the batch ``TensorDict`` (see ``_rollout/_core.py``, which calls these once per
batch).
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch
from tensordict import TensorDict

from ._casts import truncation_keys

__all__ = ["end_trajectories", "episode_stats", "nested_td", "stack_into", "time_first", "trajectory_ids"]


def end_trajectories(views: dict[Any, Any], steps: list[int], nb: int, group_flag_keys: list[Any]) -> None:
    """Mark the frames of time ``steps`` (time is dim ``nb`` of the batch's ``views``) truncated and done:
    every truncated flag (the env's and its agent groups') and the done flag beside it, as TorchRL's
    ``set_truncated`` does. For ``set_truncated`` (the batch's last step) and a restarted env."""
    if not steps:  # the common case: no restart in the batch
        return
    keys = truncation_keys(group_flag_keys)
    for t in steps:
        index = (*(slice(None),) * nb, t)
        for key in keys:
            views[key][index] = True


def time_first(array: np.ndarray, axis: int) -> np.ndarray:
    """``np.moveaxis(array, axis, 0)`` as one ``transpose`` (``moveaxis`` checks its axes in python: ~5 us,
    several times per batch)."""
    if axis == 0:
        return array
    return array.transpose(axis, *range(axis), *range(axis + 1, array.ndim))


def stack_into(out: np.ndarray, values: list[Any], axis: int) -> None:
    """``np.stack(values, axis=axis, out=out)``, several times faster for thousands of small entries.

    ``np.asarray`` converts the whole list in one C loop where ``np.stack`` makes a view per entry.
    """
    np.copyto(time_first(out, axis), np.asarray(values), casting="same_kind")


def nested_td(
    tensors: dict[Any, torch.Tensor], batch_size: tuple[int, ...], names: list[str | None] | None
) -> TensorDict:
    """``TensorDict(tensors, batch_size=batch_size, names=names)`` for flat (nested) keys, 3-5x cheaper:
    each level is made with ``TensorDict._new_unsafe``, whose checks the batch's tensors pass by
    construction (one batch size, one device, string keys; the batch size a ``torch.Size``)."""
    size = torch.Size(batch_size)
    tree: dict[str, Any] = {}
    for key, value in tensors.items():
        if isinstance(key, str):
            tree[key] = value
            continue
        node = tree
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = value

    def build(node: dict[str, Any]) -> TensorDict:
        source: dict[Any, Any] = {k: build(v) if isinstance(v, dict) else v for k, v in node.items()}
        return TensorDict._new_unsafe(source, batch_size=size, names=cast("Any", names))

    return build(tree)


def trajectory_ids(
    out: np.ndarray, done: np.ndarray, ids: np.ndarray, start: int, stride: int
) -> tuple[np.ndarray, int]:
    """Write the trajectory id of every frame into ``out`` (``[*B, steps]``, time last) from the done
    flags (same shape); ``ids`` (``[*B]``): the trajectories going on when the batch began. Returns the
    ids going on after it and the next id to hand out.

    What a per-step loop would do, vectorised: a frame has the id its env's trajectory had when the
    step began; at every episode end the env takes the next id, handed out in step order, then env
    order (``stride`` apart from ``start`` on)."""
    n = ids.size
    steps = done.shape[-1]
    if n == 1:
        return _trajectory_ids_one(out, done.reshape(steps), ids, start, stride)
    env_i, end_t = np.nonzero(done.reshape(n, steps))  # the episode ends, env-major
    n_ends = len(env_i)
    first = ids.reshape(n)
    if not n_ends:
        out[...] = ids[..., None]
        return ids, start
    # the id each end hands its env: its rank in step order, then env order
    new = np.empty(n_ends, dtype=np.int64)
    new[np.argsort(end_t * n + env_i)] = np.arange(start, start + stride * n_ends, stride, dtype=np.int64)
    firsts = np.empty(n_ends, dtype=bool)  # an env's first end in the batch
    firsts[0] = True
    np.not_equal(env_i[1:], env_i[:-1], out=firsts[1:])
    prev = np.empty_like(new)  # the id each end replaces
    prev[1:] = new[:-1]
    prev[firsts] = first[env_i[firsts]]
    # per env, the id from the batch's start, then its changes one step after each end: summed along time
    ids_at = np.zeros((n, steps + 1), dtype=np.int64)
    ids_at[:, 0] = first
    ids_at[env_i, end_t + 1] = new - prev
    np.cumsum(ids_at, axis=1, out=ids_at)
    out[...] = ids_at[:, :steps].reshape(out.shape)
    after = first.copy()
    last = np.empty_like(firsts)
    last[-1] = True
    last[:-1] = firsts[1:]
    after[env_i[last]] = new[last]
    return after.reshape(ids.shape), start + stride * n_ends


def _trajectory_ids_one(
    out: np.ndarray, done: np.ndarray, ids: np.ndarray, start: int, stride: int
) -> tuple[np.ndarray, int]:
    """:func:`trajectory_ids` for one env, in half the numpy calls: frame ``t`` has the id of the
    trajectory after the episode ends before it (``cumsum(done)[t - 1]`` of them)."""
    ends = np.cumsum(done, dtype=np.int64)
    n_ends = int(ends[-1])
    first = ids.reshape(())
    if not n_ends:
        out[...] = first
        return ids, start
    values = np.arange(start - stride, start + stride * n_ends, stride, dtype=np.int64)
    values[0] = first  # before the first end of the batch
    flat = out.reshape(-1)
    flat[0] = first
    np.take(values, ends[:-1], out=flat[1:])
    return values[-1].reshape(ids.shape), start + stride * n_ends


def episode_stats(
    reward: np.ndarray, done: np.ndarray, carry_ret: np.ndarray, carry_len: np.ndarray
) -> tuple[list[float], list[int], np.ndarray, np.ndarray]:
    """Returns and lengths of the episodes that ended in a batch (``reward``, ``done``: ``[*B, T]``),
    with the return and length each env carries over (``[*B]``, in and out).

    Vectorised over every episode end of the batch (env-major, then time: the order of the lists):
    an episode's return is the difference of the cumulative rewards at its end and at the previous
    end in its env, plus what its env carried over from earlier batches for the first one."""
    shape = carry_ret.shape
    n = carry_ret.size
    T = reward.shape[-1]
    if T == 0:
        return [], [], carry_ret, carry_len
    if n == 1:
        return _episode_stats_one(reward.reshape(T), done.reshape(T), carry_ret, carry_len)
    carry_ret = carry_ret.reshape(n)
    carry_len = carry_len.reshape(n)
    csum = np.cumsum(reward.reshape(n, T).astype(np.float64), axis=1)
    env_i, end_t = np.nonzero(done.reshape(n, T))
    if not len(env_i):  # no episode ended: every env carries the whole batch over
        carry_ret += csum[:, -1]
        carry_len += T
        return [], [], carry_ret.reshape(shape), carry_len.reshape(shape)
    at_end = csum[env_i, end_t]
    first = np.empty(len(env_i), dtype=bool)
    first[0] = True
    np.not_equal(env_i[1:], env_i[:-1], out=first[1:])
    last = np.empty_like(first)
    last[-1] = True
    last[:-1] = first[1:]
    before = np.empty_like(at_end)  # the cumulative reward before the episode (minus the carry)
    before[1:] = at_end[:-1]
    before[first] = -carry_ret[env_i[first]]
    start = np.empty_like(end_t)  # the step before the episode (minus the carried length)
    start[1:] = end_t[:-1]
    start[first] = -1 - carry_len[env_i[first]]
    returns = (at_end - before).tolist()
    lengths = (end_t - start).tolist()
    ended = np.zeros(n, dtype=bool)
    ended[env_i] = True
    carry_ret[~ended] += csum[~ended, -1]
    carry_len[~ended] += T
    carry_ret[env_i[last]] = csum[env_i[last], -1] - at_end[last]
    carry_len[env_i[last]] = T - 1 - end_t[last]
    return returns, lengths, carry_ret.reshape(shape), carry_len.reshape(shape)


def _episode_stats_one(
    reward: np.ndarray, done: np.ndarray, carry_ret: np.ndarray, carry_len: np.ndarray
) -> tuple[list[float], list[int], np.ndarray, np.ndarray]:
    """:func:`episode_stats` for one env (``[T]``), in half the numpy calls, the same arithmetic."""
    T = reward.shape[0]
    csum = np.cumsum(reward.astype(np.float64))
    end_t = np.flatnonzero(done)
    if not len(end_t):
        return [], [], np.asarray(carry_ret + csum[-1]), np.asarray(carry_len + T)
    at_end = csum[end_t]
    before = np.empty_like(at_end)  # the cumulative reward before each episode (minus the carry)
    before[0] = -carry_ret.reshape(())  # the carry is [] (one env) or [1] (a vector env of one)
    before[1:] = at_end[:-1]
    start = np.empty_like(end_t)  # the step before each episode (minus the carried length)
    start[0] = -1 - carry_len.reshape(())
    start[1:] = end_t[:-1]
    returns = (at_end - before).tolist()
    lengths = (end_t - start).tolist()
    ret = (csum[-1] - at_end[-1]).reshape(carry_ret.shape)
    length = np.asarray(T - 1 - end_t[-1], dtype=np.int64).reshape(carry_len.shape)
    return returns, lengths, ret, length
