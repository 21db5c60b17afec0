"""``split_trajectories``: a batch ``[..., T]`` -> zero-padded trajectories ``[n_traj, max_len]``."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from .._envs._spaces import NestedKey

__all__ = ["split_trajectories"]


def split_trajectories(
    td: TensorDictBase,
    *,
    trajectory_key: NestedKey = ("collector", "traj_ids"),
    mask_key: NestedKey = ("collector", "mask"),
) -> TensorDictBase:
    """Split a batch into one row per trajectory, zero-padded, with a boolean mask.

    Frames are grouped by consecutive equal ids along the time dim of each env row, so a trajectory that
    crosses a batch border gives two rows (one per batch). Frames whose id is ``-1`` (never collected,
    e.g. preempted) are dropped. Padding is zero everywhere except the trajectory ids, padded with ``-1``
    (``0`` is a real id). The mask is ``True`` on real frames.

    Args:
        td: a batch of shape ``[T]`` or ``[*B, T]`` (time last) holding ``trajectory_key``.
        trajectory_key: where the trajectory ids are.
        mask_key: where to write the mask.

    Returns:
        A TensorDict of shape ``[n_traj, max_len]``, trajectories ordered by env row, then time.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> td = TensorDict({"x": torch.arange(5), ("collector", "traj_ids"): torch.tensor([0, 0, 0, 1, 1])},
        ...                 batch_size=[5])
        >>> out = split_trajectories(td)
        >>> out["x"].tolist(), out["collector", "mask"].tolist()
        ([[0, 1, 2], [3, 4, 0]], [[True, True, True], [True, True, False]])
    """
    if td.batch_dims == 0:
        raise ValueError("split_trajectories needs a batch with a time dim, got batch_size=[]")
    if trajectory_key not in td.keys(include_nested=True):
        raise KeyError(
            f"split_trajectories needs trajectory ids at {trajectory_key!r}; collectors write them at "
            "('collector', 'traj_ids')"
        )
    td = td.clone(recurse=False)
    td.names = None
    T = td.batch_size[-1]
    flat = td.reshape(-1)
    ids = flat.get(trajectory_key).reshape(-1)
    n = ids.numel()
    row = torch.arange(n, device=ids.device) // max(T, 1)
    new_seg = torch.ones(n, dtype=torch.bool, device=ids.device)
    if n > 1:
        new_seg[1:] = (ids[1:] != ids[:-1]) | (row[1:] != row[:-1])
    valid = ids != -1
    seg = torch.cumsum(new_seg, 0)[valid]
    flat = flat[valid]
    if seg.numel() == 0:
        raise ValueError("split_trajectories got a batch without any valid frame")
    _, seg, lengths = torch.unique_consecutive(seg, return_inverse=True, return_counts=True)
    n_traj = lengths.numel()
    max_len = int(lengths.max())
    starts = torch.cumsum(lengths, 0) - lengths
    pos = torch.arange(seg.numel(), device=ids.device) - starts[seg]
    out = flat[:1].expand(n_traj, max_len).clone()
    out.zero_()
    out.set(trajectory_key, torch.full((n_traj, max_len), -1, dtype=ids.dtype, device=ids.device))
    out[seg, pos] = flat
    mask = torch.zeros(n_traj, max_len, dtype=torch.bool, device=ids.device)
    mask[seg, pos] = True
    out.set(mask_key, mask)
    out.names = [None, "time"]
    return out
