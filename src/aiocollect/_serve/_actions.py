"""Actions from the network, checked against the env's action space before the env sees them.

The server calls an :func:`action_checker`; the client an :func:`action_encoder` to send what the space
expects (its dtype and shape), so that a well-behaved client never trips the check.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from typing import Any

import numpy as np
from gymnasium import spaces

from ._wire import ProtocolError

__all__ = [
    "action_checker",
    "action_encoder",
    "as_action_value",
    "batch_action_checker",
    "batch_action_encoder",
    "check_action",
]


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


# -- a vector env's actions: one array (or a tree of arrays) for all its sub-envs -------------------------
def batch_action_encoder(space: spaces.Space[Any], n: int) -> Callable[[Any], Any]:
    """What a vector client sends for the actions of ``n`` sub-envs of one action ``space``: an array
    ``[n, *shape]`` of the space's dtype (torch tensors converted; a dict or list of them for a Dict or
    Tuple space), its type looked up once."""
    if isinstance(space, spaces.Dict):
        parts = {k: batch_action_encoder(s, n) for k, s in space.spaces.items()}
        return lambda actions: {k: encode(actions[k]) for k, encode in parts.items()}
    if isinstance(space, spaces.Tuple):
        items = [batch_action_encoder(s, n) for s in space.spaces]
        return lambda actions: [encode(a) for encode, a in zip(items, actions, strict=True)]
    dtype = np.int64 if isinstance(space, spaces.Discrete) else space.dtype
    return functools.partial(_encode_rows, dtype, (n, *(space.shape or ())))


def _encode_rows(dtype: Any, shape: tuple[int, ...], actions: Any) -> np.ndarray:
    array = np.asarray(_plain(actions))
    if array.dtype != dtype:
        if array.dtype.kind == "f" and np.dtype(dtype).kind in "iu":  # a float action for an int space
            raise ValueError(f"actions of dtype {array.dtype} for a space of integers ({np.dtype(dtype)})")
        array = array.astype(dtype)
    if array.shape != shape:
        if array.size != math.prod(shape):
            raise ValueError(f"actions of shape {array.shape} for {shape[0]} sub-envs of shape {shape[1:]}")
        array = array.reshape(shape)
    return array


def batch_action_checker(space: spaces.Space[Any], n: int) -> Callable[[Any], Any]:
    """The server's check of ``n`` sub-envs' actions at once (as :func:`check_action` per row: a Box
    column by shape and dtype, integer spaces by their values too); returns them as they arrived."""
    if isinstance(space, spaces.Dict):
        parts = {k: batch_action_checker(s, n) for k, s in space.spaces.items()}

        def check_dict(actions: Any) -> Any:
            if not isinstance(actions, dict) or set(actions) != set(parts):
                raise ValueError(f"actions must be a dict with keys {sorted(parts)}")
            return {k: check(actions[k]) for k, check in parts.items()}

        return check_dict
    if isinstance(space, spaces.Tuple):
        items = [batch_action_checker(s, n) for s in space.spaces]

        def check_tuple(actions: Any) -> Any:
            if not isinstance(actions, list) or len(actions) != len(items):
                raise ValueError(f"actions must be a sequence of {len(items)} columns")
            return tuple(check(a) for check, a in zip(items, actions, strict=True))

        return check_tuple
    shape = (n, *(space.shape or ()))
    if isinstance(space, spaces.Discrete):
        low, high = int(space.start), int(space.start) + int(space.n)

        def check_discrete(actions: Any) -> np.ndarray:
            array = _number(actions)
            if array.shape != shape or array.dtype.kind not in "iu":
                raise ValueError(f"actions of {space} must be {n} integers, got {array.dtype} {array.shape}")
            if n and (int(array.min()) < low or int(array.max()) >= high):
                raise ValueError(f"an action is not in {space}")
            return array

        return check_discrete
    if isinstance(space, spaces.Box):

        def check_box(actions: Any) -> np.ndarray:
            array = _number(actions)
            if array.shape != shape or array.dtype != space.dtype:
                raise ValueError(
                    f"actions have shape {array.shape} and dtype {array.dtype}; {n} sub-envs of the action "
                    f"space {space} take {shape} and {space.dtype}"
                )
            return array

        return check_box

    def check_multi(actions: Any) -> np.ndarray:
        array = _number(actions)
        if array.shape != shape or array.dtype.kind not in "biu":
            raise ValueError(f"actions of {space} must be integers of shape {shape}, got {array.shape}")
        array = array.astype(space.dtype)
        if not all(space.contains(row) for row in array):
            raise ValueError(f"an action is not in {space}")
        return array

    return check_multi
