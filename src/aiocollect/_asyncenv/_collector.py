"""``AsyncEnvCollector``: many async envs stepped concurrently on the collector's event loop, the policy
called on batches of the envs that are ready (central inference, as in SEED RL); and :class:`Hosted`, the
declared handle through which a ``MultiAsyncEnvCollector`` worker runs one."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Unpack

import anyio
import anyio.abc
import anyio.to_thread
import torch
from tensordict import TensorDictBase

from .._core._gcfreeze import GcHold
from .._core._mistakes import explicit_keywords
from .._core._restart import derive_seed
from .._core._resume import derived_seed, to_arrays, to_plain
from .._core._rng import RolloutRNG
from .._core._validation import flag, optional_callable, policy_arg, replay_buffer_arg, seed_arg
from .._envs._async import AsyncVectorEnvProtocol
from .._episodes._args import check_async_envs
from .._episodes._assembler import TrajectoryAssembler
from .._episodes._trajectories import split_trajectories
from .._local._base import CollectorBase
from .._observe._events import WeightsLoaded, WeightsPublished, WorkerFailed, WorkerStarted, WorkerStopped
from .._observe._stats import CollectorStatistics, WorkerStatistics
from .._policies._weights import as_weights, check_compatible, module_weights
from .._procenv._env import Part, ProcessVectorEnv
from ._checkpoint import (
    CANNOT_LOAD,
    CANNOT_SAVE,
    FromState,
    capture,
    load_random_states,
    maybe_await,
    random_states,
    state_methods_of,
)
from ._engine import Engine, Setup, Stepper
from ._envset import EnvSet, close_once, env_fns_arg, open_envs
from ._fused import FusedSteps
from ._keywords import AsyncEnvKeywords
from ._options import AsyncEnvOptions
from ._policy import BatchPolicy, RandomFirst, is_async_policy
from ._restarts import EnvRestarts, restart_arg
from ._run import LoopSteps

__all__ = ["ENV_THREADS", "AsyncEnvCollector", "Finish", "Hosted"]

#: worker threads shared by the gymnasium envs an ``AsyncEnvCollector`` wraps in ``ThreadedAsyncEnv``
ENV_THREADS = 32


class AsyncEnvCollector(CollectorBase):
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

    @explicit_keywords(keywords=AsyncEnvKeywords)
    def __init__(
        self,
        env_fns: Sequence[Callable[[], Any] | AsyncVectorEnvProtocol],
        policy: Any = None,
        **kwargs: Unpack[AsyncEnvKeywords],
    ) -> None:
        kw = kwargs
        env_fns = env_fns_arg(env_fns)  # every argument is checked here, before any env is built
        restart = restart_arg(kw["restart"], env_fns)
        options = AsyncEnvOptions.of(
            "AsyncEnvCollector", [len(env_fns)], **{**kw, "restart": restart}, policy=policy
        )
        postproc = optional_callable("postproc", kw["postproc"])
        replay_buffer, progress = replay_buffer_arg(kw["replay_buffer"]), kw["progress"]
        self._setup(env_fns, policy, options, None, postproc, replay_buffer, progress, kw["freeze_gc"])

    def _setup(
        self,
        env_fns: list[Any],
        policy: Any,
        options: AsyncEnvOptions,
        host: Hosted | None,
        postproc: Callable[[TensorDictBase], TensorDictBase] | None = None,
        replay_buffer: Any = None,
        progress: Any = None,
        freeze_gc: bool = True,
    ) -> None:
        """The collector of ``options`` (checked) over ``env_fns``; ``host``: the handle of the host that
        runs it (a ``MultiAsyncEnvCollector`` worker)."""
        self._env_fns, self._options, self._host = env_fns, options, host
        self.frames_per_batch, self.total_frames = options.frames_per_batch, options.total_frames
        trajs = options.trajs_per_batch
        self._episodes = None if trajs is None else TrajectoryAssembler(trajs, options.group_size)
        self._finish, self.replay_buffer = Finish(options, postproc), replay_buffer
        self._gc_hold = GcHold() if flag("freeze_gc", freeze_gc) else None
        self._source_policy = policy_arg(policy)
        self._init_base(progress)  # checks `progress`
        self._seed = options.seed  # a hosted collector's: from its first env id, once its envs are built
        self._rng = RolloutRNG(self._seed)  # a seeded collector's policy draws from its own generator
        self._kind: Callable[[Engine], Stepper] = LoopSteps  # FusedSteps: decided on entering
        self._engine: Engine | None = None
        self._policy: BatchPolicy | None = None
        self._version = 0  # trajs_per_batch: the policy version of the newest frames taken
        self._episodes_delivered: list[tuple[int, float, int]] = []  # those of the batch delivered last
        self._offset = 0  # a hosted collector's first env id over its host's (once placed)

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
            policy, engine_policy = self._policies(spec, await self._placed(spec))
            self._kind = _stepper_kind(self._options.fused, envs, engine_policy is not policy)
        except BaseException:  # best effort: the error that stopped us goes on
            for i in range(len(envs)):
                await close_once(envs, set(), i)
            raise
        policy.rng = self._rng = RolloutRNG(self._seed)  # the seed as _placed left it
        policy.start()  # the thread gets the entering thread's torch settings
        self._policy = policy
        if self._gc_hold is not None:  # after the envs are built: they are long-lived too
            self._gc_hold.hold()
        restarts = None
        if self._options.restart is not None:  # its events: as the host numbers them (its env ids)
            restarts = EnvRestarts(self._options.restart, self._env_fns, limiter, spec, self._hub)
            restarts.worker, restarts.offset = self._options.member or 0, self._offset
        setup = Setup(
            spec,
            engine_policy,
            self._options,
            self._kind,
            hub=self._hub,
            is_paused=self._is_paused,
            resumed=self._resumed,
            restarts=restarts,
            offset=self._offset,
        )
        self._engine = Engine(envs, setup, target=self._options.target(), seed=self._seed)
        for i in range(spec.rows):
            self._hub.publish(WorkerStarted(i))
        assert self._task_group is not None
        await self._task_group.start(self._engine.stepper.run)

    def _policies(self, spec: EnvSet, random_seed: int | None) -> tuple[BatchPolicy, Any]:
        """The collector's policy, and what the engine calls: the policy, or (a worker's
        ``init_random_frames``) its first actions drawn at random, seeded with ``random_seed``."""
        policy = BatchPolicy(
            self._source_policy,
            action_space=spec.action_space,
            obs_keys=spec.obs_keys,
            exploration_type=self._options.exploration_type,
            name=f"aiocollect-policy-{id(self):x}",
        )
        actions = self._options.random_frames
        if not actions:
            return policy, policy
        return policy, RandomFirst(policy, spec.action_space, actions=actions, seed=random_seed)

    async def _placed(self, spec: EnvSet) -> int | None:
        """A hosted collector learns its first env id from its host (its seeds follow from it, and from
        its generation: a replaced worker's are derived); the seed of ``init_random_frames``' draws."""
        host, seed = self._host, self._seed
        if host is None:
            return seed
        first = self._offset = await host.place(spec)
        if seed is not None:  # env i of these envs is env first + i of the host's
            self._seed = derive_seed(seed + first, self._options.generation)
        return None if seed is None else seed + first

    def _check_vector_envs(self, spec: EnvSet) -> None:
        """Refuse what vector envs cannot do, once the envs are built (an env fn's kind is known then)."""
        options = self._options
        check_async_envs(spec.rows, spec.has_vector, options.group_size, options.on_update)
        if not spec.has_vector:
            return
        if options.max_frames_per_traj is not None:
            raise ValueError(
                f"max_frames_per_traj={options.max_frames_per_traj} cannot be kept with async vector envs: "
                "a vector env resets a sub-env only when its episode ends (same-step autoreset), not on "
                "request. Drop max_frames_per_traj and limit the episodes in the env (e.g. gymnasium's "
                "TimeLimit, or max_episode_steps= of gymnasium.make_vec)"
            )
        rows = spec.rows
        options.warn_ahead(
            rows, options.frames_per_batch, f", fewer than the {rows} sub-envs of the vector envs"
        )

    def _is_paused(self) -> bool:
        return bool(self._pauses)

    async def _resumed(self) -> None:
        """Until the collector is resumed (no ``pause()``, capture or host's hold open): the engine's policy
        side waits here while paused (no call is in flight)."""
        await self._pauses.resumed()

    def _hold(self) -> contextlib.AbstractContextManager[None]:
        """No policy call starts while this is open (counted with ``pause()``'s, without waiting for the
        steps in flight: a hung env does not hold it back)."""
        return self._pauses.hold()

    async def aclose(self) -> None:
        """Stop the env tasks and the policy (after the steps and the policy call in flight), close every
        env and end the policy thread. Idempotent."""
        with anyio.CancelScope(shield=True):
            if self._background is not None:  # start()'s background collection: stop after its batch
                self._background.cancel()
                async with self._lock:
                    pass
            if not self._closed:
                self._close("it was closed")
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
            await engine.stepper.stop()
            async with anyio.create_task_group() as tg:
                for i in range(len(engine.envs)):
                    tg.start_soon(engine.close_env, i)
        if self._policy is not None:
            await self._policy.stop()
        if self._gc_hold is not None:
            self._gc_hold.release()

    async def _fail(self, exc: BaseException) -> None:
        self._close(f"an env or the policy failed with {type(exc).__name__}: {exc}", failed=True)
        self._hub.publish(WorkerFailed(-1, f"{type(exc).__name__}: {exc}"))
        await self._shutdown()
        self._hub.close()

    # -- the iterator -----------------------------------------------------------------------------
    def _budget_reached(self) -> bool:  # (a resumed collector counts from the checkpoint)
        budget = self.total_frames if self._episodes is not None else self._options.target()
        return 0 < budget <= self._stats.frames

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
        self._episodes_delivered = episodes
        batch = self._finish(batch)
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
        if is_async_policy(self._source_policy):
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
        return self._engine is not None and self._engine.kind is FusedSteps

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
        split = engine.clock.recent() if engine is not None and not self._closed else None  # its policy side
        return self._stats.snapshot(
            version, workers=workers, paused=self.paused, loop_lag_ms=self._lag.percentiles_ms(), split=split
        )

    def __repr__(self) -> str:
        return (
            f"AsyncEnvCollector(envs={len(self._env_fns)}, frames_per_batch={self.frames_per_batch}, "
            f"total_frames={self.total_frames}, closed={self._closed})"
        )

    # -- seeds, resets, checkpoints (see _checkpoint.py) ------------------------------------------
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
            await engine.stepper.stop()  # first: no policy call draws from the new seed before the restart
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
        states then go into ``rngs``), then the engine restarted from it."""
        if self._episodes is not None:
            raise ValueError(
                "state_dict(envs=True) with trajs_per_batch: the trajectories being assembled are not saved; "
                "save without envs (the envs then start from reset at a resume)"
            )
        methods = state_methods_of(engine, CANNOT_SAVE)
        with self._hold():
            captured = await capture(engine, methods)
            if captured is None:
                return None
            obs, states = captured
            rngs.append(await self._in_policy_thread(lambda: self._random_states(engine)))
            await self._restart_engine(None, obs)  # from the state saved, as a resumed collector
            return {"envs": states, "obs": [to_plain(o) for o in obs]}

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
            methods = [] if saved is None else state_methods_of(engine, CANNOT_LOAD)  # before anything stops
            module = None if self._policy is None else self._policy.module
            if "policy" in state and module is not None:
                check_compatible(module_weights(module), as_weights(state["policy"]))
            await engine.stepper.stop()  # no policy call in flight from here on
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
            assert self._policy is not None
            policy = self._policy
            await self._in_policy_thread(lambda: load_random_states(self._rng, policy, engine, rngs))
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
        await self._restart_engine(None, [to_arrays(o) for o in saved["obs"]], frames=frames)

    def _random_states(self, engine: Engine) -> dict[str, Any]:
        assert self._policy is not None
        return random_states(self._rng, self._policy, engine)

    async def _restart_engine(
        self,
        seed: int | None,
        obs: list[Any] | None = None,
        frames: int | None = None,
        group_round: int | None = None,
    ) -> None:
        """Stop the engine (dropping what it collected ahead) and start its successor over the same envs:
        each env reset with ``seed + its env id`` (``None``: unseeded), or with ``obs`` (per env) as it is
        now, without a reset. Fresh trajectory ids; ``frames``: the budget left counts from there; seeded
        episodes go on from round ``group_round`` at least (a checkpoint's)."""
        with anyio.CancelScope(shield=True):  # never left without an engine
            old = self._engine
            assert old is not None
            assert self._task_group is not None
            await old.stepper.stop()
            if self._episodes is not None:  # trajectories in assembly went with the frames dropped
                self._episodes = self._episodes.emptied()
            done = self._stats.frames if frames is None else frames
            target = self._options.target()
            if 0 < target <= done:  # the budget is collected already: nothing more to run
                return
            envs = list(old.envs)
            run = envs if obs is None else [FromState(env, o) for env, o in zip(envs, obs, strict=True)]
            new = old.successor(run, seed=seed, target=target - done if target > 0 else -1, at=group_round)
            self._engine = new
            await self._task_group.start(new.stepper.run)
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


def _stepper_kind(given: bool | None, envs: list[Any], wraps: bool) -> Callable[[Engine], Stepper]:
    """The fused steps where they can step ``envs`` (``given``: ``fused=`` as checked; ``wraps``: the
    collector wraps its policy), else the steps on the loop; ``fused=True`` that cannot: ``ValueError``."""
    if given is False:
        return LoopSteps
    if not all(isinstance(env, (ProcessVectorEnv, Part)) for env in envs):
        why = "every env must be a ProcessVectorEnv or one of its split() parts"
    elif wraps:
        why = "the collector wraps its policy (init_random_frames)"
    else:
        return FusedSteps
    if given:
        raise ValueError(f"fused=True: {why}; pass fused=None to fall back to the engine on the loop")
    return LoopSteps


class Finish:
    """The batch as delivered: trajectories split (sorted by trajectory first: a flat batch interleaves
    its envs; with ``trajs_per_batch`` they follow one another already), then the user's ``postproc``."""

    def __init__(
        self, options: AsyncEnvOptions, postproc: Callable[[TensorDictBase], TensorDictBase] | None
    ) -> None:
        self.split_trajs = options.split_trajs
        self.grouped = options.trajs_per_batch is not None
        self.postproc = postproc

    def __call__(self, batch: TensorDictBase) -> TensorDictBase:
        batch.names = None  # a flat batch of frames, not a time dimension
        if self.split_trajs:
            if not self.grouped:
                batch = batch[torch.sort(batch.get(("collector", "traj_ids")), stable=True).indices]
            batch = split_trajectories(batch)
        return self.postproc(batch) if self.postproc is not None else batch


class Hosted:
    """An ``AsyncEnvCollector`` run by a host (a ``MultiAsyncEnvCollector`` worker, ``_worker.py``), and the
    declared handle through which the host acts on it: its options (the worker's view, checked by the
    trainer), ``place`` (awaited once the envs are built, none reset yet: the first env id of these envs
    among the host's, from which their seeds follow), a hold on its policy calls, weights loaded from the
    host's receiver, its state read at once, its time split and the episodes of its last batch."""

    def __init__(
        self,
        env_fns: list[Any],
        policy: Any,
        options: AsyncEnvOptions,
        place: Callable[[EnvSet], Awaitable[int]],
    ) -> None:
        self.place = place
        self.collector = AsyncEnvCollector.__new__(AsyncEnvCollector)
        self.collector._setup(env_fns, policy, options, self)

    def hold(self) -> contextlib.AbstractContextManager[None]:
        """No policy call starts while this is open (as in ``pause()``, without waiting for the steps in
        flight: a hung env does not hold it back)."""
        return self.collector._hold()

    async def load_weights(self, load: Callable[[torch.nn.Module, int], int]) -> int:
        """``load(module, version)`` (a weight receiver's: the version it loaded) between two policy calls,
        in the policy thread; the version the policy runs (``on_update="restart"``: a new one restarts the
        episodes in flight)."""
        engine, policy = self.collector._engine, self.collector._policy
        assert engine is not None
        assert policy is not None
        module = policy.module
        if module is None:
            return engine.version
        async with engine.policy_lock:
            before = engine.version
            engine.version = await policy.in_thread(lambda: load(module, before))
            if engine.version != before and engine.episodes is not None:
                engine.episodes.updated()
        return engine.version

    async def state_now(self) -> dict[str, Any]:
        """``state_dict()`` at once, between two engine events (not after the batch being collected)."""
        engine = self.collector._check_restartable("state_dict", restarts=False)
        return await self.collector._read_state(engine, envs=False)

    def time_split(self) -> tuple[float, ...]:
        engine = self.collector._engine
        return engine.clock.totals() if engine is not None else ()

    @property
    def episodes(self) -> list[tuple[int, float, int]]:
        """``(env id, return, length)`` of the episodes that ended in the batch delivered last."""
        return self.collector._episodes_delivered
