"""TorchRL's leniencies in the rollout (``aiocollect.compat`` turns them on): lossless action casts, and
the flags ``set_truncated`` sets.

A policy whose action differs from the env's action spec in dtype or shape is refused by the native
collectors (a silent cast once hid a wraparound). TorchRL passes it to the env instead, and its tests rely
on it: a float tensor holding integers for an integer or binary spec, or shape ``()`` for ``(1,)``.
:func:`lossless_casts` plans such casts once (at the rollout's dry policy call) and :class:`ActionCaster`
applies them to what the env is given at every step, checking each time that nothing is lost (the batch
keeps what the policy wrote, as TorchRL's does); a lossy action is refused with the error the native
collectors raise.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from typing import Any

import torch

from .._envs._spaces import LeafSpec, NestedKey

__all__ = ["ActionCaster", "lossless_casts", "truncation_keys"]


def truncation_keys(group_flag_keys: list[NestedKey]) -> list[NestedKey]:
    """The keys ``set_truncated`` sets on a batch's last frame, as TorchRL does: every truncated flag
    (the env's and its agent groups') and the done flag beside it."""
    keys: list[NestedKey] = [("next", "truncated"), ("next", "done")]
    for key in group_flag_keys:
        if isinstance(key, tuple) and key[-1] == "truncated":
            keys.append(("next", *key))
            done = (*key[:-1], "done")
            if done in group_flag_keys:
                keys.append(("next", *done))
    return keys


@dataclass(frozen=True)
class _Cast:
    spec: LeafSpec  # the action spec's shape (per env) and dtype
    error: Exception  # the native collectors' refusal, raised for a lossy action


def _castable(act: LeafSpec, exp: LeafSpec) -> bool:
    """Whether an output like ``act`` may become ``exp`` without loss (values checked at each step):
    the same elements but for dims of size 1, and no float spec fed integers, no complex numbers."""
    same_elements = [d for d in act.shape if d != 1] == [d for d in exp.shape if d != 1]
    if not same_elements or prod(act.shape) != prod(exp.shape):
        return False
    if act.dtype.is_complex or exp.dtype.is_complex:
        return False
    return act.dtype.is_floating_point or not exp.dtype.is_floating_point


def lossless_casts(
    env: Any, specs: dict[NestedKey, LeafSpec]
) -> tuple[dict[NestedKey, LeafSpec], dict[NestedKey, _Cast]]:
    """The policy's output specs as the env checks them (the castable actions with the action spec's
    dtype and shape), and the casts to make; raises the native refusal for an action that cannot be cast.
    Warns once per key."""
    specs = dict(specs)
    casts: dict[NestedKey, _Cast] = {}
    for key, exp in env.action_specs.items():
        act = specs.get(key)
        if act is None:
            continue  # env.check_policy_outputs says what is missing
        error = env.action_mismatch(key, act)
        if error is None:
            continue
        if not _castable(act, exp):
            raise error
        casts[key] = _Cast(exp, error)
        specs[key] = exp
        warnings.warn(
            f"policy output {key!r} has dtype {act.dtype} and shape {act.shape} per env; the action spec "
            f"has {exp.dtype} and shape {exp.shape}: cast at every step, where no value changes (as "
            "TorchRL does; aiocollect's native collectors refuse it). Write the spec's dtype and shape "
            "in the policy to silence this",
            UserWarning,
            stacklevel=2,
        )
    return specs, casts


def _lossless(value: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``value`` (floating) holds integers that fit ``dtype`` (an integer or bool dtype)."""
    if not value.dtype.is_floating_point or dtype.is_floating_point:
        return True
    low, high = (0, 1) if dtype == torch.bool else (torch.iinfo(dtype).min, torch.iinfo(dtype).max)
    return bool(((value == value.trunc()) & (value >= low) & (value <= high)).all())


class ActionCaster:
    """A policy's outputs -> the same with the actions cast to the action spec (see :func:`lossless_casts`);
    ``action_from(out)`` is the env's ``action_from`` of the cast outputs."""

    def __init__(self, casts: Mapping[NestedKey, _Cast], batch_shape: tuple[int, ...], action_from: Any):
        self.casts = dict(casts)
        self.batch_shape = batch_shape
        self._env_action_from = action_from

    def action_from(self, out: Mapping[NestedKey, torch.Tensor]) -> Any:
        return self._env_action_from(self(out))

    def __call__(self, out: Mapping[NestedKey, torch.Tensor]) -> dict[NestedKey, torch.Tensor]:
        out = dict(out)
        for key, cast in self.casts.items():
            value = out[key]
            if not _lossless(value, cast.spec.dtype):
                bad = value[value != value.to(cast.spec.dtype).to(value.dtype)]
                error = type(cast.error)(*cast.error.args)
                error.add_note(
                    f"the values {bad.unique()[:5].tolist()} are not integers in the range of "
                    f"{cast.spec.dtype}: a cast would change them, so the action is refused"
                )
                raise error
            out[key] = value.reshape((*self.batch_shape, *cast.spec.shape)).to(cast.spec.dtype)
        return out
