"""Recurrent policies: state entries carried from one step to the next.

A policy is *recurrent* when it reads an entry ``key`` and writes ``("next", key)`` (TorchRL's
``LSTMModule`` / ``GRUModule`` read ``"recurrent_state_h"`` and write ``("next", "recurrent_state_h")``).
Each such state is carried one of two ways:

* **by the env**, when the env has ``key`` as an observation (a TorchRL env with the policy's
  ``TensorDictPrimer``): the policy's ``("next", key)`` goes to the env with the action, and the env
  carries it and resets it, as in TorchRL;
* **by the collector** otherwise: the next step's ``key`` is this step's ``("next", key)``, set back to the
  initial value where an episode ended. The initial value (of one env) comes from the policy: a
  ``recurrent_state = {key: tensor}`` attribute on the policy or any submodule, or the primer of a TorchRL
  recurrent module (``make_tensordict_primer()``: zeros of its spec).

With collector-carried states (or a policy that reads ``"is_init"``) and no ``"is_init"`` from the env,
the collector writes ``"is_init"`` as TorchRL's ``InitTracker`` does: ``True`` on the first step of every
trajectory, and ``("next", "is_init")`` ``False``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict.utils import unravel_key

from .._envs._spaces import LeafSpec, NestedKey

__all__ = ["Carry", "Recurrence", "find_recurrence"]

IS_INIT = "is_init"
_IS_INIT_SPEC = LeafSpec((1,), torch.bool)


@dataclass(frozen=True)
class Recurrence:
    """The recurrent states of a policy on an env (see the module docstring)."""

    #: the ``("next", key)`` outputs of the policy the rollout keeps (every state)
    next_outputs: list[NestedKey] = field(default_factory=list)
    #: the states the env carries: their ``("next", key)`` goes to the env with the action
    env_keys: list[NestedKey] = field(default_factory=list)
    #: the entries the collector carries (the states, and ``"is_init"`` when it writes it)
    specs: dict[NestedKey, LeafSpec] = field(default_factory=dict)
    #: the initial value of one env for each collector-carried state
    initial: dict[NestedKey, np.ndarray] = field(default_factory=dict)


def _next_key(key: NestedKey) -> tuple[str, ...]:
    return ("next", key) if isinstance(key, str) else ("next", *key)


def _unnext(key: NestedKey) -> NestedKey | None:
    """``k`` for an output key ``("next", k)``, else ``None``."""
    key = unravel_key(key)
    if isinstance(key, tuple) and len(key) > 1 and key[0] == "next":
        return key[1] if len(key) == 2 else key[1:]
    return None


def _modules(policy: Any) -> list[Any]:
    policy = getattr(policy, "_orig_mod", policy)  # torch.compile'd
    return list(policy.modules()) if isinstance(policy, torch.nn.Module) else [policy]


def _declared(policy: Any) -> dict[NestedKey, torch.Tensor]:
    """``recurrent_state`` attributes of the policy and its submodules."""
    out: dict[NestedKey, torch.Tensor] = {}
    for module in _modules(policy):
        state = module.__dict__.get("recurrent_state") if hasattr(module, "__dict__") else None
        if state is None:
            continue
        if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise TypeError(
                f"{type(module).__name__}.recurrent_state must map state keys to the initial tensor of one "
                f"env (e.g. {{'hidden': torch.zeros(1, 64)}}), got {state!r}"
            )
        out.update({unravel_key(k): v.detach().cpu() for k, v in state.items()})
    return out


def _primers(policy: Any) -> dict[NestedKey, torch.Tensor]:
    """Zeros of the specs of TorchRL recurrent modules' primers (``make_tensordict_primer()``)."""
    out: dict[NestedKey, torch.Tensor] = {}
    for module in _modules(policy):
        make = getattr(type(module), "make_tensordict_primer", None)
        if make is None:
            continue
        primers = getattr(make(module), "primers", None)
        if primers is None:
            continue
        for key, spec in primers.items(include_nested=True, leaves_only=True):
            out[unravel_key(key)] = torch.zeros(tuple(spec.shape), dtype=spec.dtype)
    return out


