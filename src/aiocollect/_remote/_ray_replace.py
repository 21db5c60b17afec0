"""Replacing the Ray actors of a ``RayCollector`` that die or hang, under a ``RestartPolicy``.

An :class:`ActorReplacer` belongs to one :class:`~._ray_fleet.RayActors`: per actor, a restart budget;
the newest weights published to each actor (their object ref, kept so that a replacement loads them before
its first frame). A replacement is a new actor on the same slot: the first generation's env constructors,
collector and policy (the same objects in Ray's object store), trajectory ids of its own generation
(:func:`~aiocollect._workers._replace.restarted_options`), a seed derived from its predecessor's
(:func:`~aiocollect._core._restart.derive_seed`), and the newest weights loaded before it is asked for a
batch.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import anyio
import anyio.to_thread

from .._core._errors import WorkerDiedError, WorkerTimeoutError
from .._core._restart import RestartBudget, RestartPolicy, derive_seed
from .._observe._events import Restarted, WorkerStarted
from .._observe._stats import WorkerState
from .._transport._messages import SetSeed
from .._workers._replace import restarted_options
from ._ray_reaper import descendants

if TYPE_CHECKING:
    from ._ray_fleet import Actor, RayActors

__all__ = ["ActorReplacer", "actor_lost"]


def actor_lost(error: BaseException) -> bool:
    """Whether ``error`` says the actor itself is gone (killed, its node lost) or hung past
    ``progress_timeout``: what a new actor answers. An exception raised in the actor (its env's past the
    env budget, its policy's, a worker of its own that died) is not."""
    if isinstance(error, WorkerTimeoutError):
        return True
    return isinstance(error, WorkerDiedError) and error.engine == "ray"


class ActorReplacer:
    """The actor replacements of ``actors`` (a ``RayActors``) under ``policy``."""

    def __init__(self, actors: RayActors, policy: RestartPolicy) -> None:
        self.actors = actors
        self.policy = policy
        self._budgets = [RestartBudget(policy) for _ in range(actors.num_actors)]
        #: per actor, the newest weights published to it: (version, object ref)
        self.latest: dict[int, tuple[int, Any]] = {}

        self._replacing: dict[int, tuple[anyio.CancelScope, anyio.Event]] = {}

    def may_replace(self, error: BaseException) -> bool:
        return actor_lost(error) and self.policy.counts(error) and not self.actors.closing

    def later(self, old: Actor, error: BaseException) -> None:
        """Replace ``old`` in the collector's task group, then ask the new actor for a batch (async
        mode: the other actors' batches are delivered meanwhile); a spent budget goes to the
        deliveries as ``error``, which ends the run."""
        tg = self.actors.fleet._task_group
        assert tg is not None
        scope, done = anyio.CancelScope(), anyio.Event()
        self._replacing[old.index] = (scope, done)
        tg.start_soon(self._later, old, error, scope, done)

    async def _later(
        self, old: Actor, error: BaseException, scope: anyio.CancelScope, done: anyio.Event
    ) -> None:
        try:
            with scope:
                new = await self.replace(old, error)
                await self.actors.submit(new)
        except Exception as exc:
            await self.actors.lost(old.index, exc)
        finally:
            if self._replacing.get(old.index, (None,))[0] is scope:
                del self._replacing[old.index]
            done.set()

    async def cancel(self) -> None:
        """Cancel the replacements in flight and wait until each has settled (an actor it created is
        then in the transport's list, killed with the others)."""
        for scope, _ in list(self._replacing.values()):
            scope.cancel()
        for _, done in list(self._replacing.values()):
            await done.wait()

    async def replace(self, old: Actor, error: BaseException) -> Actor:
        """A new actor in ``old``'s place, collecting and up to date; raises ``error`` (the restart
        history as a note) once the budget is spent. A replacement that fails to start is replaced in
        turn, after a longer backoff."""
        index = old.index
        budget = self._budgets[index]
        progressed = old.frames > old.born_frames  # it delivered: the backoff starts again
        current = old
        while True:
            delay = budget.admit(error, -1, progressed=progressed)  # raises when spent
            await anyio.to_thread.run_sync(self.actors.kill_actors, [current])
            await anyio.sleep(delay)
            new = await anyio.to_thread.run_sync(self._create, old, budget.count)
            try:
                await self._bring_up(new, budget.count)
            except Exception as exc:
                error, progressed, current = self.actors.failed_actor(new, exc, "restart"), False, new
                if not actor_lost(error):  # it raised (its env's constructor...): a new one would too
                    raise error from error.__cause__
                continue
            for record in budget.drain():
                new.restarts += 1
                self.actors.fleet._hub.publish(Restarted(index, record.env, record.cause, record.restarts))
            return new

    def _create(self, old: Actor, restarts: int) -> Actor:
        """In a worker thread: the new actor (not started), in ``old``'s slot of the transport at once
        (so that a collector closing meanwhile kills it)."""
        actors = self.actors
        rollout = actors.plan.rollouts[old.index]
        rollout = restarted_options(rollout, restarts)
        if rollout.seed is not None:  # a seed of its own in collector_kwargs: a derived one
            rollout = replace(rollout, seed=derive_seed(rollout.seed, restarts))
        new = actors.new_actor(old.index, rollout)
        new.restarts, new.frames, new.born_frames = old.restarts, old.frames, old.frames
        new.policy_version = old.policy_version
        actors.actors[old.index] = new
        return new

    async def _bring_up(self, new: Actor, restarts: int) -> None:
        """Start ``new``'s collector, seed it (derived from its slot's seed) and load the newest weights
        published to its slot, before it is asked for a batch."""
        actors, index = self.actors, new.index
        new.info = await actors.call(new, new.handle.where.remote, what="restart")
        fpb = await actors.call(new, new.handle.start.remote, what="restart")
        new.info["frames_per_batch"] = int(fpb)
        watchdog = actors.watchdog
        if watchdog is not None:  # the cluster we started: its new actor process is watched too
            await anyio.to_thread.run_sync(lambda: watchdog.watch(descendants(os.getpid())))
        seed = actors.fleet.member_seeds.get(index)
        if (derived := derive_seed(seed, restarts)) is not None:
            await actors.call(new, new.handle.call.remote, SetSeed(derived), what="SetSeed")
        if (latest := self.latest.get(index)) is not None:
            version, ref = latest
            loaded = await actors.call(new, new.handle.load_weights.remote, version, ref, what="weights")
            new.policy_version = max(new.policy_version, int(loaded))
            if new.pending is not None and new.pending[0] <= int(loaded):
                new.pending = None
        new.state = WorkerState.COLLECTING
        actors.fleet._hub.publish(WorkerStarted(index))
        cast("anyio.abc.TaskGroup", actors.fleet._task_group).start_soon(actors.watch_restarts, new)
