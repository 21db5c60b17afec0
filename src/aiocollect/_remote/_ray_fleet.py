"""The trainer's view of :class:`~aiocollect.RayCollector`'s actors: starting them (and a local Ray
cluster if none runs), awaiting Ray's object refs on any event loop, Ray's errors in the shared
vocabulary, and closing the actors (their collectors reap their workers) and the cluster it started."""

from __future__ import annotations

import abc
import asyncio
import os
import socket
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import cloudpickle
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._events import (
    WorkerStarted,
    WorkerStopped,
)
from .._fleet import FleetCollector
from .._gather import gather
from .._mistakes import warn_user
from .._options import RolloutOptions
from .._pids import pid_alive
from .._stats import WorkerState
from ._ray_actor import actor_class, import_ray, unwrap_ray_error
from ._ray_local import init_local
from ._ray_reaper import Watchdog, descendants, start_watchdog

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


class ActorFleet(FleetCollector):
    """The actors of a :class:`~aiocollect.RayCollector`; the collector surface is the subclass's."""

    _member_noun = "actor"
    num_collectors: int
    _sync: bool
    _per_actor_fpb: int
    _payloads: list[bytes]
    _rollouts: list[RolloutOptions]
    _remote_configs: list[dict[str, Any]]
    _ray_init_config: dict[str, Any] | None
    _ray: Any
    _started_ray: bool
    _watchdog: Watchdog | None
    _entered: bool
    _actors: list[Actor]
    _limiter: anyio.CapacityLimiter | None
    _torn_down: bool
    _progress_closed: bool
    _results_send: MemoryObjectSendStream[tuple[int, Any]] | None
    _results_receive: MemoryObjectReceiveStream[tuple[int, Any]] | None

    @abc.abstractmethod
    async def _submit(self, actor: Actor) -> Any:
        """Ask ``actor`` for its next batch (async mode: its result goes to ``_results_send``)."""

    # -- lifecycle (CollectorBase's async with: __aenter__ calls _on_enter, __aexit__ calls aclose) ----
    async def _on_enter(self) -> None:
        if self._entered:
            raise RuntimeError("the collector was entered already: a RayCollector is entered once")
        self._entered = True
        await self._start()

    async def aclose(self) -> None:
        """Close every remote collector (a grace period for their workers), kill every actor and shut
        down the Ray cluster if this collector started it. Idempotent; ``async with`` does it."""
        await self._shutdown()

    async def _start(self) -> None:
        ray = self._ray = import_ray()
        self._limiter = anyio.CapacityLimiter(2 * self.num_collectors + 2)
        if not ray.is_initialized():
            config = dict(DEFAULT_RAY_INIT_CONFIG)
            if self._ray_init_config is not None:
                config = (
                    dict(self._ray_init_config)
                    if "address" in self._ray_init_config
                    else {**config, **self._ray_init_config}
                )
            await anyio.to_thread.run_sync(init_local, ray, config)
            self._started_ray = True
            # kills the cluster's processes should this process die without shutting it down
            self._watchdog = await anyio.to_thread.run_sync(start_watchdog)
        elif self._ray_init_config is not None:
            warn_user(
                "ray is initialised already: ray_init_config is ignored (this collector uses that cluster)"
            )
        self._actors = await anyio.to_thread.run_sync(self._create_actors)
        # the actors' processes start (or wait for the resources they ask for: Ray queues them)
        where = [a.handle.where.remote() for a in self._actors]

        async def placed() -> list[Any]:
            return await gather(
                *[
                    partial(self._call, a, lambda ref=ref: ref, what="start")
                    for a, ref in zip(self._actors, where, strict=True)
                ]
            )

        infos: list[Any] | None = None
        with anyio.move_on_after(_PENDING_WARNING_S):
            infos = await placed()
        if infos is None:
            ray = self._ray
            warn_user(
                f"RayCollector: the actors have not started after {_PENDING_WARNING_S:.0f} s; Ray may lack "
                f"the resources they ask for (remote_config={self._remote_configs[0]}, available now: "
                f"{ray.available_resources()}). Still waiting: cancel (e.g. anyio.fail_after) to give up"
            )
            infos = await placed()
        for actor, info in zip(self._actors, infos, strict=True):
            actor.info = info
        watchdog = self._watchdog
        if watchdog is not None:  # the cluster we started runs, its agents and our actors with it
            await anyio.to_thread.run_sync(lambda: watchdog.watch(descendants(os.getpid())))
        fpbs = await gather(
            *[partial(self._call, a, a.handle.start.remote, what="start") for a in self._actors]
        )
        for actor, fpb in zip(self._actors, fpbs, strict=True):
            actor.info["frames_per_batch"] = int(fpb)
            actor.state = WorkerState.COLLECTING
            self._hub.publish(WorkerStarted(actor.index))
        self.frames_per_batch = sum(fpbs) if self._sync else fpbs[0]
        await self._members_started()
        if not self._sync:
            self._results_send, self._results_receive = anyio.create_memory_object_stream[tuple[int, Any]](
                self.num_collectors
            )
            for actor in self._actors:
                await self._submit(actor)

    def _create_actors(self) -> list[Actor]:
        """In a worker thread: pickle the policy, put it and the arguments in the object store, create
        the actors."""
        ray = self._ray
        try:
            policy_blob = cloudpickle.dumps(self._source_policy)
        except Exception as exc:
            raise TypeError(f"the policy cannot be pickled for the Ray actors: {exc}") from exc
        policy_ref = ray.put(policy_blob)
        cls = actor_class()
        actors = []
        payload_refs: dict[bytes, Any] = {}
        for i, payload in enumerate(self._payloads):
            if payload not in payload_refs:  # the same constructor for every actor: one object
                payload_refs[payload] = ray.put(payload)
            spec = (i, self.num_collectors, policy_ref, payload_refs[payload], self._rollouts[i])
            handle = cls.options(**self._remote_configs[i]).remote(*spec, self._sync)
            actors.append(Actor(i, handle))
        return actors

    async def _shutdown(self) -> None:
        with anyio.CancelScope(shield=True):
            if self._background is not None:
                self._background.cancel()
            self._closed = True
            await self._teardown()
            self._hub.close()
            if not self._progress_closed:
                self._progress_closed = True
                self._finish_progress()

    async def _teardown(self) -> None:
        """Close the remote collectors (a grace period), kill the actors, end a cluster we started."""
        with anyio.CancelScope(shield=True):
            if self._torn_down:
                return
            self._torn_down = True
            for stream in (self._results_send, self._results_receive):
                if stream is not None:
                    stream.close()
            actors = [a for a in self._actors if a.state != WorkerState.STOPPED]
            if actors:
                with anyio.move_on_after(_CLOSE_GRACE):
                    await gather(*[partial(self._close_one, a) for a in actors if not a.hung])
                await anyio.to_thread.run_sync(self._kill, actors)
                for actor in actors:
                    if actor.state != WorkerState.FAILED:
                        actor.state = WorkerState.STOPPED
                    self._hub.publish(WorkerStopped(actor.index))
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

    def _kill(self, actors: list[Actor]) -> None:
        ray = self._ray
        for actor in actors:
            try:
                ray.kill(actor.handle, no_restart=True)
            except Exception:
                pass
        # ray.kill returns at once and the process ends a little later: on this machine, wait (a
        # bounded time) until the actors and what ran under them are gone, so that leaving
        # `async with` leaves nothing of ours behind
        here = socket.gethostname()
        pids = [
            pid
            for a in actors
            if a.info.get("hostname") == here and "pid" in a.info
            for pid in [a.info["pid"], *a.leftover]
        ]
        deadline = time.monotonic() + _CLOSE_GRACE
        while pids and time.monotonic() < deadline:
            pids = [pid for pid in pids if pid_alive(pid)]
            if pids:
                time.sleep(0.01)

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

    async def _call(self, actor: Actor, method: Any, *args: Any, what: str) -> Any:
        """Call an actor method and await it; a remote exception is raised with its own type."""
        try:
            return await self._await(method(*args))
        except Exception as exc:
            error = unwrap_ray_error(exc, f"actor {actor.index} ({what})", actor)
            raise error from error.__cause__  # Ray's error stays the cause of a WorkerDiedError

    # -- iteration --------------------------------------------------------------------------------
    def _active(self) -> None:
        self._check_open()
        if not self._actors or self._task_group is None:
            raise RuntimeError(
                "RayCollector starts its actors in `async with`: write `async with RayCollector(...) as "
                "collector: async for batch in collector:`"
            )


__all__ = ["DEFAULT_RAY_INIT_CONFIG", "DEFAULT_REMOTE_CONFIG", "Actor", "ActorFleet"]
