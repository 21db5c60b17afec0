"""``GymEnv``'s batch paths for the rollout core: the actions of a whole batch checked and converted at
once, and the fused loops that step a ``GymEnv`` of one observation array (``GymEnv._run_steps``): a
gymnasium env or same-step vector env, or an EnvPool pool.

Both are ``GymEnv`` methods (assigned in its class body); they live here to keep ``_gym.py`` readable.
"""

from __future__ import annotations

from collections.abc import Mapping
from time import perf_counter
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from ._gym import GymEnv
    from ._spaces import NestedKey

__all__ = ["FUSED_BYPASSES", "by_env_id", "env_action_steps", "fusable_type", "run_pool_steps", "run_steps"]

#: the GymEnv methods the fused loop (``GymEnv._run_steps``) does the work of: a subclass that overrides one
#: of them (to fail, to change observations, ...) is stepped by the per-step path, which calls them
FUSED_BYPASSES = (
    "step",
    "reset",
    "_step_arrays",
    "_step_env_action",
    "_reset",
    "_reset_arrays",
    "_merge_reset",
    "_observation",
    "_arrays",
    "_array",
    "_to_env_action",
    "_leaf_action",
)
_fused_types: dict[type, bool] = {}


def fusable_type(env: Any, base: type) -> bool:
    """Whether ``type(env)`` overrides none of ``base``'s :data:`FUSED_BYPASSES` (cached per type)."""
    cls = type(env)
    known = _fused_types.get(cls)
    if known is None:
        known = _fused_types[cls] = all(getattr(cls, name) is getattr(base, name) for name in FUSED_BYPASSES)
    return known


def env_action_steps(self: GymEnv, actions: np.ndarray) -> list[Any] | None:
    """The actions of many steps (steps first, one action entry), checked and converted in one go:
    what ``GymEnv._step_env_action`` takes at each step, the same as ``GymEnv._leaf_action`` gives
    step by step. ``None`` for a Dict or Tuple action space (converted step by step)."""
    if self._composite:
        return None
    space, bounds, scalar_bounds, discrete = self._act_info["action"]
    if bounds is not None and actions.size:
        low, high = bounds
        if scalar_bounds:
            outside = actions.min() < low or actions.max() > high
        else:
            outside = bool((actions < low).any() or (actions > high).any())
        if outside:  # the step's own error
            for action in actions:
                self._leaf_action("action", action)
    if discrete:
        steps = actions.reshape((len(actions), *self._batch_shape)).astype(np.int64, copy=False)
    else:
        steps = actions.astype(space.dtype, copy=False)
    return list(steps)


def policy_action(self: GymEnv) -> Any:
    """``self._leaf_action`` for the ``"action"`` entry, cheaper for a float ``Box`` (no bounds to
    check: the policy's tensor to numpy and the space's dtype, nothing else)."""
    space, bounds, _, discrete = self._act_info["action"]
    if discrete or bounds is not None:
        return self._leaf_action
    dtype = space.dtype
    tensor = torch.Tensor
    asarray = np.asarray

    def box_action(key: NestedKey, action: Any) -> Any:
        # what _leaf_action does: numpy(force=True) for a tensor, np.asarray, astype(copy=False)
        if isinstance(action, tensor):
            try:  # the same array as numpy(force=True) for a CPU tensor without grad, ~0.1 us sooner
                value = action.numpy()
            except (RuntimeError, TypeError):  # needs grad, on a device, conjugate or negative bit
                value = action.numpy(force=True)
        else:
            value = asarray(action)
        return value if value.dtype == dtype else value.astype(dtype)

    return box_action


def run_steps(
    self: GymEnv,
    steps: int,
    root: np.ndarray,
    act: Any,
    actions: list[Any] | None,
    slots: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    out_hist: list[Any],
    stop: Any,
    clock: Any = None,
    reseed: Any = None,
) -> tuple[int, np.ndarray]:
    """The rollout's hot loop where :attr:`GymEnv._fused_steps` holds: what ``steps`` calls of
    :meth:`GymEnv._step_arrays` give, without a call, a dict and a named tuple per step.

    At step ``t``: ``root`` (the observation acted on) goes to ``slots[0][t]``; the action is
    ``actions[t]`` (checked and converted: :func:`env_action_steps`) or, with ``actions`` None,
    from ``out = act(torch.from_numpy(root))`` (``out`` appended to ``out_hist``, ``out["action"]``
    checked as :meth:`GymEnv._step_arrays` does); the next observation, the reward, terminated and
    truncated go to ``slots[1:][t]`` (time-first views of the batch). Stops early where
    ``stop.is_set()``. ``clock``: a ``SplitClock`` that gets the policy calls' time. ``reseed(root, done)``:
    the observations after the ended episodes are reset again, seeded (``group_size``; ``_groups.py``).
    Returns (steps taken, the observation to act on next).
    """
    env_step = self._env.step
    reset = self._env.reset
    leaf = policy_action(self)
    array = self._array
    dtype = self._plain_obs_dtype
    assert dtype is not None  # _fused_steps
    from_numpy = torch.from_numpy
    count_nonzero = np.count_nonzero
    perf = perf_counter if clock is not None else None
    policy_s = 0.0
    obs_slot, next_slot, reward_slot, terminated_slot, truncated_slot = slots
    vector = self._vector
    pending: Any = self._autoreset_pending
    taken = steps
    try:
        for t in range(steps):
            if stop is not None and stop.is_set():
                taken = t
                break
            obs_slot[t] = root
            if actions is None:
                if perf is None:
                    out = act(from_numpy(root))
                else:  # the time split's policy share: two clock reads, no call added
                    start = perf()
                    out = act(from_numpy(root))
                    policy_s += perf() - start
                out_hist.append(out)
                env_action = leaf("action", out["action"])
            else:
                env_action = actions[t]
            obs, reward, terminated, truncated, info = env_step(env_action)
            if vector:
                terminated = np.asarray(terminated, dtype=bool)
                truncated = np.asarray(truncated, dtype=bool)
                done = terminated | truncated
                root = array(obs, dtype)
                if count_nonzero(done):
                    nxt = root.copy()  # root keeps the reset observations
                    finals = info["final_obs"]
                    for i in np.nonzero(info.get("_final_obs", done))[0]:
                        nxt[i] = finals[i]
                    pending = done
                    if reseed is not None:
                        root = reseed(root, done)
                else:
                    nxt = root
                    pending = None
            else:
                terminated = bool(terminated)
                truncated = bool(truncated)
                nxt = array(obs, dtype)
                if terminated or truncated:
                    nxt = nxt.copy()  # the reset may write into the env's buffer
                    new_obs, _ = reset()
                    root = array(new_obs, dtype) if reseed is None else reseed(None, np.asarray(True))
                    pending = np.asarray(True)
                else:
                    root = nxt
                    pending = None
            next_slot[t] = nxt
            reward_slot[t] = reward  # cast to the slot's float32, as np.asarray(reward, float32)
            terminated_slot[t] = terminated
            truncated_slot[t] = truncated
    finally:
        self._autoreset_pending = pending
        self._last_obs = {"observation": root}
        if clock is not None:
            clock.policy += policy_s
    return taken, root


