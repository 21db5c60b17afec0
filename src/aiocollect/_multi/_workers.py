"""The worker pool as a :class:`~aiocollect._fleet._collector.Transport` of the one
:class:`~aiocollect._fleet._collector.FleetCollector` (:class:`Workers`), and what the multi-process
collectors
add to the fleet's surface (:class:`WorkersMixin`: ``get_distant_attr``, ``map_fn``).

Each worker (a process, or a thread with ``worker_backend="serial"``) runs the rollout core and writes
batches into shared-memory slots; the parent's task group merges their notices into one ``async for``.
How a batch is gathered is the :class:`~._delivery.Delivering` the public class picks (``Gather`` for
``MultiSyncCollector``, ``FirstReady`` for the others).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import anyio
import anyio.abc
import anyio.to_thread
import torch
from tensordict import TensorDictBase
from tensordict.nn import InteractionType

from .._core._errors import CollectorClosedError, WorkerTimeoutError
from .._core._gather import gather
from .._core._options import RolloutOptions, WeightSchedule, refuse_schedule, worker_backend_arg
from .._core._restart import RestartPolicy, derive_seed
from .._core._resume import check_fleet_env_state
from .._core._torch_settings import TorchSettings
from .._core._validation import (
    optional_callable,
    optional_positive_int,
    policy_arg,
    positive_int,
    replay_buffer_arg,
    timeout_arg,
)
from .._episodes._trajectories import split_trajectories
from .._fleet._collector import Arrival, FleetCollector
from .._observe._stats import WorkerStatistics
from .._policies._weights import weights_template
from .._transport._messages import FleetOp, GetPath, GetWeights, LoadWeights, MapFn, SetSeed
from .._transport._shm import SharedBlock
from .._weightsync._schemes import (
    PipeWeightSync,
    SharedMemoryWeightSync,
    WeightSender,
    WeightSync,
    weight_sync_arg,
)
from .._workers._paths import parse_path
from .._workers._pool import WorkerHandle, WorkerPool, start_forkserver
from .._workers._worker import WorkerSpec, control_layout
from ._args import env_fns_arg, pickled_env_fns, show_worker_warnings, start_method_arg
from ._episodes import Episodes

if TYPE_CHECKING:
    from ._delivery import Delivering

__all__ = ["Workers", "WorkersMixin", "init_workers"]


async def _first_exit(pool: WorkerPool) -> None:
    """Return when any worker has exited (its reader has recorded why)."""
    async with anyio.create_task_group() as tg:

        async def wait(exited: anyio.Event) -> None:
            await exited.wait()
            tg.cancel_scope.cancel()

        for handle in pool.workers:
            tg.start_soon(wait, handle.exited)


def _envs_per_step(handle: WorkerHandle) -> int:
    """Frames a worker's step makes: its batch's size without the time dim."""
    size = handle.ready.batch_size[:-1] if handle.ready is not None else ()
    return int(math.prod(size))


def init_workers(
    fleet: FleetCollector,
    create_env_fns: Sequence[Any],
    policy: Any = None,
    *,
    delivery: Delivering,
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
    restart: RestartPolicy | None = None,
    body: Any = None,
    on_message: Callable[[int, Any], None] | None = None,
) -> Workers:
    """Build ``fleet`` (a multi-process collector being constructed) over a pool of workers, one per env
    constructor, with the keywords checked into options; ``body``/``on_message``: the workers' own body
    (``WorkerSpec.run``) and a handler of its messages (``MultiAsyncEnvCollector``'s)."""
    env_fns = env_fns_arg(create_env_fns)
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
        **Episodes.rollout_options(delivery),
    )
    schedule = WeightSchedule.from_kwargs(
        weights,
        update_at_each_batch=update_at_each_batch,
        track_policy_version=track_policy_version,
        max_policy_lag=max_policy_lag,
    )
    refuse_schedule(schedule, type(fleet).__name__, update_at_each_batch=True)
    n = len(env_fns)
    per_worker = delivery.split_frames(options.frames_per_batch, n)
    workers = Workers(
        fleet,
        delivery,
        pickled_env_fns(env_fns),  # small: a bad one fails now; the policy once entered, in a thread
        options,
        schedule,
        per_worker,
        postproc=optional_callable("postproc", postproc),
        threads=(optional_positive_int("num_threads", num_threads, fix="None leaves it"), num_sub_threads),
        backend=worker_backend_arg(worker_backend, backend),
        start_method=start_method_arg(start_method),
        weight_sync=weight_sync_arg(weight_sync),
        timeout=timeout_arg(worker_timeout),
        body=body,
        on_message=on_message,
    )
    fleet.num_workers = n  # type: ignore[attr-defined]
    fleet._floor_lag = None if delivery.sync else schedule.max_policy_lag
    fleet._episodes = Episodes.checked(delivery, type(fleet).__name__, options)  # type: ignore[attr-defined]
    fleet._init_fleet(
        workers,
        size=n,
        sync=delivery.sync,
        total_frames=options.total_frames,
        # async: the largest worker batch (all equal unless frames_per_batch is a per-worker list)
        frames_per_batch=sum(per_worker) if delivery.sync else max(per_worker),
        policy=policy_arg(policy),
        weights_template=weights_template(policy),
        seed=options.seed,
        replay_buffer=replay_buffer_arg(replay_buffer),
        progress=progress,
    )
    start_forkserver(workers.backend, workers.start_method, type(fleet).__name__)  # imports meanwhile
    return workers


