"""TorchRL envs (``torchrl.envs.EnvBase``) seen as numpy arrays by the rollout core.

torchrl is optional: nothing here imports it at module level, and :func:`is_torchrl_env` only looks at
``sys.modules`` (an ``EnvBase`` instance cannot exist before ``torchrl.envs`` was imported).

What is supported (anything else raises a ``TypeError`` that says why and what to do):

* any batch size (``[]`` for one env, ``[N]`` for ``SerialEnv``/``ParallelEnv``/vectorised envs, more dims);
* observations: every leaf of ``env.full_observation_spec`` (nested keys become tuple keys) whose spec is
  ``Bounded``, ``Unbounded``, ``Categorical``/``Binary``, ``MultiCategorical``, ``OneHot`` or
  ``MultiOneHot`` with a dtype numpy has (not ``NonTensor``, ``Stacked``/heterogeneous, bfloat16);
* one action, at the key ``"action"``, of one of those specs (``OneHot`` actions keep their one-hot shape),
  or one per agent group at ``(group, "action")`` (TorchRL's multi-agent convention);
* one reward, at the key ``"reward"``, with one value per env, and/or per-agent rewards at
  ``(group, "reward")`` (batch entries of ``("next", ...)``; their mean is the env's reward in the
  episode statistics when there is no top-level one);
* done keys among ``"done"``, ``"terminated"``, ``"truncated"`` (a ``StepCounter`` adds ``"truncated"``),
  top-level or per group (group flags are batch entries like observations; the env-level flags are the
  top-level ones, or any agent's where there are none).

A recurrent policy's ``("next", state)`` outputs are set in the root before the step when the env carries
them (its ``TensorDictPrimer``): ``step`` keeps a preset ``"next"`` entry, as in TorchRL's collector.

Steps go through ``env.step_and_maybe_reset``: ``("next", ...)`` holds the final observation of an ended
episode and the next root the reset one, which is exactly the rollout's same-step autoreset. The root
TensorDict is carried from step to step, so the env's state keys (``full_state_spec``) reach ``step``
although only the observation keys are written to the batch. Random frames use ``env.rand_action``.
"""

from __future__ import annotations

import sys
from math import prod
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from ._gym import ArrayStep
from ._spaces import RESERVED_KEYS, LeafSpec, NestedKey

__all__ = ["TorchRLArrays", "is_torchrl_env"]

_DONE_KEYS = frozenset({"done", "terminated", "truncated"})
_SUPPORTED = "Bounded, Unbounded, Categorical, Binary, MultiCategorical, OneHot, MultiOneHot"


def is_torchrl_env(env: Any) -> bool:
    """Whether ``env`` is a ``torchrl.envs.EnvBase`` (without importing torchrl)."""
    module = sys.modules.get("torchrl.envs")
    base = getattr(module, "EnvBase", None) if module is not None else None
    return base is not None and isinstance(env, base)


def _leaf_spec(key: NestedKey, spec: Any, batch_shape: tuple[int, ...], what: str) -> LeafSpec:
    from torchrl.data import Bounded, Categorical, OneHot, Unbounded

    name = f"{what} {key!r}"
    if not isinstance(spec, (Bounded, Unbounded, Categorical, OneHot)):
        raise TypeError(
            f"unsupported torchrl spec for the {name}: {type(spec).__name__}; aiocollect supports "
            f"{_SUPPORTED} leaves. Drop or convert the entry with a transform (e.g. "
            "torchrl.envs.ExcludeTransform, or a custom Transform that makes it a tensor)"
        )
    shape = tuple(spec.shape)
    nb = len(batch_shape)
    if shape[:nb] != batch_shape:
        raise TypeError(
            f"the torchrl spec of the {name} has shape {list(shape)}, which does not start with the env "
            f"batch size {list(batch_shape)}"
        )
    try:
        torch.empty((), dtype=spec.dtype).numpy()
    except TypeError:
        raise TypeError(
            f"the {name} has dtype {spec.dtype}, which numpy lacks; cast it with "
            "torchrl.envs.DTypeCastTransform (e.g. to float32)"
        ) from None
    return LeafSpec(shape[nb:], spec.dtype)


def _composite_leaves(composite: Any, batch_shape: tuple[int, ...], what: str) -> dict[NestedKey, LeafSpec]:
    from torchrl.data import Composite

    if not isinstance(composite, Composite):
        raise TypeError(f"the env's {what} spec is a {type(composite).__name__}, expected a Composite")
    out: dict[NestedKey, LeafSpec] = {}
    for key, spec in composite.items(include_nested=True, leaves_only=True):
        out[key] = _leaf_spec(key, spec, batch_shape, what)
    return out


def _last(key: NestedKey) -> str:
    return key if isinstance(key, str) else key[-1]


