"""Any env of the protocol seen as numpy arrays, which is what the rollout core steps.

``GymEnv`` already works on arrays, so it is used directly; a torchrl ``EnvBase`` goes through
``TorchRLArrays`` (``_torchrl.py``, torchrl imported only when such an env exists). Other envs go through
their ``reset``/``step`` TensorDicts (one TensorDict per step: the slow path, documented as such), and so
does a ``GymEnv`` subclass that overrides ``step`` or ``reset`` (its methods are honoured).
"""

from __future__ import annotations

from math import prod
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from .._core._options import RolloutOptions
from ._contract import env_contract
from ._gym import ArrayStep, GymEnv, fusable_type, overrides_gym_env
from ._multiagent._base import GroupedEnv
from ._multiagent._pettingzoo import PettingZooEnv
from ._protocol import EnvProtocol
from ._spaces import LeafSpec, NestedKey, action_specs, group_specs, grouped_action_keys, observation_specs
from ._torchrl import TorchRLArrays, is_torchrl_env

__all__ = ["ArrayEnv", "check_env", "env_contract", "open_env"]

_FLAGS = ("done", "terminated", "truncated")
_REQUIRED = ("batch_size", "observation_space", "action_space", "reset", "step", "set_seed", "close")


def check_env(env: Any, *, argument: str = "create_env_fn") -> None:
    """Raise a TypeError naming the missing protocol members (a torchrl ``EnvBase`` is accepted as is)."""
    if is_torchrl_env(env):
        return
    missing = [name for name in _REQUIRED if not hasattr(env, name)]
    if missing:
        raise TypeError(
            f"{argument} gave {type(env).__name__}, which lacks {', '.join(missing)} of the env protocol "
            "(see aiocollect.EnvProtocol); wrap gymnasium envs with aiocollect.GymEnv"
        )


def open_env(create_env_fn: Any, options: RolloutOptions) -> Any:
    """The env of an in-process collector: an env instance as is, else ``create_env_fn()`` (a function,
    a class, a partial); checked, and seeded with ``options.seed``. Closed again if a check fails."""
    is_env = hasattr(create_env_fn, "step") and not isinstance(create_env_fn, type)
    env = create_env_fn if is_env else create_env_fn()
    check_env(env)
    try:
        if options.set_truncated and not getattr(env, "has_truncated", True):
            raise ValueError(
                f"set_truncated=True but {type(env).__name__} has no truncation "
                "(has_truncated=False); drop set_truncated"
            )
        if options.seed is not None:
            env.set_seed(options.seed)
    except BaseException:
        env.close()
        raise
    return env


def _expand(mask: Any, ndim: int) -> np.ndarray:
    """A per-env mask with trailing dims of 1, to ``ndim`` dims."""
    mask = np.asarray(mask, dtype=bool)
    return mask.reshape(*mask.shape, *(1,) * (ndim - mask.ndim))


def _last(key: NestedKey) -> str:
    return key if isinstance(key, str) else key[-1]


