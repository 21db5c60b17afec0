"""``GymEnv``: a gymnasium ``Env`` or ``VectorEnv`` (any autoreset mode, EnvPool too) behind the env
protocol, with same-step autoreset."""

from __future__ import annotations

from collections.abc import Mapping
from time import perf_counter
from typing import Any, NamedTuple

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import AutoresetMode
from tensordict import TensorDict

from ._gym_open import is_envpool, open_gym_env
from ._gym_state import env_state, set_env_state, set_vector_state, vector_state
from ._info import InfoKeys, InfoReader, info_specs
from ._pool_frames import PoolFrames
from ._spaces import (
    LeafSpec,
    NestedKey,
    action_bounds,
    action_leaf_spaces,
    action_outside_space,
    action_spec,
    action_specs,
    assemble_action,
    flatten_obs,
    observation_specs,
)

__all__ = ["FUSED_BYPASSES", "ArrayStep", "GymEnv", "fusable_type", "overrides_gym_env"]

#: ``ArrayStep(...)`` without the named tuple's python ``__new__`` (~0.25 us less per step)
_new_step = tuple.__new__

#: integer actions of at most this many values are bounds-checked with python's min/max over a list
_SMALL = 64


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


def overrides_gym_env(env: Any, name: str) -> bool:
    """Whether ``env`` (a GymEnv subclass) overrides GymEnv's method ``name``."""
    return getattr(type(env), name) is not getattr(GymEnv, name)


