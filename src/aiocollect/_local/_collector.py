"""``Collector``: one env (possibly batched) and a policy, collected in a worker thread, async on top."""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from math import ceil, prod
from typing import Any, TypeVar, Unpack

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread
import torch
from tensordict import TensorDictBase

from .._core._errors import WorkerTimeoutError
from .._core._keywords import rollout_keywords
from .._core._mistakes import explicit_keywords, warn_user
from .._core._options import RolloutOptions, WeightSchedule, refuse_schedule
from .._core._resume import load_member, member_state
from .._core._rng import RolloutRNG, forked_rng
from .._core._validation import (
    flag,
    non_negative_int,
    optional_callable,
    policy_arg,
    replay_buffer_arg,
    seed_arg,
    timeout_arg,
)
from .._envs._adapter import open_env
from .._envs._rebuild import env_factory
from .._episodes._args import chunk_frames, group_size_arg, refuse_cuts, trajs_per_batch_arg
from .._episodes._assembler import TrajectoryAssembler
from .._episodes._trajectories import split_trajectories
from .._observe._events import (
    WeightsLoaded,
    WeightsPublished,
    WorkerFailed,
    WorkerStarted,
    WorkerStopped,
)
from .._observe._stats import CollectorStatistics, WorkerStatistics
from .._policies._weights import as_weights, check_compatible, copy_weights, module_weights
from .._rollout._core import RolloutResult, build_rollout
from .._rollout._thread import Doorbell, Flag, Job, RolloutThread, collect_episodes
from .._weightsync._schemes import weight_sync_arg
from ._base import CollectorBase
from ._keywords import CollectorKeywords
from ._restarts import RestartReport

__all__ = ["Collector"]

T = TypeVar("T")


def _end_thread(thread: RolloutThread, bells: list[Doorbell]) -> None:
    thread.abandon()  # a no-op for a thread that has ended
    for bell in bells:
        bell.close()


@dataclass(frozen=True)
class _Batch:
    batch: TensorDictBase | None
    result: RolloutResult
    #: the batch went into the replay buffer (it counts even if the consumer is cancelled now)
    delivered: bool = False


