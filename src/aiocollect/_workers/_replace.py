"""Respawning the workers of a pool that die or hang (``restart=``): the pool's part of a replacement.

What a replacement takes (the budget, the backoff, the seed chain, the newest weights, the events) is the
fleet's, written once for every transport (``_fleet/_replace.py``). A :class:`Respawner` belongs to one
:class:`~._pool.WorkerPool` and does what only the pool can: it tells the transport that owns the pool of a
worker lost (:class:`PoolOwner`), takes the lost one down (its batch notices still queued are dropped,
their frames counted: its slots go to the new one), starts a new process of its spec on the same
shared-memory slots, and kills a hung worker so that it is replaced. A :class:`WorkerRespawn` is one
worker's replacement as the fleet drives it (``_fleet._replace.Respawn``).
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import signal
from typing import Any, Protocol

import anyio

from .._core._errors import WorkerDiedError
from .._core._restart import Lost
from .._transport._messages import BatchReady, LoadWeights
from .._transport._shm import SharedBlock
from .._weightsync._schemes import WeightSender
from ._pool import WorkerHandle, WorkerPool, signal_group
from ._worker import WorkerSpec

__all__ = ["PoolOwner", "Respawner", "WorkerRespawn"]


class PoolOwner(Protocol):
    """The transport that owns the pool (``_multi/_workers.Workers``), as its respawns see it."""

    control: SharedBlock | None
    sender: WeightSender | None

    def replace(self, handle: WorkerHandle, cause: BaseException, respawn: WorkerRespawn) -> bool:
        """Whether the fleet replaces worker ``handle`` (exited with ``cause``), with ``respawn``."""

    def may_kill(self, index: int, error: BaseException) -> bool:
        """Whether worker ``index``, hung (``error``), may be killed to be replaced (the budget permitting:
        else its history is a note on ``error``)."""

    def respawned_spec(self, index: int, restarts: int) -> WorkerSpec:
        """What worker ``index``'s ``restarts``-th replacement runs."""

    def discard(self, frames: int) -> None:
        """``frames`` collected are never delivered."""

    async def collect(self, index: int) -> None:
        """Worker ``index`` (a replacement, up to date) collects."""


class Respawner:
    """The respawns of ``pool``'s workers, for ``owner`` (the transport that owns the pool)."""

    def __init__(self, pool: WorkerPool, owner: PoolOwner) -> None:
        self.pool, self.owner = pool, owner
        #: frames of replaced workers' batches never delivered
        self.discarded_frames = 0
        #: ids of replaced workers' batch notices still in the pool's ``deliveries``
        self._void: set[int] = set()

    def lost(self, handle: WorkerHandle, cause: BaseException) -> bool:
        """Worker ``handle`` exited (``cause``): whether it is being replaced (else the pool fails)."""
        pool = self.pool
        if pool.closing or pool.failure is not None or pool.tg is None:
            return False
        replacing = WorkerRespawn(self, handle.index)
        return pool.workers[handle.index] is handle and self.owner.replace(handle, cause, replacing)

    def retire(self, old: WorkerHandle) -> None:
        """Let go of ``old`` (exited): its channel and process are closed, its batches waiting to be read
        are dropped (:meth:`current`)."""
        old.channel.close()
        if isinstance(old.process, mp.process.BaseProcess):
            with contextlib.suppress(ValueError):
                old.process.close()
        self._void.update(old.notices)

    async def respawn(self, index: int, spec: WorkerSpec) -> WorkerHandle:
        """Start a worker of ``spec`` in ``index``'s place, on the same slots; the new handle, attached to
        them once ready (``ready is None``: it exited first)."""
        pool, old = self.pool, self.pool.workers[index]
        new = await pool.spawn(spec)
        new.restarts, new.slots, new.frames = old.restarts, old.slots, old.frames
        new.born_frames = old.frames
        new.policy_version, new.attached = old.policy_version, False
        pool.workers[index] = new
        assert pool.tg is not None
        pool.tg.start_soon(pool.watch, new)
        async with anyio.create_task_group() as race:  # ready, or dead before it was

            async def until(event: anyio.Event) -> None:
                await event.wait()
                race.cancel_scope.cancel()

            race.start_soon(until, new.readied)
            race.start_soon(until, new.exited)
        if new.ready is not None and not new.exited.is_set():
            await new.channel.send(pool.attach_message(new))
            new.attached = True
        return new

    def kill_hung(self, index: int, error: BaseException) -> bool:
        """Kill worker ``index`` (hung: it delivered nothing within ``worker_timeout``) to replace it;
        ``False`` when it cannot be (a thread worker, the policy or its budget says no: ``error`` then ends
        the run)."""
        handle = self.pool.workers[index]
        if self.pool.closing or not isinstance(handle.process, mp.process.BaseProcess):
            return False
        if handle.doomed is None and not handle.exited.is_set():
            if not self.owner.may_kill(index, error):
                return False
            handle.doomed = error  # its replacement answers it
            handle.expected_since = None
            signal_group(handle.process, signal.SIGKILL)
        return True

    def current(self, item: tuple[int, BatchReady]) -> bool:
        """Whether ``item`` (a notice taken from ``deliveries``) comes from its worker as it is now; a
        replaced worker's is dropped, its frames counted as discarded."""
        index, msg = item
        if id(msg) in self._void:
            self._void.discard(id(msg))
            self.discarded_frames += msg.frames
            return False
        self.pool.workers[index].notices.discard(id(msg))
        return True


