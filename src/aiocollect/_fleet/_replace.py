"""Replacing the members that die or hang, under a ``RestartPolicy``: written once, in the fleet, for every
transport (worker processes, Ray actors, a group of torch.distributed or RPC nodes).

:class:`Replacements` holds what a replacement takes: a restart budget per slot (a member, or the whole
group of nodes), the replacements in flight (each in the collector's task group under a scope of its own,
cancelled and awaited when the collector closes), the newest weights published to each member, the seed
chain (a new member is seeded with :func:`~aiocollect._core._restart.derive_seed` of the seed its slot was
last given, and its restart count), the trajectory ids of a new generation (:func:`restarted_options`) and
the ``Restarted`` events. The one sequence (:meth:`Replacements.replace`):

1. the loss is counted against the slot's budget (spent: the run ends with the member's own error, the
   restart history as a note);
2. the transport retires the lost member(s) (:meth:`Respawn.retire`), the fleet waits the backoff, and the
   transport starts a new member in each slot (:meth:`Respawn.respawn`); one that is lost on its way up
   (``_core._restart.Lost``) counts as another loss;
3. the fleet seeds each new member and hands it the newest weights published to its slot, before its
   first batch; the transport lets it collect (:meth:`Respawn.resume`); the restarts are counted on the
   member and published as ``Restarted`` events (``env=-1``).

A transport only respawns: it implements :class:`Respawn`, and decides which errors mean its member is gone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

import anyio
import anyio.abc

from .._core._options import RolloutOptions
from .._core._restart import IDS_PER_GENERATION, Lost, RestartBudget, RestartPolicy, derive_seed
from .._observe._events import Event, Restarted
from .._transport._messages import FleetOp, SetSeed

__all__ = ["Replacements", "Respawn", "restarted_options"]


def restarted_options(options: RolloutOptions, restarts: int) -> RolloutOptions:
    """A member's ``RolloutOptions`` for its ``restarts``-th replacement: trajectory ids past every earlier
    generation's (the same residue, so still disjoint from the other members'), and a seed of its own
    derived from its own (the fleet's seed chain seeds it again once it runs).

    >>> first = RolloutOptions(frames_per_batch=8, traj_id_start=1, traj_id_stride=2, seed=3)
    >>> o = restarted_options(first, 1)
    >>> o.traj_id_start == 1 + 2 * IDS_PER_GENERATION, o.seed == derive_seed(3, 1)
    (True, True)
    """
    if restarts == 0:
        return options
    start = options.traj_id_start + restarts * IDS_PER_GENERATION * options.traj_id_stride
    return replace(options, traj_id_start=start, seed=derive_seed(options.seed, restarts))


class Respawn(Protocol):
    """What a transport does when the fleet replaces its member ``index`` (or, for a group, every member
    of ``ids``): the mechanics; the policy is :class:`Replacements`'."""

    @property
    def ids(self) -> Sequence[int]:
        """The members a replacement brings up (one, or every member of a group)."""

    @property
    def index(self) -> int:
        """The member whose loss it answers (its ``Restarted`` events and ``restarts``; ``-1``: none)."""

    async def retire(self) -> None:
        """Take the lost member(s) down (close, kill, tear down)."""

    async def respawn(self, restarts: int) -> None:
        """A new member in each slot of :attr:`ids`, running its ``restarts``-th generation
        (:func:`restarted_options`), not seeded yet; ``Lost`` if one is lost on its way up."""

    async def call(self, index: int, op: FleetOp) -> Any:
        """Run ``op`` on new member ``index`` (``Lost`` if it is lost meanwhile)."""

    async def restore(self, newest: dict[int, tuple[int, Any] | None]) -> None:
        """The new members load the newest weights published to their slots: ``{index: (version, what
        Transport.publish returned) or None}`` (none published), before their first batch."""

    async def resume(self) -> None:
        """The new members collect."""

    def counted(self, index: int) -> None:
        """Member ``index`` was replaced once more (its ``restarts``)."""

    async def give_up(self, error: BaseException) -> None:
        """A replacement in the background ended with ``error`` (the budget spent: the member's own error
        with the history; or the transport's): end the run with it, or let whoever saw it answer."""


class Replacements:
    """The fleet's replacements of its lost members under ``policy``; ``publish``: the collector's
    events, ``seed_of(i)``: the seed member ``i`` was last given, ``task_group()``: the collector's."""

    def __init__(
        self,
        policy: RestartPolicy,
        *,
        publish: Callable[[Event], None],
        seed_of: Callable[[int], int | None],
        task_group: Callable[[], anyio.abc.TaskGroup],
    ) -> None:
        self.policy = policy
        self._publish, self._seed_of, self._task_group = publish, seed_of, task_group
        self._budgets: dict[int, RestartBudget] = {}
        #: per member, the newest weights published to it: (version, what the transport's publish returned)
        self._newest: dict[int, tuple[int, Any]] = {}
        #: the replacements in flight in the background, by slot: their scopes and when they settled
        self._running: dict[int, tuple[anyio.CancelScope, anyio.Event]] = {}
        self._settling: list[anyio.Event] = []

    def counts(self, error: BaseException) -> bool:
        """Whether the policy answers ``error`` with a replacement."""
        return self.policy.counts(error)

    def busy(self, key: int) -> bool:
        """Whether slot ``key`` is being replaced (in the background)."""
        return key in self._running

    def spent(self, key: int, error: BaseException) -> bool:
        """Whether slot ``key``'s budget is spent; then its history is a note on ``error``."""
        budget = self._budget(key)
        if budget.spent():
            error.add_note(budget.note())
            return True
        return False

    def published(self, version: int, ids: Sequence[int], published: Any) -> None:
        """Weights ``version`` went to members ``ids`` (``published``: what the transport's publish
        returned): a replacement of one of them loads them before its first batch."""
        for i in ids:
            self._newest[i] = (version, published)

    # -- the replacement --------------------------------------------------------------------------
    def later(self, key: int, cause: BaseException, respawn: Respawn, *, progressed: bool) -> bool:
        """Replace slot ``key`` (lost with ``cause``) in the background; ``False`` (nothing started, the
        history a note on ``cause`` if the budget is spent) unless the policy answers it. ``progressed``:
        the lost member delivered since it started (the backoff starts again)."""
        try:
            delay = self._budget(key).admit(cause, -1, progressed=progressed)
        except BaseException:
            return False
        scope, settled = anyio.CancelScope(), anyio.Event()
        self._running[key] = (scope, settled)
        self._settling.append(settled)
        self._task_group().start_soon(self._background, key, delay, respawn, scope, settled)
        return True

    async def replace(self, key: int, cause: BaseException, respawn: Respawn, *, progressed: bool) -> None:
        """Replace slot ``key`` now (the caller waits for the new member); raises ``cause`` (the history a
        note) when the policy does not answer it."""
        await self._replace(key, self._budget(key).admit(cause, -1, progressed=progressed), respawn)

    async def cancel(self) -> None:
        """Cancel the replacements in flight and wait until each has settled (what it started is then the
        transport's, stopped with the others)."""
        for scope, _ in list(self._running.values()):
            scope.cancel()
        for settled in list(self._settling):
            await settled.wait()

    async def _background(
        self, key: int, delay: float, respawn: Respawn, scope: anyio.CancelScope, settled: anyio.Event
    ) -> None:
        try:
            with scope:
                await self._replace(key, delay, respawn)
        except Exception as exc:
            await respawn.give_up(exc)
        finally:
            if self._running.get(key, (None,))[0] is scope:
                del self._running[key]
            self._settling.remove(settled)
            settled.set()

    async def _replace(self, key: int, delay: float, respawn: Respawn) -> None:
        budget = self._budget(key)
        while True:
            index = respawn.index  # the member this attempt answers the loss of
            try:
                await respawn.retire()
                await anyio.sleep(delay)
                await respawn.respawn(budget.count)
                await self._bring_up(respawn, budget.count)
                await respawn.resume()
                return
            except Lost as lost:  # the new member is gone too: another loss, after a longer backoff
                cause = lost.cause
            finally:
                self._report(budget, index, respawn)
            delay = budget.admit(cause, -1, progressed=False)  # raises `cause` once the budget is spent

    async def _bring_up(self, respawn: Respawn, restarts: int) -> None:
        """Seed each new member from the seed chain and hand it the newest weights of its slot."""
        for i in respawn.ids:
            seed = derive_seed(self._seed_of(i), restarts)
            if seed is not None:
                await respawn.call(i, SetSeed(seed))
        await respawn.restore({i: self._newest.get(i) for i in respawn.ids})

    def _report(self, budget: RestartBudget, index: int, respawn: Respawn) -> None:
        """The restarts not reported yet: counted on member ``index``, a ``Restarted`` event each."""
        for record in budget.drain():
            if index >= 0:
                respawn.counted(index)
            self._publish(Restarted(index, record.env, record.cause, record.restarts))

    def _budget(self, key: int) -> RestartBudget:
        budget = self._budgets.get(key)
        if budget is None:
            budget = self._budgets[key] = RestartBudget(self.policy)
        return budget
