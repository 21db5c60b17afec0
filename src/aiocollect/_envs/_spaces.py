"""Gymnasium spaces -> flat tensor specs, and sampling from them.

A *spec* here is the shape and dtype of one leaf of a batch for a single (unbatched) env. Observation
spaces map to one or more keys (a ``Dict`` space gives one key per entry, nested dicts give tuple keys);
action spaces map to the single key ``"action"``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gymnasium import spaces

__all__ = [
    "RESERVED_KEYS",
    "LeafSpec",
    "NestedKey",
    "action_bounds",
    "action_entries",
    "assemble_action",
    "action_leaf_spaces",
    "action_outside_space",
    "action_spec",
    "action_specs",
    "flatten_obs",
    "group_specs",
    "grouped_action_keys",
    "leaf_spec",
    "nest_obs",
    "observation_specs",
    "sample",
    "sample_leaf",
]

NestedKey = str | tuple[str, ...]

_SUPPORTED = "Box, Discrete, MultiDiscrete, MultiBinary, Dict (and Tuple for actions)"


@dataclass(frozen=True)
class LeafSpec:
    """Shape and dtype of one entry for a single env (no batch or time dims)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        return torch.empty((), dtype=self.dtype).numpy().dtype


def _torch_dtype(np_dtype: Any) -> torch.dtype:
    return torch.from_numpy(np.empty((), dtype=np_dtype)).dtype


def leaf_spec(space: spaces.Space[Any], *, what: str) -> LeafSpec:
    """The spec of a non-Dict space; ``what`` names the space in error messages."""
    if isinstance(space, spaces.Box):
        return LeafSpec(tuple(space.shape), _torch_dtype(space.dtype))
    if isinstance(space, spaces.Discrete):
        return LeafSpec((), torch.int64)
    if isinstance(space, spaces.MultiDiscrete):
        return LeafSpec(tuple(space.shape), torch.int64)
    if isinstance(space, spaces.MultiBinary):
        return LeafSpec(tuple(space.shape), torch.int8)
    raise TypeError(
        f"unsupported {what} space {space!r} ({type(space).__name__}); aiocollect supports {_SUPPORTED}. "
        "Wrap the env with a gymnasium wrapper that flattens it (e.g. gymnasium.wrappers.FlattenObservation)."
    )


#: top-level batch keys an observation Dict entry would collide with
RESERVED_KEYS = frozenset({"action", "next", "collector", "done", "terminated", "truncated", "reward"})


def observation_specs(space: spaces.Space[Any]) -> dict[NestedKey, LeafSpec]:
    """Keys and specs of an observation space: ``{"observation": ...}`` or one key per Dict entry."""
    if isinstance(space, spaces.Dict):
        clash = sorted(set(space.spaces) & RESERVED_KEYS)
        if clash:
            raise TypeError(
                f"unsupported observation space {space!r}: the Dict entries {clash} would collide with "
                f"the batch keys {sorted(RESERVED_KEYS)}; rename them with a gymnasium wrapper (e.g. "
                "gymnasium.wrappers.TransformObservation)"
            )
        return _dict_specs(space)
    return {"observation": leaf_spec(space, what="observation")}


def _dict_specs(space: spaces.Dict) -> dict[NestedKey, LeafSpec]:
    """The leaves of a (possibly nested) Dict space; nested entries get tuple keys."""
    out: dict[NestedKey, LeafSpec] = {}
    for name, sub in space.spaces.items():
        if isinstance(sub, spaces.Dict):
            for key, spec in _dict_specs(sub).items():
                out[(name, *((key,) if isinstance(key, str) else key))] = spec
        else:
            out[name] = leaf_spec(sub, what=f"observation[{name!r}]")
    if not out:
        raise TypeError(f"unsupported observation space {space!r}: an empty Dict")
    return out


def action_specs(space: spaces.Space[Any]) -> dict[NestedKey, LeafSpec]:
    """Keys and specs of the action entries: ``{"action": spec}`` for a leaf space; a ``Dict`` or
    ``Tuple`` space (nested) gives one key per leaf: ``("action", name)``, ``("action", "0")``, ...

    Box actions are float32 on the policy side (whatever the Box dtype).
    """
    return {("action", *path) if path else "action": spec for path, spec in _action_leaves(space, ())}


def _action_leaves(space: spaces.Space[Any], path: tuple[str, ...]) -> list[tuple[tuple[str, ...], LeafSpec]]:
    if isinstance(space, (spaces.Dict, spaces.Tuple)):
        items = space.spaces.items() if isinstance(space, spaces.Dict) else enumerate(space.spaces)
        out = [leaf for name, sub in items for leaf in _action_leaves(sub, (*path, str(name)))]
        if not out:
            raise TypeError(f"unsupported action space {space!r}: an empty {type(space).__name__}")
        return out
    where = "action" + "".join(f"[{p!r}]" for p in path)
    spec = leaf_spec(space, what=where)
    if isinstance(space, spaces.Box) and spec.dtype.is_floating_point:
        spec = LeafSpec(spec.shape, torch.float32)
    return [(path, spec)]


