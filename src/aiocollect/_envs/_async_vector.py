"""``ThreadedAsyncVectorEnv``: a gymnasium ``VectorEnv`` behind the async vector env protocol, its calls in a
worker thread and its autoreset made same-step (by :class:`aiocollect.GymEnv`, which it wraps)."""

from __future__ import annotations

from typing import Any

import anyio
import gymnasium as gym
import numpy as np

from ._async import ThreadedCalls
from ._gym import GymEnv
from ._spaces import NestedKey, action_entries, nest_obs

__all__ = ["ThreadedAsyncVectorEnv"]


class ThreadedAsyncVectorEnv(ThreadedCalls):
    """A gymnasium ``VectorEnv`` (``SyncVectorEnv``, ``gym.make_vec``'s vectorised envs such as
    CartPole's, an EnvPool pool) behind :class:`AsyncVectorEnvProtocol`: each call runs in a worker
    thread, never on the event loop, and one env's calls never overlap.

    A vector env with next-step autoreset (gymnasium's default, EnvPool's) or none is made same-step as
    :class:`aiocollect.GymEnv` does it (ended sub-envs are reset with ``reset(options={"reset_mask":
    ...})`` right after the step): ``step`` gives the reset observations, and the final ones in
    ``info["final_obs"]`` (``info["_final_obs"]``: which sub-envs ended). ``info`` holds nothing else.
    Observations come in the dtypes of the space. :class:`aiocollect.AsyncEnvCollector` wraps a
    gymnasium vector env given by an env fn in this by itself.

    Args:
        env: a ``gymnasium.vector.VectorEnv``, or a callable returning one (called here).
        limiter: an ``anyio.CapacityLimiter`` bounding the threads of all the envs that share it;
            ``None`` (default): one thread for this env.

    Example:
        >>> import anyio, gymnasium, numpy as np
        >>> from aiocollect import ThreadedAsyncVectorEnv
        >>> async def main():
        ...     env = ThreadedAsyncVectorEnv(lambda: gymnasium.make_vec("CartPole-v1", num_envs=8))
        ...     obs, info = await env.reset(seed=0)
        ...     obs, reward, terminated, truncated, info = await env.step(np.zeros(8, np.int64))
        ...     await env.close()
        ...     print(env.num_envs, obs.shape, reward.shape)
        >>> anyio.run(main)
        8 (8, 4) (8,)
    """

    def __init__(self, env: Any, *, limiter: anyio.CapacityLimiter | None = None) -> None:
        super().__init__(limiter)
        if isinstance(env, type) or (not hasattr(env, "step") and callable(env)):
            env = env()  # a factory
        if not isinstance(env, gym.vector.VectorEnv):
            raise TypeError(
                "ThreadedAsyncVectorEnv needs a gymnasium.vector.VectorEnv (or a callable returning one), "
                f"e.g. gymnasium.make_vec('CartPole-v1', num_envs=64); got {env!r}"
            )
        self._gym = GymEnv(env)  # checks the autoreset mode; same-step stepping
        self.num_envs: int = int(env.num_envs)
        self.single_observation_space: gym.Space[Any] = env.single_observation_space
        self.single_action_space: gym.Space[Any] = env.single_action_space
        self._space = self.single_observation_space
        self._dict = isinstance(self._space, gym.spaces.Dict)
        self._act_dict = isinstance(self.single_action_space, (gym.spaces.Dict, gym.spaces.Tuple))

    @property
    def env(self) -> Any:
        """The wrapped gymnasium vector env (an EnvPool pool is made anew by a seeded reset)."""
        return self._gym.env

    # -- the protocol -----------------------------------------------------------------------------
    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset every sub-env (sub-env ``k`` seeded with ``seed + k``) in a worker thread; ``options``
        must be ``None`` (a partial reset happens only inside ``step``, by the autoreset)."""
        if options is not None:
            raise ValueError(
                f"ThreadedAsyncVectorEnv.reset takes no options (got {options!r}): it resets every sub-env, "
                "and ended sub-envs are reset inside step (same-step autoreset)"
            )
        return await self._call(self._reset, seed)

    async def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Step every sub-env with ``actions`` ``[num_envs, ...]`` in a worker thread (same-step
        autoreset: see the class)."""
        return await self._call(self._step, actions)

    async def close(self) -> None:
        """Close the vector env in a worker thread; idempotent."""
        await self._close(self._gym.close)

    def __repr__(self) -> str:
        return f"ThreadedAsyncVectorEnv({self._gym.env!r})"

    # -- in the worker thread ---------------------------------------------------------------------
    def _reset(self, seed: int | None) -> tuple[Any, dict[str, Any]]:
        if seed is not None:
            self._gym.set_seed(seed)  # sub-env k: seed + k
        root = self._gym._reset_arrays()
        return self._raw(root, slice(None)), {}

    def _step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        if self._act_dict:  # GymEnv takes a Dict/Tuple action as its entries
            actions = action_entries(self.single_action_space, actions)
        step = self._gym._step_arrays(actions)
        terminated, truncated = step.terminated, step.truncated
        done = terminated | truncated
        info: dict[str, Any] = {}
        if done.any():
            final = np.empty(self.num_envs, dtype=object)
            for k in np.flatnonzero(done).tolist():
                final[k] = self._raw(step.next_obs, k)
            info = {"final_obs": final, "_final_obs": done}
        return self._raw(step.root_obs, slice(None)), step.reward, terminated, truncated, info

    def _raw(self, flat: dict[NestedKey, np.ndarray], index: Any) -> Any:
        """GymEnv's ``{key: array}`` as gymnasium gives it (an array, or a nested dict for a Dict space),
        at ``index`` (a sub-env, or every one)."""
        if not self._dict:
            return flat["observation"][index]
        return nest_obs({key: value[index] for key, value in flat.items()})
