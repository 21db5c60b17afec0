"""What the multi-process collectors share (``MultiCollectorBase``): start-up, shutdown, iteration,
control, weights and statistics.

Each worker (a process, or a thread with ``worker_backend="serial"``) runs the rollout core and writes
batches into shared-memory slots; the parent's task group merges their notices into one ``async for``.
``MultiSyncCollector`` (``_multi_sync.py``) and ``MultiAsyncCollector`` (``_multi_async.py``) say how a
batch is gathered.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import torch
from tensordict import TensorDictBase
from tensordict.nn import InteractionType

from .._errors import CollectorClosedError, WorkerTimeoutError
from .._events import WeightsPublished
from .._fleet import FleetCollector, Member
from .._gather import gather
from .._options import (
    RolloutOptions,
    WeightSchedule,
    refuse_schedule,
    worker_backend_arg,
)
from .._restart import RestartPolicy
from .._resume import check_fleet_env_state
from .._stats import WorkerStatistics
from .._torch_settings import TorchSettings
from .._trajectories import split_trajectories
from .._transport._messages import (
    FleetOp,
    GetAttr,
    GetPath,
    GetState,
    GetWeights,
    LoadState,
    LoadWeights,
    MapFn,
)
from .._transport._shm import SharedBlock
from .._validation import (
    optional_callable,
    optional_positive_int,
    policy_arg,
    positive_int,
    replay_buffer_arg,
    timeout_arg,
)
from .._weights import flat_weights
from .._weightsync import WeightSender, WeightSync, weight_sync_arg
from .._workers._paths import parse_path
from .._workers._pool import WorkerPool, start_forkserver
from .._workers._worker import WorkerSpec, control_layout
from ._args import (
    env_fns_arg,
    pickled_env_fns,
    set_worker_warnings,
    show_worker_warnings,
    start_method_arg,
)
from ._delivery import Delivering

__all__ = [
    "MultiCollectorBase",
    "env_fns_arg",
    "pickled_env_fns",
    "set_worker_warnings",
    "start_method_arg",
]


async def _first_exit(pool: WorkerPool) -> None:
    """Return when any worker has exited (its reader has recorded why)."""
    async with anyio.create_task_group() as tg:

        async def wait(exited: anyio.Event) -> None:
            await exited.wait()
            tg.cancel_scope.cancel()

        for handle in pool.workers:
            tg.start_soon(wait, handle.exited)


class MultiCollectorBase(FleetCollector):
    """What the multi-worker collectors share: start-up, shutdown, control, weights, statistics; how a
    batch is gathered is the ``delivery``'s."""

    def __init__(
        self,
        create_env_fns: Sequence[Any],
        policy: Any = None,
        *,
        frames_per_batch: int | Sequence[int] | None = None,
        total_frames: int | None = -1,
        max_frames_per_traj: int | None = None,
        init_random_frames: int | None = None,
        reset_at_each_iter: bool = False,
        split_trajs: bool = False,
        postproc: Callable[[TensorDictBase], TensorDictBase] | None = None,
        exploration_type: str | InteractionType = "random",
        set_truncated: bool = False,
        seed: int | None = None,
        device: Any = None,
        env_device: Any = None,
        policy_device: Any = None,
        storing_device: Any = None,
        replay_buffer: Any = None,
        track_policy_version: bool = False,
        compile_policy: bool | Mapping[str, Any] = False,
        update_at_each_batch: bool = False,
        num_threads: int | None = None,
        num_sub_threads: int = 1,
        worker_backend: str = "process",
        start_method: str | None = None,
        weight_sync: WeightSync | None = None,
        max_policy_lag: int | None = None,
        progress: Any = None,
        traj_id_start: int = 0,
        traj_id_stride: int = 1,
        worker_timeout: float | None = None,
        rollout: RolloutOptions | None = None,
        weights: WeightSchedule | None = None,
        backend: str | None = None,
        delivery: Delivering,
        restart: RestartPolicy | None = None,
    ) -> None:
        env_fns = env_fns_arg(create_env_fns)
        self._delivery = delivery
        options = RolloutOptions.from_kwargs(
            rollout,
            frames_per_batch=frames_per_batch,
            total_frames=total_frames,
            max_frames_per_traj=max_frames_per_traj,
            init_random_frames=init_random_frames,
            reset_at_each_iter=reset_at_each_iter,
            split_trajs=split_trajs,
            set_truncated=set_truncated,
            exploration_type=exploration_type,
            seed=seed,
            device=device,
            env_device=env_device,
            policy_device=policy_device,
            storing_device=storing_device,
            compile_policy=compile_policy,
            traj_id_start=traj_id_start,
            traj_id_stride=traj_id_stride,
            restart=restart,
        )
        schedule = WeightSchedule.from_kwargs(
            weights,
            update_at_each_batch=update_at_each_batch,
            track_policy_version=track_policy_version,
            max_policy_lag=max_policy_lag,
        )
        self._options, self._schedule = options, schedule
        refuse_schedule(self._schedule, type(self).__name__, update_at_each_batch=True)
        self.num_workers = n = len(env_fns)
        self.total_frames = options.total_frames
        self._seed = options.seed
        self._per_worker_fpb = delivery.split_frames(options.frames_per_batch, n)
        self._postproc = optional_callable("postproc", postproc)
        self.replay_buffer = replay_buffer_arg(replay_buffer)
        self._num_threads = optional_positive_int("num_threads", num_threads, fix="None leaves it")
        self._num_sub_threads = positive_int("num_sub_threads", num_sub_threads)
        self._backend = worker_backend_arg(worker_backend, backend)
        self._start_method = start_method_arg(start_method)
        self._source_policy = policy_arg(policy)
        self._weight_sync: WeightSync = weight_sync_arg(weight_sync)
        self._sender: WeightSender | None = None
        self._weights_template = flat_weights(policy) if isinstance(policy, torch.nn.Module) else None
        # the env constructors are pickled here (small: a bad one fails now); the policy, which can be
        # large, once and in a thread when the collector is entered (never on the event loop)
        self._payloads = pickled_env_fns(env_fns)
        self._show_warnings = show_worker_warnings()
        self._init_base(progress)
        self._worker_timeout = timeout_arg(worker_timeout)
        self._pool: WorkerPool | None = None
        self._last_workers: tuple[WorkerStatistics, ...] = ()
        self._closed_before = False
        self._control: SharedBlock | None = None
        self._entered = False
        self._version = 0
        self._issued = 0  # the last version number handed to a publish (interrupted ones included)
        self._weights_lock = anyio.Lock()
        self._saved_threads: int | None = None
        #: per worker, the oldest policy version a delivered batch may have (update_weights(flush=True),
        #: max_policy_lag on MultiAsyncCollector); mirrored in the shared control block's "floor"
        self._floors = [0] * n
        #: frames of stale batches dropped here; frames the workers discarded (the control block's
        #: "discarded"), as they were when the collector closed
        self._dropped_frames = self._last_discarded = 0
        # async: the largest worker batch (all equal unless frames_per_batch is a per-worker list)
        self.frames_per_batch = sum(self._per_worker_fpb) if delivery.sync else max(self._per_worker_fpb)
        start_forkserver(self._backend, self._start_method, type(self).__name__)  # imports meanwhile

    # -- lifecycle --------------------------------------------------------------------------------
    async def _on_enter(self) -> None:
        if self._entered:
            raise RuntimeError("the collector was entered already")
        self._entered = True
        try:
            await self._start_workers()
        except Exception as exc:  # closed on the way out of __aenter__: say why on any further use
            self._closed_reason = f"it failed to start with {type(exc).__name__}: {exc}"
            raise

    async def _start_workers(self) -> None:
        assert self._task_group is not None
        n = self.num_workers
        policy_payload = await self._pickled_policy("the worker processes")
        self._control = SharedBlock(control_layout(n), ())
        self._control.td.zero_()
        self._targets: list[int] = [0] * n  # per worker: the last version published for it
        receivers: list[Any] = [None] * n
        if self._weights_template is not None:
            template = self._weights_template
            self._sender = await anyio.to_thread.run_sync(
                lambda: self._weight_sync.open_sender(template.clone(), n, self._send_to)
            )
            receivers = self._sender.receivers()
        settings = TorchSettings.capture()  # this (the entering) thread's: serial workers take them
        specs = [
            WorkerSpec(
                index=i,
                num_workers=n,
                payload=self._payloads[i],
                policy_payload=policy_payload,
                # worker i's ids: traj_id_start + traj_id_stride * (i + num_workers * k)
                rollout=self._options.for_member(i, n, frames_per_batch=self._per_worker_fpb[i]),
                schedule=self._schedule,
                control_name=self._control.name,
                weights=receivers[i],
                num_threads=self._num_sub_threads,
                in_process=self._backend == "serial",
                show_warnings=self._show_warnings,
                torch_settings=settings,
                run=self._worker_body(),
            )
            for i in range(n)
        ]
        if self._num_threads is not None:
            self._saved_threads = torch.get_num_threads()
            torch.set_num_threads(self._num_threads)
        self._pool = WorkerPool(
            specs,
            backend=self._backend,
            start_method=self._start_method,
            slots_per_worker=self._delivery.slots_per_worker(self),
            on_event=self._hub.publish,
            timeout=self._worker_timeout,
            on_message=self._worker_message,
        )
        if self._sender is not None:
            await gather(
                partial(self._pool.start, self._task_group),
                self._sender.connect,
            )
        else:
            await self._pool.start(self._task_group)
        ready = [w.ready for w in self._pool.workers]
        self._delivery.check_layouts(ready)
        self._worker_frames = [r.frames_per_batch for r in ready if r is not None]
        self.frames_per_batch = (sum if self._delivery.sync else max)(self._worker_frames)
        await self._members_started()
        await self._delivery.started(self, self._pool)

    def _worker_body(self) -> Any:
        """``WorkerSpec.run`` of the workers: None (the rollout worker), or another kind's body."""
        return None

    def _worker_message(self, index: int, msg: Any) -> None:
        """A message of worker ``index``'s own body (``_worker_body``), outside the rollout protocol:
        none by default (``MultiAsyncEnvCollector``'s workers send some)."""

    def _budget_fits_batches(self) -> bool:
        # batches of different sizes (per-worker frames_per_batch) arrive in no set order: no warning
        varied = not self._delivery.sync and len(set(self._worker_frames)) > 1
        return varied or super()._budget_fits_batches()

    async def _shutdown(self) -> None:
        with anyio.CancelScope(shield=True):
            if self._background is not None:
                self._background.cancel()
            if self._control is not None:
                # workers mid-batch stop at their next step instead of finishing it
                self._control.td["stop"].fill_(1)
            async with self._lock:
                self._closed = True
                pool, self._pool = self._pool, None
                if pool is not None:
                    await pool.aclose()
                    self._last_workers = tuple(
                        WorkerStatistics(w.index, w.state, w.frames, w.policy_version) for w in pool.workers
                    )
                if self._control is not None:
                    self._last_discarded = int(self._control.td["discarded"].sum())
                    self._control.unlink()
                    self._control.close()
                    self._control = None
                if self._sender is not None:
                    self._sender.close()
                    self._sender = None
                if self._saved_threads is not None:
                    torch.set_num_threads(self._saved_threads)
                    self._saved_threads = None
                self._hub.close()
                if not self._closed_before:
                    self._closed_before = True
                    self._finish_progress()

    async def aclose(self) -> None:
        """Stop and reap every worker and free every shared-memory segment. Idempotent.

        ``async with`` does this on exit; the collector cannot be used afterwards.
        """
        await self._shutdown()

    def _active_pool(self) -> WorkerPool:
        self._check_open()
        if self._pool is None:
            raise RuntimeError(
                f"{type(self).__name__} starts its workers in `async with`: write "
                f"`async with {type(self).__name__}(...) as collector: async for batch in collector:`"
            )
        return self._pool

    # -- iteration --------------------------------------------------------------------------------
    async def __anext__(self) -> TensorDictBase | None:
        await self._batch_turn()
        try:
            pool = self._active_pool()
            try:
                out = await self._delivery.next_batch(self, pool)
            except Exception as exc:
                if pool.failure is not None:  # closed for good: any further use says so
                    self._closed_reason = f"a worker failed with {type(exc).__name__}: {exc}"
                    self._closed = True
                raise
            self._record(out.frames, out.episodes, worker_id=out.worker_id, policy_version=out.policy_version)
            batch = out.batch
            if self._options.split_trajs:
                batch = split_trajectories(batch)
            if self._postproc is not None:
                batch = self._postproc(batch)
            if self._options.devices.storing is not None:
                batch = batch.to(self._options.devices.storing)
            if self.replay_buffer is not None:
                await anyio.to_thread.run_sync(
                    self.replay_buffer.extend, self._delivery.frames_for_buffer(self, batch)
                )
                return None
            return batch
        finally:
            self._lock.release()

    async def _receive(self, pool: WorkerPool) -> tuple[int, Any]:
        """The next batch notice, or :class:`WorkerTimeoutError` once a worker that should be collecting
        has delivered nothing for ``worker_timeout`` seconds (while others may keep delivering)."""
        timeout = self._worker_timeout
        if timeout is None:
            return await pool.receive()
        while True:
            now = anyio.current_time()
            due = [
                (w.expected_since + timeout, w.index) for w in pool.workers if w.expected_since is not None
            ]
            deadline = min(due)[0] if due else now + timeout
            with anyio.move_on_after(max(0.0, deadline - now)):
                return await pool.receive()
            late = [i for d, i in due if d <= anyio.current_time()]
            if late:
                error = WorkerTimeoutError(
                    f"workers {late} delivered no batch within worker_timeout={timeout} s "
                    "(a hung env or policy?)"
                )
                pool.fail(error)
                raise error

    # -- control ----------------------------------------------------------------------------------
    @property
    def _fleet_size(self) -> int:
        return self.num_workers

    def _members(self) -> Sequence[Member]:
        pool = self._pool
        return pool.workers if pool is not None else ()

    def _active(self) -> None:
        self._active_pool()

    async def _call_member(self, index: int, op: FleetOp) -> Any:
        return await self._active_pool().call(index, op)

    async def state_dict(self, *, envs: bool = False) -> dict[str, Any]:
        """Per-worker state (trajectory-id counters, policy versions, frames, random states; ``envs``:
        the envs' own state, see ``Collector.state_dict``) plus the counters."""
        check_fleet_env_state(envs, self._delivery.sync, self.num_workers)  # _resume.py
        async with self._lock:
            workers = await self._active_pool().call_all(GetState(envs=envs))
        state: dict[str, Any] = {f"worker{i}": sd for i, sd in enumerate(workers)}
        state.update(self._counters())
        weights = workers and await self._active_pool().call(0, GetWeights())
        if weights is not None:
            state["policy"] = weights
        return state

    async def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; the frame budget continues from the saved count."""
        self._check_state(state, "worker")
        async with self._lock:
            pool = self._active_pool()
            for i in range(self.num_workers):
                await pool.call(i, LoadState(dict(state[f"worker{i}"])))
            self._load_counters(state)
            self._issued = max(self._issued, self._version)  # version numbers are never reused
        if "policy" in state and self._weights_template is not None:
            await self.update_weights(state["policy"], wait=True)

    async def getattr_policy(self, name: str) -> Any:
        """An attribute of worker 0's policy."""
        return await self._active_pool().call(0, GetAttr("policy", name))

    async def getattr_env(self, name: str) -> Any:
        """An attribute of worker 0's env."""
        return await self._active_pool().call(0, GetAttr("env", name))

    async def get_distant_attr(self, path: str) -> list[Any]:
        """The object at ``path`` in every worker, in worker order (torchrl's ``get_distant_attr``).

        ``path`` starts with ``env`` or ``policy`` and goes on with attribute names and ``[int]`` /
        ``['key']`` subscripts, e.g. ``"env.transform[0].max_steps"``; it is parsed, never evaluated. The
        value is pickled back from each worker.
        """
        parse_path(path)
        return await self._active_pool().call_all(GetPath(path))

    async def map_fn(
        self,
        path: str,
        list_of_args: Sequence[Sequence[Any]] | None = None,
        list_of_kwargs: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[Any]:
        """Call the method at ``path`` (see :meth:`get_distant_attr`) in every worker, between batches, with
        worker ``i``'s ``list_of_args[i]`` and ``list_of_kwargs[i]`` (default: no arguments); the results in
        worker order (torchrl's ``map_fn``, on the workers' env and policy)."""
        parse_path(path)
        n = self.num_workers
        args = [tuple(a) for a in list_of_args] if list_of_args is not None else [()] * n
        kwargs = [dict(k) for k in list_of_kwargs] if list_of_kwargs is not None else [{}] * n
        if len(args) != n or len(kwargs) != n:
            raise ValueError(
                f"map_fn: list_of_args and list_of_kwargs take one entry per worker ({n}), got "
                f"{len(args)} and {len(kwargs)}"
            )
        async with self._lock:
            pool = self._active_pool()
            calls = [partial(pool.call, i, MapFn(path, args[i], kwargs[i])) for i in range(n)]
            return await gather(*calls)

    async def _send_to(self, index: int, message: Any) -> None:
        await self._active_pool().send(index, message)

    async def update_weights(
        self,
        policy_or_weights: Any = None,
        *,
        worker_ids: Sequence[int] | None = None,
        wait: bool = False,
        flush: bool = False,
    ) -> int:
        """Publish weights to the workers (through ``weight_sync``) and return the new policy version.

        Workers load them at their next batch boundary (never mid-step); ``wait=True`` returns only when
        every targeted worker runs the new version. Concurrent calls are serialised: versions strictly
        increase.

        ``flush=True`` makes every batch delivered from then on (from the targeted workers) one
        collected entirely with the new weights: batches waiting in the workers' slots are dropped
        (their slots freed at once), and rollouts in flight stop at their next step and start again on
        the new weights, their partial frames discarded. The envs are not reset. Discarded frames are
        counted in ``statistics().frames_discarded``. ``max_policy_lag=0`` on ``MultiAsyncCollector``
        flushes at every update. On ``MultiAsyncEnvCollector`` each worker instead drops the frames it
        holds below the floor, and the workers below it load the new weights before this returns.

        Args:
            policy_or_weights: an ``nn.Module``, a TensorDict of weights or a state dict; ``None`` means
                the policy the collector was built with (its current weights). Parameters and buffers.
            worker_ids: the workers to update (default: all).
            wait: wait until those workers run the new weights.
            flush: deliver nothing collected with older weights from now on (see above).

        Example:
            >>> async def train(collector, policy):  # doctest: +SKIP
            ...     async for batch in collector:
            ...         ppo_update(policy, batch)
            ...         await collector.update_weights(policy, flush=True)  # the next batch is on-policy
        """
        if not isinstance(flush, bool):
            raise TypeError(f"flush must be True or False, got {flush!r}")
        self._check_open()  # a closed collector says so first, an un-entered one after the policy check
        weights = self._weights_to_publish(policy_or_weights)
        pool = self._active_pool()
        assert self._sender is not None  # a collector with weights has a sender
        ids = self._target_ids(worker_ids)
        raised: list[int] = []  # the workers whose staleness floor rose
        async with self._weights_lock:
            # numbers are never reused: an update interrupted midway may still reach some workers
            version = self._issued = self._issued + 1
            if self._sender.one_copy and len(ids) < len(pool.workers):
                await self._load_pending(pool, ids)
            await self._publish(pool, weights, version, ids)
            for i in ids:
                self._targets[i] = version
            self._version = version
            self._hub.publish(WeightsPublished(version))
            if self._control is not None:
                # the floors first: a worker that reads the new "published" sees them (Worker._spare_ids)
                floor = self._delivery.floor_after(self, version, flush)
                raised = self._raise_floors(ids, floor) if floor is not None else []
                published = self._control.td["published"]
                for i in ids:
                    published[i] = version
                if raised:
                    await self._delivery.drop_stale(self, pool)
        if wait:
            await self._load_now(pool, ids)
        elif raised:
            await self._delivery.load_behind(self, pool, raised)
        return version

    def _raise_floors(self, ids: list[int], floor: int) -> list[int]:
        """Workers ``ids`` deliver nothing older than ``floor`` from now on: the shared floor makes their
        rollouts in flight restart (the weights are published already); the workers whose floor rose."""
        assert self._control is not None
        raised = [i for i in ids if floor > self._floors[i]]
        for i in raised:
            self._floors[i] = self._control.td["floor"][i] = floor
        return raised

    def _frames_discarded(self) -> int:
        """Frames collected and not delivered: rollouts the workers restarted on newer weights, and
        batches dropped here as stale."""
        control = self._control
        in_workers = int(control.td["discarded"].sum()) if control is not None else self._last_discarded
        return in_workers + self._dropped_frames

    @staticmethod
    async def _load_now(pool: WorkerPool, ids: list[int]) -> None:
        """Workers ``ids`` load the newest weights published for them now (between two policy calls), and
        the versions they then run are noted."""
        loaded = await gather(*[partial(pool.call, i, LoadWeights()) for i in ids])
        for i, worker_version in zip(ids, loaded, strict=True):
            pool.note_version(i, worker_version)

    async def _load_pending(self, pool: WorkerPool, ids: list[int]) -> None:
        """Before an update to the workers ``ids`` only, through a scheme with one copy of the weights: the
        other workers load the version published for them that they may not have loaded yet (else they
        would load the new weights under their own version)."""
        pending = [
            i
            for i, handle in enumerate(pool.workers)
            if i not in ids and self._targets[i] > handle.policy_version
        ]
        await self._load_now(pool, pending)

    async def _publish(self, pool: WorkerPool, weights: TensorDictBase, version: int, ids: list[int]) -> None:
        """``sender.publish`` raced against the workers' exits: a worker that fails or dies while an update
        is in flight (a collective transfer waits for every worker) ends it with that worker's error."""
        sender = self._sender
        assert sender is not None
        outcome: list[Exception | None] = []

        async with anyio.create_task_group() as tg:

            async def run() -> None:
                try:
                    await sender.publish(weights, version, ids)
                    outcome.append(None)
                except Exception as exc:
                    outcome.append(exc)
                tg.cancel_scope.cancel()

            tg.start_soon(run)
            await _first_exit(pool)
            tg.cancel_scope.cancel()
        if outcome == [None]:
            return
        if pool.failure is None and outcome:
            # the transfer failed, typically because a worker died: its reader is about to say so
            with anyio.move_on_after(2.0):
                await _first_exit(pool)
        if pool.failure is not None:
            raise pool.failure
        if outcome and outcome[0] is not None:
            raise outcome[0]
        raise CollectorClosedError("a worker stopped while weights were being published")