class Collector(CollectorBase):
    """Collect batches from one env with a policy; ``async for batch in collector``.

    The rollout runs in one long-lived thread of the collector's own (one hand-off per batch), started
    with the torch settings of the thread that enters the collector (``torch.set_num_threads``,
    flush-denormal, default dtype, grad mode), so the event loop stays free for a trainer, a dashboard or
    other collectors, and the rollout never waits for the loop.

    Args:
        create_env_fn: an env (see :class:`EnvProtocol`, e.g. :class:`GymEnv`) or a callable returning one.
        policy: a ``TensorDictModule``, an ``nn.Module`` (called on the observations, returns the action),
            a callable ``td -> td``, or ``None`` for :class:`RandomPolicy`. ``nn.Module`` policies are
            copied: the collector runs its own weights, changed only by :meth:`update_weights`.
        frames_per_batch, total_frames, max_frames_per_traj, init_random_frames, reset_at_each_iter, \
        split_trajs, exploration_type, set_truncated, seed, device, env_device, policy_device, \
        storing_device, compile_policy, traj_id_start, traj_id_stride: what a batch is: the fields of
            :class:`RolloutOptions` (documented there), given flat; or all of them as ``rollout=``.
        track_policy_version, max_policy_lag: :class:`WeightSchedule`'s, given flat; or ``weights=``.
            In-process, :meth:`update_weights` copies straight into the collector's policy before the
            next batch, so no transport is involved and the lag is always 0 (``max_policy_lag`` and
            ``weight_sync`` are accepted and checked so that the same arguments work everywhere).
        rollout: a :class:`RolloutOptions` instead of its flat keywords (giving both raises ``TypeError``).
        weights: a :class:`WeightSchedule` instead of its flat keywords.
        postproc: a callable applied to each batch.
        replay_buffer: anything with ``extend(batch)``; batches go there and ``async for`` yields ``None``.
            ``extend`` is called from the collector's worker thread (a large copy must not hold the
            event loop): the buffer must accept writes from another thread, as torchrl's
            ``ReplayBuffer`` does.
        worker_timeout: seconds a batch may take before :class:`WorkerTimeoutError` is raised (a hung env
            or policy); ``None`` waits forever. A thread stuck in a call that never returns cannot be
            stopped: it is left to finish on its own and the collector is closed.
        progress: a progress bar over ``total_frames`` with frames/s and mean return: ``None`` (default:
            shown when stderr is a terminal), ``True``, ``False``, a tqdm bar or a rich ``Progress``.
        prefetch: batches the rollout thread collects ahead of ``async for`` (default 0: a batch starts
            when it is asked for, so a batch asked for after :meth:`update_weights` runs the new weights).
            With ``prefetch=k`` the trainer gets a batch at once, but up to ``k`` batches were collected
            with older weights: ``("collector", "policy_version")`` (``track_policy_version=True``) says
            which.
        trajs_per_batch: instead of ``frames_per_batch``, batches of this many whole trajectories (each
            from a reset to its ``("next", "done")``), flat over frames (``[N, T]`` with a mask with
            ``split_trajs``), in the order they started; ``total_frames`` counts their frames. See
            the episodes guide (docs/episodes.md).
        group_size: with ``trajs_per_batch`` (a multiple of it), episodes in groups of ``group_size``
            that start from the same initial state (the same reset seed), delivered whole, each frame
            with its ``("collector", "group_id")``; the env's batch size a multiple of it (docs/episodes.md,
            "Groups").
        restart: a :class:`RestartPolicy` (a field of :class:`RolloutOptions`): an env that raises in
            ``reset``/``step`` is closed, rebuilt from ``create_env_fn`` (a callable, not an instance)
            and the batch goes on (see docs/faults.md); ``None`` (default): the error ends the run.

    Example:
        >>> import anyio
        >>> from aiocollect import Collector, GymEnv
        >>> async def main():
        ...     async with Collector(lambda: GymEnv("CartPole-v1"), frames_per_batch=64,
        ...                          total_frames=128, seed=0) as collector:
        ...         async for batch in collector:
        ...             print(batch.batch_size)
        >>> anyio.run(main)
        torch.Size([64])
        torch.Size([64])
    """

    @explicit_keywords(keywords=CollectorKeywords)
    def __init__(self, create_env_fn: Any, policy: Any = None, **kwargs: Unpack[CollectorKeywords]) -> None:
        # -- every argument is checked before the env is built ----------------------------------
        kw, rollout = kwargs, kwargs["rollout"]
        trajs = trajs_per_batch_arg("Collector", kw["trajs_per_batch"], kw["frames_per_batch"])
        group = group_size_arg("Collector", kw["group_size"], trajs)
        frames_per_batch = (
            1 if trajs and rollout is None else kw["frames_per_batch"]
        )  # chunks: _build_rollout
        options = RolloutOptions.from_kwargs(
            rollout, frames_per_batch=frames_per_batch, group_size=group, **rollout_keywords(kw)
        )
        schedule = WeightSchedule.from_kwargs(
            kw["weights"],
            track_policy_version=kw["track_policy_version"],
            max_policy_lag=kw["max_policy_lag"],
        )
        self._options, self._schedule = options, schedule
        refuse_cuts("Collector", trajs, options)
        if not isinstance(options.frames_per_batch, int):
            raise TypeError(
                f"Collector takes one frames_per_batch (an int), got {options.frames_per_batch!r}"
            )
        refuse_schedule(self._schedule, type(self).__name__)
        self._prefetch = non_negative_int(
            "prefetch", kw["prefetch"], fix="0 collects each batch when asked for"
        )
        self.total_frames = options.total_frames
        self._seed = options.seed
        self._postproc = optional_callable("postproc", kw["postproc"])
        self.replay_buffer = replay_buffer_arg(kw["replay_buffer"])
        weight_sync_arg(kw["weight_sync"])
        self._worker_timeout = timeout_arg(kw["worker_timeout"])
        self._init_base(kw["progress"])  # checks `progress`
        if not callable(create_env_fn) and not hasattr(create_env_fn, "step"):
            raise TypeError(
                f"create_env_fn must be an env or a callable returning one, got {create_env_fn!r}"
            )
        policy_arg(policy)
        # -- the env, the policy and the rollout ------------------------------------------------
        env = open_env(create_env_fn, options)
        self._episodes = None if trajs is None else TrajectoryAssembler(trajs, group)
        try:
            self._build_rollout(env, policy, create_env_fn)
        except BaseException:
            env.close()
            raise
        self.frames_per_batch = self._rollout.frames_per_batch
        self._init_random_frames = self._rounded_budgets(env)
        # the rollout thread, started on entering (or at the first batch), and what it hands back
        self._thread = RolloutThread(f"aiocollect-rollout-{id(self):x}", clock=self._rollout.clock)
        self._bells: list[Doorbell] = []  # made with the thread (see _submit)
        # a collector dropped without aclose() (never entered, or its iteration abandoned) ends its thread
        weakref.finalize(self, _end_thread, self._thread, self._bells)
        self._pending: deque[Job[_Batch]] = deque()  # batches collected ahead (prefetch)
        self._free_results: deque[RolloutResult] = deque()  # start(): in the buffer, not yet counted
        self._thread_stuck = False

    def _build_rollout(self, env: Any, policy: Any, create_env_fn: Any = None) -> None:
        """The collector's own policy, the random policy and the rollout, checked with one dry call;
        with a restart policy, the rollout rebuilds the env from ``create_env_fn``."""
        self._env = env
        self._source_policy = policy
        if self._episodes is not None and self._options.frames_per_batch == 1:  # trajs_per_batch's chunks
            self._options = replace(self._options, frames_per_batch=chunk_frames(prod(env.batch_size)))
        self._rollout, self._policy, self._random_policy = build_rollout(
            env,
            policy,
            self._options,
            self._schedule,
            copy_module=True,
            storing_device=self._options.devices.storing,
            factory=env_factory(create_env_fn, self._options.restart),
            on_env=partial(setattr, self, "_env"),
        )
        self._restarts = RestartReport(self._hub, self._rollout.restarts)
        # the policy samples with the collector's own torch RNG state when seeded (see _core/_rng.py)
        self._rng = RolloutRNG(self._seed)
        # one dry policy call: a broken policy fails here, not later. It draws from a forked RNG so
        # that the first batch is the one a later set_seed(seed) gives (no number drawn here).
        with forked_rng():
            self._rollout.output_specs()
        self._rollout._batch_specs()  # a batch too large for this machine's memory is refused now

    def _rounded_budgets(self, env: Any) -> int:
        """Warn where a budget is not a whole number of batches; the random frames, in whole batches."""
        requested = self._options.frames_per_batch
        if self.frames_per_batch != requested:
            warn_user(
                f"frames_per_batch={requested} is not a multiple of the env batch "
                f"size {list(env.batch_size)}: each batch has {self.frames_per_batch} frames"
            )
        if self.total_frames > 0 and self.total_frames % self.frames_per_batch and self._episodes is None:
            warn_user(
                f"total_frames={self.total_frames} is not a multiple of the batch size "
                f"{self.frames_per_batch}: the last batch is not cut, {len(self) * self.frames_per_batch} "
                "frames will be collected"
            )
        init_random = self._options.init_random_frames
        rounded = ceil(init_random / self.frames_per_batch) * self.frames_per_batch
        if init_random % self.frames_per_batch:
            warn_user(
                f"init_random_frames={init_random} is rounded up to whole batches: {rounded} random frames"
            )
        return rounded

    @classmethod
    async def create(
        cls, create_env_fn: Any, policy: Any = None, **kwargs: Unpack[CollectorKeywords]
    ) -> Collector:
        """Build the collector in a worker thread: ``await Collector.create(...)`` takes the same arguments
        as ``Collector(...)``.

        The constructor builds the env, copies the policy and makes one dry policy call where it is
        called; in a coroutine that is on the event loop (a heavy env, e.g. a simulator that loads
        assets, can take seconds). ``create`` does that work off the loop. If the caller is cancelled
        meanwhile, the collector being built is closed once it is ready.

        Example:
            >>> import anyio
            >>> from aiocollect import Collector, GymEnv
            >>> async def main():
            ...     collector = await Collector.create(lambda: GymEnv("CartPole-v1"), frames_per_batch=32,
            ...                                        total_frames=64)
            ...     async with collector:
            ...         async for batch in collector:
            ...             print(batch.batch_size)
            >>> anyio.run(main)
            torch.Size([32])
            torch.Size([32])
        """
        built: list[Collector] = []

        def build() -> None:
            built.append(cls(create_env_fn, policy, **kwargs))

        try:
            with anyio.CancelScope(shield=True):  # never leave a half-built env behind
                await anyio.to_thread.run_sync(build)
            await anyio.lowlevel.checkpoint_if_cancelled()
        except BaseException:
            if built:
                await built[0].aclose()
            raise
        return built[0]

    # -- the iterator ---------------------------------------------------------------------------
    async def __anext__(self) -> TensorDictBase | None:
        await self._batch_turn()
        try:
            job = self._pending.popleft() if self._pending else self._submit_batch()
            try:
                out = await job.wait(timeout=self._worker_timeout)
            except anyio.get_cancelled_exc_class():
                # the job was stopped and waited for; a batch already in the replay buffer counts
                if job.done.is_set():
                    try:
                        stopped = job.result()
                    except BaseException:
                        stopped = None
                    if stopped is not None and stopped.delivered:
                        self._record_result(stopped.result)
                raise
            except Exception as exc:
                if isinstance(exc, WorkerTimeoutError):
                    self._thread_stuck = True
                await self._fail(exc)
                raise
            self._record_result(out.result)
            self._prefetch_batches()
            return out.batch
        finally:
            self._lock.release()

    def _submit_batch(self) -> Job[_Batch]:
        """Queue the next batch in the rollout thread (random while ``init_random_frames`` last)."""
        ahead = self._stats.frames + self.frames_per_batch * len(self._pending)
        random = ahead < self._init_random_frames
        return self._submit(lambda stop: self._collect_in_thread(stop, random))

    def _prefetch_batches(self) -> None:
        """Keep ``prefetch`` batches queued, never past ``total_frames``."""
        while len(self._pending) < self._prefetch:
            ahead = self._stats.frames + self.frames_per_batch * len(self._pending)
            if 0 < self.total_frames <= ahead:
                return
            self._pending.append(self._submit_batch())

    async def _fail(self, exc: BaseException) -> None:
        self._close(f"a batch failed with {type(exc).__name__}: {exc}", failed=True)
        self._restarts.publish()
        self._hub.publish(WorkerFailed(0, f"{type(exc).__name__}: {exc}"))
        await self._close_env()
        self._hub.close()
        await self._end_thread()

    def _record_result(self, result: RolloutResult) -> None:
        self._restarts.publish()
        self._record(
            result.frames,
            [(0, r, n) for r, n in zip(result.episode_returns, result.episode_lengths, strict=True)],
            worker_id=0,
            policy_version=result.policy_version,
        )

    def _collect_in_thread(self, stop: Flag, random: bool) -> _Batch:
        def collect() -> RolloutResult:
            return self._rng.run(lambda: self._rollout.collect(random=random, stop=stop))

        if self._episodes is None:
            result = collect()
        else:  # whole trajectories, assembled here in the rollout thread
            result = collect_episodes(self._episodes, collect, stop, self._rollout.policy_version)
        batch: TensorDictBase = result.batch
        if stop.is_set():  # cancelled: the caller discards this
            return _Batch(None, result)
        if self._options.split_trajs:
            batch = split_trajectories(batch)
        if self._postproc is not None:
            batch = self._postproc(batch)
        if self.replay_buffer is None:
            return _Batch(batch, result)
        self.replay_buffer.extend(batch)
        return _Batch(None, result, delivered=True)

    # -- background collection: the rollout thread fills the replay buffer on its own -------------
    async def _run_free(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """``start()``: batches are collected and written to the replay buffer by the rollout thread,
        back to back, while the loop only counts them: collection goes on while the loop is blocked
        (a long synchronous training step). The thread yields between batches to control calls,
        ``pause()`` and ``async for``."""
        with anyio.CancelScope() as scope:
            self._background = scope
            task_status.started()
            try:
                while not self._budget_reached() and not self._stop_requested:
                    await self._acquire_batch_lock()
                    try:
                        self._check_open()
                        job = self._submit(partial(self._free_run, frames=self._stats.frames), free=True)
                    finally:
                        self._lock.release()
                    try:
                        while not job.done.is_set():
                            await job.bell.wait()
                            self._count_free_results()
                    finally:
                        if not job.done.is_set():  # cancelled: stop after this step, count what is in
                            await job.stop_and_wait()
                        self._count_free_results()
                    job.result()
            except Exception as exc:  # raised by __aexit__, with its own type and traceback
                if not self._closed:
                    await self._fail(exc)
                self._background_error = exc
                if self._task_group is not None:
                    self._task_group.cancel_scope.cancel()  # and the `async with` body stops

    def _free_run(self, stop: Flag, *, frames: int) -> None:
        """In the rollout thread: collect into the replay buffer until stopped, paused, the budget is
        reached, or another job waits for the thread."""
        while (
            not stop.is_set() and not self._pauses and not self._thread.pending() and not self._stop_requested
        ):
            if 0 < self.total_frames <= frames:
                return
            out = self._collect_in_thread(stop, frames < self._init_random_frames)
            if not out.delivered:  # stopped mid-batch: discarded
                return
            frames += out.result.frames
            self._free_results.append(out.result)
            self._bells[1].ring()

    def _count_free_results(self) -> None:
        # only the results there now: the rollout thread may add them faster than they are recorded, and
        # the loop would never leave this function (the next bell brings the rest)
        for _ in range(len(self._free_results)):
            self._record_result(self._free_results.popleft())

    async def _wait_idle(self) -> None:
        """``pause()``: wait for the batch in flight, including one the background collection runs."""
        async with self._lock:
            if self._thread.alive() and not self._thread_stuck:
                await self._submit(lambda stop: None).wait()
                self._count_free_results()  # start()'s batches written by now are counted by now

    def _submit(self, fn: Callable[[Flag], T], *, free: bool = False) -> Job[T]:
        """Queue ``fn(stop)`` in the rollout thread, started now (with this thread's torch settings) if
        the collector was not entered. Its doorbell is the batch lock holder's, or ``start()``'s."""
        if not self._bells:
            self._bells.extend((Doorbell(), Doorbell()))
            self._thread.start()
        return self._thread.submit(fn, self._bells[1] if free else self._bells[0])

    # -- lifecycle ------------------------------------------------------------------------------
    async def _on_enter(self) -> None:
        self._submit(lambda stop: None)  # the thread starts with the entering thread's torch settings
        self._hub.publish(WorkerStarted(0))
        assert self._task_group is not None
        self._task_group.start_soon(self._restarts.run)

    async def aclose(self) -> None:
        """Stop background collection, wait for a batch in flight, close the env and end the rollout
        thread. Idempotent."""
        if self._background is not None:
            self._background.cancel()
        with anyio.CancelScope(shield=True):
            async with self._lock:
                if not self._closed:
                    self._close("it was closed")
                    self._hub.publish(WorkerStopped(0))
                    self._finish_progress()
                await self._close_env()
                self._hub.close()
                await self._end_thread()

    async def _end_thread(self) -> None:
        """Join the rollout thread (a stuck one is left to finish on its own) and close its doorbells."""
        if not self._thread_stuck:
            await self._thread.stop()
        _end_thread(self._thread, self._bells)
        self._restarts.close()

    async def _close_env(self) -> None:
        for job in self._pending:  # batches collected ahead: stop and drop them
            job.stop.set()
        self._pending.clear()
        env, self._env = self._env, None
        if env is None:
            return
        with anyio.CancelScope(shield=True):
            if self._thread.alive() and not self._thread_stuck:
                # in the rollout thread, after any batch still queued: an env may be bound to its thread
                await self._submit(lambda stop: env.close()).wait()
            else:
                await anyio.to_thread.run_sync(env.close)

    # -- control --------------------------------------------------------------------------------
    async def _control(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` in the rollout thread between batches (after any batch collected ahead)."""
        self._check_open()
        async with self._lock:
            self._check_open()
            if self._free_results or self._background is not None:
                # start(): the batches it wrote before fn runs are counted first (state_dict reads them)
                await self._submit(lambda stop: None).wait()
                self._count_free_results()
            return await self._submit(lambda stop: fn()).wait()

    async def set_seed(self, seed: int) -> int:
        """Seed the env, the random policy and the policy's sampling; resets the env.

        Returns the last seed the env used (seed the next env with ``returned + 1``).
        """
        seed = seed_arg(seed)
        if seed is None:
            raise TypeError("set_seed needs an int")

        def apply() -> int:
            assert self._env is not None
            last = int(self._env.set_seed(seed))
            if self._rollout.restarts is not None:
                self._rollout.restarts.seeded(seed)
            self._rng.seed(seed)
            self._rollout.seed_groups(seed)
            self._rollout.reset()
            return last

        return int(await self._control(apply))

    async def reset(self) -> None:
        """Reset the env: the next batch starts new episodes (with new trajectory ids)."""
        await self._control(self._rollout.reset)

    async def state_dict(self, *, envs: bool = False) -> dict[str, Any]:
        """Counters, trajectory ids, policy version, weights, random states; ``envs``: env state too."""
        fix = "make the collector with prefetch=0" if self._prefetch else None

        def read() -> dict[str, Any]:
            state: dict[str, Any] = {
                "frames": self._stats.frames,
                "batches": self._stats.batches,
                "episodes": self._stats.episodes,
                **self._rollout.state_dict(),
                **member_state(self._rollout, self._rng, self._random_policy, envs=envs, ahead=fix),
            }
            if isinstance(self._policy, torch.nn.Module):
                state["policy"] = module_weights(self._policy).detach().clone().to_dict()
            return state

        return await self._control(read)

    async def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; the frame budget continues from the saved count."""
        missing = {"frames", "batches", "next_traj_id", "policy_version"} - set(state)
        if missing:
            raise KeyError(f"state dict lacks {sorted(missing)}")

        def apply() -> None:
            weights = None
            if "policy" in state and isinstance(self._policy, torch.nn.Module):
                weights = as_weights(state["policy"])
                check_compatible(module_weights(self._policy), weights)
            load_member(self._rollout, self._rng, self._random_policy, dict(state), int(state["frames"]))
            self._stats.load(int(state["frames"]), int(state["batches"]), int(state.get("episodes", 0)))
            if weights is not None:
                copy_weights(module_weights(self._policy), weights)

        await self._control(apply)
        self._restarts.count = int(state.get("env_restarts", 0))  # statistics().restarts goes on

    async def update_weights(
        self,
        policy_or_weights: Any = None,
        *,
        worker_ids: Sequence[int] | None = None,
        wait: bool = False,
    ) -> int:
        """Copy weights into the collector's policy (between batches) and return the new version.

        The copy happens before the next batch starts, so ``wait`` changes nothing here; it and
        ``worker_ids`` (``None`` or ``[0]``: the collector is its own single worker) exist so that code
        written for the multi-process collectors runs unchanged.

        Args:
            policy_or_weights: an ``nn.Module``, a TensorDict of weights or a state dict; ``None`` means
                the policy the collector was built with (its current weights).
            worker_ids: ``None`` or ``[0]``.
            wait: accepted for a uniform signature; the update is always applied on return.
        """
        self._check_open()
        if worker_ids is not None and list(worker_ids) != [0]:
            raise ValueError(f"worker_ids must be None or [0] for an in-process Collector: {worker_ids!r}")
        flag("wait", wait)
        if not isinstance(self._policy, torch.nn.Module):
            raise TypeError(
                f"the collector's policy ({type(self._policy).__name__}) has no weights to update; "
                "update_weights needs an nn.Module policy"
            )
        source = self._source_policy if policy_or_weights is None else policy_or_weights

        def apply() -> int:  # in the worker thread: a large model's copy does not hold the loop
            weights = as_weights(source)
            target = module_weights(self._policy)
            check_compatible(target, weights)
            copy_weights(target, weights)
            self._rollout.policy_version += 1
            return self._rollout.policy_version

        version = int(await self._control(apply))
        self._hub.publish(WeightsPublished(version))
        self._hub.publish(WeightsLoaded(version, 0))
        return version

    @property
    def policy_version(self) -> int:
        return self._rollout.policy_version

    @property
    def policy(self) -> Any:
        """The collector's own policy (a copy of the ``nn.Module`` it was given)."""
        return self._policy

    @property
    def env(self) -> Any:
        return self._env

    def statistics(self) -> CollectorStatistics:
        """A frozen record of what the collector has done (see :class:`CollectorStatistics`)."""
        if self._failed:
            state = "failed"
        elif self._closed:
            state = "stopped"
        else:
            state = "paused" if self.paused else "collecting"
        version = self._rollout.policy_version
        worker = WorkerStatistics(0, state, self._stats.frames, version, restarts=self._restarts.count)
        return self._stats.snapshot(
            version,
            workers=(worker,),
            paused=self.paused,
            loop_lag_ms=self._lag.percentiles_ms(),
            splits=[None if self._closed else self._rollout.clock.recent()],  # closed: the last one
        )

    def __repr__(self) -> str:
        return (
            f"Collector(env={self._env!r}, frames_per_batch={self.frames_per_batch}, "
            f"total_frames={self.total_frames}, closed={self._closed})"
        )