def _check_integer_range(key: NestedKey, action: torch.Tensor, dtype: torch.dtype, spec: Any) -> None:
    """Raise if an integer action does not fit ``dtype`` (a cast would wrap it around silently)."""
    low, high = (0, 1) if dtype == torch.bool else (torch.iinfo(dtype).min, torch.iinfo(dtype).max)
    bad = (action < low) | (action > high)
    if bool(bad.any()):
        values = torch.unique(action[bad])[:5].tolist()
        raise ValueError(
            f"policy output {key!r} has {action.dtype} values {values} that do not fit the action spec's "
            f"dtype {dtype} (values in [{low}, {high}]); the spec is {spec}. Integer actions are checked, "
            "never wrapped to fit: write actions in the spec's range (or its dtype)"
        )


class TorchRLArrays:
    """A torchrl ``EnvBase`` with the array interface of :class:`~aiocollect.GymEnv` (used by ``ArrayEnv``).

    ``_reset_arrays(mask)`` and ``_step_arrays(action)`` give what the rollout needs; one TensorDict per
    step is unavoidable with a torchrl env (that is how torchrl envs step).
    """

    def __init__(self, env: Any) -> None:
        self.env = env
        self.batch_shape: tuple[int, ...] = tuple(env.batch_size)
        bs = self.batch_shape
        self.obs_specs = _composite_leaves(env.full_observation_spec, bs, "observation")
        if not self.obs_specs:
            raise TypeError(f"{type(env).__name__} has an empty observation spec: nothing to collect")
        clash = sorted(
            k if isinstance(k, str) else k[0]
            for k in self.obs_specs
            if (k if isinstance(k, str) else k[0]) in RESERVED_KEYS
        )
        if clash:
            raise TypeError(
                f"{type(env).__name__}'s observation entries {clash} collide with the batch keys "
                f"{sorted(RESERVED_KEYS)}; rename them with torchrl.envs.RenameTransform"
            )
        self._init_actions(env)
        self._init_rewards(env)
        self._init_dones(env)
        self._device = env.device
        self._root: TensorDictBase | None = None

    def _init_actions(self, env: Any) -> None:
        """Actions: ``"action"``, or one per agent group at ``(group, "action")`` (TorchRL's convention)."""
        bs = self.batch_shape
        keys = list(env.full_action_spec.keys(include_nested=True, leaves_only=True))
        odd = [k for k in keys if _last(k) != "action"]
        if odd or not keys:
            raise TypeError(
                f"{type(env).__name__} has the action keys {keys}; aiocollect collects an action at the key "
                "'action', or one per agent group at (group, 'action') (rename it with "
                "torchrl.envs.RenameTransform)"
            )
        self.action_torch_specs = {k: env.full_action_spec[k] for k in keys}
        self.action_specs = {
            k: _leaf_spec(k, spec, bs, "action") for k, spec in self.action_torch_specs.items()
        }
        self.action_torch_spec = (
            self.action_torch_specs["action"] if keys == ["action"] else env.full_action_spec
        )
        self.action_spec = next(iter(self.action_specs.values()))

    def _init_rewards(self, env: Any) -> None:
        """One reward per env at ``"reward"``; nested (per-agent) rewards are batch entries of their own,
        and their mean is the env's reward in the episode statistics."""
        bs = self.batch_shape
        keys = list(env.reward_keys)
        odd = [k for k in keys if _last(k) != "reward"]
        if odd or not keys:
            raise TypeError(
                f"{type(env).__name__} has the reward keys {keys}; aiocollect needs a reward at the key "
                "'reward' or (group, 'reward') (rename it with torchrl.envs.RenameTransform)"
            )
        self.has_reward = "reward" in keys
        if self.has_reward:
            reward_shape = tuple(env.full_reward_spec["reward"].shape)
            if prod(reward_shape[len(bs) :]) != 1:
                raise TypeError(
                    f"{type(env).__name__}'s reward has shape {list(reward_shape)}: aiocollect needs one "
                    f"reward per env at 'reward' (shape {[*bs, 1]}); per-agent rewards at (group, 'reward')"
                )
        #: entries of ("next", ...) only: the nested rewards
        self.next_specs = {
            k: _leaf_spec(k, env.full_reward_spec[k], bs, "reward") for k in keys if not isinstance(k, str)
        }

    def _init_dones(self, env: Any) -> None:
        """Top-level done flags, and nested (per-agent) ones, which are batch entries like observations;
        the env's flags in the rollout are any of them."""
        bs = self.batch_shape
        keys = list(env.done_keys)
        odd = [k for k in keys if _last(k) not in _DONE_KEYS]
        if odd or not keys:
            raise TypeError(
                f"{type(env).__name__} has the done keys {keys}; aiocollect supports {sorted(_DONE_KEYS)}, "
                "at the top level or in agent groups"
            )
        #: the agent groups' flags (batch entries like observations)
        self.group_flag_keys: list[NestedKey] = [k for k in keys if not isinstance(k, str)]
        for key in self.group_flag_keys:
            self.obs_specs[key] = _leaf_spec(key, env.full_done_spec[key], bs, "done flag")
        # the env's own flags are its top-level ones; an env without them ends when any agent does
        top = [k for k in keys if isinstance(k, str)]
        ends = top if {"done", "terminated"} & set(top) else keys
        terminated = [k for k in ends if _last(k) == "terminated"]
        self._terminated_keys = terminated or [k for k in ends if _last(k) == "done"]
        self._truncated_keys = [k for k in (top if "truncated" in top else keys) if _last(k) == "truncated"]
        self.has_truncated = bool(self._truncated_keys)

    # -- the array interface ----------------------------------------------------------------------
    def _arrays(
        self, td: TensorDictBase, where: str, specs: dict[NestedKey, LeafSpec] | None = None
    ) -> dict[NestedKey, np.ndarray]:
        out = {}
        for key, spec in (self.obs_specs if specs is None else specs).items():
            value = td.get(key, None)
            if value is None:
                raise KeyError(
                    f"{type(self.env).__name__}.{where} has no {key!r} entry, although its observation "
                    f"spec has it (keys: {list(self.obs_specs)})"
                )
            # a copy: batched torchrl envs write their next step into the same (shared) tensors
            out[key] = value.detach().to("cpu", spec.dtype, copy=True).numpy()
        return out

    def _any(self, td: TensorDictBase, keys: list[NestedKey]) -> np.ndarray:
        """Whether any of the flags ``keys`` (per env: any agent's) is set."""
        bs = self.batch_shape
        out = np.zeros(bs, dtype=bool)
        for key in keys:
            value = td.get(key, None)
            if value is not None:
                out |= value.detach().reshape(*bs, -1).any(-1).cpu().numpy()
        return out

    def _reset_arrays(self, mask: np.ndarray | None = None) -> dict[NestedKey, np.ndarray]:
        env = self.env
        if mask is None or self._root is None or not self.batch_shape:
            root = env.reset()
        else:
            # as EnvBase.maybe_reset does: the entries of the sub-envs not reset come from the root
            td = self._root.copy()
            reset = torch.as_tensor(np.asarray(mask, dtype=bool)).reshape(*self.batch_shape, 1)
            td.set("_reset", reset.to(td.device) if td.device is not None else reset)
            root = env.reset(td, select_reset_only=True)
            root.pop("_reset", None)
        self._root = root
        return self._arrays(root, "reset()")

    def _step_arrays(self, action: torch.Tensor | dict[NestedKey, torch.Tensor]) -> ArrayStep:
        root = self._root
        if root is None:
            raise RuntimeError(f"{type(self.env).__name__} was stepped before a reset")
        entries = action.items() if isinstance(action, dict) else [("action", action)]
        for key, value in entries:
            if key in self.action_specs:
                value = self._action(key, value)
            elif self._device is not None and value.device != self._device:  # ("next", state)
                value = value.to(self._device, non_blocking=True)
            root.set(key, value)
        stepped, self._root = self.env.step_and_maybe_reset(root)
        nxt = stepped.get("next")
        next_obs = self._arrays(nxt, "step()['next']")
        if self.next_specs:
            next_obs.update(self._arrays(nxt, "step()['next']", self.next_specs))
        root_obs = self._arrays(self._root, "step_and_maybe_reset()[1]")
        bs = self.batch_shape
        if self.has_reward:
            reward = nxt.get("reward").detach().reshape(bs).to("cpu", torch.float32).numpy().copy()
        else:  # per-agent rewards only: their mean, for the episode statistics
            values = [next_obs[k].reshape(*bs, -1).astype(np.float32) for k in self.next_specs]
            reward = np.concatenate(values, axis=-1).mean(-1)
        terminated = self._any(nxt, self._terminated_keys)
        truncated = self._any(nxt, self._truncated_keys)
        if not bs:  # one env: python scalars, as GymEnv gives
            return ArrayStep(next_obs, float(reward), bool(terminated), bool(truncated), root_obs)
        return ArrayStep(next_obs, reward, terminated, truncated, root_obs)

    def _action(self, key: NestedKey, action: torch.Tensor) -> torch.Tensor:
        spec = self.action_specs[key]
        action = action.reshape((*self.batch_shape, *spec.shape))
        if action.dtype != spec.dtype:
            if not (spec.dtype.is_floating_point or action.dtype.is_floating_point):
                _check_integer_range(key, action, spec.dtype, self.action_torch_specs[key])
            action = action.to(spec.dtype)
        if self._device is not None and action.device != self._device:
            action = action.to(self._device, non_blocking=True)
        return action

    def rand_action(self) -> dict[NestedKey, torch.Tensor]:
        """Random actions from ``env.rand_action`` (which may depend on the current root state)."""
        root = self._root
        td = root.copy() if root is not None else TensorDict({}, batch_size=self.batch_shape)
        drawn = self.env.rand_action(td)
        return {key: drawn.get(key) for key in self.action_specs}
