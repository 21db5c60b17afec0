"""Actions from the network, checked against the env's action space before the env sees them.

The server calls an :func:`action_checker`; the client an :func:`action_encoder` to send what the space
expects (its dtype and shape), so that a well-behaved client never trips the check.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import numpy as np
from gymnasium import spaces

from ._wire import ProtocolError

__all__ = ["action_checker", "action_encoder", "as_action_value", "check_action"]


def check_action(space: spaces.Space[Any], value: Any) -> Any:
    """``value`` as the env expects it (an int for Discrete), or ``ValueError`` naming what is wrong.

    Box actions must have the space's shape and dtype (values out of bounds pass: the env clips them
    as it would locally); Discrete, MultiDiscrete and MultiBinary ones must lie in the space."""
    return action_checker(space)(value)


def action_checker(space: spaces.Space[Any]) -> Callable[[Any], Any]:
    """:func:`check_action` for one space, its type looked up once (the server keeps one per env)."""
    if isinstance(space, spaces.Dict):
        checkers = {k: action_checker(s) for k, s in space.spaces.items()}

        def check_dict(value: Any) -> Any:
            if not isinstance(value, dict) or set(value) != set(checkers):
                raise ValueError(f"action must be a dict with keys {sorted(checkers)}")
            return {k: check(value[k]) for k, check in checkers.items()}

        return check_dict
    if isinstance(space, spaces.Tuple):
        parts = [action_checker(s) for s in space.spaces]

        def check_tuple(value: Any) -> Any:
            if not isinstance(value, list) or len(value) != len(parts):
                raise ValueError(f"action must be a sequence of {len(parts)} actions")
            return tuple(check(v) for check, v in zip(parts, value, strict=True))

        return check_tuple
    if isinstance(space, spaces.Discrete):
        return functools.partial(_check_discrete, space)
    if isinstance(space, spaces.Box):
        return functools.partial(_check_box, space)
    return functools.partial(_check_multi, space)


def _number(value: Any) -> np.ndarray:
    array = value if type(value) is np.ndarray else np.asarray(value)
    if array.dtype.kind not in "biuf":
        raise ProtocolError(f"action of dtype {array.dtype} is not a number")
    return array


def _check_discrete(space: spaces.Discrete, value: Any) -> int:
    array = _number(value)
    if array.shape != () or array.dtype.kind not in "iu":
        raise ValueError(f"action {array!r} is not in {space} (an integer scalar)")
    action = int(array)
    if not int(space.start) <= action < int(space.start) + int(space.n):
        raise ValueError(f"action {action} is not in {space}")
    return action


def _check_box(space: spaces.Box, value: Any) -> np.ndarray:
    array = _number(value)
    if array.shape != space.shape:
        raise ValueError(f"action has shape {array.shape}, the action space {space} has {space.shape}")
    if array.dtype != space.dtype:
        raise ValueError(f"action has dtype {array.dtype}, the action space {space} has {space.dtype}")
    return array


def _check_multi(space: spaces.Space[Any], value: Any) -> np.ndarray:
    array = _number(value)
    if array.shape != space.shape:
        raise ValueError(f"action has shape {array.shape}, the action space {space} has {space.shape}")
    if array.dtype.kind not in "biu" or not space.contains(array.astype(space.dtype)):
        raise ValueError(f"action {array!r} is not in {space}")
    return array.astype(space.dtype)


def action_encoder(space: spaces.Space[Any]) -> Callable[[Any], Any]:
    """What the client sends for an action of ``space``: numpy values of the space's dtype (torch
    tensors converted), its type looked up once."""
    if isinstance(space, spaces.Dict):
        parts = {k: action_encoder(s) for k, s in space.spaces.items()}
        return lambda action: {k: encode(action[k]) for k, encode in parts.items()}
    if isinstance(space, spaces.Tuple):
        items = [action_encoder(s) for s in space.spaces]
        return lambda action: [encode(a) for encode, a in zip(items, action, strict=True)]
    if isinstance(space, spaces.Discrete):
        return _encode_discrete
    return functools.partial(_encode_array, space.dtype, tuple(space.shape or ()))


def _plain(action: Any) -> Any:
    if hasattr(action, "detach") and hasattr(action, "numpy"):  # a torch tensor
        return action.detach().cpu().numpy()
    return action


def _encode_discrete(action: Any) -> int:
    """The action as a Python int (a column of them travels as one array)."""
    if type(action) is int:
        return action
    try:
        return operator.index(action)  # numpy integers, 0-d integer arrays and tensors: no copy
    except TypeError:
        return int(np.asarray(_plain(action)).reshape(()))


def _encode_array(dtype: Any, shape: tuple[int, ...], action: Any) -> np.ndarray:
    return np.asarray(_plain(action), dtype=dtype).reshape(shape)


def as_action_value(space: spaces.Space[Any], action: Any) -> Any:
    """:func:`action_encoder` applied once."""
    return action_encoder(space)(action)
