"""TensorDict leaves <-> the wire's ``(keys, arrays)`` (a key is a list of strings: nested keys travel)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from ._wire import ProtocolError

__all__ = ["leaves_to_wire", "td_leaves", "wire_keys", "wire_to_tensors"]


def leaves_to_wire(items: Iterable[tuple[Any, torch.Tensor]]) -> tuple[list[list[str]], list[np.ndarray]]:
    """``(key, tensor)`` pairs -> wire keys and numpy arrays (CPU copies where needed)."""
    keys, arrays = [], []
    for key, tensor in items:
        keys.append([key] if isinstance(key, str) else list(key))
        arrays.append(tensor.detach().cpu().numpy())
    return keys, arrays


def wire_keys(header: dict[str, Any], count: int) -> list[str | tuple[str, ...]]:
    """The keys a message's header lists for its ``count`` arrays, as TensorDict keys."""
    keys = header.get("keys")
    if not isinstance(keys, list) or len(keys) != count:
        raise ProtocolError("'keys' must list one key (a list of strings) per array")
    out: list[str | tuple[str, ...]] = []
    for key in keys:
        if not (isinstance(key, list) and key and all(isinstance(p, str) and p for p in key)):
            raise ProtocolError(f"bad key {key!r}: a non-empty list of non-empty strings")
        out.append(key[0] if len(key) == 1 else tuple(key))
    return out


def wire_to_tensors(header: dict[str, Any], arrays: list[np.ndarray]) -> dict[Any, torch.Tensor]:
    """The tensors of a message, by key (sharing the arrays' memory)."""
    return {k: torch.from_numpy(a) for k, a in zip(wire_keys(header, len(arrays)), arrays, strict=True)}


def td_leaves(td: TensorDictBase) -> list[tuple[Any, torch.Tensor]]:
    return [(k, v) for k, v in td.items(include_nested=True, leaves_only=True)]  # type: ignore[misc]