class ArrayEnv:
    """The rollout's view of an env: numpy arrays in and out, batch dims first."""

    def __init__(self, env: EnvProtocol) -> None:
        check_env(env)
        self.env = env
        self.batch_shape: tuple[int, ...] = tuple(env.batch_size)
        self.numel = prod(self.batch_shape)
        self.action_masks: dict[NestedKey, NestedKey] = {}  # action key -> its legal-action mask's key
        if is_torchrl_env(env) or isinstance(env, GroupedEnv):
            # a PettingZooEnv / VmasEnv is its own array view (agent groups, TorchRL's layout)
            arrays: Any = TorchRLArrays(env) if is_torchrl_env(env) else env
            self.action_space: Any = arrays.action_torch_spec if arrays is not env else env.action_space
            self.obs_specs: dict[NestedKey, LeafSpec] = arrays.obs_specs
            self.action_specs: dict[NestedKey, LeafSpec] = arrays.action_specs
            self.next_specs: dict[NestedKey, LeafSpec] = arrays.next_specs
            self.has_reward = arrays.has_reward
            self.has_truncated = arrays.has_truncated
            self._gym: Any = arrays  # the array fast path: a GymEnv, or this adapter
            if isinstance(env, GroupedEnv):
                self.action_rename = grouped_action_keys(env.action_space)
                self.action_masks = dict(env.action_masks)
        else:
            self.action_space = env.action_space
            gym_env = isinstance(env, GymEnv)
            self.next_specs = {}
            self.has_reward = True
            if isinstance(env, GymEnv):
                self.obs_specs = env.obs_specs
                self.action_specs = env.action_specs
            else:
                self.obs_specs = observation_specs(env.observation_space)
                self.action_specs = action_specs(env.action_space)
                self._init_groups(env)
            self.has_truncated = bool(getattr(env, "has_truncated", True))
            fast = gym_env and not (overrides_gym_env(env, "step") or overrides_gym_env(env, "reset"))
            self._gym = env if fast else None
        #: ``step`` takes numpy actions as well as tensors (a GymEnv's array path)
        self.numpy_actions = isinstance(self._gym, GymEnv)
        #: the observation entries a plain ``nn.Module`` policy is called on: not the info entries
        info = env.info_specs if isinstance(env, GymEnv) else {}
        self.module_obs_keys: list[NestedKey] = [k for k in self.obs_specs if k not in info]
        if isinstance(env, GroupedEnv):  # the groups' observations, not their masks and flags
            self.module_obs_keys = list(env.module_obs_keys)
        #: the spec of the first action entry (the only one but for Dict/Tuple action spaces)
        self.action_spec: LeafSpec = next(iter(self.action_specs.values()))
        self._action_keys = list(self.action_specs)
        self._one_action = self._action_keys == ["action"]
        self._state_keys: list[NestedKey] = []  # ("next", state) entries the env takes with the action

    action_rename: dict[NestedKey, NestedKey] | None = None
    _group_flags: dict[NestedKey, np.ndarray] = {}  # noqa: RUF012 (the last root's group flags)
    _flag_keys: list[NestedKey] = []  # noqa: RUF012 (read-only class defaults)
    _terminated_keys: list[NestedKey] = []  # noqa: RUF012
    _truncated_keys: list[NestedKey] = []  # noqa: RUF012

    def _init_groups(self, env: Any) -> None:
        """Agent groups of a protocol env (TorchRL's multi-agent keys): grouped actions (a Dict action
        space whose leaves are all named ``"action"``: ``{"agents": {"action": ...}}`` is written at
        ``("agents", "action")``), and the optional ``reward_space`` / ``done_space`` (Dict spaces of the
        reward and done entries of ``step()["next"]``, nested per group)."""
        self.action_rename = grouped_action_keys(env.action_space)
        if self.action_rename:
            self.action_specs = {self.action_rename[k]: v for k, v in self.action_specs.items()}
        reward_space = getattr(env, "reward_space", None)
        if reward_space is not None:
            rewards = group_specs(reward_space, "reward", ("reward",))
            self.has_reward = "reward" in rewards
            self.next_specs = {k: v for k, v in rewards.items() if not isinstance(k, str)}
        done_space = getattr(env, "done_space", None)
        flags = group_specs(done_space, "done", _FLAGS) if done_space is not None else {}
        self._flag_keys = [k for k in flags if not isinstance(k, str)]
        self.obs_specs = {
            **self.obs_specs,
            **{k: LeafSpec(flags[k].shape, torch.bool) for k in self._flag_keys},
        }
        # the env's own flags are its top-level ones; an env without them ends when any agent does
        nested = [] if {"done", "terminated"} & set(flags) else self._flag_keys
        self._terminated_keys = [k for k in nested if k[-1] == "terminated"] or [
            k for k in nested if k[-1] == "done"
        ]
        self._truncated_keys = [] if "truncated" in flags else [k for k in nested if k[-1] == "truncated"]

    @property
    def group_flag_keys(self) -> list[NestedKey]:
        """The done flags of the agent groups (``("agents", "truncated")``, ...): batch entries like
        observations, at the root and under ``"next"``."""
        arrays = self.env if isinstance(self.env, GroupedEnv) else self.torchrl_arrays
        return arrays.group_flag_keys if arrays is not None else self._flag_keys

    def pass_to_env(self, state_keys: list[NestedKey]) -> None:
        """Recurrent states the env carries (a TorchRL env with a ``TensorDictPrimer``): the policy's
        ``("next", key)`` goes to the env with the action."""
        if state_keys:
            self._state_keys = [("next", k) if isinstance(k, str) else ("next", *k) for k in state_keys]
            self._one_action = False

    # -- the policy side: which outputs are actions -----------------------------------------------
    def check_policy_outputs(self, specs: dict[NestedKey, LeafSpec]) -> None:
        """Raise if the policy's outputs (from one dry call; shapes per env) cannot drive this env."""
        missing = [key for key in self._action_keys if key not in specs]
        if missing:
            wrote = [k for k in specs if (k if isinstance(k, str) else k[0]) == "action"]
            raise KeyError(
                f"the policy wrote the action entries {wrote}; the action space {self.action_space} needs "
                f"{self._action_keys} (missing {missing})"
            )
        for key in self.action_specs:
            error = self.action_mismatch(key, specs[key])
            if error is not None:
                raise error

    def action_mismatch(self, key: NestedKey, act: LeafSpec) -> Exception | None:
        """The error for a policy output ``act`` (shape and dtype per env) at the action key ``key`` that
        cannot drive this env, else ``None``."""
        exp = self.action_specs[key]
        if act.shape != exp.shape and not (act.shape == (1,) and exp.shape == ()):
            return ValueError(
                f"policy output {key!r} has shape {act.shape} per env; the action space "
                f"{self.action_space} needs shape {exp.shape} ({exp.dtype})"
            )
        if act.dtype.is_floating_point != exp.dtype.is_floating_point or act.dtype.is_complex:
            kind = "a floating" if exp.dtype.is_floating_point else "an integer"
            return TypeError(
                f"policy output {key!r} has dtype {act.dtype}; the action space "
                f"{self.action_space} needs {kind} dtype ({exp.dtype}, shape {exp.shape} per env)"
            )
        return None

    def stepper(self, *, converted: bool = False) -> Any:
        """:meth:`step`, or the array path's own step method where there is one (a call less per step);
        ``converted``: the step method for the actions :meth:`action_steps` gave."""
        if converted and self._converts_actions:
            assert self._gym is not None
            return self._gym._step_env_action
        return self._gym._step_arrays if self._gym is not None else self.step

    @property
    def fused_gym(self) -> GymEnv | None:
        """The GymEnv whose ``_run_steps`` can run the rollout's steps now (see ``GymEnv._fused_steps``),
        else ``None``."""
        gym_env = self._gym
        if isinstance(gym_env, GymEnv) and self._one_action and gym_env._fused_steps:
            return gym_env
        return None

    def action_steps(self, actions: dict[NestedKey, Any]) -> list[Any] | None:
        """The actions of a batch's steps (``{key: array}``, steps first), checked and converted at once
        for ``stepper(converted=True)``; ``None`` where they go to :meth:`step` one by one."""
        if not self._converts_actions or not self._one_action:
            return None
        assert self._gym is not None
        return self._gym._env_action_steps(actions["action"])

    @property
    def _converts_actions(self) -> bool:
        """Whether a batch's actions may be converted at once and stepped past ``_step_arrays`` (not where
        a GymEnv subclass overrides one of ``_gym.FUSED_BYPASSES``: its override sees every step)."""
        gym_env = self._gym
        return isinstance(gym_env, GymEnv) and fusable_type(gym_env, GymEnv)

    @property
    def one_action(self) -> bool:
        """Whether :meth:`action_from` gives ``out["action"]`` as it is (one action entry, no state)."""
        return self._one_action

    def action_from(self, out: dict[NestedKey, torch.Tensor]) -> Any:
        """What :meth:`step` takes, picked from one policy call's outputs: the ``"action"`` tensor, or
        ``{key: tensor}`` of the entries of a Dict/Tuple action space."""
        if self._one_action:
            return out["action"]
        step = {key: out[key] for key in self._action_keys}
        for key in self._state_keys:  # none in random frames: the env keeps the state (TorchRL's primer)
            if key in out:
                step[key] = out[key]
        return step

    @property
    def torchrl_arrays(self) -> TorchRLArrays | None:
        """A torchrl env's array view (whose ``rand_action`` gives random actions), else ``None``."""
        return self._gym if isinstance(self._gym, TorchRLArrays) else None

    def reset(self, mask: np.ndarray | None = None) -> dict[NestedKey, np.ndarray]:
        if self._gym is not None:
            with env_contract(self):  # a bare observation, a shape the space does not have: named
                return self._gym._reset_arrays(mask)
        # a GymEnv subclass (same-step autoreset already done) is told which sub-envs, even unbatched
        if mask is None or (not self.batch_shape and not isinstance(self.env, GymEnv)):
            td = self.env.reset()
        else:
            reset_td = TensorDict(
                {"_reset": torch.as_tensor(np.asarray(mask, dtype=bool)).reshape(*self.batch_shape, 1)},
                batch_size=self.batch_shape,
            )
            td = self.env.reset(reset_td)
        root = self._obs_arrays(td, "reset()")
        if mask is not None and self._flag_keys and self._group_flags:
            # a group's flags the env's reset left out go on in the sub-envs not reset
            for flag in self._flag_keys:
                if td.get(flag, None) is None:
                    root[flag] = self._group_flags[flag] & ~_expand(mask, root[flag].ndim)
        self._group_flags = {flag: root[flag] for flag in self._flag_keys}
        return root

    def check_reset_seeded(self) -> None:
        """Raise unless :meth:`reset_seeded` works for this env (``group_size``, ``on_update="restart"``)."""
        if isinstance(self._gym, (GymEnv, PettingZooEnv)):
            self._gym._check_reset_seeded()
        elif self.batch_shape or self.torchrl_arrays is not None:
            raise ValueError(
                f"group_size and on_update='restart' reset each env slot with a seed of its own, which "
                f"{type(self.env).__name__} (batch size {list(self.batch_shape)}) cannot do: use a GymEnv "
                "(a gymnasium env or vector env), or an env of batch size [] (seeded by set_seed, then reset)"
            )

    def reset_seeded(self, mask: np.ndarray | None, seeds: np.ndarray) -> dict[NestedKey, np.ndarray]:
        """Reset the sub-envs in ``mask`` (all: ``None``), sub-env ``i`` with seed ``seeds[i]``; the
        observations of every sub-env (see :meth:`check_reset_seeded`)."""
        if isinstance(self._gym, (GymEnv, PettingZooEnv)):
            return self._gym._reset_seeded(mask, seeds)
        self.env.set_seed(int(seeds.reshape(-1)[0]))  # one env: set_seed seeds its next reset
        return self.reset()

    def step(self, action: torch.Tensor) -> ArrayStep:
        if self._gym is not None:
            return self._gym._step_arrays(action)
        td = TensorDict({}, batch_size=self.batch_shape)
        for key, value in action.items() if isinstance(action, dict) else [("action", action)]:
            td.set(key, value)
        out = self.env.step(td)
        nxt = out.get("next", None)
        if nxt is None:
            raise KeyError(f"{type(self.env).__name__}.step() returned no 'next' entry: {out}")
        bs = self.batch_shape

        def entry(name: str, dtype: type, default: np.ndarray | None = None) -> np.ndarray:
            # copied: the rollout keeps these until the end of the batch, the env may reuse its tensors
            value = nxt.get(name, None)
            if value is None:
                if default is not None:
                    return default
                raise KeyError(f"{type(self.env).__name__}.step() returned no ('next', {name!r}) entry")
            return np.array(torch.as_tensor(value).detach().cpu().reshape(bs).numpy(), dtype=dtype)

        next_obs = self._obs_arrays(nxt, "step()['next']")
        has_done = nxt.get("done", None) is not None
        no_flag = np.zeros(bs, dtype=bool) if self._terminated_keys else None  # groups only: fine
        terminated = entry("terminated", bool, entry("done", bool) if has_done else no_flag)
        truncated = entry("truncated", bool, np.zeros(bs, dtype=bool))
        for flag in self._terminated_keys:  # agent groups: any agent's flag is the env's
            terminated = terminated | next_obs[flag].reshape(*bs, -1).any(-1)
        for flag in self._truncated_keys:
            truncated = truncated | next_obs[flag].reshape(*bs, -1).any(-1)
        if self.next_specs:
            next_obs.update(self._obs_arrays(nxt, "step()['next']", self.next_specs))
        if self.has_reward:
            reward = entry("reward", np.float32)
        else:  # per-agent rewards only: their mean, for the episode statistics
            values = [next_obs[k].reshape(*bs, -1).astype(np.float32) for k in self.next_specs]
            reward = np.concatenate(values, axis=-1).mean(-1)
        done = terminated | truncated
        root = next_obs
        self._group_flags = {flag: next_obs[flag] for flag in self._flag_keys}
        if done.any():
            root = self.reset(done)
        if not bs:  # one env: python scalars, as GymEnv gives
            return ArrayStep(next_obs, float(reward), bool(terminated), bool(truncated), root)
        return ArrayStep(next_obs, reward, terminated, truncated, root)

    def set_seed(self, seed: int) -> int:
        return int(self.env.set_seed(seed))

    def close(self) -> None:
        self.env.close()

    def _obs_arrays(
        self, td: TensorDict, where: str, specs: dict[NestedKey, LeafSpec] | None = None
    ) -> dict[NestedKey, np.ndarray]:
        out = {}
        specs = self.obs_specs if specs is None else specs
        for key in specs:
            value = td.get(key, None)
            if value is None and key in self._flag_keys:  # a group's done flag left out: not done
                value = torch.zeros((*self.batch_shape, *specs[key].shape), dtype=torch.bool)
            if value is None:
                raise KeyError(
                    f"{type(self.env).__name__}.{where} has no {key!r} entry; the observation space "
                    f"gives the keys {list(self.obs_specs)}"
                )
            value = torch.as_tensor(value).detach()
            # a copy in the spec dtype: the env may update its tensors in place later
            out[key] = value.to("cpu", specs[key].dtype, copy=True).numpy()
        return out
