"""The async env protocols (envs whose ``reset``/``step`` are coroutines: one env, or a vector of ``N``
sub-envs stepped together) and ``ThreadedAsyncEnv``, which puts a gymnasium env behind the first by running
its calls in a worker thread."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import anyio
import anyio.to_thread

if TYPE_CHECKING:
    from gymnasium import spaces

__all__ = [
    "AsyncEnvProtocol",
    "AsyncVectorEnvProtocol",
    "ThreadedAsyncEnv",
    "ThreadedCalls",
    "is_async_vector_env",
]


@runtime_checkable
class AsyncEnvProtocol(Protocol):
    """An environment whose ``reset`` and ``step`` are coroutines, for envs that wait on I/O (a simulator
    behind a socket, a browser, an HTTP API): thousands of them are stepped concurrently on one event loop
    by :class:`aiocollect.AsyncEnvCollector`.

    The values are gymnasium's (numpy arrays or python scalars), for **one** env:

    * ``observation_space`` / ``action_space``: gymnasium spaces (those :class:`EnvProtocol` supports).
    * ``async reset(*, seed=None, options=None) -> (obs, info)``.
    * ``async step(action) -> (obs, reward, terminated, truncated, info)``; the collector resets the env
      after ``terminated or truncated`` (no autoreset inside the env).
    * ``async close() -> None``.

    ``step`` must not block the event loop: await I/O, or run CPU work in a thread
    (:class:`ThreadedAsyncEnv` does that for a whole gymnasium env).

    Example:
        >>> import numpy as np, anyio
        >>> from gymnasium import spaces
        >>> from aiocollect import AsyncEnvProtocol
        >>> class Echo:
        ...     observation_space = spaces.Box(-1, 1, (1,), np.float32)
        ...     action_space = spaces.Discrete(2)
        ...     async def reset(self, *, seed=None, options=None):
        ...         return np.zeros(1, np.float32), {}
        ...     async def step(self, action):
        ...         await anyio.sleep(0)  # a network call, say
        ...         return np.full(1, action, np.float32), 1.0, False, False, {}
        ...     async def close(self):
        ...         pass
        >>> isinstance(Echo(), AsyncEnvProtocol)
        True
    """

    observation_space: spaces.Space[Any]
    action_space: spaces.Space[Any]

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]: ...

    async def step(self, action: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]: ...

    async def close(self) -> None: ...


@runtime_checkable
class AsyncVectorEnvProtocol(Protocol):
    """A vector of ``num_envs`` sub-envs stepped together by coroutines: one ``await`` steps them all
    (a GPU simulator, a game server that steps many envs per message, an env pool on another machine).
    :class:`aiocollect.AsyncEnvCollector` gives each sub-env an env id of its own and runs one task per
    vector env.

    The values are gymnasium ``VectorEnv``'s, with **same-step** autoreset:

    * ``num_envs``: the number ``N`` of sub-envs (an ``int``).
    * ``single_observation_space`` / ``single_action_space``: one sub-env's gymnasium spaces.
    * ``async reset(*, seed=None, options=None) -> (obs, info)``: ``obs`` is an array ``[N, *shape]`` (a
      dict of such arrays for a ``Dict`` space); ``seed=s`` seeds sub-env ``k`` with ``s + k``.
    * ``async step(actions) -> (obs, reward, terminated, truncated, info)``: ``actions`` is ``[N,
      *action_shape]`` (a dict or tuple of such arrays for a ``Dict`` or ``Tuple`` action space);
      ``reward`` is float ``[N]``, ``terminated``/``truncated`` bool ``[N]``. A sub-env ``k`` whose episode
      ended in this step is already reset: ``obs[k]`` is the first observation of its next episode, and
      the final one is ``info["final_obs"][k]`` (``info["_final_obs"]``, the bool mask ``[N]``, says which;
      gymnasium 1.x's ``AutoresetMode.SAME_STEP``).
    * ``async close() -> None``.

    Recognised by its coroutine ``reset`` and ``step``, an int ``num_envs`` and a
    ``single_observation_space``. A sub-env cannot be reset on its own, so ``max_frames_per_traj`` is
    refused with vector envs. :class:`aiocollect.ThreadedAsyncVectorEnv` puts a gymnasium ``VectorEnv``
    behind this protocol.

    Example:
        >>> import numpy as np, anyio
        >>> from gymnasium import spaces
        >>> from aiocollect import AsyncVectorEnvProtocol
        >>> class Echoes:
        ...     num_envs = 4
        ...     single_observation_space = spaces.Box(-1, 1, (1,), np.float32)
        ...     single_action_space = spaces.Discrete(2)
        ...     async def reset(self, *, seed=None, options=None):
        ...         return np.zeros((4, 1), np.float32), {}
        ...     async def step(self, actions):
        ...         await anyio.sleep(0)  # one network call for the 4 sub-envs
        ...         obs = actions.reshape(4, 1).astype(np.float32)
        ...         return obs, np.ones(4), np.zeros(4, bool), np.zeros(4, bool), {}
        ...     async def close(self):
        ...         pass
        >>> isinstance(Echoes(), AsyncVectorEnvProtocol)
        True
    """

    num_envs: int
    single_observation_space: spaces.Space[Any]
    single_action_space: spaces.Space[Any]

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]: ...

    async def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]: ...

    async def close(self) -> None: ...


def is_async_vector_env(env: Any) -> bool:
    """Whether ``env`` is an async vector env: coroutine ``reset``/``step``, an int ``num_envs`` and a
    ``single_observation_space`` (see :class:`AsyncVectorEnvProtocol`)."""
    num = getattr(env, "num_envs", None)
    return (
        isinstance(num, int)
        and not isinstance(num, bool)
        and hasattr(env, "single_observation_space")
        and inspect.iscoroutinefunction(getattr(env, "step", None))
        and inspect.iscoroutinefunction(getattr(env, "reset", None))
    )


class ThreadedCalls:
    """The thread plumbing of the threaded async envs: each call in a worker thread (``anyio.to_thread``),
    one env's calls never overlapping, bounded by a shared ``limiter`` or one thread of the env's own."""

    def __init__(self, limiter: anyio.CapacityLimiter | None) -> None:
        if limiter is not None and not isinstance(limiter, anyio.CapacityLimiter):
            raise TypeError(f"limiter must be an anyio.CapacityLimiter or None, got {limiter!r}")
        self._shared = limiter
        self._own: anyio.CapacityLimiter | None = None  # made on the loop, at the first call
        self._closed = False

    def _limiter(self) -> anyio.CapacityLimiter:
        if self._shared is not None:
            return self._shared
        if self._own is None:
            self._own = anyio.CapacityLimiter(1)
        return self._own

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        # one env's calls never overlap: the collector awaits each one before the next, and a shared
        # limiter bounds threads across envs; a cancelled caller waits for the call (gymnasium envs are
        # not safe to call from two threads at once)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter(), abandon_on_cancel=False)

    async def _close(self, close: Callable[[], Any]) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self._call(close)


class ThreadedAsyncEnv(ThreadedCalls):
    """A gymnasium env behind :class:`AsyncEnvProtocol`: each call runs in a worker thread
    (``anyio.to_thread``), never on the event loop; the calls of one env never overlap.

    Args:
        env: a ``gymnasium.Env``, or a callable returning one (called here, at construction).
        limiter: an ``anyio.CapacityLimiter`` bounding the threads of all the envs that share it (e.g.
            ``anyio.CapacityLimiter(16)`` for many envs); ``None`` (default): one thread for this env.

    Use it to mix ordinary (CPU) envs with async ones in :class:`aiocollect.AsyncEnvCollector`, which
    wraps gymnasium envs given to it this way by itself. Many CPU-bound envs are faster in
    :class:`aiocollect.Collector` with a vector env: a thread hop per step costs ~100 µs.

    Example:
        >>> import anyio, gymnasium
        >>> from aiocollect import ThreadedAsyncEnv
        >>> async def main():
        ...     env = ThreadedAsyncEnv(lambda: gymnasium.make("CartPole-v1"))
        ...     obs, info = await env.reset(seed=0)
        ...     obs, reward, terminated, truncated, info = await env.step(0)
        ...     await env.close()
        ...     print(obs.shape, reward)
        >>> anyio.run(main)
        (4,) 1.0
    """

    def __init__(self, env: Any, *, limiter: anyio.CapacityLimiter | None = None) -> None:
        super().__init__(limiter)
        if isinstance(env, type) or (not hasattr(env, "step") and callable(env)):
            env = env()  # a factory (a class too)
        for member in ("reset", "step", "observation_space", "action_space"):
            if not hasattr(env, member):
                raise TypeError(
                    f"ThreadedAsyncEnv needs a gymnasium env (or a callable returning one): {env!r} has "
                    f"no {member!r}"
                )
        self.env: Any = env
        self.observation_space = env.observation_space
        self.action_space = env.action_space

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """``env.reset(seed=seed, options=options)`` in a worker thread."""
        return await self._call(lambda: self.env.reset(seed=seed, options=options))

    async def step(self, action: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """``env.step(action)`` in a worker thread."""
        return await self._call(self.env.step, action)

    async def close(self) -> None:
        """``env.close()`` in a worker thread; idempotent."""
        await self._close(self.env.close)

    def __repr__(self) -> str:
        return f"ThreadedAsyncEnv({self.env!r})"