class WorkerRespawn:
    """Worker ``index``'s replacement (the fleet's ``Replacements`` drive it): a new process of its spec
    on the same slots; seeded and given the newest weights by the fleet; then its delivery has it collect."""

    def __init__(self, respawner: Respawner, index: int) -> None:
        self.pool, self.owner = respawner.pool, respawner.owner
        self.respawner, self.index, self.ids = respawner, index, [index]

    async def retire(self) -> None:
        handle, control = self.pool.workers[self.index], self.owner.control
        if control is not None:  # the steps it began in its last batch are lost (the one it died in, too)
            steps, control.td["progress"][self.index] = int(control.td["progress"][self.index]), 0
            size = handle.ready.batch_size[:-1] if handle.ready is not None else ()  # a step's frames
            self.owner.discard(max(0, steps - 1) * math.prod(size))
        self.respawner.retire(handle)

    async def respawn(self, restarts: int) -> None:
        new = await self.respawner.respawn(self.index, self.owner.respawned_spec(self.index, restarts))
        if not new.attached:  # it exited on its way up (or the pool failed meanwhile: raised here)
            self.pool.check()
            raise Lost(new.doomed or WorkerDiedError(self.index, new.exitcode))

    async def call(self, index: int, op: Any) -> Any:
        return await self.pool.call(index, op)

    async def restore(self, newest: dict[int, tuple[int, Any] | None]) -> None:
        sender, entry = self.owner.sender, newest[self.index]
        if sender is None:
            return
        if entry is not None and entry[1] is not None:  # the pipe: sent again (a shared copy holds them)
            await sender.publish(entry[1], entry[0], [self.index])
        self.pool.note_version(self.index, await self.pool.call(self.index, LoadWeights()))

    async def resume(self) -> None:
        self.pool.workers[self.index].expected_since = None
        await self.owner.collect(self.index)

    def counted(self, index: int) -> None:
        self.pool.workers[index].restarts += 1

    async def give_up(self, error: BaseException) -> None:
        pool, handle = self.pool, self.pool.workers[self.index]
        if pool.closing or pool.failure is not None or (handle.attached and handle.exited.is_set()):
            return  # closing, failed already, or it died once attached: its reader answers
        if handle.exited.is_set():
            pool.lost(handle, error)  # lost on its way up, past the budget
        else:
            pool.fail(error)
