"""``RayCollector``: each remote collector is a Ray actor running one of our collectors; the trainer awaits
their batches as Ray object refs and merges them on its own event loop.

What crosses the network: the env constructors and the policy once (``cloudpickle``, put in the object
store once and fetched by every actor), one pickled batch per delivered batch (actor -> trainer), and the
weights once per update (``ray.put`` once; each targeted actor fetches the same object with its next
request, or at once with ``update_weights(wait=True)``). Everything else is small control calls.

Ray is imported when a ``RayCollector`` is entered, never by ``import aiocollect``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from tensordict import TensorDictBase

from .._errors import CollectorClosedError, WorkerTimeoutError
from .._events import (
    WeightsLoaded,
    WeightsPublished,
    WorkerFailed,
)
from .._gather import gather
from .._local._collector import Collector
from .._mistakes import explicit_keywords
from .._multi._async import MultiAsyncCollector, ProcessCollector
from .._multi._renames import DroppedBatchRenames
from .._multi._sync import MultiSyncCollector
from .._options import WeightSchedule
from .._stats import WorkerState
from .._transport._messages import FleetOp, GetState, LoadState
from .._validation import flag, positive_int, replay_buffer_arg, total_frames_arg
from ._args import (
    UNSET,
    check_keywords,
    check_policy,
    collector_kwargs_arg,
    member_rollouts,
    payloads,
    per_member,
    seconds_or_none,
    split_frames,
    weight_plan,
)
from ._messages import ControlOp
from ._nodes import DEFAULT_PROGRESS_TIMEOUT
from ._ray_actor import unwrap_ray_error
from ._ray_fleet import DEFAULT_REMOTE_CONFIG, Actor, ActorFleet
from ._ray_wire import from_wires, weights_to_wire


@dataclass
class _Delivery:
    batch: TensorDictBase
    frames: int
    episodes: list[tuple[int, float, int]]
    worker_id: int | None
    policy_version: int


def _env_args(create_env_fn: Any, n: int, collector_class: type) -> list[Any]:
    """Each actor's env argument: a constructor, or (a multi-process collector class) a list of them,
    one per worker."""
    multi = issubclass(collector_class, (MultiSyncCollector, MultiAsyncCollector)) and not issubclass(
        collector_class, ProcessCollector
    )
    if callable(create_env_fn) and not isinstance(create_env_fn, Sequence):
        env_fns = [create_env_fn] * n
    else:
        env_fns = per_member("create_env_fn", create_env_fn, n, (), "actor")
    for i, fn in enumerate(env_fns):
        if multi:
            if callable(fn) and not isinstance(fn, Sequence):
                env_fns[i] = [fn]
            elif not (isinstance(fn, Sequence) and fn and all(callable(f) for f in fn)):
                raise TypeError(
                    f"create_env_fn[{i}] must be an env constructor or a list of them (the actor's "
                    f"{collector_class.__name__} workers), got {fn!r}"
                )
        elif not callable(fn):
            raise TypeError(f"create_env_fn[{i}] must be a callable returning an env, got {fn!r}")
    return env_fns


_COLLECTOR_CLASSES = (Collector, MultiSyncCollector, MultiAsyncCollector)


class RayCollector(ActorFleet):
    """Collect with ``num_collectors`` Ray actors, each running one of our collectors.

    ``async with RayCollector(...) as c: async for batch in c:`` as with every collector. Entering starts
    a local Ray cluster (or connects to ``ray_init_config["address"]``; or uses the one ``ray.init`` made
    already), starts the actors and waits until each one's collector runs; leaving closes every remote
    collector (its worker processes are reaped), kills every actor (``ray.kill``) and shuts down the
    cluster only if this collector started it.

    Args:
        create_env_fn: an env constructor for every actor, or a list of ``num_collectors``, one per actor.
            With a multi-process ``collector_class``, an actor's entry is the list of its workers' env
            constructors (a single constructor means one worker). They and the policy are pickled with
            ``cloudpickle``: functions and classes are pickled by reference, so their modules must be
            importable on the Ray nodes (``runtime_env={"py_modules": [...]}`` in ``remote_config`` or
            ``ray_init_config``), unless registered with ``cloudpickle.register_pickle_by_value``.
        policy: as for :class:`Collector` (an ``nn.Module``, a ``TensorDictModule``, a callable or None).
        frames_per_batch: frames per delivered batch. ``sync=True``: split evenly over the actors (each
            collects ``ceil(frames_per_batch / num_collectors)``); ``sync=False``: each actor's batch.
        total_frames: frames to deliver before ``async for`` ends; ``-1`` for endless.
        num_collectors: how many actors.
        collector_class: what each actor runs: :class:`Collector` (default), :class:`MultiSyncCollector`
            or :class:`MultiAsyncCollector` (worker processes inside the actor), or
            :class:`ProcessCollector`.
        collector_kwargs: keyword arguments of ``collector_class``, one dict for all or a list, one per
            actor. A ``seed`` in a shared dict seeds actor ``i`` after actor ``i - 1`` (distinct seeds,
            as :meth:`set_seed`); an ``init_random_frames`` in a shared dict is split over the actors.
        remote_config: Ray actor options (``num_cpus``, ``num_gpus``, ``memory``, ``resources``,
            ``runtime_env``, ``scheduling_strategy``...), one dict or one per actor; default
            ``{"num_cpus": 1}``.
        ray_init_config: ``ray.init`` arguments when Ray is not initialised yet; with ``"address"`` it
            connects to that cluster, otherwise it starts a local one (``address="local"``).
        sync: ``True``: every batch stacks one batch of each actor (``[num_collectors, ...]``), asked
            for together; ``False``: each actor's batch as it arrives, with ``("collector",
            "worker_id")``, while the actor collects its next one.
        update_at_each_batch: send the trainer's current weights before every request: to the actor
            that delivered (``sync=False``, its next batch is asked for when ``async for`` asks for the
            next batch, after the training step) or to all actors (``sync=True``).
            ``update_after_each_batch`` is its deprecated spelling.
        max_weight_update_interval: an actor that delivered this many batches without receiving
            weights is sent the trainer's current weights before its next batch (``None``: never; ``0``
            and ``-1`` are deprecated spellings of it).
        weights: a :class:`~aiocollect.WeightSchedule` instead of the two keywords above.
        replay_buffer: batches go there (``extend`` runs in a worker thread) and ``async for`` yields
            ``None``; :meth:`start` collects into it in the background.
        progress_timeout: seconds an actor may take to deliver one batch (default 600: generous, so that
            a hung env or policy is noticed without any setting); then the collector fails with
            ``WorkerTimeoutError`` naming the actor, which is killed at once. ``None``: no limit.
        progress: as for :class:`Collector`.

    Example:
        >>> import anyio
        >>> from aiocollect import GymEnv, RayCollector
        >>> async def main():  # doctest: +SKIP
        ...     async with RayCollector(lambda: GymEnv("CartPole-v1"), frames_per_batch=256,
        ...                             total_frames=1024, num_collectors=2) as c:
        ...         async for batch in c:
        ...             print(batch.batch_size, batch["collector", "worker_id"][0].item())
        >>> anyio.run(main)  # doctest: +SKIP
    """

    _member_noun = "actor"

    @explicit_keywords
    def __init__(
        self,
        create_env_fn: Any,
        policy: Any = None,
        *,
        frames_per_batch: int,
        total_frames: int | None = -1,
        num_collectors: int,
        collector_class: type = Collector,
        collector_kwargs: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        remote_config: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        ray_init_config: Mapping[str, Any] | None = None,
        sync: bool = False,
        update_at_each_batch: bool = False,
        max_weight_update_interval: int | None = None,
        replay_buffer: Any = None,
        progress_timeout: float | None = DEFAULT_PROGRESS_TIMEOUT,
        progress: Any = None,
        update_after_each_batch: Any = UNSET,
        weights: WeightSchedule | None = None,
    ) -> None:
        n = self.num_collectors = positive_int("num_collectors", num_collectors)
        self._progress_timeout = seconds_or_none("progress_timeout", progress_timeout)
        self.total_frames = total_frames_arg(total_frames)
        self._sync = flag("sync", sync)
        self.replay_buffer = replay_buffer_arg(replay_buffer)
        if not isinstance(collector_class, type) or not issubclass(collector_class, _COLLECTOR_CLASSES):
            raise TypeError(
                "collector_class must be Collector, MultiSyncCollector, MultiAsyncCollector or "
                f"ProcessCollector, got {collector_class!r}"
            )
        self._collector_class = collector_class
        check_policy(policy)
        plan = weight_plan(
            policy, update_at_each_batch, max_weight_update_interval, update_after_each_batch, weights
        )
        self._update_at_each_batch, self._interval = plan.at_each_batch, plan.interval or 0
        self._source_policy = policy
        self._weights_template = plan.template
        env_args = _env_args(create_env_fn, n, collector_class)
        kwargs_list, self._seed = collector_kwargs_arg(
            collector_kwargs, n, "RayCollector", "actor", list_seeds=True
        )
        if (collector_kwargs is None or isinstance(collector_kwargs, Mapping)) and kwargs_list[0].get(
            "init_random_frames"
        ):  # a shared budget of random frames: split over the actors
            share = math.ceil(int(kwargs_list[0]["init_random_frames"]) / n)
            kwargs_list = [{**kw, "init_random_frames": share} for kw in kwargs_list]
        remote_list = per_member("remote_config", remote_config or {}, n, Mapping, "actor")
        self._remote_configs = [{**DEFAULT_REMOTE_CONFIG, **dict(rc)} for rc in remote_list]
        if ray_init_config is not None and not isinstance(ray_init_config, Mapping):
            raise TypeError(f"ray_init_config must be a dict of ray.init arguments, got {ray_init_config!r}")
        self._ray_init_config = dict(ray_init_config) if ray_init_config is not None else None
        self._per_actor_fpb = split_frames(frames_per_batch, n, self._sync, "actor", stacklevel=3)
        self.frames_per_batch = self._per_actor_fpb * n if self._sync else self._per_actor_fpb
        # pickled here (small: a bad one fails now); the policy once, in a thread, when entered
        check_keywords(collector_class, kwargs_list)
        self._rollouts = member_rollouts(kwargs_list, self._per_actor_fpb)  # checked here, sent typed
        self._payloads = payloads(env_args, collector_class, kwargs_list, "actor")
        self._init_base(progress)
        self._ray: Any = None
        self._started_ray = False
        self._watchdog = None
        self._entered = False
        self._actors: list[Actor] = []
        self._version = 0
        self._weights_lock = anyio.Lock()
        self._results_send: MemoryObjectSendStream[tuple[int, Any]] | None = None
        self._results_receive: MemoryObjectReceiveStream[tuple[int, Any]] | None = None
        self._due: list[int] = []  # async mode: actors to ask for their next batch
        #: per actor, the oldest version a delivered batch may have (update_weights(flush=True)), and the
        #: frames of the batches dropped below it
        self._floors: dict[int, int] = {}
        self._dropped_frames = 0
        #: trajectories that go on after a dropped batch take fresh ids (no delivered id spans a gap)
        self._renames = DroppedBatchRenames()
        self._limiter: anyio.CapacityLimiter | None = None
        self._torn_down = False
        self._progress_closed = False
        self._delivered = 0

    async def __anext__(self) -> TensorDictBase | None:
        await self._batch_turn()
        try:
            try:
                out = await (self._next_sync() if self._sync else self._next_async())
            except Exception as exc:
                if self._closed and not self._failed:  # closed under us (aclose from another task)
                    raise CollectorClosedError(f"the collector is closed: {self._closed_reason}") from exc
                self._failed = True
                self._closed = True
                self._closed_reason = f"a remote collector failed with {type(exc).__name__}: {exc}"
                await self._teardown()
                self._hub.close()
                raise
            self._delivered += 1
            self._record(out.frames, out.episodes, worker_id=out.worker_id, policy_version=out.policy_version)
            if self.replay_buffer is not None:
                await anyio.to_thread.run_sync(self.replay_buffer.extend, out.batch)
                return None
            return out.batch
        finally:
            self._lock.release()

    async def _submit(self, actor: Actor) -> Any:
        """Ask ``actor`` for its next batch, sending weights with the request when some are due."""
        if self._interval > 0 and actor.since_update >= self._interval and actor.pending is None:
            await self.update_weights(worker_ids=[actor.index])
        version, weights = actor.pending if actor.pending is not None else (None, None)
        if actor.pending is not None:
            actor.pending = None
            actor.since_update = 0
        ref = actor.handle.next.remote(version, weights)
        if not self._sync:
            assert self._task_group is not None
            self._task_group.start_soon(self._wait_one, actor, ref)
        return ref

    async def _wait_one(self, actor: Actor, ref: Any) -> None:
        """Async mode, in the task group: await one batch and hand it (or its error) to ``__anext__``."""
        try:
            out: Any = await self._await_batch(actor, ref)
        except Exception as exc:
            out = exc
        send = self._results_send
        if send is not None:
            try:
                await send.send((actor.index, out))
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass

    async def _await_batch(self, actor: Actor, ref: Any) -> Any:
        """``ref`` (an actor's next batch); an actor that takes longer than ``progress_timeout`` is
        ``WorkerTimeoutError`` naming it (and is killed, not closed, when the collector closes)."""
        timeout = self._progress_timeout
        if timeout is None:
            return await self._await(ref)
        with anyio.move_on_after(timeout):
            return await self._await(ref)
        actor.hung = True
        actor_id = getattr(getattr(actor.handle, "_actor_id", None), "hex", lambda: None)()
        info = actor.info
        where = f"actor {actor.index} (Ray actor {actor_id}" + (
            f", {info['hostname']}, pid {info['pid']})" if "pid" in info else ")"
        )
        raise WorkerTimeoutError(
            f"{where} delivered no batch within progress_timeout={timeout:g} s: a hung env or policy? "
            "(give a larger progress_timeout for slower batches, or None for no limit)"
        )

    def _delivered_by(self, actor: Actor, meta: dict[str, Any]) -> list[tuple[int, float, int]]:
        actor.frames += int(meta["frames"])
        actor.since_update += 1
        version = int(meta["policy_version"])
        if version > actor.policy_version:
            actor.policy_version = version
            self._hub.publish(WeightsLoaded(version, actor.index))
        return [(actor.index, r, n) for r, n in meta["episodes"]]

    def _failed_actor(self, actor: Actor, exc: BaseException, what: str) -> BaseException:
        actor.state = WorkerState.FAILED
        error = unwrap_ray_error(exc, f"actor {actor.index} ({what})", actor)
        self._hub.publish(WorkerFailed(actor.index, f"{type(error).__name__}: {error}"))
        return error

    async def _next_async(self) -> _Delivery:
        due, self._due = self._due, []
        for index in due:
            if self._update_at_each_batch:
                await self.update_weights(worker_ids=[index])
            await self._submit(self._actors[index])
        assert self._results_receive is not None
        while True:
            index, out = await self._results_receive.receive()
            actor = self._actors[index]
            if isinstance(out, BaseException):
                error = self._failed_actor(actor, out, "next batch")
                raise error from error.__cause__
            wire, meta = out
            if int(meta["policy_version"]) >= self._floors.get(index, 0):
                break
            # collected before an update_weights(flush=True) reached this actor: dropped, and the actor
            # asked again (its request carries the new weights, loaded before the batch)
            self._dropped_frames += int(meta["frames"])
            self._renames.dropped(index)
            await self._submit(actor)
        batch = await anyio.to_thread.run_sync(from_wires, [wire], False)
        self._renames.delivered(index, batch)
        episodes = self._delivered_by(actor, meta)
        if self._update_at_each_batch:
            self._due.append(index)  # asked for again at the next __anext__: after the training step
        else:
            await self._submit(actor)
        return _Delivery(batch, int(meta["frames"]), episodes, index, int(meta["policy_version"]))

    async def _next_sync(self) -> _Delivery:
        if self._update_at_each_batch and self._delivered:
            await self.update_weights()
        due = [
            a.index
            for a in self._actors
            if self._interval > 0 and a.since_update >= self._interval and a.pending is None
        ]
        if due:  # one put for every actor due (max_weight_update_interval)
            await self.update_weights(worker_ids=due)
        refs = [await self._submit(actor) for actor in self._actors]

        async def one(actor: Actor, ref: Any) -> Any:
            try:
                return await self._await_batch(actor, ref)
            except Exception as exc:
                error = self._failed_actor(actor, exc, "next batch")
                raise error from error.__cause__

        outs = await gather(*[partial(one, a, r) for a, r in zip(self._actors, refs, strict=True)])
        parts = [b for b, _ in outs]
        episodes: list[tuple[int, float, int]] = []
        for actor, (_, meta) in zip(self._actors, outs, strict=True):
            episodes.extend(self._delivered_by(actor, meta))
        shapes = {tuple(b.batch_size) for b in parts}
        if len(shapes) > 1:
            raise ValueError(
                f"sync=True stacks one batch per actor, but the actors' batches differ: {sorted(shapes)}; "
                "give every actor the same env batch size, or use sync=False"
            )
        # the one copy of the batch on the trainer, off the loop (a pixel batch copies for milliseconds)
        batch = await anyio.to_thread.run_sync(from_wires, parts, True)
        return _Delivery(
            batch,
            sum(int(m["frames"]) for _, m in outs),
            episodes,
            None,
            min(int(m["policy_version"]) for _, m in outs),
        )

    # -- weights ----------------------------------------------------------------------------------
    async def update_weights(
        self,
        policy_or_weights: Any = None,
        *,
        worker_ids: Sequence[int] | None = None,
        wait: bool = False,
        flush: bool = False,
    ) -> int:
        """Put the weights in Ray's object store once and return the new policy version.

        Each targeted actor fetches them with its next batch request and loads them before that batch
        (never mid-batch); ``wait=True`` sends them at once and returns when every targeted actor runs
        them (an actor collecting a batch finishes it first).

        Args:
            policy_or_weights: an ``nn.Module``, a TensorDict of weights or a state dict; ``None`` means
                the policy the collector was built with (its current weights).
            worker_ids: the actors to update (default: all).
            wait: wait until those actors run the new weights.
            flush: ``sync=False``: deliver nothing collected with older weights from now on: a batch an
                actor collected before it had them is dropped when it arrives (counted in
                ``statistics().frames_discarded``) and the actor asked for another. (``sync=True``
                batches are asked for after the update, so they run it already.)
        """
        self._active()
        weights = self._weights_to_publish(policy_or_weights)
        flag("wait", wait)
        flag("flush", flush)
        ids = self._target_ids(worker_ids)

        def put() -> Any:  # the copy out of the trainer's tensors and the pickling, off the loop
            return self._ray.put(weights_to_wire(weights))

        async with self._weights_lock:
            ref = await anyio.to_thread.run_sync(put)
            version = self._version = self._version + 1
            for i in ids:
                self._actors[i].pending = (version, ref)
                if flush:
                    self._floors[i] = version
            self._hub.publish(WeightsPublished(version))
        if wait:
            actors = [self._actors[i] for i in ids]
            loaded = await gather(
                *[
                    partial(self._call, a, a.handle.load_weights.remote, version, ref, what="weights")
                    for a in actors
                ]
            )
            for actor, v in zip(actors, loaded, strict=True):
                if actor.pending is not None and actor.pending[0] <= v:
                    actor.pending = None
                    actor.since_update = 0
                if v > actor.policy_version:
                    actor.policy_version = int(v)
                    self._hub.publish(WeightsLoaded(int(v), actor.index))
        return version

    def _frames_discarded(self) -> int:
        return self._dropped_frames

    # -- control ----------------------------------------------------------------------------------
    @property
    def _fleet_size(self) -> int:
        return self.num_collectors

    def _members(self) -> Sequence[Actor]:
        return self._actors

    async def _call_member(self, index: int, op: FleetOp) -> Any:
        return await self._control(self._actors[index], op)

    async def _control(self, actor: Actor, op: ControlOp) -> Any:
        """Run a control operation on ``actor``'s collector."""
        return await self._call(actor, actor.handle.call.remote, op, what=type(op).__name__)

    async def state_dict(self) -> dict[str, Any]:
        """Each actor's collector state (trajectory-id counters, versions), the counters, and the
        policy's weights (from actor 0)."""
        self._active()
        async with self._lock:
            states = await self._call_all(GetState(versioned=True))
        state: dict[str, Any] = {
            f"worker{i}": {k: v for k, v in s.items() if k != "policy"} for i, s in enumerate(states)
        }
        state.update(self._counters())
        if states and states[0]["policy"] is not None:
            state["policy"] = states[0]["policy"]
        return state

    async def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (same ``num_collectors``); the budget continues from the
        saved count and the saved weights are loaded into every actor."""
        self._check_state(state, "worker")
        self._active()
        async with self._lock:
            await gather(
                *[
                    partial(self._control, a, LoadState(dict(state[f"worker{a.index}"]), versioned=True))
                    for a in self._actors
                ]
            )
            self._load_counters(state)
            for actor in self._actors:
                actor.policy_version = int(state[f"worker{actor.index}"].get("version", 0))
        if "policy" in state and self._weights_template is not None:
            await self.update_weights(state["policy"], wait=True)

    # -- introspection ----------------------------------------------------------------------------
    @property
    def actors(self) -> list[Any]:
        """The Ray actor handles (while the collector is entered)."""
        return [a.handle for a in self._actors]

    def actor_info(self) -> list[dict[str, Any]]:
        """Where each actor runs: ``pid``, ``node_id``, ``hostname`` and its ``frames_per_batch``."""
        return [dict(a.info) for a in self._actors]

    def __repr__(self) -> str:
        return (
            f"RayCollector(num_collectors={self.num_collectors}, collector_class="
            f"{self._collector_class.__name__}, frames_per_batch={self.frames_per_batch}, "
            f"total_frames={self.total_frames}, sync={self._sync}, closed={self._closed})"
        )


__all__ = ["RayCollector"]
