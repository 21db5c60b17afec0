"""The actors of :class:`~aiocollect.RayCollector` as a transport of the one
:class:`~aiocollect._fleet._collector.FleetCollector` (:class:`RayActors`): starting them (and a local Ray
cluster if
none runs), asking them for batches (sync and async), weights through Ray's object store, awaiting Ray's
object refs on any event loop, Ray's errors in the shared vocabulary, and closing the actors (their
collectors reap their workers) and the cluster it started."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import anyio
import anyio.abc
import anyio.to_thread
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from tensordict import TensorDictBase

from .._core._errors import WorkerTimeoutError
from .._core._gather import gather
from .._core._mistakes import warn_user
from .._core._options import RolloutOptions
from .._core._restart import RestartPolicy
from .._fleet._transport import Arrival, FleetHandle
from .._observe._events import WeightsLoaded, WorkerStarted, WorkerStopped
from .._observe._stats import WorkerState
from .._observe._timesplit import SplitWindows
from .._transport._messages import FleetOp
from ._args import WeightPlan
from ._ray_actor import actor_class, import_ray, unwrap_ray_error
from ._ray_local import init_local
from ._ray_reaper import Watchdog, descendants, end_processes, start_watchdog
from ._ray_wire import from_wires, weights_to_wire
from ._trainer import Hosts

#: remote options used unless ``remote_config`` says otherwise
DEFAULT_REMOTE_CONFIG: dict[str, Any] = {"num_cpus": 1}
#: ``ray.init`` arguments used when RayCollector starts a local cluster itself: on loopback, every process
#: of it listening on 127.0.0.1 only (``_ray_local.init_local``)
DEFAULT_RAY_INIT_CONFIG: dict[str, Any] = {
    "address": "local",
    "include_dashboard": False,
    "_node_ip_address": "127.0.0.1",
}
#: seconds after which actors that have not started yet are reported (a warning), e.g. lacking resources
_PENDING_WARNING_S = 60.0
#: seconds an actor gets to close its collector (and reap its worker processes) before ``ray.kill``
_CLOSE_GRACE = 10.0


@dataclass
class Actor:
    index: int
    handle: Any
    info: dict[str, Any] = field(default_factory=dict)
    state: WorkerState = WorkerState.STARTING
    frames: int = 0
    policy_version: int = 0
    #: batches delivered since this actor was last sent weights (max_weight_update_interval)
    since_update: int = 0
    #: weights to send with its next request: (version, object ref)
    pending: tuple[int, Any] | None = None
    #: processes that were still under the actor when its collector closed
    leftover: list[int] = field(default_factory=list)
    #: it missed ``progress_timeout``: killed without a graceful close
    hung: bool = False
    time_split: SplitWindows = field(default_factory=SplitWindows)  # its collector's, from its batches
    #: its collector's env restarts and its own replacements (``RestartPolicy``)
    restarts: int = 0
    #: its slot's frames when it started (a replacement: its predecessors')
    born_frames: int = 0


@dataclass(frozen=True)
class ActorPlan:
    """A ``RayCollector``'s keywords, checked: what its actors run and where."""

    sync: bool
    #: per actor: the pickled env constructors and collector arguments, its rollout options, its Ray
    #: options
    payloads: list[bytes]
    rollouts: list[RolloutOptions]
    remote_configs: list[dict[str, Any]]
    ray_init_config: dict[str, Any] | None
    weights: WeightPlan
    progress_timeout: float | None
    #: actors that die or hang are replaced under this policy (``None``: the run ends)
    restart: RestartPolicy | None = None


@dataclass(frozen=True)
class _Lost:
    """An actor that could not be replaced (its budget spent): ``error`` ends the run."""

    error: BaseException


class ActorReplacing(Protocol):
    """A lost actor's replacement under ``restart=`` (``_ray_replace.ActorRespawn``), as the actors call it:
    ``later`` (in the background; ``False``: not answered) or ``now`` (raises the error when not)."""

    def later(self, actors: RayActors, old: Actor, error: BaseException) -> bool: ...
    async def now(self, actors: RayActors, old: Actor, error: BaseException) -> Actor: ...


