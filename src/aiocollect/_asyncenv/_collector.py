"""``AsyncEnvCollector``: many async envs stepped concurrently on the collector's event loop, the policy
called on batches of the envs that are ready (central inference, as in SEED RL)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from math import ceil
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import torch
from tensordict import TensorDictBase
from tensordict.nn import InteractionType

from .._envs._async import AsyncVectorEnvProtocol
from .._episodes import TrajectoryAssembler
from .._episodes_args import async_chunk, check_async_envs, episode_args, trajs_per_batch_arg
from .._events import WeightsLoaded, WeightsPublished, WorkerFailed, WorkerStarted, WorkerStopped
from .._gcfreeze import GcHold
from .._local._base import CollectorBase
from .._mistakes import explicit_keywords, warn_user
from .._restart import RestartPolicy
from .._rng import RolloutRNG
from .._stats import CollectorStatistics, WorkerStatistics
from .._trajectories import split_trajectories
from .._validation import (
    exploration_type_arg,
    flag,
    frames_per_batch_arg,
    non_negative_int,
    optional_callable,
    optional_positive_int,
    policy_arg,
    replay_buffer_arg,
    seed_arg,
    total_frames_arg,
)
from ._args import engine_kind, fused_arg, max_wait_arg, on_env_error_arg
from ._checkpoint import CheckpointMixin, SeededPolicy
from ._envset import EnvSet, env_fns_arg, open_envs
from ._fused import FusedEngine
from ._policy import BatchPolicy, is_async_policy
from ._restarts import env_restarts, restart_arg
from ._run import Engine, EngineConfig

__all__ = ["ENV_THREADS", "AsyncEnvCollector"]

#: worker threads shared by the gymnasium envs an ``AsyncEnvCollector`` wraps in ``ThreadedAsyncEnv``
ENV_THREADS = 32


class AsyncEnvCollector(CheckpointMixin, CollectorBase):
    """Step many async envs concurrently on the event loop and batch the policy over the envs that are
    ready; ``async for batch in collector`` gives flat ``[frames]`` batches.

    Each env runs in a task of the collector's task group; a ready env waits for the policy, which is
    called once ``min_batch`` envs wait or the oldest has waited ``max_wait`` seconds. A torch policy
    runs in the collector's own thread (never on the loop), an async policy is awaited. Envs progress at
    their own rates, so a batch interleaves them: ``("collector", "env_id")`` says which env a frame is
    from and ``("collector", "traj_ids")`` which trajectory (unique over the collector's life); frames of
    one env are in time order. A frame is written when its step returns, so a slow env never holds a
    batch back; at most ``(1 + prefetch) * frames_per_batch`` frames are collected or in flight ahead of
    ``async for`` (then the envs wait). Everything the collector starts ends with ``async with``.

    Args:
        env_fns: callables (one per env) returning an async env (:class:`AsyncEnvProtocol`), an async
            vector env (:class:`AsyncVectorEnvProtocol`: ``N`` sub-envs stepped together, ``N``
            consecutive env ids, one task), a gymnasium env (wrapped in :class:`ThreadedAsyncEnv`) or a
            gymnasium vector env (wrapped in :class:`ThreadedAsyncVectorEnv`), the gymnasium ones sharing
            32 worker threads; called when the collector is entered, in a worker thread (an env given
            itself is used as it is, e.g. ``ProcessVectorEnv.split()``'s parts). Every env (every sub-env)
            must have the same spaces.
        policy: a ``TensorDictModule``, an ``nn.Module`` (called on the observations, returns the action;
            copied: the collector runs its own weights, changed by :meth:`update_weights`), a callable
            ``td -> td`` (these three run in the collector's thread), an async policy (an ``async def``
            callable ``td -> td``, awaited on the loop), or ``None`` for random actions.
        frames_per_batch: frames in each batch.
        total_frames: frames to collect (rounded up to whole batches); ``-1`` (default): endless.
        trajs_per_batch: instead of ``frames_per_batch``, batches of this many whole trajectories, in
            the order they started (see :class:`Collector`).
        group_size: with ``trajs_per_batch``, episodes in groups of envs that start from the same
            initial state, delivered whole (see :class:`Collector`); single async envs only.
        on_update: with ``trajs_per_batch``: ``"continue"`` (default: episodes go on with the new
            weights) or ``"restart"``: the episodes in flight at :meth:`update_weights` are discarded
            and started again from their initial state (docs/episodes.md).
        min_batch: envs waiting that start a policy call (default: half of the envs), counted in
            sub-envs (a vector env's sub-envs are never split across policy calls).
        max_wait: seconds the oldest waiting env waits before a policy call on fewer than ``min_batch``
            envs (default 0.002).
        max_frames_per_traj: truncate episodes after this many steps (``("next", "truncated")`` set);
            refused with vector envs (``ValueError`` on entering), which cannot reset a sub-env on request.
        split_trajs: deliver the batch as zero-padded trajectories ``[n_traj, max_len]`` with a mask.
        exploration_type: the ``tensordict.nn`` interaction type for torch policies (default ``"random"``).
        seed: env ``i`` is first reset with ``seed + i`` (a vector env whose first sub-env is env ``i``:
            ``reset(seed=seed + i)``, sub-env ``k`` seeded with ``seed + i + k``).
        track_policy_version: write ``("collector", "policy_version")``: the version each frame's action
            was computed with.
        on_env_error: ``"raise"`` (default): an env's error ends the collector and is raised from
            ``async for`` with its type and traceback; ``"drop"``: that env is closed and dropped, a
            :class:`WorkerFailed` event (``worker_id`` = the env index; a vector env's: one per sub-env) is
            published and the others go on (the failed step is no frame; when every env is dropped,
            ``RuntimeError``).
        restart: a :class:`RestartPolicy`: an env (a vector env: all its sub-envs) that raises is closed,
            rebuilt from its env fn after the backoff, and reset; its trajectories end, the others go on
            (docs/faults.md). Past an env's budget, ``on_env_error`` decides. ``None``: no restarts.
        prefetch: batches collected ahead of ``async for`` (default 1); then the envs wait.
        postproc: a callable applied to each batch.
        replay_buffer: anything with ``extend(batch)`` (called in a worker thread); see :meth:`fill`.
        progress: a progress bar (see :class:`Collector`).
        freeze_gc: while the collector runs, leave the objects that exist when it starts (modules, the
            policy, the envs) out of the garbage collector's full scans (``gc.freeze()``, undone when the
            last such collector closes; nothing is done in a process that froze by itself). Default
            ``True``: with many envs in flight, full scans of every object of a process that imported torch
            otherwise stall the loop for 100-150 ms every few seconds (docs/async-envs.md, "Performance").
            The cost: a reference cycle among those objects that becomes garbage while the collector runs
            is freed only after it closes. ``False``: the garbage collector as it was.
        fused: ``None`` (default): when every env is a :class:`ProcessVectorEnv` (or its ``split()`` parts),
            the policy a torch one and ``restart`` unset, one thread of the collector waits on the workers'
            doorbells, writes their frames and runs the policy, the loop only receiving batches (about 2x the
            frames/s of the engine on the loop: docs/async-envs.md, "The fused path"); else the engine on
            the loop. ``True``: that path, or a ``ValueError`` saying what prevents it; ``False``: never.

    Example:
        >>> import anyio, numpy as np
        >>> from gymnasium import spaces
        >>> from aiocollect import AsyncEnvCollector
        >>> class Ping:
        ...     observation_space = spaces.Box(0, 1, (1,), np.float32)
        ...     action_space = spaces.Discrete(2)
        ...     async def reset(self, *, seed=None, options=None):
        ...         return np.zeros(1, np.float32), {}
        ...     async def step(self, action):
        ...         await anyio.sleep(0.001)  # a network call
        ...         return np.ones(1, np.float32), 1.0, False, False, {}
        ...     async def close(self):
        ...         pass
        >>> async def main():
        ...     async with AsyncEnvCollector([Ping] * 100, frames_per_batch=500, total_frames=1000) as c:
        ...         async for batch in c:
        ...             print(batch.batch_size, batch["collector", "env_id"].unique().numel())
        >>> anyio.run(main)
        torch.Size([500]) 100
        torch.Size([500]) 100
    """

    @explicit_keywords
    def __init__(
        self,
        env_fns: Sequence[Callable[[], Any] | AsyncVectorEnvProtocol],
        policy: Any = None,
        *,
        frames_per_batch: int | None = None,
        total_frames: int | None = -1,
        trajs_per_batch: int | None = None,
        min_batch: int | None = None,
        max_wait: float = 0.002,
        max_frames_per_traj: int | None = None,
        split_trajs: bool = False,
        exploration_type: str | InteractionType = "random",
        seed: int | None = None,
        track_policy_version: bool = False,
        on_env_error: str = "raise",
        prefetch: int = 1,
        postproc: Callable[[TensorDictBase], TensorDictBase] | None = None,
        replay_buffer: Any = None,
        progress: Any = None,
        freeze_gc: bool = True,
        restart: RestartPolicy | None = None,
        group_size: int | None = None,
        on_update: str = "continue",
        fused: bool | None = None,
    ) -> None:
        # every argument is checked here, before any env is built
        self._env_fns = env_fns_arg(env_fns)
        self._restart_policy = restart_arg(restart, self._env_fns)
        self._fused_arg = fused_arg(fused, policy, restart)
        self._engine_kind: Any = Engine  # FusedEngine where the envs are process envs (decided on entering)
        n = len(self._env_fns)
        trajs = trajs_per_batch_arg(
            "AsyncEnvCollector", trajs_per_batch, frames_per_batch, on_env_error=on_env_error == "drop"
        )
        self._group_size, self._on_update = episode_args(
            "AsyncEnvCollector", trajs, group_size, on_update, restart
        )
        self._episodes = None if trajs is None else TrajectoryAssembler(trajs, self._group_size)
        self.frames_per_batch = frames_per_batch_arg(async_chunk(frames_per_batch, trajs, n))
        self.total_frames = total_frames_arg(total_frames)
        # counted in (sub-)envs: the default, half of them, is known once the envs are built
        self._min_batch_arg = optional_positive_int("min_batch", min_batch, fix="None: half of the envs")
        self._max_wait = max_wait_arg(max_wait)
        self._max_frames_per_traj = optional_positive_int("max_frames_per_traj", max_frames_per_traj)
        self._split_trajs = flag("split_trajs", split_trajs)
        self._exploration_type = exploration_type_arg(exploration_type)
        self._seed = seed_arg(seed)
        self._track_policy_version = flag("track_policy_version", track_policy_version)
        self._drop_failed = on_env_error_arg(on_env_error) == "drop"
        self._prefetch = non_negative_int("prefetch", prefetch, fix="0: a batch is collected when asked for")
        self._postproc = optional_callable("postproc", postproc)
        self._gc_hold = GcHold() if flag("freeze_gc", freeze_gc) else None
        self.replay_buffer = replay_buffer_arg(replay_buffer)
        self._source_policy = policy_arg(policy)
        self._async_policy = is_async_policy(policy)
        self._init_base(progress)  # checks `progress`
        ahead = (1 + self._prefetch) * self.frames_per_batch
        if ahead < n:
            warn_user(
                f"(1 + prefetch) * frames_per_batch = {ahead} frames may be collected or stepping at once, "
                f"fewer than the {n} envs: the others wait. Raise frames_per_batch or prefetch"
            )
        if self.total_frames > 0 and self.total_frames % self.frames_per_batch and trajs is None:
            warn_user(
                f"total_frames={self.total_frames} is not a multiple of frames_per_batch="
                f"{self.frames_per_batch}: the last batch is not cut, {self._target()} frames are collected"
            )
        self._engine: Engine | None = None
        self._policy: BatchPolicy | None = None
        self._rng = RolloutRNG(self._seed)  # a seeded collector's policy draws from its own generator
        self._parked = False  # the engine's policy task waits while paused (see _checkpoint.py)
        self._version = 0  # trajs_per_batch: the policy version of the newest frames taken

    def _target(self) -> int:
        if self.total_frames < 0 or self._episodes is not None:  # episodes: the budget is delivered frames
            return -1
        return ceil(self.total_frames / self.frames_per_batch) * self.frames_per_batch

    # -- lifecycle --------------------------------------------------------------------------------
    async def _on_enter(self) -> None:
        envs: list[Any] = []
        try:
            with anyio.CancelScope(shield=True):  # never leave a half-built env behind
                # gymnasium envs given as env_fns: their steps share ENV_THREADS worker threads
                limiter = anyio.CapacityLimiter(ENV_THREADS)
                await anyio.to_thread.run_sync(open_envs, self._env_fns, envs, limiter)
            spec = EnvSet(envs)
            self._check_vector_envs(spec)
            await self._envs_opened(spec)
            policy = SeededPolicy(
                self._source_policy,
                action_space=spec.action_space,
                obs_keys=spec.obs_keys,
                exploration_type=self._exploration_type,
                name=f"aiocollect-policy-{id(self):x}",
            )
            wraps = self._engine_policy(policy, spec) is not policy
            self._engine_kind = engine_kind(self._fused_arg, envs, wraps)
        except BaseException:
            with anyio.CancelScope(shield=True):
                for env in envs:
                    try:
                        await env.close()
                    except Exception:  # best effort: the error that stopped us goes on
                        pass
            raise
        policy.rng = self._rng = RolloutRNG(self._seed)  # the seed as _envs_opened left it
        policy.start()  # the thread gets the entering thread's torch settings
        self._policy = policy
        if self._gc_hold is not None:  # after the envs are built: they are long-lived too
            self._gc_hold.hold()
        config = EngineConfig(
            frames_per_batch=self.frames_per_batch,
            target=self._target(),
            min_batch=self._min_batch(spec.rows),
            max_wait=self._max_wait,
            prefetch=self._prefetch,
            max_frames_per_traj=self._max_frames_per_traj,
            seed=self._seed,
            drop_failed_envs=self._drop_failed,
            track_policy_version=self._track_policy_version,
            group_size=self._group_size,
            restart_on_update=self._on_update == "restart",
        )
        restarts = env_restarts(self._restart_policy, self._env_fns, limiter, spec, self._hub)
        self._engine = self._new_engine(envs, spec, self._engine_policy(policy, spec), config, restarts)
        for i in range(spec.rows):
            self._hub.publish(WorkerStarted(i))
        assert self._task_group is not None
        await self._task_group.start(self._engine.run)

    def _min_batch(self, rows: int) -> int:
        """``min_batch`` in (sub-)envs: default half of them."""
        given = self._min_batch_arg
        return max(1, rows // 2) if given is None else min(given, rows)

    def _check_vector_envs(self, spec: EnvSet) -> None:
        """Refuse what vector envs cannot do, once the envs are built (an env fn's kind is known then)."""
        check_async_envs(spec.rows, spec.has_vector, self._group_size, self._on_update)
        if not spec.has_vector:
            return
        if self._max_frames_per_traj is not None:
            raise ValueError(
                f"max_frames_per_traj={self._max_frames_per_traj} cannot be kept with async vector envs: "
                "a vector env resets a sub-env only when its episode ends (same-step autoreset), not on "
                "request. Drop max_frames_per_traj and limit the episodes in the env (e.g. gymnasium's "
                "TimeLimit, or max_episode_steps= of gymnasium.make_vec)"
            )
        ahead = (1 + self._prefetch) * self.frames_per_batch
        if ahead < spec.rows:
            warn_user(
                f"(1 + prefetch) * frames_per_batch = {ahead} frames may be collected or stepping at once, "
                f"fewer than the {spec.rows} sub-envs of the vector envs: the others wait. Raise "
                "frames_per_batch or prefetch"
            )

    async def _envs_opened(self, spec: EnvSet) -> None:
        """A subclass's hook: the envs are built and checked, no env is reset yet
        (``MultiAsyncEnvCollector``'s workers learn their first env id, hence their seeds, here). An error
        closes the envs."""

    def _engine_policy(self, policy: BatchPolicy, spec: EnvSet) -> Any:
        """What the engine calls on each batch of ready envs: ``policy`` (a subclass may wrap it)."""
        return policy

    async def aclose(self) -> None:
        """Stop the env tasks and the policy (after the steps and the policy call in flight), close every
        env and end the policy thread. Idempotent."""
        with anyio.CancelScope(shield=True):
            if self._background is not None:  # start()'s background collection: stop after its batch
                self._background.cancel()
                async with self._lock:
                    pass
            if not self._closed:
                self._closed = True
                self._closed_reason = "it was closed"
                if self._engine is not None:
                    for i in range(self._engine.rows):
                        self._hub.publish(WorkerStopped(i))
                self._finish_progress()
            await self._shutdown()
            self._hub.close()

    async def _shutdown(self) -> None:
        engine = self._engine
        if engine is not None:
            engine.consumer_signal.set()  # a consumer waiting for a batch sees the collector closed
            await engine.stop()
            async with anyio.create_task_group() as tg:
                for i in range(len(engine.envs)):
                    tg.start_soon(engine.close_env, i)
        if self._policy is not None:
            await self._policy.stop()
        if self._gc_hold is not None:
            self._gc_hold.release()

    async def _fail(self, exc: BaseException) -> None:
        self._closed_reason = f"an env or the policy failed with {type(exc).__name__}: {exc}"
        self._closed = True
        self._failed = True
        self._hub.publish(WorkerFailed(-1, f"{type(exc).__name__}: {exc}"))
        await self._shutdown()
        self._hub.close()

    # -- the iterator -----------------------------------------------------------------------------
    def _budget_reached(self) -> bool:
        if self._episodes is not None:
            return 0 < self.total_frames <= self._stats.frames
        return 0 < self._target() <= self._stats.frames  # a resumed collector counts from the checkpoint

    async def __anext__(self) -> TensorDictBase | None:
        if self._engine is None and not self._closed:
            raise RuntimeError(
                "an AsyncEnvCollector is iterated inside `async with AsyncEnvCollector(...) as c:`"
            )
        await self._batch_turn()
        try:
            engine = self._engine
            assert engine is not None
            while True:
                if self._episodes is not None and self._episodes.ready():  # from the frames taken already
                    return await self._deliver(engine)
                while not engine.complete and engine.error is None:
                    self._active()
                    await engine.consumer_signal.wait()
                if engine.error is not None:
                    error = engine.error
                    with anyio.CancelScope(shield=True):
                        await self._fail(error)
                    raise error
                if self._episodes is None:
                    return await self._deliver(engine)
                frames = engine.take_batch()
                self._version = frames.version
                self._episodes.push(frames.finish())
        finally:
            self._lock.release()

    async def _deliver(self, engine: Engine) -> TensorDictBase | None:
        if self._episodes is None:
            frames = engine.take_batch()
            version, episodes = frames.version, frames.episodes
            batch: TensorDictBase = frames.finish()
        else:  # whole trajectories in admission order (already flat over them: no sort for split_trajs)
            popped = self._episodes.pop()
            version, batch = self._version, popped.batch
            episodes = [(-1, r, n) for r, n in zip(popped.returns, popped.lengths, strict=True)]
        self._record(batch.shape[0], episodes, worker_id=None, policy_version=version)
        if self._split_trajs and self._episodes is not None:
            batch = split_trajectories(batch)
        elif self._split_trajs:
            order = torch.sort(batch.get(("collector", "traj_ids")), stable=True).indices
            batch = split_trajectories(batch[order])
        if self._postproc is not None:
            batch = self._postproc(batch)
        if self.replay_buffer is None:
            return batch
        with anyio.CancelScope(shield=True):  # counted already: it goes to the buffer
            await anyio.to_thread.run_sync(self.replay_buffer.extend, batch)
        return None

    async def _wait_idle(self) -> None:
        """``pause()``: wait for the batch being delivered, then for the steps and policy call in flight."""
        async with self._lock:
            pass
        engine = self._engine
        while engine is not None and not engine.idle and engine.error is None and not self._closed:
            await engine.idle_signal.wait()

    # -- weights ----------------------------------------------------------------------------------
    async def update_weights(
        self,
        policy_or_weights: Any = None,
        *,
        worker_ids: Sequence[int] | None = None,
        wait: bool = False,
    ) -> int:
        """Copy weights into the collector's policy, between two policy calls, and return the new version.

        Args:
            policy_or_weights: an ``nn.Module``, a TensorDict of weights or a state dict; ``None``: the
                policy the collector was built with (its current weights).
            worker_ids: ``None`` (every env shares the one policy).
            wait: accepted for a uniform signature; the update is applied on return.
        """
        self._check_open()
        flag("wait", wait)
        if worker_ids is not None:
            raise ValueError(f"worker_ids must be None (the envs share one policy), got {worker_ids!r}")
        if self._async_policy:
            raise TypeError(
                "update_weights needs an nn.Module policy; an async policy updates its own weights"
            )
        if not isinstance(self._source_policy, torch.nn.Module):
            raise TypeError(
                f"the collector's policy ({type(self._source_policy).__name__}) has no weights to update; "
                "update_weights needs an nn.Module policy"
            )
        engine = self._engine
        if engine is None or self._policy is None:
            raise RuntimeError(
                "update_weights needs an entered collector: `async with AsyncEnvCollector(...) as c:`"
            )
        async with engine.policy_lock:
            await self._policy.load_weights(policy_or_weights)
            version = engine.new_version()
        self._hub.publish(WeightsPublished(version))
        self._hub.publish(WeightsLoaded(version, 0))
        return version

    # -- state ------------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self._engine.version if self._engine is not None else 0

    @property
    def policy(self) -> Any:
        """The policy the collector runs (its own copy of an ``nn.Module``; ``None`` before entering)."""
        return self._policy.policy if self._policy is not None else None

    @property
    def fused(self) -> bool:
        """Whether the fused path steps the envs (known once entered; see ``fused=``)."""
        return isinstance(self._engine, FusedEngine)

    @property
    def envs(self) -> list[Any]:
        """The envs (as async envs or async vector envs, one per env fn), once the collector is entered."""
        return list(self._engine.envs) if self._engine is not None else []

    @property
    def policy_batch_sizes(self) -> list[int]:
        """The number of envs (sub-envs) in each of the last 10,000 policy calls (the dynamic batching at
        work)."""
        return list(self._engine.batch_sizes) if self._engine is not None else []

    def statistics(self) -> CollectorStatistics:
        """A frozen record of what the collector has done; one worker per env, a vector env's sub-envs
        each one (``worker_id`` = its env id, a dropped env ``"failed"``)."""
        engine = self._engine
        version = self.policy_version
        if self._failed:
            state = "failed"
        elif self._closed:
            state = "stopped"
        else:
            state = "paused" if self.paused else ("collecting" if engine is not None else "starting")
        workers: tuple[WorkerStatistics, ...] = ()
        if engine is not None:
            workers = tuple(
                WorkerStatistics(i, "failed" if i in engine.dropped else state, frames, version, restarts=r)
                for i, (frames, r) in enumerate(zip(engine.env_frames, engine.restart_counts(), strict=True))
            )
        split = engine.clock.recent() if engine is not None and not self._closed else None  # its policy task
        return self._stats.snapshot(
            version, workers=workers, paused=self.paused, loop_lag_ms=self._lag.percentiles_ms(), split=split
        )

    def __repr__(self) -> str:
        return (
            f"AsyncEnvCollector(envs={len(self._env_fns)}, frames_per_batch={self.frames_per_batch}, "
            f"total_frames={self.total_frames}, closed={self._closed})"
        )
