"""Batches and weights as Ray moves them fastest (numpy arrays, sent out of band and mapped from the object
store without a copy)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase


@dataclass
class Wire:
    """A batch as numpy arrays, the form Ray moves fastest: its serialiser sends numpy arrays out of
    band and maps them from the object store without a copy, where pickling torch tensors costs ~5 ms
    more per batch (measured; see docs/ray.md). The arrays it returns are read-only views of the object
    store: :func:`from_wires` makes the one copy."""

    batch_size: tuple[int, ...]
    keys: list[tuple[str, ...]]
    arrays: list[np.ndarray]


def to_wire(batch: TensorDictBase) -> Wire | TensorDictBase:
    """``batch`` as a :class:`Wire`, or as it is when a leaf is not a CPU tensor numpy can hold."""
    keys: list[tuple[str, ...]] = []
    arrays: list[np.ndarray] = []
    for key, value in batch.items(include_nested=True, leaves_only=True):
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
            return batch
        try:
            arrays.append(value.detach().numpy())
        except (TypeError, RuntimeError):  # e.g. bfloat16
            return batch
        keys.append(key if isinstance(key, tuple) else (key,))
    return Wire(tuple(batch.batch_size), keys, arrays)


def _tensordict(batch_size: Sequence[int], keys: list[tuple[str, ...]], arrays: list[np.ndarray]) -> Any:
    nested: dict[str, Any] = {}
    for key, array in zip(keys, arrays, strict=True):
        node = nested
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = torch.from_numpy(array)
    return TensorDict(nested, batch_size=list(batch_size))


def from_wires(parts: list[Any], stack: bool) -> TensorDictBase:
    """One batch (``stack=False``: ``parts`` has one) or the actors' batches stacked on a new dim 0,
    copied out of Ray's read-only buffers once. Runs in a worker thread (the copy is the big cost)."""
    wires = [p for p in parts if isinstance(p, Wire)]
    same = len(wires) == len(parts) and all(
        w.keys == wires[0].keys and w.batch_size == wires[0].batch_size for w in wires
    )
    batch: Any
    if not same:
        tds = [
            _tensordict(p.batch_size, p.keys, [a.copy() for a in p.arrays]) if isinstance(p, Wire) else p
            for p in parts
        ]
        batch = torch.stack(tds, 0) if stack else tds[0]
    elif stack:
        arrays = [np.stack([w.arrays[j] for w in wires]) for j in range(len(wires[0].keys))]
        batch = _tensordict((len(wires), *wires[0].batch_size), wires[0].keys, arrays)
    else:
        (wire,) = wires
        batch = _tensordict(wire.batch_size, wire.keys, [a.copy() for a in wire.arrays])
    batch.names = [None] * (batch.ndim - 1) + ["time"]
    return batch


def weights_to_wire(weights: TensorDictBase) -> dict[str, Any]:
    """Flat weights as numpy arrays where numpy holds the dtype (Ray's fast path, as for batches)."""
    out: dict[str, Any] = {}
    for key, value in weights.items():
        value = value.detach().cpu()
        try:
            out[key] = value.numpy()
        except (TypeError, RuntimeError):  # e.g. bfloat16: pickled as a tensor
            out[key] = value
    return out


def weights_from_wire(weights: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Tensors again; Ray's arrays are read-only views of its object store: copied (then copied into
    the policy), not aliased."""
    return {k: torch.from_numpy(v.copy()) if isinstance(v, np.ndarray) else v for k, v in weights.items()}


__all__ = ["Wire", "from_wires", "to_wire", "weights_from_wire", "weights_to_wire"]