class GymEnv:
    """A gymnasium environment (one env or a vector of them) with the aiocollect env protocol.

    Args:
        env: a gymnasium id (``"CartPole-v1"``), a ``gymnasium.Env``, or a ``gymnasium.vector.VectorEnv``
            of any autoreset mode (``SyncVectorEnv``, ``AsyncVectorEnv``, an EnvPool pool made with
            ``envpool.make_gymnasium``).
        num_envs: with an id, build ``num_envs`` copies in a synchronous vector env (batch ``[num_envs]``).
        seed: seed of the first reset (``set_seed`` changes it later).
        info_keys: entries of the envs' ``info`` to put in the batch, as observations: under
            ``("next", key)`` with each step, and at the root with the observation the policy acts on
            (an action mask reaches the policy). A list of names takes each entry's shape and dtype
            from the reset info; a dict ``{name: space}`` gives them (needed for entries only steps
            give, such as ``"is_success"`` or ``"episode"``). Missing at a step: zeros.
        **make_kwargs: passed to ``gymnasium.make`` / ``gymnasium.make_vec`` (ids only).

    At an episode end, ``("next", "observation")`` is the final observation and the following frame's
    ``"observation"`` the reset one. A vector env with next-step autoreset (gymnasium's default, and
    EnvPool's) or autoreset disabled has its ended sub-envs reset at once with
    ``reset(options={"reset_mask": done})``: its reset step never happens, and the data equal a
    same-step env's for the same seeds.

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
    _pool_frames: PoolFrames | None = None  # an EnvPool pool's fused loop (made at its first batch)

    def __init__(
        self,
        env: str | gym.Env[Any, Any] | gym.vector.VectorEnv[Any, Any, Any],
        *,
        num_envs: int | None = None,
        seed: int | None = None,
        info_keys: InfoKeys | None = None,
        **make_kwargs: Any,
    ) -> None:
        if num_envs is not None and (
            isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1
        ):
            raise ValueError(f"num_envs must be a positive int or None, got {num_envs!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        self._vector: bool
        self._env, self._vector = open_gym_env(env, num_envs, make_kwargs)
        try:
            self._pool = self._vector and is_envpool(self._env.unwrapped)
            self._same_step = not self._vector or self._check_autoreset(self._env)
            if self._vector:
                self._num_envs = int(self._env.num_envs)
                self._obs_space = self._env.single_observation_space
                self._act_space = self._env.single_action_space
            else:
                self._num_envs = 0
                self._obs_space = self._env.observation_space
                self._act_space = self._env.action_space
            self.obs_specs: dict[NestedKey, LeafSpec] = observation_specs(self._obs_space)
            self.action_specs: dict[NestedKey, LeafSpec] = action_specs(self._act_space)
            self._act_leaves = action_leaf_spaces(self._act_space)
            self._act_bounds = {key: action_bounds(sub) for key, sub in self._act_leaves.items()}
            #: per action leaf, what _leaf_action reads at each step: (space, bounds, scalar bounds, Discrete)
            self._act_info = {
                key: (
                    sub,
                    bounds,
                    bounds is not None and np.ndim(bounds[0]) == 0,
                    isinstance(sub, gym.spaces.Discrete),
                )
                for (key, sub), bounds in zip(
                    self._act_leaves.items(), self._act_bounds.values(), strict=True
                )
            }
            self._composite = list(self.action_specs) != ["action"]
            self._batch_shape: tuple[int, ...] = (self._num_envs,) if self._vector else ()
            self._seed = seed
            if self._pool and seed is not None:
                self._reseed_pool(seed)
            self._last_obs: dict[NestedKey, np.ndarray] | None = None
            self._info: InfoReader | None = None
            if info_keys is not None:
                self._info = self._info_reader(info_keys)
                self.obs_specs = {**self.obs_specs, **self._info.specs}
        except BaseException:
            self._env.close()
            raise
        self._obs_dtypes = {key: spec.numpy_dtype for key, spec in observation_specs(self._obs_space).items()}
        self._obs_dtype = (
            None if isinstance(self._obs_space, gym.spaces.Dict) else self._obs_dtypes["observation"]
        )
        #: the observation's dtype where it is all there is to read (one array, no info entries)
        self._plain_obs_dtype = self._obs_dtype if self._info is None else None
        # The arrays of the array path are valid until the next step or reset: the rollout copies each
        # observation into its batch at once, so an env may hand back an internal buffer that it updates
        # in place, and nothing is copied here (a 100 KB Atari frame cost a copy per step). Only where a
        # reset would overwrite a final observation still to be read is it copied first. The public
        # TensorDict step()/reset() copy (see _obs_td).
        # gymnasium's vector envs hand out fresh arrays at every step (unless made with copy=False)
        self._fresh_obs = self._vector and bool(getattr(self._env.unwrapped, "copy", False))
        self._autoreset_pending: np.ndarray | None = None
        self._needs_reset = True

    def _check_autoreset(self, env: Any) -> bool:
        """Whether the vector env resets ended sub-envs in the same step (raise if its mode is unusable)."""
        mode = env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP)
        mode = AutoresetMode(mode) if not isinstance(mode, AutoresetMode) else mode
        inner = env.unwrapped
        if self._pool and inner.is_async:
            cfg = inner.config
            raise ValueError(
                f"EnvPool async mode (batch_size={cfg['batch_size']} < num_envs={cfg['num_envs']}) is not "
                "supported: each step returns a different subset of the envs, while a batch holds every "
                "env at every time step ([num_envs, T], one trajectory per row). Make the pool with "
                "batch_size=num_envs (the default); for more throughput use several collector workers"
            )
        wrapper = env
        while mode != AutoresetMode.SAME_STEP and isinstance(wrapper, gym.vector.VectorWrapper):
            if isinstance(wrapper, gym.wrappers.vector.RecordEpisodeStatistics):
                raise ValueError(
                    "gymnasium.wrappers.vector.RecordEpisodeStatistics records wrong statistics when "
                    f"sub-envs are reset in part, as a {mode.name} vector env needs (gymnasium's "
                    "SyncVectorEnv pops options['reset_mask'] before the wrapper reads it); wrap each "
                    "sub-env with gymnasium.wrappers.RecordEpisodeStatistics instead, or make the vector "
                    "env with autoreset_mode=AutoresetMode.SAME_STEP"
                )
            wrapper = wrapper.env
        if (
            mode == AutoresetMode.NEXT_STEP
            and isinstance(inner, gym.vector.AsyncVectorEnv)
            and not inner.shared_memory
        ):
            raise ValueError(
                "AsyncVectorEnv(shared_memory=False) with next-step autoreset cannot be reset in part "
                "(gymnasium then still takes the reset step after reset(options={'reset_mask': ...})); "
                "make it with shared_memory=True (the default) or autoreset_mode=AutoresetMode.SAME_STEP"
            )
        return mode == AutoresetMode.SAME_STEP

    @property
    def info_specs(self) -> dict[NestedKey, LeafSpec]:
        """The batch entries read from ``info`` (``info_keys``), a part of ``obs_specs``."""
        return dict(self._info.specs) if self._info is not None else {}

    def _info_reader(self, info_keys: InfoKeys) -> InfoReader:
        needs_sample = not isinstance(info_keys, Mapping) or any(v is None for v in info_keys.values())
        sample = None
        if needs_sample:  # the reset info tells the shapes and dtypes (this reset's seed is used again)
            _, sample = self._reset(self._seed, None)
            self._needs_reset = True
        specs = info_specs(info_keys, sample, vector=self._vector, obs_keys=list(self.obs_specs))
        return InfoReader(specs, self._batch_shape)

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
    def action_spec(self) -> LeafSpec:
        """The spec of the ``"action"`` entry (a leaf action space; see ``action_specs`` for all)."""
        return action_spec(self._act_space)

    @property
    def env(self) -> Any:
        """The wrapped gymnasium env or vector env (an EnvPool pool is made anew by ``set_seed``)."""
        return self._env

    def set_seed(self, seed: int) -> int:
        """Seed the next reset (sub-env ``i`` gets ``seed + i``); returns the last seed used.

        EnvPool fixes its seeds when a pool is made: ``set_seed`` makes the pool anew with ``seed``.
        """
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        self._seed = seed
        if self._pool:
            self._reseed_pool(seed)
        self._act_space.seed(seed)
        return seed + max(self._num_envs, 1) - 1

    def _reseed_pool(self, seed: int) -> None:
        """Make the pool anew with ``seed``, unless it has that seed and was not reset since it was
        made (a pool handed to ``GymEnv`` is taken to be new). EnvPool's seeds are C ints: a larger seed
        (a restart's derived one) is taken modulo ``2**31 - num_envs``."""
        pool = self._env
        seed %= 2**31 - self._num_envs
        if pool.config["seed"] == seed and getattr(self, "_pool_fresh", True):
            return
        if pool is not pool.unwrapped:
            raise ValueError(
                "EnvPool fixes its seeds when a pool is made, and this pool is wrapped, so it cannot be made "
                "anew with another seed: pass seed= to envpool.make_gymnasium, and no seed to GymEnv or "
                "the collector"
            )
        spec = pool.spec
        values = tuple(
            seed if k == "seed" else v for k, v in zip(spec._config_keys, spec._config_values, strict=True)
        )
        self._env = type(pool)(type(spec)(values))
        pool.close()
        self._pool_fresh = True
        self._needs_reset = True

    def get_state(self) -> dict[str, Any]:
        """The envs' own state (numpy arrays, Python scalars, lists, dicts), for ``state_dict(envs=True)``:
        classic control, ALE and MuJoCo envs (their ``TimeLimit`` counters and random generators
        included), one or in a ``SyncVectorEnv``; other envs raise a ``TypeError`` naming what cannot be
        saved. :meth:`set_state` restores it into a ``GymEnv`` made alike.

        Example:
            >>> import torch
            >>> env = GymEnv("CartPole-v1", seed=0)
            >>> _ = env.reset()
            >>> saved = env.get_state()
            >>> step = lambda: env.step(env.reset().set("action", torch.tensor(1)))
            >>> a = step()
            >>> env.set_state(saved)
            >>> torch.equal(step()["next", "observation"], a["next", "observation"])
            True
        """
        if self._pool:
            raise TypeError("GymEnv.get_state: an EnvPool pool cannot save its state; save without env state")
        envs = vector_state(self._env) if self._vector else env_state(self._env)
        last = None if self._last_obs is None else [[k, v.copy()] for k, v in self._last_obs.items()]
        pending = self._autoreset_pending
        return {
            "envs": envs,
            "needs_reset": self._needs_reset,
            "seed": self._seed,
            "last_obs": last,
            "autoreset_pending": None if pending is None else np.array(pending, copy=True),
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`get_state`'s output (arrays may come back as tensors, from a checkpoint)."""
        state = _as_arrays(state)
        if self._vector:
            set_vector_state(self._env, state["envs"])
        else:
            set_env_state(self._env, state["envs"])
        self._needs_reset = bool(state["needs_reset"])
        self._seed = state["seed"]
        last = state["last_obs"]
        self._last_obs = None if last is None else {_key(k): np.array(v) for k, v in last}
        pending = state["autoreset_pending"]
        self._autoreset_pending = None if pending is None else np.array(pending, dtype=bool)

    def reset(self, td: TensorDict | None = None) -> TensorDict:
        reset = None if td is None else td.get("_reset", None)
        mask = None
        if reset is not None:
            mask = reset.reshape(self._batch_shape).cpu().numpy().astype(bool)
        return self._obs_td(self._reset_arrays(mask))

    def step(self, td: TensorDict) -> TensorDict:
        if self._needs_reset:
            raise RuntimeError("GymEnv.step() called before reset()")
        action: Any = td.get("action")
        if self._composite:
            action = {("action", *k): v for k, v in action.items(include_nested=True, leaves_only=True)}
        result = self._step_arrays(action)
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
            # a copy, unless the env gives fresh arrays: it may write into its arrays later
            td.set(key, torch.as_tensor(value) if self._fresh_obs else torch.tensor(value))
        return td

    def _reset(self, seed: int | None, mask: np.ndarray | None) -> tuple[Any, dict[str, Any]]:
        """Reset all sub-envs (``mask`` None) or those in ``mask``; EnvPool has its own seed (set_seed)."""
        self._pool_fresh = False
        if mask is None:
            return self._env.reset() if self._pool or seed is None else self._env.reset(seed=seed)
        if not self._vector:
            return self._env.reset()
        return self._env.reset(options={"reset_mask": mask})

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
                obs, info = self._reset(None, todo)
                root = self._observation(obs, info)
            else:
                root = self._merge_reset({k: v.copy() for k, v in self._last_obs.items()}, todo)
        else:
            obs, info = self._reset(seed, None)
            root = self._observation(obs, info)
        self._needs_reset = False
        self._autoreset_pending = None
        self._last_obs = root
        return root

    def _check_reset_seeded(self) -> None:
        if self._pool:
            raise ValueError(
                "group_size and on_update='restart' reset each env slot with a seed of its own; an EnvPool "
                "pool fixes its seeds when it is made: use a gymnasium vector env (gymnasium.make_vec)"
            )

    def _reset_seeded(self, mask: np.ndarray | None, seeds: np.ndarray) -> dict[NestedKey, np.ndarray]:
        """Reset the sub-envs in ``mask`` (all: ``None``), sub-env ``i`` with ``seeds[i]`` (one env:
        ``seeds`` of shape ``[]``); returns the observation of every sub-env."""
        self._pool_fresh = False
        if not self._vector:
            root = self._observation(*self._env.reset(seed=int(seeds)))
        elif mask is None or self._last_obs is None:
            root = self._observation(*self._env.reset(seed=[int(s) for s in seeds]))
        else:
            mask = np.asarray(mask, dtype=bool)
            base = {k: v.copy() for k, v in self._last_obs.items()}
            root = self._merge_reset(
                base, mask, [int(s) if m else None for s, m in zip(seeds, mask, strict=True)]
            )
        self._seed = None
        self._needs_reset = False
        self._autoreset_pending = None
        self._last_obs = root
        return root

    def _merge_reset(
        self, base: dict[NestedKey, np.ndarray], mask: np.ndarray, seeds: list[int | None] | None = None
    ) -> dict[NestedKey, np.ndarray]:
        """Reset the sub-envs in ``mask`` and write their observations (and info entries) into ``base``.

        Gymnasium's vector envs return every sub-env's observation; EnvPool those of the reset ones
        (in the order of its ``info["env_id"]``).
        """
        obs, info = (
            self._reset(None, mask)
            if seeds is None
            else self._env.reset(seed=seeds, options={"reset_mask": mask})
        )
        arrays = self._arrays(obs)
        first = next(iter(arrays.values()))
        if first.shape[0] == self._num_envs:
            rows: Any = mask
            if self._info is not None:
                arrays.update(self._info.read(info))
            for key, value in arrays.items():
                base[key][rows] = value[rows]
            return base
        rows = np.asarray(info["env_id"]) if "env_id" in info else np.flatnonzero(mask)
        if self._info is not None:
            arrays.update(self._info.read(info, len(rows)))
        for key, value in arrays.items():
            base[key][rows] = value
        return base

    def _observation(self, obs: Any, info: Any) -> dict[NestedKey, np.ndarray]:
        """The observation arrays, and the info entries asked for."""
        out = self._arrays(obs)
        if self._info is not None:
            out.update(self._info.read(info))
        return out

    def _arrays(self, obs: Any) -> dict[NestedKey, np.ndarray]:
        """A raw observation -> ``{key: array}`` of the spec dtypes, owned by us, usable by torch."""
        if self._obs_dtype is not None:  # not a Dict space: the one "observation" entry
            return {"observation": self._array(obs, self._obs_dtype)}
        dtypes = self._obs_dtypes
        return {
            key: self._array(value, dtypes[key]) for key, value in flatten_obs(self._obs_space, obs).items()
        }

    def _array(self, value: Any, dtype: np.dtype[Any]) -> np.ndarray:
        """``value`` as an array of ``dtype`` that ``torch.from_numpy`` takes as it is (writable, no
        negative strides), valid until the next step or reset (the rollout copies it at once)."""
        if isinstance(value, np.ndarray) and value.dtype == dtype:
            flags = value.flags
            # a C-contiguous array has no negative strides: one flag read instead of a loop over strides
            if (flags.c_contiguous or min(value.strides, default=0) >= 0) and flags.writeable:
                return value
            return value.copy()
        return np.array(value, dtype=dtype)  # a new array: python scalars, other dtypes (float64 ...)

    def _to_env_action(self, action: Any) -> Any:
        """The policy's action as the env takes it (a dict or tuple for a Dict or Tuple space).

        Integer actions outside the space raise a ``ValueError`` naming the space: they are checked,
        never wrapped by a cast (an env would fail obscurely, index out of range, or act on garbage).
        """
        if not self._composite:
            return self._leaf_action("action", action)
        if not isinstance(action, Mapping):
            raise TypeError(
                f"the action space {self._act_space} takes the action entries {list(self.action_specs)}, "
                f"got {type(action).__name__}"
            )
        return assemble_action(
            self._act_space, lambda key, _: self._leaf_action(key, self._entry(action, key))
        )

    def _entry(self, entries: Mapping[Any, Any], key: NestedKey) -> Any:
        if key not in entries:
            raise KeyError(f"no action entry {key!r}; the action space needs {list(self.action_specs)}")
        return entries[key]

    def _leaf_action(self, key: NestedKey, action: Any) -> Any:
        space, bounds, scalar_bounds, discrete = self._act_info[key]
        if discrete and not self._vector:
            # a numpy int64, as the space's own sample() gives: gymnasium checks it ~1 us faster than a
            # python int (Discrete.contains builds an np.iinfo for an int)
            value = action if type(action) is np.int64 else np.int64(int(action))
            if value < bounds[0] or value > bounds[1]:  # type: ignore[index]
                raise action_outside_space(space, int(value), key)
            return value
        if isinstance(action, torch.Tensor):
            action = action.numpy(force=True)  # detach().cpu().numpy() in one call
        action = np.asarray(action)
        if bounds is not None and action.size:
            low, high = bounds
            if scalar_bounds and action.size <= _SMALL:
                # a few values: python's min/max over a list, ~5x cheaper than two numpy reductions
                values = action.ravel().tolist()
                outside = min(values) < low or max(values) > high
            elif scalar_bounds:  # Discrete, MultiBinary: two reductions, half the cost of 2 compares + any
                outside = action.min() < low or action.max() > high
            else:
                outside = bool((action < low).any() or (action > high).any())
            if outside:
                raise action_outside_space(space, action, key)
        if discrete:
            # policies may give a trailing singleton dim
            return action.reshape(self._batch_shape).astype(np.int64, copy=False)
        return action.astype(space.dtype, copy=False)

    def _step_arrays(self, action: Any) -> ArrayStep:
        """Step every sub-env; ended episodes are reset at once (same-step autoreset).

        One env gives python scalars for reward and flags, a vector env numpy arrays.
        """
        # the common case, one action entry, skips a call (each costs ~0.1 us per step)
        env_action = self._to_env_action(action) if self._composite else self._leaf_action("action", action)
        return self._step_env_action(env_action)

    @property
    def _fused_steps(self) -> bool:
        """Whether :meth:`_run_steps` can collect: one observation array (no Dict space, no info
        entries), one action entry, one env, a gymnasium vector env with same-step autoreset or an
        unwrapped EnvPool pool, and no subclass override of a method the fused loop stands in for
        (:data:`FUSED_BYPASSES`)."""
        return (
            self._plain_obs_dtype is not None
            and not self._composite
            and (self._same_step or (self._pool and self._env is self._env.unwrapped))
            and not self._needs_reset
            and fusable_type(self, GymEnv)
        )

    def _run_steps(self, *args: Any, **kwargs: Any) -> tuple[int, np.ndarray]:
        """The rollout's fused loop (where :attr:`_fused_steps` holds): :meth:`_run_gym_steps`, or
        :meth:`_run_pool_steps` for an EnvPool pool."""
        return (self._run_pool_steps if self._pool else self._run_gym_steps)(*args, **kwargs)

    def _reseed_rows(self, root: np.ndarray | None, mask: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        """The fused loop's :meth:`_reset_seeded`: the sub-envs in ``mask`` reset with their ``seeds``,
        their observations written into ``root`` (the observations to act on; one env: ``None``)."""
        if root is None:  # one env
            return self._array(self._env.reset(seed=int(seeds))[0], self._plain_obs_dtype)  # type: ignore[arg-type]
        seeded = [int(s) if m else None for s, m in zip(seeds, mask, strict=True)]
        return self._merge_reset({"observation": root}, mask, seeded)["observation"]

    # -- the batch paths: a batch's actions at once, and the fused step loops --------------------------
    def _env_action_steps(self, actions: np.ndarray) -> list[Any] | None:
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

    def _policy_action(self) -> Any:
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

    def _run_gym_steps(
        self,
        steps: int,
        root: np.ndarray,
        act: Any,
        actions: list[Any] | None,
        slots: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        out_hist: list[Any],
        stop: Any,
        clock: Any = None,
        reseed: Any = None,
        split: Any = None,
    ) -> tuple[int, np.ndarray]:
        """The rollout's hot loop where :attr:`GymEnv._fused_steps` holds: what ``steps`` calls of
        :meth:`GymEnv._step_arrays` give, without a call, a dict and a named tuple per step.

        At step ``t``: ``root`` (the observation acted on) goes to ``slots[0][t]``; the action is
        ``actions[t]`` (checked and converted: :meth:`_env_action_steps`) or, with ``actions`` None,
        from ``out = act(torch.from_numpy(root))`` (``out`` appended to ``out_hist``, ``out["action"]``
        checked as :meth:`GymEnv._step_arrays` does); the next observation, the reward, terminated and
        truncated go to ``slots[1:][t]`` (time-first views of the batch). Stops early where
        ``stop.is_set()``. ``clock``: a ``SplitClock`` that gets the policy calls' time.
        ``reseed(root, done)``: the observations after the ended episodes are reset again, seeded
        (``group_size``; ``_episodes/_groups.py``). ``slots[0]`` None (one env, ``_rollout/_chain.py``):
        ``slots[1][t]`` is step ``t + 1``'s observation until an episode ends; ``split`` gives its slot.
        Returns (steps taken, the observation to act on next).
        """
        env_step, reset = self._env.step, self._env.reset
        leaf = self._policy_action()
        array, dtype = self._array, self._plain_obs_dtype
        assert dtype is not None  # _fused_steps
        from_numpy, count_nonzero = torch.from_numpy, np.count_nonzero
        perf = perf_counter if clock is not None else None
        policy_s = 0.0
        obs_slot, next_slot, reward_slot, terminated_slot, truncated_slot = slots
        vector, taken = self._vector, steps
        pending: Any = self._autoreset_pending
        try:
            for t in range(steps):
                if stop is not None and stop.is_set():
                    taken = t
                    break
                if obs_slot is not None:  # None: chained, root is next_slot[t - 1] already
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
                        if obs_slot is None and t + 1 < steps:
                            obs_slot = split(t + 1)
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

    def _run_pool_steps(
        self,
        steps: int,
        root: np.ndarray,
        act: Any,
        actions: list[Any] | None,
        slots: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        out_hist: list[Any],
        stop: Any,
        clock: Any = None,
    ) -> tuple[int, np.ndarray]:
        """:meth:`_run_gym_steps` for an EnvPool pool (sync mode, unwrapped): the pool resets ended envs
        itself at their next step, and each env fills its frames at its own pace (:class:`PoolFrames`):
        one call into the pool per step, the batch the same-step paths give."""
        frames = self._pool_frames
        if frames is None:
            shape = self.obs_specs["observation"].shape
            dtype = self._plain_obs_dtype
            assert dtype is not None  # _fused_steps
            frames = self._pool_frames = PoolFrames(self._num_envs, shape, dtype, self._policy_action())
        self._pool_fresh = False
        taken, root, pending = frames.run(self._env, steps, root, act, actions, slots, out_hist, stop, clock)
        if taken:
            self._autoreset_pending = pending
            self._last_obs = {"observation": root}
        return taken, root

    def _step_env_action(self, env_action: Any) -> ArrayStep:
        """:meth:`_step_arrays` of an action already checked and converted (:meth:`_env_action_steps`)."""
        obs, reward, terminated, truncated, info = self._env.step(env_action)
        if not self._vector:
            terminated = bool(terminated)
            truncated = bool(truncated)
            dtype = self._plain_obs_dtype
            nxt: dict[NestedKey, np.ndarray] = (
                {"observation": self._array(obs, dtype)}
                if dtype is not None
                else self._observation(obs, info)
            )
            if terminated or truncated:
                nxt = {k: v.copy() for k, v in nxt.items()}  # the reset may write into the env's buffer
                new_obs, reset_info = self._env.reset()
                root = self._observation(new_obs, reset_info)
                self._autoreset_pending = np.asarray(True)
            else:
                root = nxt
                self._autoreset_pending = None
            self._last_obs = root
            return _new_step(ArrayStep, (nxt, float(reward), terminated, truncated, root))
        terminated = np.asarray(terminated, dtype=bool)
        truncated = np.asarray(truncated, dtype=bool)
        done = terminated | truncated
        if self._pool:
            order = np.asarray(info["env_id"])
            if order.shape != (self._num_envs,) or (order != self._pool_ids).any():
                obs, reward, terminated, truncated, info, done = by_env_id(
                    order, obs, reward, terminated, truncated, info, done
                )
        if self._same_step:
            dtype = self._plain_obs_dtype
            root = (
                {"observation": self._array(obs, dtype)}
                if dtype is not None
                else self._observation(obs, info)
            )
            if np.count_nonzero(done):  # ~4x cheaper than done.any() on a few envs
                nxt = {k: v.copy() for k, v in root.items()}  # root keeps the reset observations
                final_mask = info.get("_final_obs", done)
                finals = info["final_obs"]
                if dtype is not None:  # one observation array: no flattening per sub-env
                    plain = nxt["observation"]
                    for i in np.nonzero(final_mask)[0]:  # np.flatnonzero costs 2-3x more
                        plain[i] = finals[i]
                else:
                    for i in np.nonzero(final_mask)[0]:
                        for key, value in flatten_obs(self._obs_space, finals[i]).items():
                            nxt[key][i] = value
                if self._info is not None:
                    self._final_info_entries(info, done, nxt, root)
                self._autoreset_pending = done
            else:
                nxt = root
                self._autoreset_pending = None
        else:
            nxt = self._observation(obs, info)
            if np.count_nonzero(done):
                # next-step (or disabled) autoreset: reset the ended sub-envs now, so that their reset
                # step never happens; ``nxt`` is copied first, the reset may write into its buffers
                nxt = {k: v.copy() for k, v in nxt.items()}  # may be the env's buffer (copy=False)
                root = self._merge_reset({k: v.copy() for k, v in nxt.items()}, done)
                self._autoreset_pending = done
            else:
                root = nxt
                self._autoreset_pending = None
        self._last_obs = root
        return _new_step(ArrayStep, (nxt, np.asarray(reward, dtype=np.float32), terminated, truncated, root))

    def _final_info_entries(
        self, info: Mapping[str, Any], done: np.ndarray, nxt: dict[NestedKey, Any], root: dict[NestedKey, Any]
    ) -> None:
        """Same-step autoreset: an ended sub-env's info holds its reset info, and ``final_info`` the
        step's. An entry not in ``final_info`` was added to the step's info by a vector wrapper (such
        as ``RecordEpisodeStatistics``): it belongs to the step, and the reset observation has none."""
        assert self._info is not None
        final = info.get("final_info", {})
        final_values = self._info.read(final)
        for key, in_final in self._info.present(final).items():
            from_final = done & in_final
            nxt[key][from_final] = final_values[key][from_final]
            from_step = done & ~in_final
            if from_step.any():
                root[key][from_step] = 0

    @property
    def _pool_ids(self) -> np.ndarray:
        return self._env.unwrapped.all_env_ids


def _as_arrays(value: Any) -> Any:
    """Tensors (a state back from a checkpoint) as numpy arrays; lists and dicts walked."""
    if isinstance(value, torch.Tensor):
        return value.numpy().copy()
    if isinstance(value, Mapping):
        return {k: _as_arrays(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_arrays(v) for v in value]
    return value


def _key(key: Any) -> NestedKey:
    return tuple(key) if isinstance(key, list) else key


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