def grouped_action_keys(space: spaces.Space[Any]) -> dict[NestedKey, NestedKey] | None:
    """For a Dict action space whose leaves are all named ``"action"`` (TorchRL's agent groups:
    ``{"agents": {"action": Box(...)}}``), the key of each leaf under :func:`action_specs`'s convention
    (``("action", "agents", "action")``) mapped to its own key (``("agents", "action")``); else ``None``."""
    if not isinstance(space, spaces.Dict):
        return None
    keys = list(action_leaf_spaces(space))
    if not all(isinstance(k, tuple) and len(k) > 2 and k[-1] == "action" for k in keys):
        return None
    return {k: k[1:] for k in keys}


def group_specs(space: Any, what: str, names: tuple[str, ...]) -> dict[NestedKey, LeafSpec]:
    """The leaves of a protocol env's ``reward_space`` / ``done_space``: a (nested) Dict space whose leaf
    names are among ``names`` (``("agents", "reward")`` ...); ``what`` names it in errors."""
    if not isinstance(space, spaces.Dict):
        raise TypeError(f"an env's {what}_space must be a gymnasium Dict space, got {space!r}")
    out = _dict_specs(space)
    odd = [k for k in out if (k if isinstance(k, str) else k[-1]) not in names]
    if odd:
        raise TypeError(f"the {what}_space entries {odd} are not named {' or '.join(map(repr, names))}")
    return out


def action_spec(space: spaces.Space[Any]) -> LeafSpec:
    """Spec of the ``"action"`` entry of a leaf action space (see :func:`action_specs` for all)."""
    specs = action_specs(space)
    if list(specs) != ["action"]:
        raise TypeError(f"the action space {space!r} has several entries {list(specs)}, not one 'action'")
    return specs["action"]


def action_leaf_spaces(space: spaces.Space[Any]) -> dict[NestedKey, spaces.Space[Any]]:
    """The leaf spaces of an action space, under the keys of :func:`action_specs`."""
    out: dict[NestedKey, spaces.Space[Any]] = {}

    def walk(sub: spaces.Space[Any], path: tuple[str, ...]) -> None:
        if isinstance(sub, spaces.Dict):
            for name, inner in sub.spaces.items():
                walk(inner, (*path, name))
        elif isinstance(sub, spaces.Tuple):
            for i, inner in enumerate(sub.spaces):
                walk(inner, (*path, str(i)))
        else:
            out[("action", *path) if path else "action"] = sub

    walk(space, ())
    return out


def action_bounds(space: spaces.Space[Any]) -> tuple[Any, Any] | None:
    """Inclusive bounds of the values of an integer action space (``Discrete``, ``MultiDiscrete``,
    ``MultiBinary``, an integer ``Box``); ``None`` for a float ``Box`` (an out-of-bounds continuous
    action goes to the env as it is: clipping is the env's business)."""
    if isinstance(space, spaces.Discrete):
        return int(space.start), int(space.start + space.n - 1)
    if isinstance(space, spaces.MultiDiscrete):
        start = np.asarray(space.start, dtype=np.int64)
        return start, start + np.asarray(space.nvec, dtype=np.int64) - 1
    if isinstance(space, spaces.MultiBinary):
        return 0, 1
    if isinstance(space, spaces.Box) and not np.issubdtype(space.dtype, np.floating):
        return space.low, space.high
    return None


def action_outside_space(space: spaces.Space[Any], action: Any, key: NestedKey = "action") -> ValueError:
    """The error for a policy action with values outside the integer action space ``space``."""
    bounds = action_bounds(space)
    assert bounds is not None
    low, high = bounds
    values = np.asarray(action)
    bad = np.unique(values[(values < low) | (values > high)])[:5].tolist()
    spec = leaf_spec(space, what="action")
    where = (
        f"[{low}, {high}]"
        if np.ndim(low) == 0
        else f"[{np.asarray(low).tolist()}, {np.asarray(high).tolist()}]"
    )
    return ValueError(
        f"policy output {key!r} has values outside the action space {space}: {bad}; expected "
        f"{spec.dtype} values in {where} (shape {spec.shape} per env). Integer actions are checked, "
        "never wrapped to fit"
    )


