"""What ``GymEnv(env, num_envs=..., **make_kwargs)`` wraps: a gymnasium env or vector env from an id, an
``Env`` or a ``VectorEnv`` (EnvPool pools recognised without importing envpool)."""

from __future__ import annotations

import sys
from typing import Any

import gymnasium as gym
from gymnasium.vector import AutoresetMode

__all__ = ["is_envpool", "open_gym_env"]


def is_envpool(env: Any) -> bool:
    """Whether ``env`` is an EnvPool pool (without importing envpool)."""
    module = sys.modules.get("envpool.python.envpool")
    mixin = getattr(module, "EnvPoolMixin", None) if module is not None else None
    return mixin is not None and isinstance(env, mixin)


def open_gym_env(env: Any, num_envs: int | None, make_kwargs: dict[str, Any]) -> tuple[Any, bool]:
    """The gymnasium env that ``GymEnv(env, num_envs=..., **make_kwargs)`` wraps, and whether it is a
    vector env."""
    if isinstance(env, str):
        if num_envs is None:
            return gym.make(env, **make_kwargs), False
        vector_kwargs = dict(make_kwargs.pop("vector_kwargs", {}) or {})
        vector_kwargs["autoreset_mode"] = AutoresetMode.SAME_STEP
        vec = gym.make_vec(
            env,
            num_envs=num_envs,
            vectorization_mode=make_kwargs.pop("vectorization_mode", "sync"),
            vector_kwargs=vector_kwargs,
            **make_kwargs,
        )
        return vec, True
    if isinstance(env, gym.vector.VectorEnv):
        if num_envs is not None and num_envs != env.num_envs:
            raise ValueError(f"num_envs={num_envs} but the vector env has {env.num_envs} envs")
        if make_kwargs:
            raise TypeError(f"make kwargs {sorted(make_kwargs)} only apply to an env id")
        return env, True
    if isinstance(env, gym.Env):
        if is_envpool(env):  # EnvPool before 1.0: a batch of envs that is no gymnasium VectorEnv
            raise TypeError(
                "this EnvPool pool is not a gymnasium.vector.VectorEnv (EnvPool < 1.0): install "
                "envpool>=1.2 (pip install 'aiocollect[envpool]')"
            )
        if num_envs is not None:
            raise ValueError(
                "num_envs needs an env id (GymEnv('CartPole-v1', num_envs=8)); an Env instance cannot "
                "be replicated"
            )
        if make_kwargs:
            raise TypeError(f"make kwargs {sorted(make_kwargs)} only apply to an env id")
        return env, False
    raise TypeError(
        f"env must be a gymnasium id, a gymnasium.Env or a gymnasium.vector.VectorEnv, got {env!r}"
    )
