"""What ``AsyncEnvCollector``'s checkpoints read from and write into its engine: the envs' state once every
env waits for its action, the random states, and the checks a checkpoint's env state passes before
anything stops.

The envs of an ``AsyncEnvCollector`` step concurrently and run ahead of the batches delivered, so every
checkpoint call but a plain ``state_dict()`` *restarts the engine* (``Engine.successor``): the engine is
stopped, the frames collected ahead of the consumer are dropped, and a new engine over the same envs (and
policy) goes on from the new start: envs reset with a seed (``set_seed``, a resume without env state),
unseeded (``reset``), or from their saved state (``state_dict(envs=True)`` restarts from what it saved, so
that the run that saved and a run resumed from the checkpoint deliver the same frames). Every trajectory in
flight goes on under a fresh trajectory id at a restart (its frames collected ahead were dropped).

An env saves and restores its own state with its ``get_state()``/``set_state(state)`` (sync or async); for
the gymnasium envs the collector wraps, the state ``GymEnv`` saves. A restored env (:class:`FromState`)
gives the saved observation at its first ``reset`` instead of resetting.

Random states: a seeded collector's torch policy draws from the collector's own torch generator (swapped
in around each policy call, in the policy thread, as ``Collector`` does), and the random policy's (and a
worker's ``init_random_frames``) generators are saved with it.

Example:
    >>> import anyio, gymnasium as gym
    >>> from aiocollect import AsyncEnvCollector
    >>> async def main():
    ...     fns = [lambda: gym.make_vec("CartPole-v1", num_envs=2)]
    ...     async with AsyncEnvCollector(fns, frames_per_batch=8, total_frames=-1, seed=0) as c:
    ...         print(await c.set_seed(3))  # sub-envs reset with seeds 3 and 4
    ...         state = await c.state_dict()
    ...     print(state["frames"], sorted(state["rng"]))
    >>> anyio.run(main)
    4
    0 ['random_policy', 'rollout']
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .._core._resume import generator_state, set_generator_state, to_arrays, to_plain
from .._core._rng import RolloutRNG
from .._envs._async import ThreadedAsyncEnv
from .._envs._async_vector import ThreadedAsyncVectorEnv
from .._envs._gym_state import env_state as gym_env_state
from .._envs._gym_state import set_env_state as set_gym_env_state
from .._envs._spaces import nest_obs
from ._engine import Engine
from ._policy import BatchPolicy, RandomFirst
from ._run import LoopSteps

__all__ = ["CANNOT_LOAD", "CANNOT_SAVE", "capture", "load_random_states", "random_states", "state_methods_of"]


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
    return nest_obs(dict(zip(spec.obs_keys, values, strict=True))) if spec._dict else values[0]


#: why an env's state cannot be saved (``state_dict(envs=True)``) or loaded, and the fix
CANNOT_SAVE = (
    "state_dict(envs=True): the env {name} cannot save its state (it has no get_state()/set_state(state)); "
    "call state_dict() without envs: the envs then start from reset at a resume"
)
CANNOT_LOAD = (
    "the checkpoint holds env state, but the env {name} has no set_state(state); load it into a collector "
    "of the same envs, or drop 'env_state'"
)


def state_methods_of(engine: Engine, refusal: str) -> list[Any]:
    """Each env's ``(get_state, set_state)``; ``TypeError(refusal)`` (before anything waits) for an env
    without."""
    methods = [state_methods(env) for env in engine.envs]
    for env, pair in zip(engine.envs, methods, strict=True):
        if pair is None:
            raise TypeError(refusal.format(name=type(env).__name__))
    return methods


async def capture(engine: Engine, methods: list[Any]) -> tuple[list[Any], list[Any]] | None:
    """Once the collector is paused (no policy call starts), wait until every env waits for its action and
    read the observations each acts on next and the envs' own state (``methods``: each one's
    ``(get_state, set_state)``); ``None`` where the frame budget is collected (nothing is left to
    resume)."""
    steps = engine.stepper
    assert isinstance(steps, LoopSteps)  # a process env (the fused steps) saves no state
    engine.policy_signal.set()  # a policy task waiting for envs or room parks now
    while True:
        if engine.error is not None:
            raise engine.error
        if engine.collected():
            return None
        if engine.dropped:
            raise ValueError("state_dict(envs=True): an env was dropped meanwhile; save without envs")
        ready = len(steps.ready)
        if steps.parked and ready == engine.rows:
            break
        if steps.parked:
            steps.wake_at = ready + 1  # the next env ready wakes us
        await engine.policy_signal.wait()  # an env ready, a batch complete, an error, a drop
    spec = engine.spec
    obs = [
        raw_obs(spec, [slot[f : f + max(w, 1)] for slot in steps.stage], w)
        for f, w in zip(spec.firsts, spec.widths, strict=True)
    ]
    return obs, [to_plain(await maybe_await(pair[0]())) for pair in methods]


def random_states(rng: RolloutRNG, policy: BatchPolicy, engine: Engine) -> dict[str, Any]:
    """The random states a checkpoint saves (read in the policy thread)."""
    state = rng.state
    rngs: dict[str, Any] = {
        "rollout": None if state is None else state.clone(),
        "random_policy": generator_state(getattr(policy.policy, "generator", None)),
    }
    if isinstance(engine.policy, RandomFirst):  # a worker's init_random_frames
        rngs["random_first"] = {
            "left": engine.policy.left,
            "generator": generator_state(engine.policy.random.generator),
        }
    return rngs


def load_random_states(rng: RolloutRNG, policy: BatchPolicy, engine: Engine, rngs: Mapping[str, Any]) -> None:
    """:func:`random_states`' output loaded (in the policy thread)."""
    rng.state = None if rngs["rollout"] is None else rngs["rollout"].clone()
    set_generator_state(getattr(policy.policy, "generator", None), rngs["random_policy"])
    first = rngs.get("random_first")
    if first is not None and isinstance(engine.policy, RandomFirst):
        engine.policy.left = int(first["left"])
        set_generator_state(engine.policy.random.generator, first["generator"])
