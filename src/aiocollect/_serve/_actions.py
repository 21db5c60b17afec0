"""Actions from the network, checked against the env's action space before the env sees them.

The server calls :func:`check_action`; the client calls :func:`as_action_value` to send what the space
expects (its dtype and shape), so that a well-behaved client never trips the check.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import spaces

from ._wire import ProtocolError

__all__ = ["as_action_value", "check_action"]


def check_action(space: spaces.Space[Any], value: Any) -> Any:
    """``value`` as the env expects it (an int for Discrete), or ``ValueError`` naming what is wrong.

    Box actions must have the space's shape and dtype (values out of bounds pass: the env clips them
    as it would locally); Discrete, MultiDiscrete and MultiBinary ones must lie in the space."""
    if isinstance(space, spaces.Dict):
        if not isinstance(value, dict) or set(value) != set(space.spaces):
            raise ValueError(f"action must be a dict with keys {sorted(space.spaces)}")
        return {k: check_action(s, value[k]) for k, s in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        if not isinstance(value, list) or len(value) != len(space.spaces):
            raise ValueError(f"action must be a sequence of {len(space.spaces)} actions")
        return tuple(check_action(s, v) for s, v in zip(space.spaces, value, strict=True))
    array = np.asarray(value)
    if array.dtype.kind not in "biuf":
        raise ProtocolError(f"action of dtype {array.dtype} is not a number")
    if isinstance(space, spaces.Discrete):
        if array.shape != () or array.dtype.kind not in "iu" or not space.contains(np.int64(array)):
            raise ValueError(f"action {array!r} is not in {space} (an integer scalar)")
        return int(array)
    if array.shape != space.shape:
        raise ValueError(f"action has shape {array.shape}, the action space {space} has {space.shape}")
    if isinstance(space, spaces.Box):
        if array.dtype != space.dtype:
            raise ValueError(f"action has dtype {array.dtype}, the action space {space} has {space.dtype}")
        return array
    if not space.contains(array.astype(space.dtype)) or array.dtype.kind not in "biu":
        raise ValueError(f"action {array!r} is not in {space}")
    return array.astype(space.dtype)


def as_action_value(space: spaces.Space[Any], action: Any) -> Any:
    """What the client sends for ``action``: numpy arrays of the space's dtype (torch tensors converted)."""
    if isinstance(space, spaces.Dict):
        return {k: as_action_value(s, action[k]) for k, s in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return [as_action_value(s, a) for s, a in zip(space.spaces, action, strict=True)]
    if hasattr(action, "detach") and hasattr(action, "numpy"):
        action = action.detach().cpu().numpy()
    if isinstance(space, spaces.Discrete):
        return np.int64(np.asarray(action).reshape(()))
    return np.asarray(action, dtype=space.dtype).reshape(space.shape)
