"""The envs' own state in ``AsyncEnvCollector``'s checkpoints (``state_dict(envs=True)``): how an async env
saves and restores it (its own ``get_state()``/``set_state(state)``, sync or async, or for the gymnasium envs
the collector wraps the state ``GymEnv`` saves), its observation as staged, and an env restored from it.

Example:
    >>> import anyio, numpy as np
    >>> class Env:
    ...     async def reset(self, *, seed=None, options=None):
    ...         return np.zeros(1), {}
    >>> env = FromState(Env(), np.ones(1))
    >>> anyio.run(env.reset)[0], anyio.run(env.reset)[0]
    (array([1.]), array([0.]))
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .._core._resume import to_arrays
from .._envs._async import ThreadedAsyncEnv
from .._envs._async_vector import ThreadedAsyncVectorEnv
from .._envs._gym_state import env_state as gym_env_state
from .._envs._gym_state import set_env_state as set_gym_env_state

__all__ = ["FromState", "as_obs", "maybe_await", "raw_obs", "state_methods"]


class FromState:
    """An env restored from a checkpoint (or rebased on one): its first ``reset`` returns the saved
    observation without resetting it; everything else is the env's."""

    def __init__(self, env: Any, obs: Any) -> None:
        self._env = env
        self._obs = obs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    async def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        obs, self._obs = self._obs, None
        if obs is not None:
            return obs, {}
        return await self._env.reset(seed=seed, options=options)


async def maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def state_methods(env: Any) -> tuple[Callable[[], Any], Callable[[Any], Any]] | None:
    """An env's ``(get_state, set_state)`` (sync or async): its own, or for the gymnasium envs the
    collector wraps, the state ``GymEnv`` saves; ``None``: it cannot save its state."""
    get, put = getattr(env, "get_state", None), getattr(env, "set_state", None)
    if callable(get) and callable(put):
        return get, put
    if isinstance(env, ThreadedAsyncVectorEnv):
        return env._gym.get_state, env._gym.set_state
    if isinstance(env, ThreadedAsyncEnv):
        inner = env.env
        return (lambda: gym_env_state(inner)), (lambda s: set_gym_env_state(inner, to_arrays(s)))
    return None


def raw_obs(spec: Any, rows: list[np.ndarray], width: int) -> Any:
    """An env's observation as it gives it (one array, or a dict of them for a ``Dict`` space) from its
    staging rows (a single env's first row; a vector env's ``[width, ...]``)."""
    values = [r.copy() if width else r[0].copy() for r in rows]
    if not spec._dict:
        return values[0]
    out: dict[str, Any] = {}
    for key, value in zip(spec.obs_keys, values, strict=True):
        parts = (key,) if isinstance(key, str) else key
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def as_obs(value: Any) -> Any:
    """A saved observation (tensors, from a checkpoint) as numpy arrays, as an env gives them."""
    if isinstance(value, torch.Tensor):
        return value.numpy().copy()
    if isinstance(value, dict):
        return {k: as_obs(v) for k, v in value.items()}
    return value