class RayActors(Hosts):
    """The actors of a ``RayCollector``, a :class:`~aiocollect._fleet._transport.Transport` (``fleet``: the
    collector's handle); ``replacing``: how a lost actor is replaced (``restart=``)."""

    state_prefix = "worker"
    versioned = True

    def __init__(
        self, fleet: FleetHandle, *, plan: ActorPlan, replacing: ActorReplacing | None = None
    ) -> None:
        self.fleet, self.plan = fleet, plan
        self._replacing = replacing if fleet.replacements is not None else None
        self.num_actors = len(plan.payloads)
        self._ray: Any = None
        self._started_ray = False
        self._watchdog: Watchdog | None = None
        self.actors: list[Actor] = []
        self._results_send: MemoryObjectSendStream[tuple[int, Any]] | None = None
        self._results_receive: MemoryObjectReceiveStream[tuple[int, Any]] | None = None
        self._due: list[int] = []  # async mode: actors to ask for their next batch
        self._limiter: anyio.CapacityLimiter | None = None
        self._torn_down = False
        self._delivered = 0
        self._refs: tuple[Any, list[Any]] | None = None  # the policy's and each actor's payload's refs

    @property
    def closing(self) -> bool:
        return self._torn_down or self.fleet.closed

    @property
    def watchdog(self) -> Watchdog | None:
        return self._watchdog

    @property
    def started(self) -> bool:
        return bool(self.actors)

    def members(self) -> Sequence[Actor]:
        return self.actors

    async def start(self) -> list[int]:
        ray = self._ray = import_ray()
        self._limiter = anyio.CapacityLimiter(3 * self.num_actors + 2)  # a batch, a call, its restarts
        if not ray.is_initialized():
            config = dict(DEFAULT_RAY_INIT_CONFIG)
            if self.plan.ray_init_config is not None:
                config = (
                    dict(self.plan.ray_init_config)
                    if "address" in self.plan.ray_init_config
                    else {**config, **self.plan.ray_init_config}
                )
            await anyio.to_thread.run_sync(init_local, ray, config)
            self._started_ray = True
            # kills the cluster's processes should this process die without shutting it down
            self._watchdog = await anyio.to_thread.run_sync(start_watchdog)
        elif self.plan.ray_init_config is not None:
            warn_user(
                "ray is initialised already: ray_init_config is ignored (this collector uses that cluster)"
            )
        policy_blob = await self.fleet.pickled_policy("the Ray actors")
        self.actors = await anyio.to_thread.run_sync(self._create_actors, policy_blob)
        # the actors' processes start (or wait for the resources they ask for: Ray queues them)
        where = [a.handle.where.remote() for a in self.actors]

        async def placed() -> list[Any]:
            return await gather(
                *[
                    partial(self.call, a, lambda ref=ref: ref, what="start")
                    for a, ref in zip(self.actors, where, strict=True)
                ]
            )

        infos: list[Any] | None = None
        with anyio.move_on_after(_PENDING_WARNING_S):
            infos = await placed()
        if infos is None:
            warn_user(
                f"RayCollector: the actors have not started after {_PENDING_WARNING_S:.0f} s; Ray may lack "
                f"the resources they ask for (remote_config={self.plan.remote_configs[0]}, available now: "
                f"{ray.available_resources()}). Still waiting: cancel (e.g. anyio.fail_after) to give up"
            )
            infos = await placed()
        for actor, info in zip(self.actors, infos, strict=True):
            actor.info = info
        watchdog = self._watchdog
        if watchdog is not None:  # the cluster we started runs, its agents and our actors with it
            await anyio.to_thread.run_sync(lambda: watchdog.watch(descendants(os.getpid())))
        fpbs = await gather(
            *[partial(self.call, a, a.handle.start.remote, what="start") for a in self.actors]
        )
        for actor, fpb in zip(self.actors, fpbs, strict=True):
            actor.info["frames_per_batch"] = int(fpb)
            actor.state = WorkerState.COLLECTING
            self.fleet.publish(WorkerStarted(actor.index))
        return [int(f) for f in fpbs]

    async def run(self) -> None:
        for actor in self.actors:
            self.fleet.task_group.start_soon(self.watch_restarts, actor)
        if not self.plan.sync:
            self._results_send, self._results_receive = anyio.create_memory_object_stream[tuple[int, Any]](
                self.num_actors
            )
            for actor in self.actors:
                await self.submit(actor)

    async def next_delivery(self) -> Arrival:
        fleet = self.fleet
        try:
            out = await (self._next_sync() if self.plan.sync else self._next_async())
        except Exception as exc:
            if fleet.closed and not fleet.failed:  # closed under us (aclose from another task)
                raise fleet.closed_error() from exc
            fleet.fail(f"a remote collector failed with {type(exc).__name__}: {exc}", close=True)
            await self._teardown()
            fleet.end_events()
            raise
        self._delivered += 1
        return out

    async def submit(self, actor: Actor) -> Any:
        """Ask ``actor`` for its next batch, sending weights with the request when some are due."""
        interval = self.plan.weights.interval or 0
        if interval > 0 and actor.since_update >= interval and actor.pending is None:
            await self.fleet.update_weights(worker_ids=[actor.index])
        version, weights = actor.pending if actor.pending is not None else (None, None)
        if actor.pending is not None:
            actor.pending = None
            actor.since_update = 0
        ref = actor.handle.next.remote(version, weights)
        if not self.plan.sync:
            self.fleet.task_group.start_soon(self._wait_one, actor, ref)
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
        timeout = self.plan.progress_timeout
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
        actor.time_split.add(meta.get("time_split", ()))
        actor.since_update += 1
        version = int(meta["policy_version"])
        if version > actor.policy_version:
            actor.policy_version = version
            self.fleet.publish(WeightsLoaded(version, actor.index))
        return [(actor.index, r, n) for r, n in meta["episodes"]]

    def failed_actor(self, actor: Actor, exc: BaseException, what: str) -> BaseException:
        actor.state = WorkerState.FAILED
        error = unwrap_ray_error(exc, f"actor {actor.index} ({what})", actor)
        self.failed(actor, error)
        return error

    async def watch_restarts(self, actor: Actor) -> None:
        """In the collector's task group, while ``actor`` holds its slot: its restarts as its collector
        makes them (a call waits in the actor for the next ones)."""
        with contextlib.suppress(Exception):  # the actor is gone: its batch says how
            while self.actors[actor.index] is actor and (
                records := await self._await(actor.handle.restarts.remote())
            ):
                self.restarted(actor, records)

    async def _next_async(self) -> Arrival:
        due, self._due = self._due, []
        for index in due:
            if self.plan.weights.at_each_batch:
                await self.fleet.update_weights(worker_ids=[index])
            await self.submit(self.actors[index])
        assert self._results_receive is not None
        while True:
            index, out = await self._results_receive.receive()
            actor = self.actors[index]
            if isinstance(out, _Lost):
                raise out.error
            if isinstance(out, BaseException):
                error = self.failed_actor(actor, out, "next batch")
                if self._replacing is not None and self._replacing.later(self, actor, error):
                    continue  # the others deliver meanwhile
                raise error from error.__cause__
            wire, meta = out
            if not self.fleet.stale(index, int(meta["policy_version"]), int(meta["frames"])):
                break
            # collected before an update_weights(flush=True) reached this actor: dropped, and the actor
            # asked again (its request carries the new weights, loaded before the batch)
            await self.submit(actor)
        batch = await anyio.to_thread.run_sync(from_wires, [wire], False)
        self.fleet.delivered(index, batch)
        episodes = self._delivered_by(actor, meta)
        if self.plan.weights.at_each_batch:
            self._due.append(index)  # asked for again at the next __anext__: after the training step
        else:
            await self.submit(actor)
        return Arrival(batch, int(meta["frames"]), episodes, index, int(meta["policy_version"]))

    async def _next_sync(self) -> Arrival:
        if self.plan.weights.at_each_batch and self._delivered:
            await self.fleet.update_weights()
        interval = self.plan.weights.interval or 0
        due = [
            a.index for a in self.actors if interval > 0 and a.since_update >= interval and a.pending is None
        ]
        if due:  # one put for every actor due (max_weight_update_interval)
            await self.fleet.update_weights(worker_ids=due)
        refs = [await self.submit(actor) for actor in self.actors]

        async def one(actor: Actor, ref: Any) -> Any:
            while True:
                try:
                    return await self._await_batch(actor, ref)
                except Exception as exc:
                    error = self.failed_actor(actor, exc, "next batch")
                    if self._replacing is None:
                        raise error from error.__cause__
                # a new actor collects its share of this batch again (the others' wait for it)
                actor = await self._replacing.now(self, actor, error)
                ref = await self.submit(actor)

        outs = await gather(*[partial(one, a, r) for a, r in zip(self.actors, refs, strict=True)])
        parts = [b for b, _ in outs]
        episodes: list[tuple[int, float, int]] = []
        for actor, (_, meta) in zip(self.actors, outs, strict=True):
            episodes.extend(self._delivered_by(actor, meta))
        shapes = {tuple(b.batch_size) for b in parts}
        if len(shapes) > 1:
            raise ValueError(
                f"sync=True stacks one batch per actor, but the actors' batches differ: {sorted(shapes)}; "
                "give every actor the same env batch size, or use sync=False"
            )
        # the one copy of the batch on the trainer, off the loop (a pixel batch copies for milliseconds)
        batch = await anyio.to_thread.run_sync(from_wires, parts, True)
        return Arrival(
            batch,
            sum(int(m["frames"]) for _, m in outs),
            episodes,
            None,
            min(int(m["policy_version"]) for _, m in outs),
        )

    # -- weights and calls ------------------------------------------------------------------------
    async def publish(self, weights: TensorDictBase, version: int, ids: list[int]) -> Any:
        """Put the weights in Ray's object store once: each targeted actor fetches them with its next
        batch request and loads them before that batch (never mid-batch); the object ref."""

        def put() -> Any:  # the copy out of the trainer's tensors and the pickling, off the loop
            return self._ray.put(weights_to_wire(weights))

        ref = await anyio.to_thread.run_sync(put)
        for i in ids:
            self.actors[i].pending = (version, ref)
        return ref

    async def load_now(self, ids: list[int], version: int, published: Any) -> None:
        """Send the weights at once (an actor collecting a batch finishes it first)."""
        # an actor being replaced loads the newest weights before its first batch (ActorRespawn.restore)
        actors = [a for i in ids if (a := self.actors[i]).state != WorkerState.STARTING]
        loaded = await gather(
            *[
                partial(self.call, a, a.handle.load_weights.remote, version, published, what="weights")
                for a in actors
            ]
        )
        for actor, v in zip(actors, loaded, strict=True):
            if actor.pending is not None and actor.pending[0] <= v:
                actor.pending = None
                actor.since_update = 0
            if v > actor.policy_version:
                actor.policy_version = int(v)
                self.fleet.publish(WeightsLoaded(int(v), actor.index))

    async def call_each(self, ops: Sequence[tuple[int, FleetOp]]) -> list[Any]:
        return await gather(
            *[
                partial(
                    self.call, self.actors[i], self.actors[i].handle.call.remote, op, what=type(op).__name__
                )
                for i, op in ops
            ]
        )

    def _create_actors(self, policy_blob: bytes) -> list[Actor]:
        """In a worker thread: put the pickled policy and the arguments in the object store, create the
        actors."""
        ray = self._ray
        policy_ref = ray.put(policy_blob)
        payload_refs: dict[bytes, Any] = {}
        for payload in self.plan.payloads:
            if payload not in payload_refs:  # the same constructor for every actor: one object
                payload_refs[payload] = ray.put(payload)
        self._refs = (policy_ref, [payload_refs[p] for p in self.plan.payloads])
        return [self.new_actor(i, self.plan.rollouts[i]) for i in range(self.num_actors)]

    def new_actor(self, index: int, rollout: RolloutOptions) -> Actor:
        """A new actor for slot ``index`` running ``rollout`` (not started); a worker thread's call."""
        assert self._refs is not None
        policy_ref, payload_refs = self._refs
        spec = (index, self.num_actors, policy_ref, payload_refs[index], rollout)
        handle = actor_class().options(**self.plan.remote_configs[index]).remote(*spec, self.plan.sync)
        return Actor(index, handle)

    async def lost(self, index: int, error: BaseException) -> None:
        """Actor ``index`` could not be replaced: ``error`` ends the run at the next delivery."""
        send = self._results_send
        if send is not None:
            try:
                await send.send((index, _Lost(error)))
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass

    async def stop(self) -> None:
        self.fleet.close()  # nothing new starts (Transport.stop)
        await self._teardown()

    async def _teardown(self) -> None:
        """Close the remote collectors (a grace period), kill the actors, end a cluster we started."""
        with anyio.CancelScope(shield=True):
            if self._torn_down:
                return
            self._torn_down = True
            if (replacements := self.fleet.replacements) is not None:  # an actor it started is listed now
                await replacements.cancel()
            for stream in (self._results_send, self._results_receive):
                if stream is not None:
                    stream.close()
            actors = [a for a in self.actors if a.state != WorkerState.STOPPED]
            if actors:
                with anyio.move_on_after(_CLOSE_GRACE):
                    await gather(*[partial(self._close_one, a) for a in actors if not a.hung])
                await anyio.to_thread.run_sync(self.kill_actors, actors)
                for actor in actors:
                    if actor.state != WorkerState.FAILED:
                        actor.state = WorkerState.STOPPED
                    self.fleet.publish(WorkerStopped(actor.index))
            if self._started_ray:
                self._started_ray = False
                try:
                    await anyio.to_thread.run_sync(self._ray.shutdown)
                finally:
                    if (watchdog := self._watchdog) is not None:
                        self._watchdog = None
                        await anyio.to_thread.run_sync(watchdog.close)

    async def _close_one(self, actor: Actor) -> None:
        try:
            actor.leftover = list(await self._await(actor.handle.close.remote()))
        except Exception:
            pass  # a dead or failed actor: it is killed next anyway

    def kill_actors(self, actors: list[Actor]) -> None:
        # ray.kill returns at once and the process ends a little later: on this machine, wait (a
        # bounded time) until the actors and what ran under them (taken now: an actor whose close ran
        # past the grace did not report its workers) are gone, then kill what is left, so that
        # leaving `async with` leaves nothing of ours behind
        here = socket.gethostname()
        pids = [
            pid
            for a in actors
            if a.info.get("hostname") == here and "pid" in a.info
            for pid in {a.info["pid"], *a.leftover, *descendants(a.info["pid"])}
        ]
        for actor in actors:
            with contextlib.suppress(Exception):
                self._ray.kill(actor.handle, no_restart=True)
        end_processes(pids, _CLOSE_GRACE)

    # -- awaiting Ray ------------------------------------------------------------------------------
    async def _await(self, ref: Any) -> Any:
        """``await ref`` on asyncio (Ray deserialises the result in its own thread); elsewhere (trio),
        ``ray.get`` in a worker thread, since Ray's futures belong to asyncio."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return await anyio.to_thread.run_sync(
                self._ray.get, ref, abandon_on_cancel=True, limiter=self._limiter
            )
        return await ref

    async def call(self, actor: Actor, method: Any, *args: Any, what: str) -> Any:
        """Call an actor method and await it; a remote exception is raised with its own type."""
        try:
            return await self._await(method(*args))
        except Exception as exc:
            error = unwrap_ray_error(exc, f"actor {actor.index} ({what})", actor)
            raise error from error.__cause__  # Ray's error stays the cause of a WorkerDiedError


__all__ = [
    "DEFAULT_RAY_INIT_CONFIG",
    "DEFAULT_REMOTE_CONFIG",
    "Actor",
    "ActorPlan",
    "ActorReplacing",
    "RayActors",
]
