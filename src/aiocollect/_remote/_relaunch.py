"""Relaunching every node of a ``DistributedCollector`` / ``RPCCollector`` under a ``RestartPolicy``.

A gloo process group (and the weight broadcast over it) cannot take a new process as a dead rank, and an
RPC group's membership is fixed once it started: a node that dies (or hangs past ``progress_timeout``) is
answered by relaunching the **whole group**. A :class:`GroupRelauncher` belongs to one
:class:`~._nodes.Nodes`: one :class:`~aiocollect._core._restart.RestartBudget` for the group, the newest
weights
published to each node, and the relaunch itself, run in the collector's I/O task group:

1. the loss is counted against the budget (spent: the run ends with the node's own error, the restart
   history as a note); a ``Restarted`` event (``env=-1``) names the node that was lost;
2. every node is closed (a grace period, then killed with its process group), the data plane (process
   group, weight group, RPC agent, store) is released and the generation's I/O tasks (listener,
   connections, transfers) end; a batch whose notice had arrived is counted in ``frames_discarded``;
3. after the backoff, every node is launched again on a new control port, store and token, with
   trajectory ids of a new generation (:func:`~aiocollect._workers._replace.restarted_options`), each
   node seeded with :func:`~aiocollect._core._restart.derive_seed` of its seed and the restart count, and the
   newest weights loaded before its first batch. A node that fails on the way up counts as another loss.

Callers of the transport (a batch, a weight update, a call) that meet the loss wait for the new group and
try again (:meth:`Nodes._guard`). The batches the lost group delivered that the consumer had not taken yet
(or that finished arriving while it was closed) are held until it is gone, then delivered, each node's
last one with its last frame marked truncated and done: its trajectories never go on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
from tensordict import TensorDictBase

from .._core._errors import WorkerDiedError, WorkerTimeoutError
from .._core._options import RolloutOptions
from .._core._restart import RestartBudget, RestartPolicy, derive_seed
from .._observe._events import Restarted
from .._transport._messages import SetSeed
from .._workers._replace import restarted_options

if TYPE_CHECKING:
    from ._nodes import Nodes, RemoteNode

__all__ = ["RELAUNCHED", "GroupLost", "GroupRelauncher"]


class GroupLost(Exception):
    """The node group a call ran on was lost and is being relaunched (never reaches the user)."""


#: queued to the async deliveries once a new group runs: ``__anext__`` asks it for batches
RELAUNCHED = object()


class GroupRelauncher:
    """The group relaunches of ``nodes`` (a ``Nodes``) under ``policy``."""

    def __init__(self, nodes: Nodes, policy: RestartPolicy) -> None:
        self.nodes = nodes
        self.policy = policy
        self.budget = RestartBudget(policy)
        #: per node, the newest weights published to it: (version, a copy of them)
        self.latest: dict[int, tuple[int, TensorDictBase]] = {}
        #: frames of batches whose notice had arrived when their group was lost
        self.discarded_frames = 0
        #: set when the current group is lost (a new event per group)
        self.lost = anyio.Event()
        #: set while a group runs (or once the run failed for good)
        self.up = anyio.Event()
        #: tearing a lost group down: its nodes' ends are expected, not failures
        self.quiet = False
        self._error: BaseException | None = None
        self._culprit: RemoteNode | None = None
        self._scope: anyio.CancelScope | None = None
        self._done = anyio.Event()
        self._done.set()
        self._born_frames = 0
        self._launched = False
        #: async mode: the lost group's batches, held until it is torn down (``(node, batch, frames)``)
        self.held: list[Any] | None = None

    @property
    def settled(self) -> bool:
        """A group runs and is not lost."""
        return self.up.is_set() and not self.lost.is_set()

    def started(self) -> None:
        """The first group runs: from now on a loss is answered with a relaunch."""
        self._launched = True
        self._born_frames = self.nodes.fleet._stats.frames
        self.up.set()

    def counts(self, error: BaseException) -> bool:
        """Whether ``error`` says a node of this engine is gone (died, or hung past ``progress_timeout``)
        and the policy counts it. A node's own exception (its env's past the env budget) is not."""
        gone = isinstance(error, WorkerTimeoutError) or (
            isinstance(error, WorkerDiedError) and error.engine == self.nodes._engine_name
        )
        return gone and self.policy.counts(error)

    def lose(self, node: RemoteNode | None, error: BaseException) -> bool:
        """``node`` failed with ``error``: relaunch the group (``True``) if the policy answers it, else
        ``False`` (the run ends as without a policy)."""
        n = self.nodes
        if self.quiet or self.lost.is_set():
            return True  # the group is lost already: the first error drives the relaunch
        if not self._launched or n._closing or not self.counts(error):
            return False
        self._error, self._culprit = error, node
        self.lost.set()
        self.held = []
        while True:  # what it delivered and the consumer did not take yet: held (see _release)
            try:
                self.held.append(n._deliveries.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
        if self.up.is_set():
            self.up = anyio.Event()
        if self._done.is_set():  # else a relaunch is bringing the group up: it sees ``lost``
            self._done = anyio.Event()
            self._scope = anyio.CancelScope()
            assert n._hosting is not None
            n._hosting.start_soon(self._run, self._scope, self._done)
        return True

    async def wait_up(self) -> None:
        """Return once a group runs; raise the run's failure."""
        while True:
            if self.nodes._failure is not None:
                raise self.nodes._failure
            if self.settled:
                return
            await self.up.wait()

    async def cancel(self) -> None:
        """End a relaunch in flight (the collector closes) once it settled: whatever it started is then
        in the nodes' list, stopped with the others."""
        if self._scope is not None:
            self._scope.cancel()
        await self._done.wait()

    def rollout(self, index: int, restarts: int) -> RolloutOptions:
        """Node ``index``'s rollout options for the ``restarts``-th group: trajectory ids of a new
        generation; a seed of its own (``collector_kwargs``) derived."""
        rollout = self.nodes.plan.rollouts[index]
        if restarts == 0:
            return rollout
        rollout = restarted_options(rollout, restarts)
        if rollout.seed is not None:
            rollout = replace(rollout, seed=derive_seed(rollout.seed, restarts))
        return rollout

    def published(self, weights: TensorDictBase, version: int, ids: list[int]) -> None:
        """Weights published to nodes ``ids``: a relaunched group loads them before its first batch."""
        copy = weights.detach().clone()
        for i in ids:
            self.latest[i] = (version, copy)

    # -- the relaunch -------------------------------------------------------------------------------
    async def _run(self, scope: anyio.CancelScope, done: anyio.Event) -> None:
        n = self.nodes
        try:
            with scope:
                while True:
                    error, culprit = self._error, self._culprit
                    assert error is not None
                    progressed = n.fleet._stats.frames > self._born_frames  # the backoff starts again
                    try:
                        delay = self.budget.admit(error, -1, progressed=progressed)
                    except Exception:  # spent: the history is a note on ``error``
                        self._release(mark=False)  # delivered before the error, as without a policy
                        n._end(error)
                        return
                    self.budget.drain()
                    index = culprit.index if culprit is not None else -1
                    if culprit is not None:
                        culprit.restarts += 1
                    cause = f"{type(error).__name__}: {error}"
                    n.fleet._hub.publish(Restarted(index, -1, cause, self.budget.count))
                    await self._teardown()
                    await anyio.sleep(delay)
                    try:
                        await self._launch(self.budget.count)
                    except GroupLost:
                        continue
                    except Exception as exc:  # a node raised on its way up: a new group would too
                        n._end(exc if n._failure is None else n._failure)
                        return
                    self._born_frames = n.fleet._stats.frames
                    self.up.set()
                    n._deliveries_send.send_nowait(RELAUNCHED)
                    return
        finally:
            self._release(mark=False)  # (the run ended, or the collector closes, before the teardown)
            done.set()

    def _release(self, mark: bool) -> None:
        """Deliver the lost group's held batches, in order; ``mark``: each node's last one has its last
        frame truncated and done (its trajectories never go on)."""
        held, self.held = self.held, None
        if not held:
            return
        if mark:
            last = {item[0]: item for item in held if isinstance(item, tuple)}
            for item in last.values():
                end_trajectories(item[1].batch)
        for item in held:
            self.nodes._deliveries_send.send_nowait(item)

    async def _teardown(self) -> None:
        """Close every node of the lost group and release its data plane and I/O tasks."""
        n = self.nodes
        self.quiet = True
        with anyio.CancelScope(shield=True):
            await n._close_nodes()
            await anyio.to_thread.run_sync(n._close_transport)
            await n._end_generation()
            for node in n.nodes:
                self.discarded_frames += node.announced
                node.renew()
            self._release(mark=True)

    async def _launch(self, restarts: int) -> None:
        """The next group: launched, joined, seeded and up to date; ``GroupLost`` if it is lost
        meanwhile."""
        n = self.nodes
        self.lost = anyio.Event()
        self.quiet = False
        await n._new_generation()
        await n._start(restarts)

        async def bring_up() -> None:
            for node in n.nodes:
                seed = derive_seed(n.fleet.member_seeds.get(node.index), restarts)
                if seed is not None:
                    await n._call(node, SetSeed(seed))
            versions: dict[int, tuple[TensorDictBase, list[int]]] = {}
            for i, (version, weights) in sorted(self.latest.items()):
                versions.setdefault(version, (weights, []))[1].append(i)
            for version, (weights, ids) in sorted(versions.items()):
                await n._send_weights(weights, version, ids)

        await n._watched(bring_up, self.lost)


def end_trajectories(batch: TensorDictBase) -> None:
    """Mark ``batch``'s last frame (its time is its last batch dim) truncated and done, every truncated
    flag under ``"next"`` and the done flag beside it, as TorchRL's ``set_truncated`` does."""
    index = (slice(None),) * (batch.batch_dims - 1) + (-1,)
    for key in batch.keys(include_nested=True, leaves_only=True):
        if isinstance(key, tuple) and key[0] == "next" and key[-1] == "truncated":
            for flag in (key, (*key[:-1], "done")):
                if flag in batch.keys(include_nested=True):
                    batch.get(flag)[index] = True


async def guarded(nodes: Nodes, fn: Callable[[], Awaitable[Any]], retry: bool) -> Any:
    """``await fn()`` on a running group, ended by the run's failure (raised); a group lost meanwhile:
    again on the next one (``retry``) or ``GroupLost``."""
    relauncher = nodes.relauncher
    assert relauncher is not None
    while True:
        await relauncher.wait_up()
        try:
            return await nodes._watched(fn, relauncher.lost)
        except GroupLost:
            if not retry:
                raise
