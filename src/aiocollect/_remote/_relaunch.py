"""Relaunching every node of a ``DistributedCollector`` / ``RPCCollector`` under a ``RestartPolicy``: the
nodes' part of a replacement.

A gloo process group (and the weight broadcast over it) cannot take a new process as a dead rank, and an
RPC group's membership is fixed once it started: a node that dies (or hangs past ``progress_timeout``) is
answered by relaunching the **whole group**. What a replacement takes (one budget for the group, the
backoff, the seed chain, the newest weights, the ``Restarted`` event naming the node lost, ``env=-1``) is
the fleet's (``_fleet/_replace.py``); a :class:`GroupRelauncher` belongs to one :class:`~._nodes.Nodes`
and is the group's :class:`~aiocollect._fleet._replace.Respawn`:

1. **retire**: every node is closed (a grace period, then killed with its process group), the data plane
   (process group, weight group, RPC agent, store) is released and the generation's I/O tasks (listener,
   connections, transfers) end; a batch whose notice had arrived is counted in ``frames_discarded``;
2. **respawn**: every node is launched again on a new control port, store and token, with trajectory ids
   of a new generation (:func:`~aiocollect._fleet._replace.restarted_options`); a node lost on the way up
   counts as another loss (the fleet then seeds each node and loads the newest weights, watched the same
   way);
3. **resume**: the deliveries ask the new group for batches.

Callers of the transport (a batch, a weight update, a call) that meet the loss wait for the new group and
try again (``Nodes._guard``). The batches the lost group delivered that the consumer had not taken yet
(or that finished arriving while it was closed) are held until it is gone, then delivered, each node's
last one with its last frame marked truncated and done: its trajectories never go on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import anyio
import anyio.to_thread
from tensordict import TensorDictBase

from .._core._errors import WorkerDiedError, WorkerTimeoutError
from .._core._restart import Lost
from .._fleet._transport import FleetHandle
from .._transport._messages import FleetOp
from ._nodes import RELAUNCHED, GroupLost, Nodes, RemoteNode

__all__ = ["GROUP", "GroupRelauncher", "end_trajectories"]

#: the group's slot in the fleet's replacements: one budget for every node
GROUP = -1


class GroupRelauncher:
    """The group relaunches of ``nodes`` (a ``Nodes``), driven by the fleet's replacements."""

    def __init__(self, nodes: Nodes) -> None:
        self.nodes = nodes
        self.ids = [node.index for node in nodes.nodes]
        #: the node whose loss is being answered (-1: none)
        self.index = -1
        #: set when the current group is lost (a new event per group)
        self.lost = anyio.Event()
        #: set while a group runs (or once the run failed for good)
        self.up = anyio.Event()
        #: tearing a lost group down: its nodes' ends are expected, not failures
        self.quiet = False
        self._error: BaseException | None = None
        self._born_frames = 0
        self._launched = False
        #: async mode: the lost group's batches, held until it is torn down (``(node, batch, frames)``)
        self.held: list[Any] | None = None

    @property
    def _fleet(self) -> FleetHandle:
        return self.nodes.fleet

    @property
    def settled(self) -> bool:
        """A group runs and is not lost."""
        return self.up.is_set() and not self.lost.is_set()

    def started(self) -> None:
        """The first group runs: from now on a loss is answered with a relaunch."""
        self._launched = True
        self._born_frames = self._fleet.frames
        self.up.set()

    def counts(self, error: BaseException) -> bool:
        """Whether ``error`` says a node of this engine is gone (died, or hung past ``progress_timeout``)
        and the policy counts it. A node's own exception (its env's past the env budget) is not."""
        replacements = self._fleet.replacements
        gone = isinstance(error, WorkerTimeoutError) or (
            isinstance(error, WorkerDiedError) and error.engine == self.nodes._engine_name
        )
        return gone and replacements is not None and replacements.counts(error)

    def lose(self, node: RemoteNode | None, error: BaseException) -> bool:
        """``node`` failed with ``error``: relaunch the group (``True``) if the policy answers it, else
        ``False`` (the run ends as without a policy)."""
        n, replacements = self.nodes, self._fleet.replacements
        if self.quiet or self.lost.is_set():
            return True  # the group is lost already: the first error drives the relaunch
        if not self._launched or n._closing or replacements is None or not self.counts(error):
            return False
        self._error, self.index = error, (node.index if node is not None else -1)
        if not replacements.busy(GROUP):  # else a relaunch is bringing the group up: it sees ``lost``
            progressed = self._fleet.frames > self._born_frames  # the backoff starts again
            if not replacements.later(GROUP, error, self, progressed=progressed):
                return False  # the budget is spent: the history is a note on ``error``
        self.lost.set()
        self.held = []
        while True:  # what it delivered and the consumer did not take yet: held (see _release)
            try:
                self.held.append(n._deliveries.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
        if self.up.is_set():
            self.up = anyio.Event()
        return True

    async def guarded(self, fn: Callable[[], Awaitable[Any]], retry: bool) -> Any:
        """``await fn()`` on a running group, ended by the run's failure (raised); a group lost meanwhile:
        again on the next one (``retry``) or ``GroupLost``."""
        n = self.nodes
        while True:
            while not self.settled:
                if n._failure is not None:
                    raise n._failure
                await self.up.wait()
            if n._failure is not None:
                raise n._failure
            try:
                return await n._watched(fn, self.lost)
            except GroupLost:
                if not retry:
                    raise

    # -- the relaunch (aiocollect._fleet._replace.Respawn) ----------------------------------------------
    async def retire(self) -> None:
        """Close every node of the lost group and release its data plane and I/O tasks."""
        n = self.nodes
        self.quiet = True
        with anyio.CancelScope(shield=True):
            await n._close_nodes()
            await anyio.to_thread.run_sync(n._close_transport)
            await n._end_generation()
            for node in n.nodes:
                self._fleet.discard(node.announced)
                node.renew()
            self._release(mark=True)

    async def respawn(self, restarts: int) -> None:
        """The next group, launched and joined; ``Lost`` if it is lost meanwhile."""
        n = self.nodes
        self.lost = anyio.Event()
        self.quiet = False
        await n._new_generation()
        await self._watched(partial(n._start, restarts))

    async def call(self, index: int, op: FleetOp) -> Any:
        return await self._watched(partial(self.nodes._call, self.nodes.nodes[index], op))

    async def restore(self, newest: dict[int, tuple[int, Any] | None]) -> None:
        versions: dict[int, tuple[TensorDictBase, list[int]]] = {}
        for i, entry in sorted(newest.items()):
            if entry is not None and entry[1] is not None:
                versions.setdefault(entry[0], (entry[1], []))[1].append(i)
        for version, (weights, ids) in sorted(versions.items()):
            await self._watched(partial(self.nodes._send_weights, weights, version, ids))

    async def resume(self) -> None:
        self._born_frames = self._fleet.frames
        self.up.set()
        self.nodes._deliveries_send.send_nowait(RELAUNCHED)

    def counted(self, index: int) -> None:
        self.nodes.nodes[index].restarts += 1

    async def give_up(self, error: BaseException) -> None:
        self._release(mark=False)  # delivered before the error, as without a policy
        self.nodes._end(error)

    async def _watched(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        """``await fn()`` on the group being brought up; ``Lost`` if it is lost meanwhile."""
        try:
            return await self.nodes._watched(fn, self.lost)
        except GroupLost:
            assert self._error is not None
            raise Lost(self._error) from None

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


def end_trajectories(batch: TensorDictBase) -> None:
    """Mark ``batch``'s last frame (its time is its last batch dim) truncated and done, every truncated
    flag under ``"next"`` and the done flag beside it, as TorchRL's ``set_truncated`` does."""
    index = (slice(None),) * (batch.batch_dims - 1) + (-1,)
    for key in batch.keys(include_nested=True, leaves_only=True):
        if isinstance(key, tuple) and key[0] == "next" and key[-1] == "truncated":
            for flag in (key, (*key[:-1], "done")):
                if flag in batch.keys(include_nested=True):
                    batch.get(flag)[index] = True