def run_pool_steps(
    self: GymEnv,
    steps: int,
    root: np.ndarray,
    act: Any,
    actions: list[Any] | None,
    slots: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    out_hist: list[Any],
    stop: Any,
    clock: Any = None,
) -> tuple[int, np.ndarray]:
    """:func:`run_steps` for an EnvPool pool (sync mode, unwrapped): what ``steps`` calls of
    :meth:`GymEnv._step_arrays` give, and the same calls into the pool.

    Where episodes ended, the pool's partial reset (``reset(options={"reset_mask": done})``, which is
    ``_reset(env ids)`` then ``recv``) is split: the reset is sent at once, the step's entries are
    written into the batch while the pool's threads reset, and only then are the reset observations
    received. A pool resets the ended envs itself only at their next step (next-step autoreset), so
    this round trip is the price of same-step data; overlapping it with the writes hides part of it.
    """
    pool = self._env
    env_step = pool.step
    send_reset = pool._reset
    recv = pool.recv
    reset_info = bool(pool.config["gym_reset_return_info"])
    ids = self._pool_ids
    num_envs = self._num_envs
    leaf = policy_action(self)
    array = self._array
    dtype = self._plain_obs_dtype
    assert dtype is not None  # _fused_steps
    from_numpy = torch.from_numpy
    count_nonzero = np.count_nonzero
    perf = perf_counter if clock is not None else None
    policy_s = 0.0
    flatnonzero = np.flatnonzero
    obs_slot, next_slot, reward_slot, terminated_slot, truncated_slot = slots
    pending: Any = self._autoreset_pending
    taken = steps
    try:
        for t in range(steps):
            if stop is not None and stop.is_set():
                taken = t
                break
            obs_slot[t] = root
            if actions is None:
                if perf is None:
                    out = act(from_numpy(root))
                else:  # the time split's policy share: two clock reads, no call added
                    start = perf()
                    out = act(from_numpy(root))
                    policy_s += perf() - start
                out_hist.append(out)
                env_action = leaf("action", out["action"])
            else:
                env_action = actions[t]
            obs, reward, terminated, truncated, info = env_step(env_action)
            done = terminated | truncated
            order = info["env_id"]
            if order.shape != (num_envs,) or (order != ids).any():
                obs, reward, terminated, truncated, info, done = by_env_id(
                    np.asarray(order), obs, reward, terminated, truncated, info, done
                )
            nxt = array(obs, dtype)
            if count_nonzero(done):
                self._pool_fresh = False
                send_reset(flatnonzero(done).astype(np.int32))  # what reset_mask becomes in the pool
                root = nxt.copy()  # the reset observations go into a copy: nxt is the step's
                next_slot[t] = nxt
                reward_slot[t] = reward
                terminated_slot[t] = terminated
                truncated_slot[t] = truncated
                new_obs, new_info = recv(reset=True, return_info=reset_info)
                root[np.asarray(new_info["env_id"])] = array(new_obs, dtype)
                pending = done
                continue
            root = nxt
            pending = None
            next_slot[t] = nxt
            reward_slot[t] = reward  # cast to the slot's float32, as np.asarray(reward, float32)
            terminated_slot[t] = terminated
            truncated_slot[t] = truncated
    finally:
        self._autoreset_pending = pending
        self._last_obs = {"observation": root}
        if clock is not None:
            clock.policy += policy_s
    return taken, root


def by_env_id(order: np.ndarray, *results: Any) -> Any:
    """EnvPool step results (the last one the done flags) put in env-id order (a pool in sync mode gives
    them so already)."""
    if order.shape != (len(results[-1]),):
        raise ValueError(f"EnvPool stepped the envs {order.tolist()}, not all of them once")
    perm = np.argsort(order)

    def take(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: take(v) for k, v in value.items()}
        return np.asarray(value)[perm]

    return tuple(take(value) for value in results)