def find_recurrence(policy: Any, obs_specs: Mapping[NestedKey, LeafSpec], *, env_carries: bool) -> Recurrence:
    """The recurrent states of ``policy`` on an env with observations ``obs_specs``.

    ``env_carries``: the env takes ``("next", key)`` entries with the action (a TorchRL env).
    """
    inner = getattr(policy, "_orig_mod", policy)
    in_keys = [unravel_key(k) for k in getattr(inner, "in_keys", None) or []]
    out_keys = [unravel_key(k) for k in getattr(inner, "out_keys", None) or []]
    declared = _declared(policy)
    written = [k for k in map(_unnext, out_keys) if k is not None]
    keys = [k for k in written if k in in_keys or k in declared]
    keys += [k for k in declared if k not in keys]
    env_keys: list[NestedKey] = []
    initial: dict[NestedKey, np.ndarray] = {}
    primers: dict[NestedKey, torch.Tensor] | None = None
    for key in keys:
        if key in obs_specs:
            if not env_carries:
                raise TypeError(
                    f"the policy writes ('next', {key!r}), a recurrent state, but the env has {key!r} as an "
                    "observation; rename the env's entry (only a TorchRL env carries a policy's state)"
                )
            env_keys.append(key)
            continue
        value = declared.get(key)
        if value is None:
            primers = _primers(policy) if primers is None else primers
            value = primers.get(key)
        if value is None:
            raise TypeError(
                f"the policy reads {key!r} and writes ('next', {key!r}), a recurrent state, but gives no "
                f"initial value for it: set `policy.recurrent_state = {{{key!r}: torch.zeros(...)}}` (the "
                "state of one env), or add the policy's TensorDictPrimer to a TorchRL env"
            )
        initial[key] = value.numpy()
    specs = {k: LeafSpec(tuple(v.shape), torch.from_numpy(v).dtype) for k, v in initial.items()}
    if (specs or IS_INIT in in_keys) and IS_INIT not in obs_specs:
        specs[IS_INIT] = _IS_INIT_SPEC
    return Recurrence(
        next_outputs=[_next_key(k) for k in keys], env_keys=env_keys, specs=specs, initial=initial
    )


class Carry:
    """The collector-carried entries of a rollout: added to every root, updated after every step."""

    def __init__(self, recurrence: Recurrence, batch_shape: tuple[int, ...]) -> None:
        self.batch_shape = batch_shape
        self.initial = {
            k: np.ascontiguousarray(np.broadcast_to(v, (*batch_shape, *v.shape)))
            for k, v in recurrence.initial.items()
        }
        self.next_keys = {k: _next_key(k) for k in self.initial}
        self.is_init = IS_INIT in recurrence.specs
        self.state: dict[NestedKey, np.ndarray] = {}
        self._not_init = np.zeros((*batch_shape, 1), dtype=bool)

    def start(self, root: Mapping[NestedKey, np.ndarray]) -> dict[NestedKey, np.ndarray]:
        """``root`` (just reset) with every state at its initial value."""
        self.state = {k: v.copy() for k, v in self.initial.items()}
        if self.is_init:
            self.state[IS_INIT] = np.ones((*self.batch_shape, 1), dtype=bool)
        return {**root, **self.state}

    def keep(self, root: Mapping[NestedKey, np.ndarray]) -> dict[NestedKey, np.ndarray]:
        """``root`` (partly reset by the env) with the current states."""
        return {**root, **self.state}

    def step(
        self,
        out: Mapping[NestedKey, Any],
        next_obs: Mapping[NestedKey, np.ndarray],
        next_root: Mapping[NestedKey, np.ndarray],
        done: Any,
    ) -> tuple[dict[NestedKey, np.ndarray], dict[NestedKey, np.ndarray]]:
        """After a step: ``("next", key)`` is the policy's output (the current state where the policy
        wrote none: random frames), the next root's ``key`` the same, or the initial value where the
        episode ended (``done``)."""
        nxt: dict[NestedKey, np.ndarray] = {}
        state: dict[NestedKey, np.ndarray] = {}
        done = np.asarray(done, dtype=bool).reshape(self.batch_shape)
        any_done = bool(done.any())
        for key, init in self.initial.items():
            value = out.get(self.next_keys[key])
            new = self.state[key] if value is None else value.detach().cpu().numpy().reshape(init.shape)
            nxt[key] = new
            if any_done:
                new = np.where(done.reshape(*self.batch_shape, *(1,) * (init.ndim - done.ndim)), init, new)
            state[key] = new
        if self.is_init:
            nxt[IS_INIT] = self._not_init
            state[IS_INIT] = done.reshape(*self.batch_shape, 1).copy()
        self.state = state
        return {**next_obs, **nxt}, {**next_root, **state}
