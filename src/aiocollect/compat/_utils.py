"""torchrl's ``split_trajectories`` signature, and ``aenumerate`` (``enumerate`` for ``async for``)."""

from __future__ import annotations

from typing import Any

from tensordict import TensorDictBase

from .._envs._spaces import NestedKey
from .._episodes._trajectories import split_trajectories as native_split_trajectories

__all__ = ["aenumerate", "split_trajectories"]


def split_trajectories(
    rollout_tensordict: TensorDictBase,
    *,
    prefix: str | None = None,
    trajectory_key: NestedKey | None = None,
    done_key: NestedKey | None = None,
    as_nested: bool = False,
) -> TensorDictBase:
    """torchrl's ``split_trajectories`` signature over :func:`aiocollect.split_trajectories`.

    The mask goes to ``(prefix, "mask")`` (default ``("collector", "mask")``); ids are read at
    ``trajectory_key`` (default ``(prefix, "traj_ids")``). Splitting on done flags (``done_key`` without
    trajectory ids) and nested tensors (``as_nested=True``) are not supported. Unlike torchrl, padded
    trajectory ids are ``-1``, not ``0`` (``0`` is a real id).
    """
    if as_nested:
        raise TypeError("as_nested=True is not supported; the result is zero-padded with a mask")
    prefix = prefix or "collector"
    key = trajectory_key if trajectory_key is not None else (prefix, "traj_ids")
    if done_key is not None and key not in rollout_tensordict.keys(include_nested=True):
        raise TypeError(
            "splitting on done flags (done_key=) without trajectory ids is not supported; aiocollect "
            "batches always carry ('collector', 'traj_ids')"
        )
    return native_split_trajectories(rollout_tensordict, trajectory_key=key, mask_key=(prefix, "mask"))


class aenumerate:
    """``enumerate`` for ``async for``: ``async for i, data in aenumerate(collector):``.

    A plain async iterator (not an async generator), so breaking out of the loop leaves nothing to
    finalise.
    """

    def __init__(self, iterable: Any, start: int = 0) -> None:
        self._iterator = aiter(iterable)
        self._count = start

    def __aiter__(self) -> aenumerate:
        return self

    async def __anext__(self) -> tuple[int, Any]:
        item = await anext(self._iterator)
        index, self._count = self._count, self._count + 1
        return index, item
