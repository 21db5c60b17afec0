"""The nodes of ``DistributedCollector``, ``DistributedSyncCollector`` and ``RPCCollector`` as a transport
of the one :class:`~aiocollect._fleet._collector.FleetCollector` (:class:`Nodes`): launching them, their
control
connections, replies, failures and shutdown, asking them for batches (sync and async) and sending them
weights. An engine subclasses it with its data plane (``_gloo.GlooNodes``, ``_rpc.RpcNodes``).

Roles: the trainer is rank 0, node ``i`` is rank ``i + 1``. The **control** channel is one TCP connection
per node (see ``_launchers``), framed pickles both ways: set-up, batch requests, control operations,
weight-transfer notices, close, and from the node its batch notices, results and errors. The trainer waits
on it with ``anyio.wait_readable``; EOF means the node died. Nothing is polled.
"""

from __future__ import annotations

import abc
import contextlib
import itertools
import math
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, cast

import anyio
import anyio.abc
import anyio.to_thread
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from tensordict import TensorDictBase

from .._core._errors import WorkerError, WorkerTimeoutError, as_error, worker_died
from .._core._gather import gather
from .._fleet._replace import restarted_options
from .._fleet._transport import Arrival, FleetHandle
from .._observe._events import WeightsLoaded, WorkerStarted, WorkerStopped
from .._observe._stats import WorkerState
from .._observe._timesplit import SplitWindows
from .._transport._messages import Failed, FleetOp, Result
from .._transport._store import StoreClient, StoreServer
from .._transport._waiters import Waiter, WaiterTable
from .._transport._wire import AsyncChannel
from ._launchers import (
    HELLO_SIZE,
    NodeProcess,
    TrainerAddress,
    check_hello,
    new_token,
    routable_host,
)
from ._messages import (
    CallFailed,
    Close,
    ControlOp,
    HostSpec,
    Loaded,
    NodeBatch,
    NodeReady,
    NodeRestarts,
    Request,
    Setup,
)
from ._trainer import NOT_REPLACED, Hosts, NodePlan

#: seconds a node gets to close its collector and hang up after ``Close`` (any worker_timeout): then killed
_CLOSE_GRACE = 2.0
#: queued to the async deliveries once a new group runs: ``__anext__`` asks it for batches
RELAUNCHED = object()


class GroupLost(Exception):
    """The node group a call ran on was lost and is being relaunched (never reaches the user)."""


