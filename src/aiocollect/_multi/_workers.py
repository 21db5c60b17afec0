"""The worker pool as a :class:`~aiocollect._fleet._transport.Transport` of the one
:class:`~aiocollect._fleet._collector.FleetCollector` (:class:`Workers`), its keywords checked into options
(:func:`init_workers`), a lost worker's respawn (:class:`_Replacing`, driven by the fleet's replacements),
and what the multi-process collectors add to the fleet's surface (:class:`WorkersMixin`:
``get_distant_attr``, ``map_fn``).

Each worker (a process, or a thread with ``worker_backend="serial"``) runs the rollout core and writes
batches into shared-memory slots; the parent's task group merges their notices into one ``async for``.
How a batch is gathered is the :class:`~._delivery.Delivering` the public class picks (``Gather`` for
``MultiSyncCollector``, ``FirstReady`` for the others).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar, Unpack

import anyio
import anyio.abc
import anyio.to_thread
import torch
from tensordict import TensorDictBase

from .._core._errors import CollectorClosedError, WorkerTimeoutError
from .._core._gather import gather
from .._core._keywords import rollout_keywords
from .._core._mistakes import keyword_list
from .._core._options import RolloutOptions, WeightSchedule, refuse_schedule, worker_backend_arg
from .._core._resume import check_fleet_env_state
from .._core._torch_settings import TorchSettings
from .._core._validation import optional_callable, optional_positive_int, positive_int, timeout_arg
from .._episodes._trajectories import split_trajectories
from .._fleet._replace import restarted_options
from .._fleet._transport import Arrival, FleetHandle, FleetSetup, Transport
from .._policies._weights import weights_template
from .._transport._messages import FleetOp, GetPath, GetWeights, LoadWeights, MapFn
from .._transport._shm import SharedBlock
from .._weightsync._schemes import (
    PipeWeightSync,
    SharedMemoryWeightSync,
    WeightSender,
    WeightSync,
    weight_sync_arg,
)
from .._workers._forkserver import start_forkserver
from .._workers._paths import parse_path
from .._workers._pool import WorkerHandle, WorkerPool
from .._workers._replace import Respawner, WorkerRespawn
from .._workers._worker import WorkerSpec, control_layout
from ._args import env_fns_arg, pickled_env_fns, show_worker_warnings, start_method_arg
from ._delivery import Delivering, WorkersView
from ._episodes import Episodes
from ._keywords import WorkersKeywords

# (with what the collectors over the pool take from here: what it delivers, what a delivery sees of it)
__all__ = [
    "Arrival",
    "Workers",
    "WorkersKeywords",
    "WorkersMixin",
    "WorkersPlan",
    "WorkersView",
    "init_workers",
]

T = TypeVar("T", bound=Transport)

#: the defaults of the keywords a caller leaves out (``MultiAsyncEnvCollector`` gives a part of the list)
_DEFAULTS = keyword_list(WorkersKeywords).defaults


async def _first_exit(pool: WorkerPool) -> None:
    """Return when any worker has exited (its reader has recorded why)."""
    async with anyio.create_task_group() as tg:

        async def wait(exited: anyio.Event) -> None:
            await exited.wait()
            tg.cancel_scope.cancel()

        for handle in pool.workers:
            tg.start_soon(wait, handle.exited)


@dataclass(frozen=True)
class WorkersPlan:
    """A worker pool's keywords, checked (:func:`init_workers`): what its workers run and how they start."""

    #: the pickled env constructors, one per worker
    payloads: list[bytes]
    options: RolloutOptions
    schedule: WeightSchedule
    #: each worker's frames per batch
    per_worker: list[int]
    postproc: Callable[[TensorDictBase], TensorDictBase] | None
    num_threads: int | None
    num_sub_threads: int
    backend: str
    start_method: str
    weight_sync: WeightSync
    timeout: float | None
    #: the policy's flat weights (``None``: it has none) and whether batches go to a replay buffer
    weights_template: TensorDictBase | None
    buffering: bool
    #: the workers' own body (``WorkerSpec.run``) and a handler of its messages (``MultiAsyncEnvCollector``)
    body: Any = None
    on_message: Callable[[int, Any], None] | None = None


