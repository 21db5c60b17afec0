"""``GymEnv``: a gymnasium ``Env`` or ``VectorEnv`` behind the env protocol, with same-step autoreset."""

from __future__ import annotations

from typing import Any, NamedTuple

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import AutoresetMode
from tensordict import TensorDict

from ._spaces import (
    LeafSpec,
    NestedKey,
    action_bounds,
    action_outside_space,
    action_spec,
    flatten_obs,
    observation_specs,
)


class ArrayStep(NamedTuple):
    """One step of a batch of envs as numpy arrays (batch dims first, no trailing reward dim).

    For one env (batch size ``[]``) reward and flags are python scalars, the cheapest to make.
    """

    next_obs: dict[NestedKey, np.ndarray]
    reward: Any  # np.ndarray, or float for one env
    terminated: Any  # np.ndarray, or bool for one env
    truncated: Any  # np.ndarray, or bool for one env
    #: the observation to act on next: ``next_obs`` where the episode goes on, a reset one where it ended
    root_obs: dict[NestedKey, np.ndarray]


class GymEnv:
    """A gymnasium environment (one env or a vector of them) with the aiocollect env protocol.

    Args:
        env: a gymnasium id (``"CartPole-v1"``), a ``gymnasium.Env`` or a ``gymnasium.vector.VectorEnv``
            (created with ``vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP}``).
        num_envs: with an id, build ``num_envs`` copies in a synchronous vector env (batch ``[num_envs]``).
        seed: seed of the first reset (``set_seed`` changes it later).
        **make_kwargs: passed to ``gymnasium.make`` / ``gymnasium.make_vec`` (ids only).

    At an episode end, ``("next", "observation")`` is the final observation and the following frame's
    ``"observation"`` the reset one (gymnasium's same-step autoreset).

    Observations come in the dtypes of the observation space (an env returning float64 for a float32
    Box is converted). They go to torch without a copy (``torch.from_numpy``), except that a single
    env's observations are copied once when read: an env may return an internal buffer that it updates
    in place, and the collectors keep every observation until the batch is complete. Gymnasium vector
    envs copy already (unless made with ``copy=False``, then they are copied here).

    Example:
        >>> import torch
        >>> from aiocollect import GymEnv
        >>> env = GymEnv("CartPole-v1", num_envs=4, seed=0)
        >>> env.batch_size
        torch.Size([4])
        >>> td = env.step(env.reset().set("action", torch.zeros(4, dtype=torch.int64)))
        >>> td["next", "reward"].shape
        torch.Size([4, 1])
        >>> env.close()
    """

    has_truncated = True

    def __init__(
        self,
        env: str | gym.Env[Any, Any] | gym.vector.VectorEnv[Any, Any, Any],
        *,
        num_envs: int | None = None,
        seed: int | None = None,
        **make_kwargs: Any,
    ) -> None:
        if num_envs is not None and (
            isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1
        ):
            raise ValueError(f"num_envs must be a positive int or None, got {num_envs!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        self._vector: bool
        if isinstance(env, str):
            if num_envs is None:
                self._env: Any = gym.make(env, **make_kwargs)
                self._vector = False
            else:
                vector_kwargs = dict(make_kwargs.pop("vector_kwargs", {}) or {})
                vector_kwargs["autoreset_mode"] = AutoresetMode.SAME_STEP
                self._env = gym.make_vec(
                    env,
                    num_envs=num_envs,
                    vectorization_mode=make_kwargs.pop("vectorization_mode", "sync"),
                    vector_kwargs=vector_kwargs,
                    **make_kwargs,
                )
                self._vector = True
        elif isinstance(env, gym.vector.VectorEnv):
            mode = env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP)
            if mode != AutoresetMode.SAME_STEP:
                raise ValueError(
                    f"GymEnv needs a vector env with same-step autoreset, got autoreset_mode={mode!r}; "
                    "create it with vector_kwargs={'autoreset_mode': gymnasium.vector.AutoresetMode."
                    "SAME_STEP} or pass an env id with num_envs=N"
                )
            if num_envs is not None and num_envs != env.num_envs:
                raise ValueError(f"num_envs={num_envs} but the vector env has {env.num_envs} envs")
            if make_kwargs:
                raise TypeError(f"make kwargs {sorted(make_kwargs)} only apply to an env id")
            self._env = env
            self._vector = True
        elif isinstance(env, gym.Env):
            if num_envs is not None:
                raise ValueError(
                    "num_envs needs an env id (GymEnv('CartPole-v1', num_envs=8)); an Env instance cannot "
                    "be replicated"
                )
            if make_kwargs:
                raise TypeError(f"make kwargs {sorted(make_kwargs)} only apply to an env id")
            self._env = env
            self._vector = False
        else:
            raise TypeError(
                f"env must be a gymnasium id, a gymnasium.Env or a gymnasium.vector.VectorEnv, got {env!r}"
            )
        try:
            if self._vector:
                self._num_envs = int(self._env.num_envs)
                self._obs_space = self._env.single_observation_space
                self._act_space = self._env.single_action_space
            else:
                self._num_envs = 0
                self._obs_space = self._env.observation_space
                self._act_space = self._env.action_space
            self.obs_specs: dict[NestedKey, LeafSpec] = observation_specs(self._obs_space)
            self.action_spec: LeafSpec = action_spec(self._act_space)
            self._act_bounds = action_bounds(self._act_space)
        except BaseException:
            self._env.close()
            raise
        self._obs_dtypes = {key: spec.numpy_dtype for key, spec in self.obs_specs.items()}
        self._obs_dtype = (
            None if isinstance(self._obs_space, gym.spaces.Dict) else self._obs_dtypes["observation"]
        )
        # The rollout keeps the arrays it is given until the end of the batch, so they must never be
        # written to again. Gymnasium's vector envs deep-copy their observations (unless made with
        # copy=False); a single env may hand back an internal buffer it updates in place, so its
        # observations are copied (one small copy per step, well under 1 us for CartPole).
        self._copy_obs = not (self._vector and getattr(self._env.unwrapped, "copy", False))
        self._batch_shape: tuple[int, ...] = (self._num_envs,) if self._vector else ()
        self._seed = seed
        self._last_obs: dict[NestedKey, np.ndarray] | None = None
        self._autoreset_pending: np.ndarray | None = None
        self._needs_reset = True

    # -- protocol ---------------------------------------------------------------------------------
    @property
    def batch_size(self) -> torch.Size:
        return torch.Size(self._batch_shape)

    @property
    def observation_space(self) -> gym.Space[Any]:
        return self._obs_space

    @property
    def action_space(self) -> gym.Space[Any]:
        return self._act_space

    @property
    def env(self) -> Any:
        """The wrapped gymnasium env or vector env."""
        return self._env

    def set_seed(self, seed: int) -> int:
        """Seed the next reset (sub-env ``i`` gets ``seed + i``); returns the last seed used."""
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        self._seed = seed
        self._act_space.seed(seed)
        return seed + max(self._num_envs, 1) - 1

    def reset(self, td: TensorDict | None = None) -> TensorDict:
        reset = None if td is None else td.get("_reset", None)
        mask = None
        if reset is not None:
            mask = reset.reshape(self._batch_shape).cpu().numpy().astype(bool)
        return self._obs_td(self._reset_arrays(mask))

    def step(self, td: TensorDict) -> TensorDict:
        if self._needs_reset:
            raise RuntimeError("GymEnv.step() called before reset()")
        result = self._step_arrays(td.get("action"))
        bs = self.batch_size
        terminated = torch.as_tensor(result.terminated).reshape(*bs, 1)
        truncated = torch.as_tensor(result.truncated).reshape(*bs, 1)
        nxt = self._obs_td(result.next_obs)
        nxt.set("reward", torch.as_tensor(result.reward, dtype=torch.float32).reshape(*bs, 1))
        nxt.set("done", terminated | truncated)
        nxt.set("terminated", terminated)
        nxt.set("truncated", truncated)
        return TensorDict({"next": nxt}, batch_size=bs)

    def close(self) -> None:
        self._env.close()

    def __repr__(self) -> str:
        return f"GymEnv({self._env!r}, batch_size={list(self._batch_shape)})"

    # -- array interface used by the rollout core (no TensorDict per step) -------------------------
    def _obs_td(self, obs: dict[NestedKey, np.ndarray]) -> TensorDict:
        td = TensorDict({}, batch_size=self.batch_size)
        for key, value in obs.items():
            td.set(key, torch.as_tensor(value))
        return td

    def _reset_arrays(self, mask: np.ndarray | None = None) -> dict[NestedKey, np.ndarray]:
        """Reset all sub-envs, or those where ``mask``; returns the observation of every sub-env."""
        seed, self._seed = self._seed, None
        if mask is not None and seed is None and self._last_obs is not None:
            mask = np.asarray(mask, dtype=bool)
            pending = self._autoreset_pending
            todo = mask & ~pending if pending is not None else mask
            self._autoreset_pending = None
            if not todo.any():
                # the sub-envs asked for were reset already by the same-step autoreset
                return self._last_obs
            if not self._vector:
                obs, _ = self._env.reset()
            else:
                obs, _ = self._env.reset(options={"reset_mask": todo})
        else:
            obs, _ = self._env.reset(seed=seed)
        self._needs_reset = False
        self._autoreset_pending = None
        self._last_obs = self._arrays(obs)
        return self._last_obs

    def _arrays(self, obs: Any) -> dict[NestedKey, np.ndarray]:
        """A raw observation -> ``{key: array}`` of the spec dtypes, owned by us, usable by torch."""
        if self._obs_dtype is not None:  # not a Dict space: the one "observation" entry
            return {"observation": self._array(obs, self._obs_dtype)}
        dtypes = self._obs_dtypes
        return {
            key: self._array(value, dtypes[key]) for key, value in flatten_obs(self._obs_space, obs).items()
        }

    def _array(self, value: Any, dtype: np.dtype[Any]) -> np.ndarray:
        """``value`` as an array of ``dtype`` that the env will not write to again (see ``_copy_obs``)
        and that ``torch.from_numpy`` takes as it is (writable, no negative strides)."""
        if isinstance(value, np.ndarray) and value.dtype == dtype:
            if self._copy_obs or not value.flags.writeable or any(st < 0 for st in value.strides):
                return value.copy()
            return value
        return np.array(value, dtype=dtype)  # a new array: python scalars, other dtypes (float64 ...)

    def _to_env_action(self, action: Any) -> Any:
        """The policy's action as the env takes it. Discrete actions outside the space raise a
        ``ValueError`` naming the space (an env would fail obscurely, or index out of range)."""
        space = self._act_space
        bounds = self._act_bounds
        if not self._vector and isinstance(space, gym.spaces.Discrete):
            value = int(action)  # a python int is the cheapest action gymnasium checks
            if value < bounds[0] or value > bounds[1]:  # type: ignore[index]
                raise action_outside_space(space, value)
            return value
        if isinstance(action, torch.Tensor):
            action = action.numpy(force=True)  # detach().cpu().numpy() in one call
        action = np.asarray(action)
        if bounds is not None and ((action < bounds[0]).any() or (action > bounds[1]).any()):
            raise action_outside_space(space, action)
        if isinstance(space, gym.spaces.Discrete):
            # policies may give a trailing singleton dim
            return action.reshape(self._batch_shape).astype(np.int64, copy=False)
        return action.astype(space.dtype, copy=False)

    def _step_arrays(self, action: Any) -> ArrayStep:
        """Step every sub-env; ended episodes are reset at once (same-step autoreset).

        One env gives python scalars for reward and flags, a vector env numpy arrays.
        """
        obs, reward, terminated, truncated, info = self._env.step(self._to_env_action(action))
        space = self._obs_space
        root = self._arrays(obs)
        if not self._vector:
            terminated = bool(terminated)
            truncated = bool(truncated)
            nxt = root
            if terminated or truncated:
                new_obs, _ = self._env.reset()
                root = self._arrays(new_obs)
                self._autoreset_pending = np.asarray(True)
            else:
                self._autoreset_pending = None
            self._last_obs = root
            return ArrayStep(nxt, float(reward), terminated, truncated, root)
        terminated = np.asarray(terminated, dtype=bool)
        truncated = np.asarray(truncated, dtype=bool)
        done = terminated | truncated
        if done.any():
            final_mask = info.get("_final_obs", done)
            finals = info["final_obs"]
            nxt = {k: v.copy() for k, v in root.items()}  # root keeps the reset observations
            for i in np.nonzero(final_mask)[0]:  # np.flatnonzero costs 2-3x more
                for key, value in flatten_obs(space, finals[i]).items():
                    nxt[key][i] = value
            self._autoreset_pending = done
        else:
            nxt = root
            self._autoreset_pending = None
        self._last_obs = root
        return ArrayStep(nxt, np.asarray(reward, dtype=np.float32), terminated, truncated, root)