def flatten_obs(space: spaces.Space[Any], obs: Any) -> dict[NestedKey, np.ndarray]:
    """Split a raw gymnasium observation into ``{key: array}`` following :func:`observation_specs`."""
    if isinstance(space, spaces.Dict):
        out: dict[NestedKey, np.ndarray] = {}
        for name, sub in space.spaces.items():
            if isinstance(sub, spaces.Dict):
                for key, value in flatten_obs(sub, obs[name]).items():
                    out[(name, *((key,) if isinstance(key, str) else key))] = value
            else:
                out[name] = np.asarray(obs[name])
        return out
    return {"observation": np.asarray(obs)}


def nest_obs(flat: dict[NestedKey, Any]) -> dict[str, Any]:
    """The inverse of :func:`flatten_obs` for a ``Dict`` space: ``{key: value}`` (tuple keys for nested
    entries) as the nested dicts gymnasium gives."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        path = (key,) if isinstance(key, str) else key
        node = out
        for name in path[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = value
    return out


def action_entries(
    space: spaces.Space[Any], actions: Any, path: tuple[str, ...] = ()
) -> dict[NestedKey, Any]:
    """A gymnasium (batched) action as its entries ``{"action" or ("action", ...): value}``, the keys of
    :func:`action_specs` (a ``Dict`` or ``Tuple`` space: one per leaf)."""
    if isinstance(space, spaces.Dict):
        parts = [action_entries(sub, actions[name], (*path, name)) for name, sub in space.spaces.items()]
    elif isinstance(space, spaces.Tuple):
        parts = [action_entries(sub, actions[i], (*path, str(i))) for i, sub in enumerate(space.spaces)]
    else:
        return {("action", *path) if path else "action": actions}
    return {key: value for part in parts for key, value in part.items()}


def assemble_action(
    space: spaces.Space[Any],
    leaf: Callable[[NestedKey, spaces.Space[Any]], Any],
    path: tuple[str, ...] = ("action",),
) -> Any:
    """A gymnasium action built from its entries (the inverse of :func:`action_entries`): a ``Dict`` or
    ``Tuple`` space's of its leaves' ``leaf(key, leaf_space)`` (keys as :func:`action_specs` names them)."""
    if isinstance(space, spaces.Dict):
        return {name: assemble_action(sub, leaf, (*path, name)) for name, sub in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return tuple(assemble_action(sub, leaf, (*path, str(i))) for i, sub in enumerate(space.spaces))
    return leaf(path if len(path) > 1 else "action", space)


def sample(
    space: spaces.Space[Any], batch_shape: tuple[int, ...], generator: torch.Generator | None
) -> dict[NestedKey, torch.Tensor]:
    """Uniform random actions for every entry of :func:`action_specs`, of shape ``batch_shape +
    spec.shape``, drawn with ``generator``."""
    return {key: sample_leaf(sub, batch_shape, generator) for key, sub in action_leaf_spaces(space).items()}


def sample_leaf(
    space: spaces.Space[Any], batch_shape: tuple[int, ...], generator: torch.Generator | None
) -> torch.Tensor:
    """Uniform random actions of shape ``batch_shape + spec.shape`` drawn with ``generator``."""
    spec = _action_leaves(space, ())[0][1]
    shape = (*batch_shape, *spec.shape)
    if isinstance(space, spaces.Discrete):
        return torch.randint(int(space.n), shape, generator=generator) + int(space.start)
    if isinstance(space, spaces.MultiDiscrete):
        nvec = torch.as_tensor(space.nvec, dtype=torch.float64)
        start = torch.as_tensor(space.start, dtype=torch.int64)
        u = torch.rand(shape, generator=generator, dtype=torch.float64)
        return (u * nvec).floor().to(torch.int64).clamp_max(nvec.to(torch.int64) - 1) + start
    if isinstance(space, spaces.MultiBinary):
        return torch.randint(2, shape, generator=generator, dtype=torch.int8)
    assert isinstance(space, spaces.Box)
    low = torch.as_tensor(space.low, dtype=torch.float64)
    high = torch.as_tensor(space.high, dtype=torch.float64)
    bounded_below = torch.as_tensor(space.bounded_below)
    bounded_above = torch.as_tensor(space.bounded_above)
    integer = not spec.dtype.is_floating_point
    u = torch.rand(shape, generator=generator, dtype=torch.float64)
    n = torch.randn(shape, generator=generator, dtype=torch.float64)
    # integer boxes include ``high``: floor(low + u * (high - low + 1)) is uniform over low..high
    both = low + u * (high - low + 1 if integer else high - low)
    only_low = low + n.abs()
    only_high = high - n.abs()
    out = torch.where(
        bounded_below & bounded_above,
        both,
        torch.where(bounded_below, only_low, torch.where(bounded_above, only_high, n)),
    )
    if integer:
        out = out.floor().clamp(low, high)
    return out.to(spec.dtype)