def init_workers(
    create_env_fns: Sequence[Any],
    policy: Any,
    delivery: Delivering,
    keywords: Mapping[str, Any],
    *,
    owner: str,
    body: Any = None,
    on_message: Callable[[int, Any], None] | None = None,
) -> tuple[FleetSetup, Callable[[FleetHandle], Workers]]:
    """A multi-process collector (``owner``, its class name) over a pool of workers, one per env
    constructor: its keywords (a :class:`~._keywords.WorkersKeywords`, or a part of one: the others take
    their defaults) checked into options; what the fleet is set up with, and its transport.
    ``body``/``on_message``: the workers' own body and a handler of its messages."""
    kw = {**_DEFAULTS, **keywords}
    env_fns = env_fns_arg(create_env_fns)
    options = RolloutOptions.from_kwargs(
        kw["rollout"],
        frames_per_batch=kw["frames_per_batch"],
        **rollout_keywords(kw),
        **Episodes.rollout_options(delivery),
    )
    schedule = WeightSchedule.from_kwargs(
        kw["weights"],
        update_at_each_batch=kw["update_at_each_batch"],
        track_policy_version=kw["track_policy_version"],
        max_policy_lag=kw["max_policy_lag"],
    )
    refuse_schedule(schedule, owner, update_at_each_batch=True)
    n = len(env_fns)
    per_worker = delivery.split_frames(options.frames_per_batch, n)
    template = weights_template(policy)
    plan = WorkersPlan(
        pickled_env_fns(env_fns),  # small: a bad one fails now; the policy once entered, in a thread
        options,
        schedule,
        per_worker,
        postproc=optional_callable("postproc", kw["postproc"]),
        num_threads=optional_positive_int("num_threads", kw["num_threads"], fix="None leaves it"),
        num_sub_threads=positive_int("num_sub_threads", kw["num_sub_threads"]),
        backend=worker_backend_arg(kw["worker_backend"], kw["backend"]),
        start_method=start_method_arg(kw["start_method"]),
        weight_sync=weight_sync_arg(kw["weight_sync"]),
        timeout=timeout_arg(kw["worker_timeout"]),
        weights_template=template,
        buffering=kw["replay_buffer"] is not None,
        body=body,
        on_message=on_message,
    )
    setup = FleetSetup(
        size=n,
        sync=delivery.sync,
        total_frames=options.total_frames,
        # async: the largest worker batch (all equal unless frames_per_batch is a per-worker list)
        frames_per_batch=sum(per_worker) if delivery.sync else max(per_worker),
        policy=policy,
        weights_template=template,
        seed=options.seed,
        replay_buffer=kw["replay_buffer"],
        progress=kw["progress"],
        floor_lag=None if delivery.sync else schedule.max_policy_lag,
        episodes=Episodes.checked(delivery, owner, options),
        # workers that die or hang are replaced with weights in shared memory or through the pipe (a
        # collective transfer cannot take in a new process); MultiAsyncEnvCollector's also restart envs
        restart=options.restart
        if isinstance(plan.weight_sync, (SharedMemoryWeightSync, PipeWeightSync))
        else None,
    )
    return setup, partial(Workers, delivery=delivery, plan=plan, owner=owner)


