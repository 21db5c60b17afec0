"""Checkpoints, seeds and resets of ``AsyncEnvCollector``: ``state_dict``, ``load_state_dict``, ``set_seed``
and ``reset``.

The envs of an ``AsyncEnvCollector`` step concurrently and run ahead of the batches delivered, so each of
these calls (but a plain ``state_dict()``) *restarts the engine*: the engine's tasks are stopped, the
frames collected ahead of the consumer are dropped, and a new engine over the same envs (and policy) goes
on from the new start: envs reset with a seed (``set_seed``, a resume without env state), unseeded
(``reset``), or from their saved state (``state_dict(envs=True)`` restarts from what it saved, so that the
run that saved and a run resumed from the checkpoint deliver the same frames). Every trajectory in flight
goes on under a fresh trajectory id at a restart (its frames collected ahead were dropped).

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

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

import anyio
import numpy as np
import torch

from .._core._restart import derive_seed
from .._core._resume import derived_seed, generator_state, set_generator_state, to_plain
from .._core._rng import RolloutRNG
from .._core._validation import seed_arg
from .._envs._spaces import NestedKey
from .._episodes._assembler import TrajectoryAssembler
from .._policies._weights import as_weights, check_compatible, module_weights
from ._envstate import FromState, as_obs, maybe_await, raw_obs, state_methods
from ._policy import BatchPolicy
from ._run import Engine, EngineConfig, Signal
from ._worker_random import RandomFirst

__all__ = ["CheckpointMixin", "SeededPolicy"]


class SeededPolicy(BatchPolicy):
    """A :class:`BatchPolicy` whose torch calls draw from ``rng`` (the collector's own torch generator when
    it is seeded; see ``_core/_rng.py``)."""

    rng: RolloutRNG

    def _call_torch(self, obs: dict[NestedKey, torch.Tensor], n: int) -> dict[NestedKey, torch.Tensor]:
        return self.rng.run(lambda: BatchPolicy._call_torch(self, obs, n))


async def _first_of(*signals: Signal) -> None:
    """Until any of ``signals`` is set (from now: each one's event is made before anything can run)."""
    events = []
    for signal in signals:
        if signal._event is None:
            signal._event = anyio.Event()
        events.append(signal._event)
    async with anyio.create_task_group() as tg:

        async def wait(event: anyio.Event) -> None:
            await event.wait()
            tg.cancel_scope.cancel()

        for event in events:
            tg.start_soon(wait, event)


class CheckpointMixin:
    """``AsyncEnvCollector``'s ``set_seed``, ``reset``, ``state_dict`` and ``load_state_dict`` (see the
    module docstring)."""

    # what the collector provides (see AsyncEnvCollector)
    _engine: Engine | None
    _policy: BatchPolicy | None
    _rng: RolloutRNG
    _seed: int | None
    _episodes: TrajectoryAssembler | None
    _parked: bool
    _engine_kind: Any  # Engine, or FusedEngine over process envs
    _closed: bool
    _paused: int
    _unpaused: anyio.Event | None
    _lock: anyio.Lock
    _stats: Any
    _hub: Any
    _task_group: Any
    _target: Callable[[], int]
    _check_open: Callable[[], None]

    # -- the engine -------------------------------------------------------------------------------
    def _new_engine(
        self, envs: list[Any], spec: Any, policy: Any, config: EngineConfig, restarts: Any = None
    ) -> Engine:
        """An engine of the kind ``_on_enter`` chose over ``envs``; ``restarts``: their restart budgets."""
        return self._engine_kind(
            envs,
            spec,
            policy,
            config,
            hub=self._hub,
            is_paused=lambda: self._paused > 0,
            resumed=self._resumed,
            restarts=restarts,
        )

    async def _resumed(self) -> None:  # the policy task waits here while paused (no call is in flight)
        self._parked = True
        if self._engine is not None:
            self._engine.policy_signal.set()  # a capture waiting for the policy task to park
        try:
            event = self._unpaused
            if event is not None:
                await event.wait()
        finally:
            self._parked = False

    async def _restart_engine(
        self,
        seed: int | None,
        obs: list[Any] | None = None,
        frames: int | None = None,
        group_round: int | None = None,
    ) -> None:
        """Stop the engine (dropping what it collected ahead) and start a new one over the same envs: each
        env reset with ``seed + its env id`` (``None``: unseeded), or with ``obs`` (per env) as it is now,
        without a reset. Fresh trajectory ids; ``frames``: the budget left counts from there; seeded
        episodes go on from round ``group_round`` at least (a checkpoint's: ``RowEpisodes.go_on_from``)."""
        with anyio.CancelScope(shield=True):  # never left without an engine
            await self._restart_shielded(seed, obs, frames, group_round)

    async def _restart_shielded(self, seed: int | None, obs: Any, frames: int | None, at: int | None) -> None:
        old = self._engine
        assert old is not None
        assert self._task_group is not None
        await old.stop()
        if self._episodes is not None:  # trajectories in assembly went with the frames dropped
            self._episodes = self._episodes.emptied()
        done = self._stats.frames if frames is None else frames
        target = self._target()
        if 0 < target <= done:  # the budget is collected already: nothing more to run
            return
        config: EngineConfig = replace(old.config, seed=seed, target=target - done if target > 0 else -1)
        envs = list(old.envs)
        run = envs if obs is None else [FromState(env, o) for env, o in zip(envs, obs, strict=True)]
        new = self._new_engine(run, old.spec, old.policy, config, old.restarts)
        n = new.rows
        new.traj_ids[:] = np.arange(old.next_traj, old.next_traj + n)
        new.next_traj = old.next_traj + n
        new.version = old.version
        if new.episodes is not None and old.episodes is not None:  # rounds (group ids) none used before
            new.episodes.go_on_from(old.episodes, at)
        new.env_frames = old.env_frames
        self._engine = new
        await self._task_group.start(new.run)
        new.envs[:] = envs  # the tasks hold the restored ones; the collector's envs are the envs

    def _check_restartable(self, what: str, restarts: bool = True) -> Engine:
        self._check_open()
        engine = self._engine
        if engine is None:
            raise RuntimeError(f"{what} needs an entered collector: `async with AsyncEnvCollector(...) as c`")
        if engine.dropped and restarts:
            raise ValueError(
                f"{what}: the envs {sorted(engine.dropped)} were dropped (on_env_error='drop'), so the "
                "collector cannot restart its envs; make a new collector (and load the checkpoint into it)"
            )
        return engine

    async def _in_policy_thread(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` between two policy calls (in the policy thread; on the loop for an async policy)."""
        policy, engine = self._policy, self._engine
        assert policy is not None
        assert engine is not None
        if policy.is_async:
            return fn()
        async with engine.policy_lock:  # the policy thread's doorbell has one waiter at a time
            return await policy.in_thread(fn)

    async def _locked(self, what: str, fn: Callable[[Engine], Awaitable[Any]], restarts: bool = True) -> Any:
        self._check_restartable(what, restarts)
        async with self._lock:
            engine = self._check_restartable(what, restarts)
            if engine.error is not None:
                raise engine.error
            return await fn(engine)

    # -- seeds and resets -------------------------------------------------------------------------
    async def set_seed(self, seed: int) -> int:
        """Reset every env with ``seed + its env id`` (a vector env's sub-env ``k``: its first env id
        ``+ k``) and seed the policy's sampling; batches collected ahead are dropped and the trajectories
        start anew (fresh trajectory ids).

        Returns the last seed an env used (seed the next collector with ``returned + 1``).
        """
        seed = seed_arg(seed)
        if seed is None:
            raise TypeError("set_seed needs an int")

        async def apply(engine: Engine) -> int:
            await engine.stop()  # first: no policy call draws from the new seed before the restart
            self._seed = seed
            await self._in_policy_thread(lambda: self._rng.seed(seed))
            await self._restart_engine(seed)
            return seed + engine.rows - 1

        return int(await self._locked("set_seed", apply))

    async def reset(self) -> None:
        """Reset every env (unseeded: each goes on with its own generator): the next batch starts new
        episodes, with fresh trajectory ids; batches collected ahead are dropped. Groups (``group_size``)
        go on seeded from the ones before: the same in every run of a seeded collector."""

        async def apply(engine: Engine) -> None:
            episodes = engine.episodes
            await self._restart_engine(None if episodes is None else derive_seed(episodes.seeds.base_seed, 1))

        await self._locked("reset", apply)

    # -- checkpoints ------------------------------------------------------------------------------
    def _random_states(self, engine: Engine) -> dict[str, Any]:
        assert self._policy is not None
        state = self._rng.state
        rngs: dict[str, Any] = {
            "rollout": None if state is None else state.clone(),
            "random_policy": generator_state(getattr(self._policy.policy, "generator", None)),
        }
        if isinstance(engine.policy, RandomFirst):  # a worker's init_random_frames
            rngs["random_first"] = {
                "left": engine.policy.left,
                "generator": generator_state(engine.policy.random.generator),
            }
        return rngs

    def _load_random_states(self, engine: Engine, rngs: Mapping[str, Any]) -> None:
        assert self._policy is not None
        self._rng.state = None if rngs["rollout"] is None else rngs["rollout"].clone()
        set_generator_state(getattr(self._policy.policy, "generator", None), rngs["random_policy"])
        first = rngs.get("random_first")
        if first is not None and isinstance(engine.policy, RandomFirst):
            engine.policy.left = int(first["left"])
            set_generator_state(engine.policy.random.generator, first["generator"])

    async def state_dict(self, *, envs: bool = False) -> dict[str, Any]:
        """Counters (frames, batches, episodes delivered), the trajectory-id counter, the policy version
        and weights, and the random states (the policy's torch generator of a seeded collector, the random
        policy's); the frames collected ahead of the consumer are not in it.

        ``envs=True`` adds each env's own state (``get_state()``, see ``EnvProtocol``) and the observation
        it acts on next, taken once every env waits for its action; the collector then restarts from that
        state (the frames collected ahead are dropped, trajectories go on under fresh ids), as a
        collector resumed from the checkpoint does. An env without ``get_state()`` raises ``TypeError``.
        """
        read = lambda engine: self._read_state(engine, envs)  # noqa: E731
        return dict(await self._locked("state_dict", read, restarts=envs))

    async def _read_state(self, engine: Engine, envs: bool) -> dict[str, Any]:
        """:meth:`state_dict` under the batch lock; without ``envs``, any time between two engine events
        (``MultiAsyncEnvCollector``'s workers read it so, not after the batch being collected)."""
        rngs: list[Any] = []  # a capture reads them before it restarts the engine (which draws)
        saved = await self._capture(engine, rngs) if envs else None
        # a capture restarted the engine: its fresh ids are those a resume gives, from the old counter
        next_traj, engine = engine.next_traj, self._engine or engine
        state: dict[str, Any] = {
            "frames": self._stats.frames,
            "batches": self._stats.batches,
            "episodes": self._stats.episodes,
            "next_traj_id": next_traj,
            "policy_version": engine.version,
        }
        if engine.episodes is not None:  # seeded episodes: a resume's groups go on after these
            state["group_round"] = engine.episodes.next_round
        state["rng"] = rngs[0] if rngs else await self._in_policy_thread(lambda: self._random_states(engine))
        if envs:
            state["env_state"] = saved
        module = self._policy.module if self._policy is not None else None
        if module is not None:
            weights = module_weights(module)
            state["policy"] = await self._in_policy_thread(lambda: weights.detach().clone().to_dict())
        return state

    async def _capture(self, engine: Engine, rngs: list[Any]) -> dict[str, Any] | None:
        """The envs' state once each waits for its action (no policy call runs meanwhile; the random
        states then go into ``rngs``), then the engine restarted from it. ``None`` where the frame budget
        is collected (nothing is left to resume)."""
        if self._episodes is not None:
            raise ValueError(
                "state_dict(envs=True) with trajs_per_batch: the trajectories being assembled are not saved; "
                "save without envs (the envs then start from reset at a resume)"
            )
        methods = [state_methods(env) for env in engine.envs]
        for env, pair in zip(engine.envs, methods, strict=True):  # before anything waits: say so at once
            if pair is None:
                raise TypeError(
                    f"state_dict(envs=True): the env {type(env).__name__} cannot save its state (it has no "
                    "get_state()/set_state(state)); call state_dict() without envs: the envs then start from "
                    "reset at a resume"
                )
        self._paused += 1
        if self._unpaused is None:
            self._unpaused = anyio.Event()
        try:
            engine.policy_signal.set()  # a policy task waiting for envs or room parks now
            while True:
                if engine.error is not None:
                    raise engine.error
                if 0 < engine.config.target <= engine.completed:
                    return None
                if engine.dropped:
                    raise ValueError("state_dict(envs=True): an env was dropped meanwhile; save without envs")
                ready = len(engine._ready)
                if self._parked and ready == engine.rows:
                    break
                if self._parked:
                    engine._wake_at = ready + 1  # the next env ready wakes us
                await _first_of(engine.policy_signal, engine.consumer_signal)
            stage, firsts, widths = engine.stage, engine.spec.firsts, engine.spec.widths
            obs = [
                raw_obs(engine.spec, [slot[f : f + max(w, 1)] for slot in stage], w)
                for f, w in zip(firsts, widths, strict=True)
            ]
            states = [to_plain(await maybe_await(pair[0]())) for pair in methods if pair is not None]
            rngs.append(await self._in_policy_thread(lambda: self._random_states(engine)))
            await self._restart_engine(None, obs)  # from the state saved, as a resumed collector
            return {"envs": states, "obs": [to_plain(o) for o in obs]}
        finally:
            self._paused -= 1
            if not self._paused and self._unpaused is not None:
                self._unpaused.set()
                self._unpaused = None

    async def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output into a collector made with the same arguments (and entered):
        the counters (the frame budget goes on from the saved count), trajectory ids, policy version and
        weights, random states, and the envs: from their saved state (``envs=True``), else reset (a
        seeded collector's with a seed derived from the checkpoint: two resumes from one checkpoint
        collect alike)."""
        missing = {"frames", "batches", "next_traj_id", "policy_version"} - set(state)
        if missing:
            raise KeyError(f"state dict lacks {sorted(missing)}")

        async def apply(engine: Engine) -> None:
            saved = state.get("env_state")
            if saved is not None and len(saved["envs"]) != len(engine.envs):
                raise ValueError(
                    f"the checkpoint holds the state of {len(saved['envs'])} envs, the collector has "
                    f"{len(engine.envs)}: load it into a collector made with the same env fns"
                )
            methods = [] if saved is None else [state_methods(env) for env in engine.envs]
            for env, pair in zip(engine.envs, methods, strict=False):  # what fails, before anything stops
                if pair is None:
                    raise TypeError(
                        f"the checkpoint holds env state, but the env {type(env).__name__} has no "
                        "set_state(state); load it into a collector of the same envs, or drop 'env_state'"
                    )
            module = None if self._policy is None else self._policy.module
            if "policy" in state and module is not None:
                check_compatible(module_weights(module), as_weights(state["policy"]))
            await engine.stop()  # no policy call in flight from here on
            try:
                await self._load_stopped(engine, state, methods)
            except BaseException:  # the collector goes on, from reset
                await self._restart_engine(None)
                raise

        await self._locked("load_state_dict", apply)

    async def _load_stopped(self, engine: Engine, state: Mapping[str, Any], methods: list[Any]) -> None:
        """:meth:`load_state_dict` once the engine is stopped (``methods``: each env's state methods)."""
        saved = state.get("env_state")
        if "policy" in state and self._policy is not None and self._policy.module is not None:
            await self._policy.load_weights(state["policy"])
        frames = int(state["frames"])
        rngs = state.get("rng")
        if rngs is not None:
            await self._in_policy_thread(lambda: self._load_random_states(engine, rngs))
        engine.next_traj = int(state["next_traj_id"])
        engine.version = int(state["policy_version"])
        self._stats.load(frames, int(state["batches"]), int(state.get("episodes", 0)))
        if saved is None:
            rollout = None if rngs is None else rngs["rollout"]
            seed = None if rollout is None else derived_seed(rollout, frames)
            await self._restart_engine(seed, frames=frames, group_round=state.get("group_round"))
            return
        for pair, env_state in zip(methods, saved["envs"], strict=True):
            await maybe_await(pair[1](env_state))
        await self._restart_engine(None, [as_obs(o) for o in saved["obs"]], frames=frames)
