"""Replacing the worker processes of a pool that die or hang, under a ``RestartPolicy``.

A :class:`Replacer` belongs to one :class:`~._pool.WorkerPool`: per worker, a restart budget; the
replacements in flight (started in the collector's task group, cancelled when the pool closes); and the
notices of replaced workers still queued, which are dropped (their slots go to the replacement). A
replacement runs the first generation's spec with trajectory ids of its own generation
(:func:`restarted_options`), on the same shared-memory slots; the transport's ``on_replaced`` then seeds
it, hands it the newest weights and has it collect.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import anyio

from .._core._restart import RestartBudget, RestartPolicy
from .._observe._events import Restarted
from .._transport._messages import Attach, BatchReady

if TYPE_CHECKING:
    from ._pool import WorkerHandle, WorkerPool

__all__ = ["IDS_PER_GENERATION", "Replacer", "restarted_options"]

#: trajectory ids a worker's generation may take before its replacement's start (ids stay disjoint)
IDS_PER_GENERATION = 1 << 32


def restarted_options(options: Any, restarts: int) -> Any:
    """A worker's ``RolloutOptions`` for its ``restarts``-th replacement: its trajectory ids past every
    earlier generation's (the same residue, so still disjoint from the other workers'); the seed of the
    replacement comes from the fleet's seed chain (``derive_seed``)."""
    start = options.traj_id_start + restarts * IDS_PER_GENERATION * options.traj_id_stride
    return replace(options, traj_id_start=start)


class Replacer:
    """The worker replacements of ``pool`` under ``policy``; ``on_replaced(index)``: the transport
    brings a ready replacement up to date."""

    def __init__(
        self,
        pool: WorkerPool,
        policy: RestartPolicy,
        on_replaced: Callable[[int], Awaitable[None]] | None,
    ) -> None:
        self.pool = pool
        self.policy = policy
        self._budgets = [RestartBudget(policy) for _ in pool.specs]
        self._on_replaced = on_replaced
        #: frames of replaced workers' batches never delivered
        self.discarded_frames = 0
        self._replacing: dict[int, anyio.CancelScope] = {}
        self._settled: dict[int, anyio.Event] = {}
        #: ids of replaced workers' batch notices still in the pool's ``deliveries``
        self._void: set[int] = set()

    def may_replace(self, error: BaseException) -> bool:
        """Whether a worker that died or hung (``error``) may be replaced: the pool is not closing and
        the policy counts ``error``."""
        return not self.pool.closing and self.policy.counts(error)

    def later(self, handle: WorkerHandle, cause: BaseException) -> bool:
        """Start replacing ``handle`` (exited) if the policy and its budget allow; ``False`` if not (the
        budget's history is then a note on ``cause``)."""
        pool = self.pool
        if pool.closing or pool.failure is not None or pool.tg is None:
            return False
        if pool.workers[handle.index] is not handle or not self.may_replace(cause):
            return False
        try:
            progressed = handle.frames > handle.born_frames  # it delivered: the backoff starts again
            delay = self._budgets[handle.index].admit(cause, -1, progressed=progressed)
        except BaseException:
            return False  # spent: `cause` carries the history
        scope = anyio.CancelScope()
        self._replacing[handle.index] = scope
        self._settled[handle.index] = anyio.Event()
        pool.tg.start_soon(self._replace, handle, cause, delay, scope)
        return True

    def count(self, index: int) -> int:
        """How many times worker ``index`` was replaced."""
        return self._budgets[index].count if self._budgets else 0

    def kill_hung(self, index: int, error: BaseException) -> bool:
        """Kill worker ``index`` (hung: it delivered nothing within ``worker_timeout``) to replace it;
        ``False`` when it cannot be (no policy, a thread worker, the budget spent: ``error`` then ends
        the run)."""
        handle = self.pool.workers[index]
        if not self.may_replace(error) or not isinstance(handle.process, mp.process.BaseProcess):
            return False
        if handle.doomed is None and not handle.exited.is_set():
            budget = self._budgets[index]
            if budget.spent():
                error.add_note(budget.note())
                return False
            handle.doomed = error
            handle.expected_since = None
            from ._pool import signal_group  # the pool's module imports this one

            signal_group(handle.process, signal.SIGKILL)
        return True

    async def _replace(
        self, old: WorkerHandle, cause: BaseException, delay: float, scope: anyio.CancelScope
    ) -> None:
        """Replace ``old`` by a fresh worker of the same spec (trajectory ids past the old one's), on the
        same slots; the transport (``on_replaced``) then seeds it, hands it the weights and has it collect.
        A replacement that dies before it is ready is replaced in turn (the budget permitting)."""
        index, pool = old.index, self.pool
        budget = self._budgets[index]
        restarts = budget.count
        old.channel.close()
        if isinstance(old.process, mp.process.BaseProcess):
            with contextlib.suppress(ValueError):
                old.process.close()
        for msg_id in old.notices:  # its batches waiting to be read are dropped (receive)
            self._void.add(msg_id)
        try:
            with scope:
                await anyio.sleep(delay)
                original = pool.specs[index]  # ids and seed from the first generation's
                spec = replace(original, rollout=restarted_options(original.rollout, restarts))
                new = await pool._spawn(spec)
                new.restarts, new.slots, new.frames = old.restarts + 1, old.slots, old.frames
                new.born_frames = old.frames
                new.policy_version, new.attached = old.policy_version, False
                pool.workers[index] = new
                assert pool.tg is not None
                pool.tg.start_soon(pool._reader, new)
                async with anyio.create_task_group() as race:  # ready, or dead before it was

                    async def until(event: anyio.Event) -> None:
                        await event.wait()
                        race.cancel_scope.cancel()

                    race.start_soon(until, pool._ready_event(new))
                    race.start_soon(until, new.exited)
                if new.ready is None:
                    return  # it died starting (its reader replaces it again, or fails the pool)
                await new.channel.send(Attach(tuple(s.name for s in new.slots)))
                new.attached = True
                record = budget.drain()
                if self._on_replaced is not None:
                    await self._on_replaced(index)
                for r in record:
                    pool._on_event(Restarted(index, r.env, r.cause, r.restarts))
        except (OSError, anyio.BrokenResourceError):
            pass  # the replacement died meanwhile: its reader says what comes next
        except Exception as exc:
            # a replacement that died while it was brought up to date (a call to it raised): its
            # reader replaces it again or fails the pool; any other error fails the pool
            if pool.failure is None and not pool.closing and not pool.workers[index].exited.is_set():
                pool.fail(exc)
        finally:
            if self._replacing.get(index) is scope:
                del self._replacing[index]
                self._settled.pop(index).set()

    def current(self, item: tuple[int, BatchReady]) -> bool:
        """Whether ``item`` (a notice taken from ``deliveries``) comes from its worker as it is now; a
        replaced worker's is dropped, its frames counted as discarded."""
        index, msg = item
        if not self._void:
            self.pool.workers[index].notices.discard(id(msg))
            return True
        if id(msg) in self._void:
            self._void.discard(id(msg))
            self.discarded_frames += msg.frames
            return False
        self.pool.workers[index].notices.discard(id(msg))
        return True

    async def cancel(self) -> None:
        """Cancel the replacements in flight and wait until each has settled (a process it started is
        then one of the pool's workers, reaped with them)."""
        for scope in list(self._replacing.values()):
            scope.cancel()
        for done in list(self._settled.values()):
            await done.wait()
