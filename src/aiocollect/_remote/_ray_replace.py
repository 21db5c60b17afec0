"""Respawning a Ray actor of a ``RayCollector`` that died or hung (``restart=``): the actors' part of a
replacement.

What a replacement takes (a budget per actor, the backoff, the seed chain, the newest weights, the
``Restarted`` events) is the fleet's (``_fleet/_replace.py``). An :class:`ActorRespawn` answers one lost
actor: the lost one is killed, a new actor takes its slot of the transport (the first generation's env
constructors, collector and policy, the same objects in Ray's object store; trajectory ids of its own
generation and a seed derived from its own, :func:`~aiocollect._fleet._replace.restarted_options`), its
collector is started; the fleet then seeds it and loads the newest weights published to its slot (the
object ref) before it is asked for a batch. A new actor that fails on its way up is answered again, after a
longer backoff, when it is gone too (``actor_lost``); any other failure of its (its env's constructor
raising) ends the run, since a new one would fail the same way.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.to_thread

from .._core._options import RolloutOptions
from .._core._restart import Lost
from .._fleet._replace import restarted_options
from .._observe._events import WorkerStarted
from .._observe._stats import WorkerState
from .._transport._messages import FleetOp
from ._ray_actor import actor_lost
from ._ray_fleet import Actor, RayActors
from ._ray_reaper import descendants

__all__ = ["ActorRespawn"]


class ActorRespawn:
    """Actor ``old``'s replacement in ``actors`` (a ``RayActors``), driven by the fleet's replacements;
    ``submit``: the new actor is asked for a batch once it runs (the async deliveries)."""

    @classmethod
    def later(cls, actors: RayActors, old: Actor, error: BaseException) -> bool:
        """Replace ``old`` in the background (the fleet's replacements), then ask the new actor for a batch
        (the async deliveries); ``False`` unless the policy answers ``error`` (its budget spent: the
        history is then a note on ``error``)."""
        replacements = actors.fleet.replacements
        if replacements is None or not actor_lost(error) or actors.closing:
            return False
        return replacements.later(
            old.index, error, cls(actors, old, True), progressed=old.frames > old.born_frames
        )

    @classmethod
    async def now(cls, actors: RayActors, old: Actor, error: BaseException) -> Actor:
        """A new actor in ``old``'s place, collecting and up to date; raises ``error`` (the history a note,
        once the budget is spent) unless the policy answers it."""
        replacements = actors.fleet.replacements
        if replacements is None or not actor_lost(error) or actors.closing:
            raise error from error.__cause__
        respawn = cls(actors, old, False)
        await replacements.replace(old.index, error, respawn, progressed=old.frames > old.born_frames)
        return actors.actors[old.index]

    def __init__(self, actors: RayActors, old: Actor, submit: bool) -> None:
        self.actors, self.index, self.ids = actors, old.index, [old.index]
        self._old = self._current = old
        self._submit = submit

    async def retire(self) -> None:
        await anyio.to_thread.run_sync(self.actors.kill_actors, [self._current])

    async def respawn(self, restarts: int) -> None:
        actors = self.actors
        rollout = restarted_options(actors.plan.rollouts[self.index], restarts)
        self._current = new = await anyio.to_thread.run_sync(self._create, rollout)
        new.info = await self._up(lambda: actors.call(new, new.handle.where.remote, what="restart"))
        fpb = await self._up(lambda: actors.call(new, new.handle.start.remote, what="restart"))
        new.info["frames_per_batch"] = int(fpb)
        watchdog = actors.watchdog
        if watchdog is not None:  # the cluster we started: its new actor process is watched too
            await anyio.to_thread.run_sync(lambda: watchdog.watch(descendants(os.getpid())))

    def _create(self, rollout: RolloutOptions) -> Actor:
        """In a worker thread: the new actor (not started), in the slot of the transport at once (so that
        a collector closing meanwhile kills it)."""
        old = self._old
        new = self.actors.new_actor(self.index, rollout)
        new.restarts, new.frames, new.born_frames = old.restarts, old.frames, old.frames
        new.policy_version = old.policy_version
        self.actors.actors[self.index] = new
        return new

    async def call(self, index: int, op: FleetOp) -> Any:
        new = self._current
        return await self._up(
            lambda: self.actors.call(new, new.handle.call.remote, op, what=type(op).__name__)
        )

    async def restore(self, newest: dict[int, tuple[int, Any] | None]) -> None:
        new, latest = self._current, newest[self.index]
        if latest is None:
            return
        version, ref = latest
        load = new.handle.load_weights.remote
        loaded = int(await self._up(lambda: self.actors.call(new, load, version, ref, what="weights")))
        new.policy_version = max(new.policy_version, loaded)
        if new.pending is not None and new.pending[0] <= loaded:
            new.pending = None

    async def resume(self) -> None:
        new = self._current
        new.state = WorkerState.COLLECTING
        self.actors.fleet.publish(WorkerStarted(self.index))
        self.actors.fleet.task_group.start_soon(self.actors.watch_restarts, new)  # its restarts as they come
        if self._submit:
            await self.actors.submit(new)

    def counted(self, index: int) -> None:
        self._old.restarts += 1  # a next attempt's actor starts from it
        if self._current is not self._old:
            self._current.restarts += 1

    async def give_up(self, error: BaseException) -> None:
        await self.actors.lost(self.index, error)

    async def _up(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        """``await fn()`` on the new actor; an actor that is gone meanwhile is ``Lost`` (answered
        again), any other failure of its is raised (a new one would fail the same way)."""
        try:
            return await fn()
        except Exception as exc:
            error = self.actors.failed_actor(self._current, exc, "restart")
            if not actor_lost(error):
                raise error from error.__cause__
            raise Lost(error) from None
