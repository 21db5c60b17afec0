"""Policy weights as TensorDicts (``TensorDict.from_module`` layout): extract, check, copy."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from ._group_policy import GroupPolicy
from ._runners import as_policy, unwrap_compiled

__all__ = [
    "as_weights",
    "check_compatible",
    "copy_weights",
    "flat_weights",
    "module_weights",
    "weights_template",
]


def module_weights(module: torch.nn.Module) -> TensorDictBase:
    """Parameters **and** buffers of ``module``, sharing its storage."""
    return TensorDict.from_module(unwrap_compiled(module), as_module=False)


def flat_weights(module: torch.nn.Module) -> TensorDictBase:
    """A module's parameters and buffers with flat ``"a.b.c"`` keys, sharing its storage."""
    return module_weights(module).flatten_keys(".")


def weights_template(policy: Any) -> TensorDictBase | None:
    """The flat weights of a collector's ``policy`` (an ``nn.Module`` or a dict ``{group: module}``), or
    ``None`` for a policy without weights."""
    if isinstance(policy, Mapping) and not isinstance(policy, TensorDictBase):
        policy = as_policy(policy)
    return flat_weights(policy) if isinstance(policy, torch.nn.Module) else None


def as_weights(source: Any) -> TensorDictBase:
    """An ``nn.Module``, a TensorDict of weights or a state dict -> a TensorDict of weights."""
    if isinstance(source, torch.nn.Module):
        return module_weights(source)
    if isinstance(source, TensorDictBase):
        return source
    if (
        isinstance(source, Mapping)
        and source
        and all(isinstance(v, torch.nn.Module) for v in source.values())
    ):
        return module_weights(GroupPolicy(source))  # a policy per group: {group: module}
    if isinstance(source, Mapping):
        return TensorDict(dict(source), batch_size=[]).unflatten_keys(".")
    raise TypeError(
        "update_weights takes an nn.Module, a TensorDict of weights (TensorDict.from_module) or a state "
        f"dict, got {type(source).__name__}"
    )


#: the only casts a weight update makes (the source dtype, the policy's): widening floats, which keep every
#: value exactly; any other difference (int64 weights for a float32 parameter, float64 for float32) is an
#: error rather than a silent, lossy cast
LOSSLESS_CASTS = frozenset(
    {
        (torch.float16, torch.float32),
        (torch.float16, torch.float64),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.float64),
        (torch.float32, torch.float64),
    }
)


def check_compatible(target: TensorDictBase, source: TensorDictBase) -> None:
    """Raise ``ValueError`` naming the first key whose presence, shape or dtype differs (a dtype may only
    differ by a lossless widening, :data:`LOSSLESS_CASTS`).

    Example:
        >>> import torch
        >>> policy = flat_weights(torch.nn.Linear(2, 1))
        >>> wrong = policy.apply(lambda t: t.to(torch.int64))
        >>> check_compatible(policy, wrong)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: weight 'bias' has dtype torch.int64, the policy's has torch.float32: ...
    """
    tkeys = {k: v for k, v in target.items(include_nested=True, leaves_only=True)}
    skeys = {k: v for k, v in source.items(include_nested=True, leaves_only=True)}
    for key in sorted(set(tkeys) | set(skeys), key=str):
        if key not in skeys:
            raise ValueError(f"weights lack the policy's entry {_dotted(key)!r}")
        if key not in tkeys:
            raise ValueError(f"weights have an entry {_dotted(key)!r} the policy does not have")
        if tkeys[key].shape != skeys[key].shape:
            raise ValueError(
                f"weight {_dotted(key)!r} has shape {tuple(skeys[key].shape)}, the policy's has "
                f"{tuple(tkeys[key].shape)}"
            )
        have, want = skeys[key].dtype, tkeys[key].dtype
        if have != want and (have, want) not in LOSSLESS_CASTS:
            raise ValueError(
                f"weight {_dotted(key)!r} has dtype {have}, the policy's has {want}: send weights of the "
                f"policy's dtypes (e.g. weights.to({want})); only lossless float widenings are cast"
            )


def copy_weights(target: TensorDictBase, source: TensorDictBase) -> None:
    """Copy ``source`` into ``target`` in place (no aliasing is created)."""
    with torch.no_grad():
        target.update_(source)


def _dotted(key: Any) -> str:
    return key if isinstance(key, str) else ".".join(key)
