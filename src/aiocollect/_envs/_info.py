"""Entries of gymnasium's ``info`` dicts as batch entries (``GymEnv(..., info_keys=[...])``).

TorchRL's info-dict-reader convention: an info entry becomes an observation entry, so it is written
under ``("next", key)`` with the step that gave it, and at the root with the observation the policy acts
on (an action mask is readable by the policy). A ``dict`` entry (``RecordEpisodeStatistics``'s
``"episode"``) gives nested keys (``("episode", "r")``). Where a step's info lacks the entry (a vector
env's ``_key`` mask is False, or a single env's info has no such key) the value is zero.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from gymnasium import spaces

from ._spaces import RESERVED_KEYS, LeafSpec, NestedKey, leaf_spec, observation_specs

__all__ = ["InfoKeys", "InfoReader", "info_specs"]

InfoKeys = Sequence[str] | Mapping[str, spaces.Space[Any] | None]


def _torch_dtype(np_dtype: np.dtype[Any]) -> torch.dtype:
    return torch.from_numpy(np.empty((), dtype=np_dtype)).dtype


def _inferred(name: NestedKey, value: Any, vector: bool) -> dict[NestedKey, LeafSpec]:
    """Specs of an info value (``vector``: its first dim is the env dim, dropped)."""
    path = (name,) if isinstance(name, str) else name
    if isinstance(value, Mapping):
        out: dict[NestedKey, LeafSpec] = {}
        for sub, inner in value.items():
            if not sub.startswith("_"):  # a vector env's masks
                out.update(_inferred((*path, sub), inner, vector))
        return out
    arr = np.asarray(value)
    if arr.dtype.kind not in "biuf":
        raise TypeError(
            f"info entry {name!r} is {type(value).__name__} of dtype {arr.dtype}, not numbers: only "
            "boolean and numeric info entries can go into the batch"
        )
    shape = arr.shape[1:] if vector else arr.shape
    return {path if len(path) > 1 else path[0]: LeafSpec(tuple(shape), _torch_dtype(arr.dtype))}


def _given(name: str, space: spaces.Space[Any]) -> dict[NestedKey, LeafSpec]:
    if isinstance(space, spaces.Dict):
        return {(name, *((k,) if isinstance(k, str) else k)): v for k, v in observation_specs(space).items()}
    return {name: leaf_spec(space, what=f"info[{name!r}]")}


def info_specs(
    keys: InfoKeys, sample: Mapping[str, Any] | None, *, vector: bool, obs_keys: Sequence[NestedKey]
) -> dict[NestedKey, LeafSpec]:
    """The batch specs of ``keys``: given as gymnasium spaces, or inferred from ``sample`` (the reset
    info). Raises naming a key that is neither, with the keys the info has."""
    if isinstance(keys, str) or not isinstance(keys, (Sequence, Mapping)):
        raise TypeError(f"info_keys must be a list of names or a dict name -> space, got {keys!r}")
    given = dict(keys) if isinstance(keys, Mapping) else dict.fromkeys(keys)
    out: dict[NestedKey, LeafSpec] = {}
    for name, space in given.items():
        if not isinstance(name, str) or name.startswith("_"):
            raise ValueError(f"info_keys: {name!r} is not an info entry name (a str not starting with '_')")
        if name in RESERVED_KEYS:
            raise ValueError(f"info_keys: {name!r} would collide with the batch key {name!r}")
        if name in {k if isinstance(k, str) else k[0] for k in obs_keys}:
            raise ValueError(f"info_keys: {name!r} is an observation key already")
        if space is not None:
            if not isinstance(space, spaces.Space):
                raise TypeError(f"info_keys[{name!r}] must be a gymnasium space or None, got {space!r}")
            out.update(_given(name, space))
        elif sample is not None and name in sample:
            out.update(_inferred(name, sample[name], vector))
        else:
            have = sorted(k for k in (sample or {}) if not k.startswith("_"))
            raise KeyError(
                f"info_keys: {name!r} is not in the env's reset info, which has the keys {have}; for an "
                f"entry that only steps give, pass its space: info_keys={{{name!r}: "
                "gymnasium.spaces.Box(0, 1, (), bool)}"
            )
    return out


class InfoReader:
    """Reads the entries of ``specs`` out of info dicts as arrays (batch dims first)."""

    def __init__(self, specs: dict[NestedKey, LeafSpec], batch_shape: tuple[int, ...]) -> None:
        self.specs = specs
        self.batch_shape = batch_shape
        self._paths = {key: ((key,) if isinstance(key, str) else key) for key in specs}
        self._dtypes = {key: spec.numpy_dtype for key, spec in specs.items()}

    def present(self, info: Mapping[str, Any]) -> dict[NestedKey, np.ndarray]:
        """Per key, the sub-envs whose (vector) ``info`` has the entry (its ``_name`` masks)."""
        out = {}
        n = self.batch_shape[0]
        for key in self.specs:
            value: Any = info
            here = np.ones(n, dtype=bool)
            for part in self._paths[key]:
                if not isinstance(value, Mapping) or part not in value:
                    here = np.zeros(n, dtype=bool)
                    break
                mask = value.get(f"_{part}")
                if mask is not None:
                    here = here & np.asarray(mask, dtype=bool)
                value = value[part]
            out[key] = here
        return out

    def read(self, info: Mapping[str, Any] | None, n: int | None = None) -> dict[NestedKey, np.ndarray]:
        """``{key: array of shape (*batch, *spec.shape)}`` (``n`` rows instead of the batch if given)."""
        lead = self.batch_shape if n is None else (n,)
        out = {}
        for key, spec in self.specs.items():
            value: Any = info
            for part in self._paths[key]:
                value = value.get(part) if isinstance(value, Mapping) else None
            shape = (*lead, *spec.shape)
            if value is None:
                out[key] = np.zeros(shape, dtype=self._dtypes[key])
                continue
            arr = np.asarray(value)
            if arr.dtype == object:  # a vector env whose sub-envs gave the entry only in part: None's
                arr = np.array([0 if v is None else v for v in arr.tolist()])
            try:
                out[key] = np.asarray(arr, dtype=self._dtypes[key]).reshape(shape)
            except ValueError:
                raise ValueError(
                    f"info entry {key!r} has shape {arr.shape}, expected {shape} (its spec {spec})"
                ) from None
        return out