async def _then_cancel(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


@dataclass
class Failure:
    error: BaseException


class Relaunching(Protocol):
    """The group's relaunch under ``restart=`` (``_relaunch.GroupRelauncher``), as the nodes see it."""

    lost: anyio.Event
    up: anyio.Event
    quiet: bool
    held: list[Any] | None

    @property
    def settled(self) -> bool: ...
    def started(self) -> None: ...
    def lose(self, node: RemoteNode | None, error: BaseException) -> bool: ...
    async def guarded(self, fn: Callable[[], Any], retry: bool) -> Any: ...


@dataclass
class RemoteNode:
    """The trainer's view of one node."""

    index: int
    process: NodeProcess | None = None
    channel: AsyncChannel | None = None
    pid: int | None = None
    host: str | None = None
    ready: NodeReady | None = None
    state: WorkerState = WorkerState.STARTING
    frames: int = 0
    policy_version: int = 0
    #: batches delivered since its last weight update
    since_update: int = 0
    #: delivered a batch since its last weight update (update_at_each_batch)
    fresh: bool = False
    in_flight: bool = False
    buffer: Any = None
    connected: anyio.Event = field(default_factory=anyio.Event)
    gone: anyio.Event = field(default_factory=anyio.Event)
    ready_event: anyio.Event = field(default_factory=anyio.Event)
    loaded_event: anyio.Event = field(default_factory=anyio.Event)
    time_split: SplitWindows = field(default_factory=SplitWindows)  # its collector's, from its batches
    #: its collector's env restarts (``RestartPolicy``), from its batches, and its group's relaunches
    restarts: int = 0
    #: frames of its batch in flight, once its notice arrived (``GroupRelauncher``: lost with its group)
    announced: int = 0

    @property
    def rank(self) -> int:
        return self.index + 1

    def renew(self) -> None:
        """Forget the process of a lost group (its counts stay): the slot waits for the next one."""
        self.process = self.channel = self.ready = self.buffer = self.pid = self.host = None
        self.state, self.fresh, self.in_flight = WorkerState.STARTING, False, False
        self.since_update = self.announced = 0
        self.connected, self.gone, self.ready_event = anyio.Event(), anyio.Event(), anyio.Event()
        self.loaded_event = anyio.Event()


class Nodes(Hosts, abc.ABC):
    """The nodes of a node collector (``fleet``), a :class:`~aiocollect._fleet._collector.Transport`; an
    engine
    subclasses it with the hooks of its data plane."""

    state_prefix = "node"
    versioned = False
    #: the module that runs a node (``_gloo``, ``_rpc``), and the engine's name in errors
    _engine: str
    _engine_name: str

    def __init__(
        self, fleet: FleetHandle, plan: NodePlan, relaunch: Callable[[Nodes], Relaunching] | None = None
    ) -> None:
        self.fleet, self.plan = fleet, plan
        self.num_nodes = plan.num_nodes
        self.nodes = [RemoteNode(i) for i in range(self.num_nodes)]
        self._failure: BaseException | None = None
        self._failed_event = anyio.Event()
        self._closing = False
        self._listener: socket.socket | None = None
        self._address: TrainerAddress | None = None
        self._policy_payload = b""
        #: callers waiting for a node's reply: ("call", id) -> Result value, ("batch", node, seq) -> notice
        self._waiters = WaiterTable(on_orphan=self._on_orphan)
        self._ids = itertools.count(1)
        # the batches of async mode: opened when the collector is entered (one never entered leaks none)
        send, receive = anyio.create_memory_object_stream[Any](math.inf)
        send.close()
        receive.close()
        self._deliveries_send: MemoryObjectSendStream[Any] = send
        self._deliveries: MemoryObjectReceiveStream[Any] = receive
        self._outstanding = 0  # frames requested from nodes and not yet delivered to the consumer
        self._io: anyio.abc.TaskGroup | None = None
        self._io_stop = anyio.Event()
        self._io_closed = anyio.Event()
        #: the authenticated store of the collector's groups, served here, and the trainer's own client
        self._store_server: StoreServer | None = None
        self._store: StoreClient | None = None
        #: the I/O host's task group (a group's own I/O tasks are ``_io``, ended with the group)
        self._hosting: anyio.abc.TaskGroup | None = None
        self._gen_closed = anyio.Event()
        #: relaunches the whole group under ``restart=`` (a launcher that can start nodes again)
        self.relauncher = relaunch(self) if relaunch is not None and fleet.replacements is not None else None

    @property
    def started(self) -> bool:
        return self._io is not None

    def members(self) -> Sequence[RemoteNode]:
        return self.nodes

    # -- batches --------------------------------------------------------------------------------------
    async def next_delivery(self) -> Arrival:
        if self._failure is not None:
            raise self._failure
        return await (self._next_sync() if self.plan.sync else self._next_async())

    async def _fetch(self, node: RemoteNode) -> NodeBatch:
        return self._account(node, await self._fetch_batch(node))

    def _account(self, node: RemoteNode, result: NodeBatch) -> NodeBatch:
        node.frames += result.frames
        node.time_split.add(result.time_split)
        node.since_update += 1
        node.fresh = True
        return result

    def _update_due(self, node: RemoteNode) -> bool:
        weights, interval = self.plan.weights, self.plan.weights.interval or 0
        return (weights.at_each_batch and node.fresh) or (interval > 0 and node.since_update >= interval)

    async def _next_sync(self) -> Arrival:
        due = [node.index for node in self.nodes if self._update_due(node)]
        if due:
            await self.fleet.update_weights(worker_ids=due)
        results = await self._round()
        shapes = {tuple(r.batch.batch_size) for r in results}
        if len(shapes) > 1:
            raise ValueError(
                f"sync=True stacks one batch per node; the nodes' batches differ: {sorted(shapes)}"
            )
        batch = cast("TensorDictBase", torch.stack([r.batch for r in results], 0))
        batch.names = [None] * (batch.ndim - 1) + ["time"]
        episodes = [(i, ret, n) for i, r in enumerate(results) for ret, n in r.episodes]
        frames = sum(r.frames for r in results)
        return Arrival(batch, frames, episodes, None, min(r.policy_version for r in results))

    async def _round(self) -> list[NodeBatch]:
        """One batch of every node; a round whose group is lost is collected again by the next group (what
        it had received is discarded)."""
        while True:
            done: dict[int, NodeBatch] = {}

            fetches = [partial(self._fetch_into, node, done) for node in self.nodes]
            try:
                await self._guard(partial(gather, *fetches), retry=False)
            except GroupLost:
                self.fleet.discard(sum(r.frames for r in done.values()))
                continue
            return [self._account(node, done[node.index]) for node in self.nodes]

    async def _fetch_into(self, node: RemoteNode, done: dict[int, NodeBatch]) -> None:
        done[node.index] = await self._fetch_batch(node)

    def _node_frames(self, node: RemoteNode) -> int:
        return node.ready.frames_per_batch if node.ready is not None else self.plan.node_fpb

    async def _top_up(self, eager: bool) -> None:
        """Ask idle nodes for their next batch (what the budget still needs); nodes due for weights get
        them first. ``eager`` (right after a delivery) leaves ``update_at_each_batch`` nodes for the
        next ``__anext__``, so that they get the weights trained on that batch."""
        chosen, due = [], []
        fleet = self.fleet
        if self.relauncher is not None and not self.relauncher.settled:
            return  # asked again once the new group runs (RELAUNCHED)
        for node in self.nodes:
            if node.in_flight or node.state != WorkerState.COLLECTING:
                continue
            if eager and self.plan.weights.at_each_batch and node.fresh:
                continue
            if 0 < fleet.total_frames <= fleet.frames + self._outstanding:
                break
            chosen.append((node, self._node_frames(node)))
            self._outstanding += chosen[-1][1]
            node.in_flight = True
            if self._update_due(node):
                due.append(node.index)
        group = self._gen_closed
        if due:
            await fleet.update_weights(worker_ids=due)
        if group is not self._gen_closed:  # its group was lost meanwhile: asked again (RELAUNCHED)
            self._outstanding -= sum(frames for _, frames in chosen)
            return
        assert self._io is not None
        for node, frames in chosen:
            self._io.start_soon(self._fetch_task, node, frames)

    async def _fetch_task(self, node: RemoteNode, frames: int) -> None:
        result = None
        try:
            result = await self._fetch(node)
        except Exception as exc:
            if self._failure is None:
                self._fail(node, exc)
            return
        finally:
            node.in_flight = False
            if result is None:  # never delivered (its group lost): the budget asks for it again
                self._outstanding -= frames
        if self.relauncher is not None and self.relauncher.held is not None:
            self.relauncher.held.append((node.index, result, frames))  # its group is lost: held
        else:
            self._deliveries_send.send_nowait((node.index, result, frames))

    async def _next_async(self) -> Arrival:
        while True:
            await self._top_up(eager=False)
            item = await self._deliveries.receive()
            if isinstance(item, Failure):
                self._deliveries_send.send_nowait(item)
                raise item.error
            if item is RELAUNCHED:
                continue  # a new group runs: ask it for batches
            index, result, frames = item
            # one collected before an update_weights(flush=True) reached its node: dropped, asked again
            if not self.fleet.stale(index, result.policy_version, result.frames):
                break
            self._outstanding -= frames
        batch = result.batch
        self.fleet.delivered(index, batch)
        batch.set(("collector", "node_id"), torch.full(batch.batch_size, index, dtype=torch.int64))
        batch.names = [None] * (batch.ndim - 1) + ["time"]
        try:  # this batch counts as outstanding until the fleet records it: never asked for twice
            await self._top_up(eager=True)
        finally:
            self._outstanding -= frames
        episodes = [(index, ret, n) for ret, n in result.episodes]
        return Arrival(batch, result.frames, episodes, index, result.policy_version)

    # -- weights and calls ------------------------------------------------------------------------------
    async def publish(self, weights: TensorDictBase, version: int, ids: list[int]) -> TensorDictBase | None:
        """Send the weights; a copy of them when a relaunched group would load them (``restart=``)."""
        if self._failure is not None:
            raise self._failure
        copy, replacements = None, self.fleet.replacements
        if self.relauncher is not None and replacements is not None:  # what a relaunched group loads
            copy = await anyio.to_thread.run_sync(lambda: weights.detach().clone())  # as they are now
            replacements.published(version, ids, copy)  # (before the send: a group relaunched meanwhile)
        await self._guard(partial(self._send_weights, weights, version, ids))
        for i in ids:
            self.nodes[i].since_update = 0
            self.nodes[i].fresh = False
        return copy

    async def load_now(self, ids: list[int], version: int, published: Any = None) -> None:
        await self._guard(lambda: gather(*[partial(self._wait_loaded, self.nodes[i], version) for i in ids]))

    async def _wait_loaded(self, node: RemoteNode, version: int) -> None:
        while node.policy_version < version:
            await node.loaded_event.wait()

    async def call_each(self, ops: Sequence[tuple[int, FleetOp]]) -> list[Any]:
        # one guard over the gather: a node failure ends every call at once
        calls = [partial(self._call, self.nodes[i], op) for i, op in ops]
        replies: list[Any] = await self._guard(lambda: gather(*calls))
        return replies

    async def _open_store(self, host: str, client_timeout: float) -> None:
        """Serve the collector's authenticated store on ``host`` and connect the trainer's client (whose
        operations time out after ``client_timeout`` seconds)."""
        self._store_server = server = StoreServer(host)
        self._store = await anyio.to_thread.run_sync(server.client, client_timeout)

    def _close_store(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._store_server is not None:
            self._store_server.close()
            self._store_server = None

    # -- transport hooks ----------------------------------------------------------------------------
    async def _open_transport(self, host: str) -> None:
        """Trainer side of the data plane, before nodes are set up."""

    def _transport_setup(self, index: int) -> dict[str, Any]:
        return {}

    async def _connect_transport(self) -> None:
        """Runs while the nodes join the data plane."""

    @abc.abstractmethod
    async def _fetch_batch(self, node: RemoteNode) -> NodeBatch:
        """``node``'s next batch."""

    @abc.abstractmethod
    async def _send_weights(self, weights: TensorDictBase, version: int, ids: list[int]) -> None:
        """Send ``weights`` as ``version`` to the nodes ``ids``."""

    async def _call(self, node: RemoteNode, op: ControlOp) -> Any:
        """Run a control operation on ``node``'s collector and return its reply."""
        request_id = next(self._ids)
        with self._expect(("call", request_id)) as waiter:
            assert node.channel is not None
            await node.channel.send(Request(request_id, op))
            value = await waiter.wait()
        if isinstance(value, CallFailed):
            raise as_error(value.error)
        return value

    async def _on_notice(self, node: RemoteNode, msg: Any) -> None:
        raise TypeError(f"unexpected message from node {node.index}: {msg!r}")

    def _close_transport(self) -> None:
        """Release the trainer's side of the data plane (nodes are gone)."""

    # -- waiting --------------------------------------------------------------------------------------
    def _expect(self, key: Any) -> Waiter:
        if self._failure is not None:
            raise self._failure
        return self._waiters.expect(key)

    def _on_orphan(self, key: Any, value: Any) -> None:
        """A reply nobody takes (its caller was cancelled): a batch is still taken off the wire, or its
        node would block in its send for ever; a call's result is dropped."""
        if key[0] == "batch" and self._io is not None and not self._io_closed.is_set():
            self._io.start_soon(self._drain, self.nodes[key[1]], value)

    async def _drain(self, node: RemoteNode, notice: Any) -> None:
        """Receive a batch nobody waits for any more, and drop it (transports with a data plane)."""

    async def _guard(self, fn: Callable[[], Any], retry: bool = True) -> Any:
        """``await fn()``, ended by a node failure (raised instead); under a relauncher, on a running
        group, and again on the next one if the group is lost meanwhile (``retry``; else ``GroupLost``)."""
        if self.relauncher is not None:
            return await self.relauncher.guarded(fn, retry)
        return await self._watched(fn)

    async def _watched(self, fn: Callable[[], Any], lost: anyio.Event | None = None) -> Any:
        """``await fn()``, ended by a node failure (raised instead) or by ``lost`` (``GroupLost``)."""
        out: list[tuple[bool, Any]] = []
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                try:
                    out.append((True, await fn()))
                except Exception as exc:
                    out.append((False, exc))
                tg.cancel_scope.cancel()

            async def watch(event: anyio.Event) -> None:
                await event.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(run)
            tg.start_soon(watch, self._failed_event)
            if lost is not None:
                tg.start_soon(watch, lost)
        if self._failure is None and lost is not None and lost.is_set():
            raise GroupLost
        if out:
            ok, value = out[0]
            if ok:
                return value
            if self._failure is not None and not isinstance(value, type(self._failure)):
                raise self._failure from None
            raise value
        assert self._failure is not None
        raise self._failure

    @property
    def _winding(self) -> bool:
        """The nodes are being closed (the collector's, or a lost group's): their ends are no failures."""
        return self._closing or (self.relauncher is not None and self.relauncher.quiet)

    async def _verdict(self, node: RemoteNode) -> None:
        """After a transfer from ``node`` failed: wait (5 s at most) for its connection to end and the
        collector to fail or its group to be lost."""
        with anyio.move_on_after(5.0):
            await node.gone.wait()
            if self._closing:
                return
            events = [self._failed_event] + ([self.relauncher.lost] if self.relauncher is not None else [])
            async with anyio.create_task_group() as tg:
                for event in events:
                    tg.start_soon(_then_cancel, event, tg.cancel_scope)

    def _died(self, node: RemoteNode, exitcode: int | None, cause: Any = None) -> BaseException:
        where = {"engine": self._engine_name, "rank": node.rank, "host": node.host, "cause": cause}
        error = worker_died(node.index, exitcode, member="node", **where)
        if self.plan.restart is not None and self.relauncher is None:
            error.add_note(NOT_REPLACED.format(engine=self._engine_name))
        return error

    def _where(self, node: RemoteNode) -> str:
        host = f", {node.host}, pid {node.pid}" if node.host else ""
        return f"node {node.index} ({self._engine_name} rank {node.rank}{host})"

    def _broke_protocol(self, node: RemoteNode, exc: Exception) -> BaseException:
        """A ``WorkerError``: ``node`` (a rogue with the token?) sent what no node sends (``exc``)."""
        said = f"{type(exc).__name__}: {exc}"
        error = WorkerError(f"{self._where(node)} broke the control protocol ({said}); it was closed")
        error.type_name, error.message = f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc)
        error.__cause__ = exc
        return error

    async def _within_progress_timeout(self, node: RemoteNode, fn: Callable[[], Any]) -> Any:
        """``await fn()`` (a node's next batch); a node that takes longer than ``progress_timeout``
        fails the collector with ``WorkerTimeoutError`` naming it."""
        timeout = self.plan.progress_timeout
        if timeout is None:
            return await fn()
        with anyio.move_on_after(timeout) as scope:
            return await fn()
        assert scope.cancelled_caught
        where = self._where(node)
        error = WorkerTimeoutError(
            f"{where} delivered no batch within progress_timeout={timeout:g} s: a hung env or policy? "
            "(give a larger progress_timeout for slower batches, or None for no limit)"
        )
        self._fail(node, error)
        raise error

    def _fail(self, node: RemoteNode | None, error: BaseException) -> None:
        if node is not None and node.state not in (WorkerState.FAILED, WorkerState.STOPPED):
            node.state = WorkerState.FAILED
            self.failed(node, error)
        if self._failure is None and not (self.relauncher is not None and self.relauncher.lose(node, error)):
            self._end(error)

    def _end(self, error: BaseException) -> None:
        """The run ends with ``error``: every caller gets it."""
        if self._failure is not None:
            return
        if self.relauncher is not None:
            self.relauncher.up.set()  # its waiters see the failure
        self._failure = error
        self.fleet.fail(f"a node failed with {type(error).__name__}: {error}")
        self._failed_event.set()
        self._waiters.fail(error)
        self._deliveries_send.send_nowait(Failure(error))

    # -- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> list[int]:
        tg = self.fleet.task_group
        self._deliveries_send, self._deliveries = anyio.create_memory_object_stream[Any](math.inf)
        self._policy_payload = await self.fleet.pickled_policy("the nodes")
        await tg.start(self._io_host)
        fpbs = await self._start()
        if self.relauncher is not None:
            self.relauncher.started()
        return fpbs

    async def run(self) -> None:
        """Nodes are asked for batches as ``async for`` asks (``_top_up``)."""

    async def _io_host(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Owns the collector's I/O: the group's tasks (``_generation``) and a relaunch in flight."""
        try:
            async with anyio.create_task_group() as tg:
                self._hosting = tg
                await self._new_generation()
                task_status.started()
                await self._io_stop.wait()
                tg.cancel_scope.cancel()
        finally:
            self._io_closed.set()

    async def _new_generation(self) -> None:
        assert self._hosting is not None
        self._gen_closed = anyio.Event()
        await self._hosting.start(self._generation, self._gen_closed)

    async def _generation(self, closed: anyio.Event, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Owns one group's I/O tasks (listener, connections, transfers); once they ended (shutdown, or
        the group was lost), closes the sockets they waited on."""
        try:
            async with anyio.create_task_group() as tg:
                self._io = tg
                task_status.started()
                await anyio.sleep_forever()
        finally:
            for node in self.nodes:
                if node.channel is not None:
                    node.channel.close()
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            closed.set()

    async def _end_generation(self) -> None:
        """End the current group's I/O tasks (its nodes are gone) and wait until its sockets closed."""
        if self._io is not None:
            self._io.cancel_scope.cancel()
        await self._gen_closed.wait()

    async def _start(self, restarts: int = 0) -> list[int]:
        tg = self._io
        assert tg is not None
        launcher = self.plan.launcher
        # the address every port of the trainer binds and the nodes connect to: loopback for nodes on
        # this machine; for jobs on other machines the interface that routes out (or trainer_address)
        host = self.plan.trainer_address or ("127.0.0.1" if launcher.local else routable_host())
        listener = socket.create_server((host, self.plan.tcp_port), backlog=max(16, self.num_nodes))
        listener.setblocking(False)
        self._listener = listener
        self._address = address = TrainerAddress(host, listener.getsockname()[1], new_token())
        tg.start_soon(self._accept_loop, listener, address.token)
        # what is opened or started here is released or reaped by stop(), whatever comes: never cancelled
        with anyio.CancelScope(shield=True):
            await self._open_transport(host)
            processes = await launcher.launch(address, [node.rank for node in self.nodes])
        for node in self.nodes:
            node.process = processes[node.rank]
            tg.start_soon(self._watch_process, node)

        async def all_ready() -> None:
            for node in self.nodes:
                await node.connected.wait()
            for node in self.nodes:
                spec = HostSpec(
                    index=node.index,
                    num_nodes=self.num_nodes,
                    payload=self.plan.payloads[node.index],
                    policy_payload=self._policy_payload,
                    rollout=restarted_options(self.plan.rollouts[node.index], restarts),
                )
                setup = Setup(self._engine, spec, self._transport_setup(node.index))
                assert node.channel is not None
                await node.channel.send(setup, encode_in_thread=True)  # it carries the pickled policy

            async def ready() -> None:
                for node in self.nodes:
                    await node.ready_event.wait()

            await gather(self._connect_transport, ready)

        await self._watched(all_ready, self.relauncher.lost if self.relauncher is not None else None)
        for node in self.nodes:
            assert node.ready is not None
            node.state = WorkerState.COLLECTING
            self.fleet.publish(WorkerStarted(node.index))
        return [n.ready.frames_per_batch for n in self.nodes if n.ready is not None]

    async def _accept_loop(self, listener: socket.socket, token: str) -> None:
        assert self._io is not None
        while True:
            await anyio.wait_readable(listener)
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                continue
            except OSError:  # (ECONNABORTED, EMFILE...): no connection this time, never the collector's end
                await anyio.sleep(0.05)
                continue
            self._io.start_soon(self._handshake, sock, token)

    async def _handshake(self, sock: socket.socket, token: str) -> None:
        sock.setblocking(False)
        data = b""
        with anyio.move_on_after(30):
            while len(data) < HELLO_SIZE:
                await anyio.wait_readable(sock)
                try:
                    chunk = sock.recv(HELLO_SIZE - len(data))
                except BlockingIOError:
                    continue
                except OSError:  # reset before its hello: not one of ours, closed below
                    break
                if not chunk:
                    break
                data += chunk
        hello = check_hello(data, token)
        rank = hello[0] if hello else -1
        if hello is None or not 1 <= rank <= self.num_nodes or self.nodes[rank - 1].channel is not None:
            sock.close()  # not one of ours (nothing of it was unpickled)
            return
        node = self.nodes[rank - 1]
        node.pid = hello[1]
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        node.channel = AsyncChannel(sock)
        node.connected.set()
        await self._reader(node)

    async def _watch_process(self, node: RemoteNode) -> None:
        """A node that ends before it connected (import error, killed, job failed) fails the start."""
        assert node.process is not None
        await node.process.wait()
        if not node.connected.is_set() and not self._winding:
            self._fail(node, self._died(node, node.process.exitcode))

    async def _reader(self, node: RemoteNode) -> None:
        channel = node.channel
        assert channel is not None
        failed = False
        try:
            while True:
                try:
                    msg = await channel.receive()
                    if isinstance(msg, Result):
                        self._waiters.resolve(("call", msg.request_id), msg.value)
                    elif isinstance(msg, Loaded):
                        if msg.version > node.policy_version:
                            node.policy_version = msg.version
                            self.fleet.publish(WeightsLoaded(msg.version, node.index))
                        node.loaded_event.set()
                        node.loaded_event = anyio.Event()
                    elif isinstance(msg, NodeReady):
                        node.ready, node.pid, node.host = msg, msg.pid, msg.host
                        node.ready_event.set()
                    elif isinstance(msg, NodeRestarts):  # as they happen
                        self.restarted(node, msg.records)
                    elif isinstance(msg, Failed):
                        self._fail(node, as_error(msg.error))
                    else:
                        await self._on_notice(node, msg)
                except (EOFError, OSError):
                    break
                except Exception as exc:  # a frame that does not unpickle, an object that is no message
                    failed = True
                    self._fail(node, self._broke_protocol(node, exc))
                    break
                failed = failed or isinstance(msg, Failed)
        finally:
            node.gone.set()
            if failed:
                channel.close()  # nothing more of it is read
            if not failed and not self._winding:
                exitcode = None
                if node.process is not None:
                    with anyio.move_on_after(2.0, shield=True):
                        await node.process.wait()
                    exitcode = node.process.exitcode
                self._fail(node, self._died(node, exitcode))
            elif not failed and node.state != WorkerState.FAILED:
                node.state = WorkerState.STOPPED
                self.fleet.publish(WorkerStopped(node.index))

    async def stop(self) -> None:
        self.fleet.close()  # nothing new starts (Transport.stop)
        with anyio.CancelScope(shield=True):
            if self._closing:
                return
            self._closing = True
            if (replacements := self.fleet.replacements) is not None:  # a group it started is in the list
                await replacements.cancel()
            await self._close_nodes()
            for node in self.nodes:
                if node.state not in (WorkerState.FAILED, WorkerState.STOPPED):
                    node.state = WorkerState.STOPPED
            await anyio.to_thread.run_sync(self._close_transport)
            if self._io is not None:
                self._io_stop.set()
                await self._io_closed.wait()
            self._deliveries_send.close()
            self._deliveries.close()

    async def _close_nodes(self) -> None:
        """Tell every node to close, then stop (reap, or kill) their processes."""
        for node in self.nodes:
            if node.channel is not None and not node.gone.is_set():
                with contextlib.suppress(Exception):
                    await node.channel.send(Close())

        # a node that hung up in the grace period gets 5 s to exit (a submitit job); others are killed
        async def close(node: RemoteNode) -> None:
            if node.channel is not None:
                with anyio.move_on_after(_CLOSE_GRACE):
                    await node.gone.wait()
            if node.process is not None:
                await node.process.stop(5.0 if node.channel is None or node.gone.is_set() else 0.0)

        await gather(*[partial(close, node) for node in self.nodes])


__all__ = ["RELAUNCHED", "Failure", "GroupLost", "Nodes", "Relaunching", "RemoteNode"]