class Workers:
    """The worker pool of a multi-process collector, a :class:`~aiocollect._fleet._transport.Transport`:
    the workers, their shared control block (stop flags, staleness floors, versions published, frames
    discarded) and the weights' sender; ``delivery`` says how a batch is gathered, ``fleet`` is the
    collector's handle."""

    state_prefix = "worker"
    versioned = False

    def __init__(self, fleet: FleetHandle, *, delivery: Delivering, plan: WorkersPlan, owner: str) -> None:
        self.fleet, self.delivery, self.plan = fleet, delivery, plan
        self.options, self.schedule = plan.options, plan.schedule
        self.num_workers = len(plan.payloads)
        self.timeout = plan.timeout
        self._show_warnings = show_worker_warnings()
        self.pool: WorkerPool | None = None
        self.control: SharedBlock | None = None
        self.sender: WeightSender | None = None
        self._respawner: Respawner | None = None
        self._targets = [0] * self.num_workers  # per worker: the last version published for it
        self._saved_threads: int | None = None
        self._last_discarded = 0  # the control block's "discarded" when the collector closed
        self._stopped = False
        start_forkserver(plan.backend, plan.start_method, owner)  # its imports run meanwhile

    @property
    def floors(self) -> Sequence[int]:
        """Per worker, the oldest policy version a delivered batch may have (the control block's "floor")."""
        return self.fleet.floors

    @property
    def started(self) -> bool:
        return self.pool is not None and not self._stopped

    def members(self) -> Sequence[WorkerHandle]:
        return self.pool.workers if self.pool is not None else ()

    # -- start --------------------------------------------------------------------------------------
    async def start(self) -> list[int]:
        try:
            return await self._start()
        except Exception as exc:  # closed on the way out of __aenter__: say why on any further use
            self.fleet.fail(f"it failed to start with {type(exc).__name__}: {exc}")
            raise

    async def _start(self) -> list[int]:
        fleet, plan, n = self.fleet, self.plan, self.num_workers
        tg = fleet.task_group
        policy_payload = await fleet.pickled_policy("the worker processes")
        self.control = SharedBlock(control_layout(n), ())
        self.control.td.zero_()
        receivers: list[Any] = [None] * n
        if (template := plan.weights_template) is not None:
            self.sender = await anyio.to_thread.run_sync(
                lambda: plan.weight_sync.open_sender(template.clone(), n, self._send_to)
            )
            receivers = self.sender.receivers()
        settings = TorchSettings.capture()  # this (the entering) thread's: serial workers take them
        specs = [
            WorkerSpec(
                index=i,
                num_workers=n,
                payload=plan.payloads[i],
                policy_payload=policy_payload,
                # worker i's ids: traj_id_start + traj_id_stride * (i + num_workers * k)
                rollout=self.options.for_member(i, n, frames_per_batch=plan.per_worker[i]),
                schedule=self.schedule,
                control_name=self.control.name,
                weights=receivers[i],
                num_threads=plan.num_sub_threads,
                in_process=plan.backend == "serial",
                show_warnings=self._show_warnings,
                torch_settings=settings,
                run=plan.body,
            )
            for i in range(n)
        ]
        if plan.num_threads is not None:
            self._saved_threads = torch.get_num_threads()
            torch.set_num_threads(plan.num_threads)
        self.pool = pool = WorkerPool(
            specs,
            backend=plan.backend,
            start_method=plan.start_method,
            slots_per_worker=self.delivery.slots_per_worker(self),
            stacked=self.delivery.stacked,
            on_event=fleet.publish,
            timeout=self.timeout,
            on_message=plan.on_message or (lambda index, msg: None),
        )
        if fleet.replacements is not None:
            self._respawner = pool.respawner = Respawner(pool, self)
        if self.sender is not None:
            await gather(partial(pool.start, tg), self.sender.connect)
        else:
            await pool.start(tg)
        self.delivery.check_layouts(ready := [w.ready for w in pool.workers])
        return [r.frames_per_batch for r in ready if r is not None]

    async def run(self) -> None:
        await self.delivery.started(self)

    # -- replacements (aiocollect._workers._replace.PoolOwner) ---------------------------------------
    def replace(self, handle: WorkerHandle, cause: BaseException, respawn: WorkerRespawn) -> bool:
        replacements = self.fleet.replacements
        progressed = handle.frames > handle.born_frames  # it delivered: the backoff starts again
        return replacements is not None and replacements.later(
            handle.index, cause, respawn, progressed=progressed
        )

    def may_kill(self, index: int, error: BaseException) -> bool:
        replacements = self.fleet.replacements
        return (
            replacements is not None and replacements.counts(error) and not replacements.spent(index, error)
        )

    def respawned_spec(self, index: int, restarts: int) -> WorkerSpec:
        assert self.pool is not None
        original = self.pool.specs[index]  # ids and seed from the first generation's
        return replace(original, rollout=restarted_options(original.rollout, restarts))

    def discard(self, frames: int) -> None:
        self.fleet.discard(frames)

    async def collect(self, index: int) -> None:
        await self.delivery.replaced(self, index)

    # -- deliveries ---------------------------------------------------------------------------------
    async def next_delivery(self) -> Arrival:
        pool = self.pool
        assert pool is not None
        try:
            out = await self.delivery.next_batch(self)
        except Exception as exc:
            if pool.failure is not None:  # closed for good: any further use says so
                self.fleet.fail(f"a worker failed with {type(exc).__name__}: {exc}", close=True)
            raise
        batch = out.batch
        if self.options.split_trajs:
            batch = split_trajectories(batch)
        if self.plan.postproc is not None:
            batch = self.plan.postproc(batch)
        if self.options.devices.storing is not None:
            batch = batch.to(self.options.devices.storing)
        if self.plan.buffering:
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
                respawner = self._respawner
                if respawner is not None and all([respawner.kill_hung(i, error) for i in late]):
                    continue  # killed, to be replaced (RestartPolicy)
                pool.fail(error)
                raise error

    # -- weights ------------------------------------------------------------------------------------
    async def publish(self, weights: TensorDictBase, version: int, ids: list[int]) -> TensorDictBase | None:
        """Through ``weight_sync``: workers ``ids`` load ``version`` at their next batch boundary; what a
        replacement of one of them is sent again (the weights, unless they are one shared copy)."""
        pool, sender = self.pool, self.sender
        assert pool is not None
        assert sender is not None  # a collector with weights has a sender
        if sender.one_copy and len(ids) < len(pool.workers):
            # one copy of the weights: the other workers load what was published for them first (else
            # they would load the new weights under their own version)
            behind = enumerate(pool.workers)
            pending = [i for i, h in behind if i not in ids and self._targets[i] > h.policy_version]
            await self.load_now(pending, version, None)
        if pool.respawner is not None:  # a worker that dies meanwhile gets these once replaced
            await sender.publish(weights, version, ids)
        else:
            await self._publish(pool, sender, weights, version, ids)
        for i in ids:
            self._targets[i] = version
        return None if sender.one_copy else weights

    async def published(self, version: int, ids: list[int], raised: list[int]) -> None:
        """The shared floors first (a worker that reads the new "published" sees them), then the
        versions; the batches waiting below a raised floor are dropped now."""
        control = self.control
        assert control is not None
        for i in raised:
            control.td["floor"][i] = self.fleet.floors[i]
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
        control = self.control
        replaced = self._respawner.discarded_frames if self._respawner is not None else 0
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
            async with (
                self.fleet.batch_lock
            ):  # after the batch in flight (its workers stop at their next step)
                self.fleet.close()
                if self._stopped:
                    return
                self._stopped = True
                if self.pool is not None:
                    self.pool.closing = True  # no worker is replaced any more; the replacements settle
                    if (replacements := self.fleet.replacements) is not None:
                        await replacements.cancel()
                    await self.pool.aclose()
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

    _workers: Workers
    _lock: anyio.Lock

    if TYPE_CHECKING:

        def _active(self) -> None: ...

        def _init_fleet(self, setup: FleetSetup, transport: Callable[[FleetHandle], T]) -> T: ...

    @property
    def num_workers(self) -> int:
        return self._workers.num_workers

    def _init_workers(
        self,
        create_env_fns: Sequence[Any],
        policy: Any,
        delivery: Delivering,
        keywords: Mapping[str, Any] | None = None,
        *,
        body: Any = None,
        on_message: Callable[[int, Any], None] | None = None,
        **given: Unpack[WorkersKeywords],
    ) -> None:
        """The fleet set up over a pool of workers (:func:`init_workers`): ``keywords``, the collector's
        keyword list (filled), or ``given`` one by one; ``body``/``on_message``: its workers' body and a
        handler of its messages."""
        kw = {**(keywords or {}), **given}
        owner = type(self).__name__
        self._workers = self._init_fleet(
            *init_workers(create_env_fns, policy, delivery, kw, owner=owner, body=body, on_message=on_message)
        )

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
