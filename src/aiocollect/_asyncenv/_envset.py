"""The envs of ``AsyncEnvCollector``: building them from ``env_fns`` (gymnasium envs wrapped in
``ThreadedAsyncEnv``, gymnasium vector envs in ``ThreadedAsyncVectorEnv``), checking that they agree, giving
each (sub-)env its row (its env id), and turning their values into arrays: a vector env's step as blocks of
rows, checked (its protocol's autoreset is same-step: an ended sub-env's next observation in the frame is
``info["final_obs"][k]``, its observation for the next step the reset one, ``obs[k]``)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import gymnasium as gym
import numpy as np
from gymnasium import spaces

from .._envs._async import ThreadedAsyncEnv, is_async_vector_env
from .._envs._async_vector import ThreadedAsyncVectorEnv
from .._envs._gym import GymEnv
from .._envs._multiagent._base import GroupedEnv
from .._envs._spaces import LeafSpec, NestedKey, action_specs, flatten_obs, observation_specs

__all__ = ["EnvSet", "close_once", "env_fns_arg", "open_env", "open_envs", "spaces_of", "vector_width"]


def _is_async_env(env: Any) -> bool:
    return inspect.iscoroutinefunction(getattr(env, "step", None)) and inspect.iscoroutinefunction(
        getattr(env, "reset", None)
    )


def env_fns_arg(env_fns: Any) -> list[Any]:
    """``env_fns``: a non-empty sequence of callables returning an env (or of envs)."""
    if isinstance(env_fns, (str, bytes)) or not isinstance(env_fns, Sequence) or not env_fns:
        raise TypeError(
            "env_fns must be a non-empty list of callables, each returning an async env (AsyncEnvProtocol) "
            f"or a gymnasium env, e.g. [lambda: MyEnv() for _ in range(100)]; got {env_fns!r}"
        )
    for i, fn in enumerate(env_fns):
        if not callable(fn) and not hasattr(fn, "step"):
            raise TypeError(f"env_fns[{i}] must be a callable returning an env, or an env; got {fn!r}")
    return list(env_fns)


def open_env(fn: Any, i: int, limiter: Any) -> Any:
    """Env ``i`` built from its env fn ``fn`` (at the start, or again at a restart); a gymnasium env wrapped
    in a thread of ``limiter``."""
    env = fn if hasattr(fn, "step") and not isinstance(fn, type) else fn()
    if is_async_vector_env(env):
        if env.num_envs < 1 or not hasattr(env, "single_action_space") or not hasattr(env, "close"):
            raise TypeError(
                f"env_fns[{i}] gave {env!r}, an async vector env without num_envs >= 1, "
                "single_action_space or close (AsyncVectorEnvProtocol)"
            )
        return env
    if isinstance(env, gym.vector.VectorEnv):  # its calls run in a worker thread, same-step autoreset
        try:
            return ThreadedAsyncVectorEnv(env, limiter=limiter)
        except BaseException:
            env.close()
            raise
    if _is_async_env(env):
        for member in ("observation_space", "action_space", "close"):
            if not hasattr(env, member):
                raise TypeError(
                    f"env_fns[{i}] gave {env!r}, an async env without {member!r} (AsyncEnvProtocol)"
                )
        return env
    if isinstance(env, GroupedEnv):  # reset(td)/step(td) of the env protocol, agent groups
        env.close()
        raise TypeError(
            f"env_fns[{i}] gave {env!r}, a multi-agent env of the env protocol (PettingZooEnv, VmasEnv): "
            "AsyncEnvCollector steps async and gymnasium envs; collect it with Collector, MultiSyncCollector "
            "or MultiAsyncCollector"
        )
    if isinstance(env, GymEnv):  # its reset/step speak TensorDicts, not gymnasium's API
        env.close()
        raise TypeError(
            f"env_fns[{i}] gave {env!r}, a GymEnv: AsyncEnvCollector steps gymnasium envs (and async ones) "
            "itself; return the gymnasium env instead (gymnasium.make(...) or gymnasium.make_vec(...)), or "
            "collect the GymEnv with Collector, MultiSyncCollector or MultiAsyncCollector"
        )
    if all(hasattr(env, m) for m in ("step", "reset", "observation_space", "action_space")):
        return ThreadedAsyncEnv(env, limiter=limiter)  # a gymnasium env: its calls run in worker threads
    raise TypeError(
        f"env_fns[{i}] gave {env!r}: neither an async env (AsyncEnvProtocol: coroutines reset/step/close, "
        "observation_space, action_space), nor an async vector env (AsyncVectorEnvProtocol), nor a gymnasium "
        "env or vector env"
    )


def open_envs(env_fns: list[Any], into: list[Any], limiter: Any) -> None:
    """Build every env into ``into`` (which holds the envs built so far if one fails, to be closed); the
    gymnasium envs among them share the threads of ``limiter``."""
    for i, fn in enumerate(env_fns):
        into.append(open_env(fn, i, limiter))


async def close_once(envs: list[Any], closed: set[int], i: int) -> None:
    """Close ``envs[i]`` unless ``i`` is in ``closed`` (then add it), shielded, within 10 s; an error closing
    it is dropped (it failed, or the collector is ending)."""
    if i in closed:
        return
    closed.add(i)
    with anyio.CancelScope(shield=True), anyio.move_on_after(10):
        try:
            await envs[i].close()
        except Exception:  # closing is best effort: the env's own error was reported
            pass


def vector_width(env: Any) -> int:
    """The number of sub-envs of an async vector env; 0 for a single async env."""
    return int(env.num_envs) if is_async_vector_env(env) else 0


def spaces_of(env: Any) -> tuple[spaces.Space[Any], spaces.Space[Any]]:
    """An env's (one sub-env's, for a vector env) observation and action spaces."""
    if is_async_vector_env(env):
        return env.single_observation_space, env.single_action_space
    return env.observation_space, env.action_space


class EnvSet:
    """What the collector needs to know of its envs' spaces, checked to be the same for all of them, and
    where each env's rows are: env ``i`` has ``widths[i]`` sub-envs (0: a single env, one row) from row
    ``firsts[i]`` on; a row is a (sub-)env id."""

    def __init__(self, envs: list[Any]) -> None:
        self.observation_space: spaces.Space[Any]
        self.action_space: spaces.Space[Any]
        self.observation_space, self.action_space = spaces_of(envs[0])
        for i, env in enumerate(envs[1:], 1):
            obs_space, act_space = spaces_of(env)
            if obs_space != self.observation_space or act_space != self.action_space:
                raise ValueError(
                    f"env_fns[{i}] has the spaces {obs_space}, {act_space}, and env_fns[0] "
                    f"{self.observation_space}, {self.action_space} (a vector env's: one sub-env's, "
                    "single_observation_space and single_action_space): every env of a collector needs "
                    "the same spaces (collect different envs with different collectors)"
                )
        self.widths = [vector_width(env) for env in envs]
        self.firsts: list[int] = []
        rows = 0
        for width in self.widths:
            self.firsts.append(rows)
            rows += max(width, 1)
        #: the number of (sub-)envs: rows of the staging arrays, env ids
        self.rows = rows
        self.has_vector = any(self.widths)
        self.has_single = not all(self.widths)
        self.obs_specs: dict[NestedKey, LeafSpec] = observation_specs(self.observation_space)
        action_specs(self.action_space)  # raises on an unsupported action space
        self.obs_keys = list(self.obs_specs)
        self._dtypes = [spec.numpy_dtype for spec in self.obs_specs.values()]
        self._dict = isinstance(self.observation_space, spaces.Dict)

    def arrays(self, obs: Any) -> list[np.ndarray]:
        """A raw observation as one array per key (in ``obs_keys`` order)."""
        if not self._dict:
            return [obs]
        flat = flatten_obs(self.observation_space, obs)
        return [flat[key] for key in self.obs_keys]

    def blocks(self, obs: Any, width: int) -> list[np.ndarray]:
        """A vector env's observation as one array ``[width, ...]`` per key, its shapes checked."""
        blocks = [np.asarray(value) for value in self.arrays(obs)]
        for (key, leaf), block in zip(self.obs_specs.items(), blocks, strict=True):
            if block.shape != (width, *leaf.shape):
                raise ValueError(
                    f"an async vector env of {width} sub-envs gave the observation {key!r} of shape "
                    f"{block.shape}; it must be {(width, *leaf.shape)} (num_envs first)"
                )
        return blocks

    def final_obs(self, blocks: list[np.ndarray], done: np.ndarray, info: Any) -> list[np.ndarray]:
        """The next observations of a vector step: the reset ones in ``blocks``, where a sub-env ended its
        final one from ``info["final_obs"]`` (same-step autoreset)."""
        finals = info.get("final_obs") if isinstance(info, Mapping) else None
        ended = done.nonzero()[0].tolist()
        if finals is None or len(finals) != len(done) or any(finals[k] is None for k in ended):
            raise ValueError(
                f"an async vector env's sub-envs {ended} ended without info['final_obs'][k]: the async "
                "vector env protocol resets ended sub-envs in the same step and gives their final "
                "observations in info['final_obs'] (gymnasium's AutoresetMode.SAME_STEP)"
            )
        nxt = [block.copy() for block in blocks]
        for k in ended:
            for slot, value in zip(nxt, self.arrays(finals[k]), strict=True):
                slot[k] = value
        return nxt

    @staticmethod
    def column(value: Any, dtype: Any, width: int, what: str) -> np.ndarray:
        """A vector step's ``reward``, ``terminated`` or ``truncated`` as an array ``(width,)``, checked."""
        array = np.asarray(value, dtype=dtype)
        if array.shape != (width,):
            raise ValueError(
                f"an async vector env of {width} sub-envs gave {what} of shape {array.shape}; it must be "
                f"({width},)"
            )
        return array

    def staging(self, n: int) -> list[np.ndarray]:
        """Arrays ``[n, ...]`` holding each env's current observation, per key."""
        return [
            np.zeros((n, *spec.shape), dtype)
            for spec, dtype in zip(self.obs_specs.values(), self._dtypes, strict=True)
        ]