class Workers:
    """The worker pool of a multi-process collector (``fleet``), a
    :class:`~aiocollect._fleet._collector.Transport`:
    the workers, their shared control block (stop flags, staleness floors, versions published, frames
    discarded) and the weights' sender; ``delivery`` says how a batch is gathered."""

    state_prefix = "worker"
    versioned = False

    def __init__(
        self,
        fleet: FleetCollector,
        delivery: Delivering,
        payloads: list[bytes],
        options: RolloutOptions,
        schedule: WeightSchedule,
        per_worker_frames: list[int],
        *,
        postproc: Callable[[TensorDictBase], TensorDictBase] | None,
        threads: tuple[int | None, int],
        backend: str,
        start_method: str,
        weight_sync: WeightSync,
        timeout: float | None,
        body: Any,
        on_message: Callable[[int, Any], None] | None,
    ) -> None:
        self.fleet, self.delivery, self.options, self.schedule = fleet, delivery, options, schedule
        self.num_workers = len(payloads)
        self._payloads, self._per_worker_frames, self._postproc = payloads, per_worker_frames, postproc
        self._num_threads, self._num_sub_threads = threads[0], positive_int("num_sub_threads", threads[1])
        self.backend, self.start_method, self._weight_sync = backend, start_method, weight_sync
        self.timeout, self._body, self._on_message = timeout, body, on_message
        self._show_warnings = show_worker_warnings()
        self.pool: WorkerPool | None = None
        self.control: SharedBlock | None = None
        self.sender: WeightSender | None = None
        self._targets = [0] * self.num_workers  # per worker: the last version published for it
        #: per worker, the weights last published for it (handed to a replacement, pipe sync)
        self._last_weights: list[TensorDictBase | None] = [None] * self.num_workers
        self._saved_threads: int | None = None
        self._last_discarded = 0  # the control block's "discarded" when the collector closed
        self._stopped = False

    @property
    def floors(self) -> list[int]:
        """Per worker, the oldest policy version a delivered batch may have (mirrored in the control
        block's "floor")."""
        return self.fleet._floors

    @property
    def started(self) -> bool:
        return self.pool is not None and not self._stopped

    def members(self) -> Sequence[WorkerHandle]:
        return self.pool.workers if self.started and self.pool is not None else ()

    # -- start --------------------------------------------------------------------------------------
    async def start(self) -> list[int]:
        try:
            return await self._start()
        except Exception as exc:  # closed on the way out of __aenter__: say why on any further use
            self.fleet._closed_reason = f"it failed to start with {type(exc).__name__}: {exc}"
            raise

    async def _start(self) -> list[int]:
        fleet, n = self.fleet, self.num_workers
        assert fleet._task_group is not None
        policy_payload = await fleet._pickled_policy("the worker processes")
        self.control = SharedBlock(control_layout(n), ())
        self.control.td.zero_()
        receivers: list[Any] = [None] * n
        if fleet._weights_template is not None:
            template = fleet._weights_template
            self.sender = await anyio.to_thread.run_sync(
                lambda: self._weight_sync.open_sender(template.clone(), n, self._send_to)
            )
            receivers = self.sender.receivers()
        settings = TorchSettings.capture()  # this (the entering) thread's: serial workers take them
        specs = [
            WorkerSpec(
                index=i,
                num_workers=n,
                payload=self._payloads[i],
                policy_payload=policy_payload,
                # worker i's ids: traj_id_start + traj_id_stride * (i + num_workers * k)
                rollout=self.options.for_member(i, n, frames_per_batch=self._per_worker_frames[i]),
                schedule=self.schedule,
                control_name=self.control.name,
                weights=receivers[i],
                num_threads=self._num_sub_threads,
                in_process=self.backend == "serial",
                show_warnings=self._show_warnings,
                torch_settings=settings,
                run=self._body,
            )
            for i in range(n)
        ]
        if self._num_threads is not None:
            self._saved_threads = torch.get_num_threads()
            torch.set_num_threads(self._num_threads)
        self.pool = pool = WorkerPool(
            specs,
            backend=self.backend,
            start_method=self.start_method,
            slots_per_worker=self.delivery.slots_per_worker(self),
            on_event=fleet._hub.publish,
            timeout=self.timeout,
            on_message=self._on_message or (lambda index, msg: None),
            restart=self._worker_restarts(),
            on_replaced=self._replaced,
        )
        if self.sender is not None:
            await gather(partial(pool.start, fleet._task_group), self.sender.connect)
        else:
            await pool.start(fleet._task_group)
        ready = [w.ready for w in pool.workers]
        self.delivery.check_layouts(ready)
        return [r.frames_per_batch for r in ready if r is not None]

    async def run(self) -> None:
        await self.delivery.started(self)

    def _worker_restarts(self) -> RestartPolicy | None:
        """The policy that replaces workers that die or hang, with weights in shared memory or through
        the pipe (a collective transfer cannot take in a new process); ``MultiAsyncEnvCollector``'s
        workers also restart their envs themselves."""
        sync = self._weight_sync
        if not isinstance(sync, (SharedMemoryWeightSync, PipeWeightSync)):
            return None
        return self.options.restart

    async def _replaced(self, index: int) -> None:
        """Worker ``index`` was replaced (``RestartPolicy``): seed it from its seed and its replacements,
        load the newest weights published for it, then let it collect."""
        pool, control = self.pool, self.control
        assert pool is not None
        assert control is not None
        handle = pool.workers[index]
        # the steps its predecessor began in its last batch are lost (the one it died in, too)
        steps, numel = int(control.td["progress"][index]), _envs_per_step(handle)
        control.td["progress"][index] = 0
        if pool.replacer is not None:
            pool.replacer.discarded_frames += max(0, steps - 1) * numel
        seed, replacer = self.fleet.member_seeds.get(index), pool.replacer
        if seed is not None and replacer is not None:
            await pool.call(index, SetSeed(cast("int", derive_seed(seed, replacer.count(index)))))
        if self.sender is not None:
            weights = self._last_weights[index]
            if not self.sender.one_copy and weights is not None:
                await self.sender.publish(weights, self._targets[index], [index])
            pool.note_version(index, await pool.call(index, LoadWeights()))
        handle.expected_since = None
        await self.delivery.replaced(self, index)

    # -- deliveries ---------------------------------------------------------------------------------
    async def next_delivery(self) -> Arrival:
        pool = self.pool
        assert pool is not None
        try:
            out = await self.delivery.next_batch(self)
        except Exception as exc:
            if pool.failure is not None:  # closed for good: any further use says so
                self.fleet._closed_reason = f"a worker failed with {type(exc).__name__}: {exc}"
                self.fleet._closed = True
            raise
        batch = out.batch
        if self.options.split_trajs:
            batch = split_trajectories(batch)
        if self._postproc is not None:
            batch = self._postproc(batch)
        if self.options.devices.storing is not None:
            batch = batch.to(self.options.devices.storing)
        if self.fleet.replay_buffer is not None:
            batch = self.delivery.frames_for_buffer(self, batch)
        out.batch = batch
        return out

    async def receive(self) -> tuple[int, Any]:
        """The next batch notice, or :class:`WorkerTimeoutError` once a worker that should be collecting
        has delivered nothing for ``worker_timeout`` seconds (while others may keep delivering)."""
        pool, timeout = self.pool, self.timeout
        assert pool is not None
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
                if pool.replacer is not None and all([pool.replacer.kill_hung(i, error) for i in late]):
                    continue  # killed, to be replaced (RestartPolicy)
                pool.fail(error)
                raise error

    # -- weights ------------------------------------------------------------------------------------
    async def publish(self, weights: TensorDictBase, version: int, ids: list[int]) -> None:
        """Through ``weight_sync``: workers ``ids`` load ``version`` at their next batch boundary."""
        pool, sender = self.pool, self.sender
        assert pool is not None
        assert sender is not None  # a collector with weights has a sender
        if sender.one_copy and len(ids) < len(pool.workers):
            # one copy of the weights: the other workers load what was published for them first (else
            # they would load the new weights under their own version)
            behind = enumerate(pool.workers)
            pending = [i for i, h in behind if i not in ids and self._targets[i] > h.policy_version]
            await self.load_now(pending, version, None)
        if pool.restart is not None:  # a worker that dies meanwhile gets these once replaced
            await sender.publish(weights, version, ids)
        else:
            await self._publish(pool, sender, weights, version, ids)
        for i in ids:
            self._targets[i] = version
            self._last_weights[i] = weights

    async def published(self, version: int, ids: list[int], raised: list[int]) -> None:
        """The shared floors first (a worker that reads the new "published" sees them), then the
        versions; the batches waiting below a raised floor are dropped now."""
        control = self.control
        assert control is not None
        for i in raised:
            control.td["floor"][i] = self.fleet._floors[i]
        published = control.td["published"]
        for i in ids:
            published[i] = version
        if raised:
            await self.delivery.drop_stale(self)

    async def load_now(self, ids: list[int], version: int, published: Any) -> None:
        """Workers ``ids`` load the newest weights published for them now (between two policy calls), and
        the versions they then run are noted."""
        pool = self.pool
        assert pool is not None
        loaded = await gather(*[partial(pool.call, i, LoadWeights()) for i in ids])
        for i, worker_version in zip(ids, loaded, strict=True):
            pool.note_version(i, worker_version)

    async def load_behind(self, raised: list[int]) -> None:
        await self.delivery.load_behind(self, raised)

    @staticmethod
    async def _publish(
        pool: WorkerPool, sender: WeightSender, weights: TensorDictBase, version: int, ids: list[int]
    ) -> None:
        """``sender.publish`` raced against the workers' exits: a worker that fails or dies while an update
        is in flight (a collective transfer waits for every worker) ends it with that worker's error."""
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

    async def _send_to(self, index: int, message: Any) -> None:
        assert self.pool is not None
        await self.pool.send(index, message)

    # -- calls, state, stop -------------------------------------------------------------------------
    async def call_each(self, ops: Sequence[tuple[int, FleetOp]]) -> list[Any]:
        pool = self.pool
        assert pool is not None
        return await gather(*[partial(pool.call, i, op) for i, op in ops])

    def discarded(self) -> int:
        control, pool = self.control, self.pool
        replaced = pool.replacer.discarded_frames if pool is not None and pool.replacer is not None else 0
        own = int(control.td["discarded"].sum()) if control is not None else self._last_discarded
        return replaced + own

    def check_env_state(self, envs: bool) -> None:
        check_fleet_env_state(envs, self.delivery.sync, self.num_workers)  # _core/_resume.py

    async def saved_policy(self, states: list[Any]) -> Any:
        return await self.pool.call(0, GetWeights()) if states and self.pool is not None else None

    async def stop(self) -> None:
        with anyio.CancelScope(shield=True):
            if self.control is not None:
                # workers mid-batch stop at their next step instead of finishing it
                self.control.td["stop"].fill_(1)
            async with self.fleet._lock:  # after the batch in flight (its workers stop at their next step)
                self.fleet._closed = True
                if self._stopped:
                    return
                if self.pool is not None:  # (members() go on until the pool is closed: statistics())
                    await self.pool.aclose()
                    self.fleet._last_workers = tuple(
                        WorkerStatistics(w.index, w.state, w.frames, w.policy_version, restarts=w.restarts)
                        for w in self.pool.workers
                    )
                self._stopped = True
                if self.control is not None:
                    self._last_discarded = int(self.control.td["discarded"].sum())
                    self.control.unlink()
                    self.control.close()
                    self.control = None
                if self.sender is not None:
                    self.sender.close()
                    self.sender = None
                if self._saved_threads is not None:
                    torch.set_num_threads(self._saved_threads)
                    self._saved_threads = None


class WorkersMixin:
    """What the multi-process collectors add to the fleet's surface: the workers' envs and policies
    reached by path (torchrl's ``get_distant_attr``, ``map_fn``)."""

    num_workers: int
    _workers: Workers
    _lock: anyio.Lock

    if TYPE_CHECKING:

        def _active(self) -> None: ...

    @property
    def _pool(self) -> WorkerPool | None:
        """The worker pool (``None`` before ``async with``)."""
        return self._workers.pool

    def _active_pool(self) -> WorkerPool:
        self._active()
        assert self._workers.pool is not None
        return self._workers.pool

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
            return await gather(*[partial(pool.call, i, MapFn(path, args[i], kwargs[i])) for i in range(n)])
