"""Parent side of the workers: start (ready or raise), supervise, talk to, stop and reap them.

One reader task per worker (in the collector's task group) waits on the worker's socket with
``anyio.wait_readable`` and routes what arrives: batch notices to one memory object stream, replies to
their callers, a failure to everyone. A worker whose socket closes without a goodbye died: its exit code
is in the ``WorkerDiedError``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import multiprocessing as mp
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, get_args

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._core._errors import WorkerDiedError, WorkerTimeoutError
from .._core._gather import gather
from .._core._processes import reaped, signal_group, started
from .._observe._events import Event, Restarted, WeightsLoaded, WorkerFailed, WorkerStarted, WorkerStopped
from .._observe._stats import WorkerState
from .._observe._timesplit import SplitWindow
from .._transport._messages import (
    Attach,
    BatchReady,
    Call,
    Close,
    Collect,
    Failed,
    Ready,
    Release,
    Result,
    RunFree,
    WorkerOp,
)
from .._transport._shm import SharedBlock
from .._transport._stacked import StackedSlots
from .._transport._waiters import WaiterTable
from .._transport._wire import AsyncChannel
from ._forkserver import context
from ._worker import WorkerSpec, start_thread_worker, worker_main

__all__ = ["Respawning", "WorkerHandle", "WorkerPool", "signal_group"]


def _check_op(op: object) -> None:
    """Raise ``TypeError`` unless ``op`` is an operation a worker answers."""
    if not isinstance(op, WorkerOp):
        names = ", ".join(t.__name__ for t in get_args(WorkerOp))
        raise TypeError(f"op must be a worker operation ({names}), got {op!r}")


@dataclass
class _Failure:
    error: BaseException


@dataclass
class WorkerHandle:
    index: int
    spec: WorkerSpec
    channel: AsyncChannel
    process: Any  # mp.Process or threading.Thread
    ready: Ready | None = None
    slots: list[SharedBlock] = field(default_factory=list)
    exited: anyio.Event = field(default_factory=anyio.Event)
    #: set once it is ready (or the pool failed)
    readied: anyio.Event = field(default_factory=anyio.Event)
    policy_version: int = 0
    frames: int = 0
    #: a WorkerState: starting, collecting, stopped or failed (the collector adds paused); typed ``str``
    #: as the fleet's ``Member`` protocol reads it
    state: str = WorkerState.STARTING
    reader_scope: anyio.CancelScope | None = None
    #: loop time since when the worker is expected to deliver a batch (None: it is not), for worker_timeout
    expected_since: float | None = None
    #: slots holding a delivered batch the parent has not released yet
    held_slots: int = 0
    #: the worker's recent time split, from its batch notices (statistics().workers[i].time_split)
    time_split: SplitWindow = field(default_factory=SplitWindow)
    #: envs the worker rebuilt after a fault, and the worker's own replacements (``RestartPolicy``):
    #: statistics().workers[i].restarts
    restarts: int = 0
    #: why the parent killed this worker to replace it (a hang past worker_timeout), if it did
    doomed: BaseException | None = None
    #: batch notices of this worker not received yet (by id): a replaced worker's are dropped
    notices: set[int] = field(default_factory=set)
    #: whether it has its slots (a replacement starting has not: what would collect is not sent)
    attached: bool = True
    #: the worker's frames when this process took over (a replacement that dies before it adds any
    #: waits longer: the backoff)
    born_frames: int = 0

    @property
    def exitcode(self) -> int | None:
        return getattr(self.process, "exitcode", None)


class Respawning(Protocol):
    """What the pool asks of its replacement of lost workers (``_replace.Respawner``, set as
    :attr:`WorkerPool.respawner` by the transport)."""

    def lost(self, handle: WorkerHandle, cause: BaseException) -> bool:
        """Worker ``handle`` exited with ``cause``: whether it is being replaced."""

    def current(self, item: tuple[int, BatchReady]) -> bool:
        """Whether a batch notice comes from its worker as it is now (a replaced one's is dropped)."""


class WorkerPool:
    """``num_workers`` workers of ``backend`` ``"process"`` or ``"serial"`` (threads, same code)."""

    def __init__(
        self,
        specs: list[WorkerSpec],
        *,
        backend: str,
        start_method: str,
        slots_per_worker: int,
        stacked: bool = False,
        on_event: Callable[[Event], None] = lambda event: None,
        timeout: float | None = None,
        on_message: Callable[[int, Any], None] = lambda index, msg: None,
    ) -> None:
        self._on_event = on_event
        #: replaces a worker that dies or hangs (``restart=``; ``None``: fail fast), set by the transport
        self.respawner: Respawning | None = None
        #: the collector's task group, once every worker started (replacements start in it)
        self.tg: anyio.abc.TaskGroup | None = None
        #: a worker body's own messages (not the rollout protocol's), with the worker's index
        self._on_message = on_message
        #: worker_timeout for control calls
        self.timeout = timeout
        self.specs = specs
        self.backend = backend
        self.start_method = start_method
        self.slots_per_worker = slots_per_worker
        #: ``stacked``: each round's batches as the rows of one segment, lent as they are (``_stacked.py``)
        self.stacked = stacked
        self.stack: StackedSlots | None = None
        self.workers: list[WorkerHandle] = []
        self.failure: BaseException | None = None
        self.closing = False
        send, receive = anyio.create_memory_object_stream[Any](math.inf)
        self._deliveries_send: MemoryObjectSendStream[Any] = send
        self.deliveries: MemoryObjectReceiveStream[Any] = receive
        #: callers waiting for a worker's reply, by request id (a cancelled caller is forgotten)
        self._replies = WaiterTable()
        self._ids = itertools.count()

    # -- start ------------------------------------------------------------------------------------
    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        """Start every worker and return when all are ready (or raise the first start-up error)."""
        for spec in self.specs:
            handle = await self.spawn(spec)
            self.workers.append(handle)
            tg.start_soon(self.watch, handle)
        with anyio.CancelScope() as scope:
            self._startup_scope = scope
            for handle in self.workers:
                while handle.ready is None:
                    if self.failure is not None:
                        raise self.failure
                    await handle.readied.wait()
        if self.failure is not None:
            raise self.failure
        if self.stacked:
            self.stack = StackedSlots.over([h.ready for h in self.workers], [s.run for s in self.specs])
        for handle in self.workers:
            assert handle.ready is not None
            if self.stack is None:
                handle.slots = [
                    SharedBlock(handle.ready.layout, handle.ready.batch_size)
                    for _ in range(self.slots_per_worker)
                ]
            await handle.channel.send(self.attach_message(handle))
        self.tg = tg  # from now on a worker that dies may be replaced (RestartPolicy)

    def attach_message(self, handle: WorkerHandle) -> Attach:
        """What worker ``handle`` maps: its own slots, or its rows of the stacked segments."""
        if self.stack is not None:
            return self.stack.attach(handle.index)
        return Attach(tuple(s.name for s in handle.slots))

    async def spawn(self, spec: WorkerSpec) -> WorkerHandle:
        """Start the worker of ``spec`` (a process, or a thread with the serial backend)."""
        parent_sock, child_sock = socket.socketpair()
        if self.backend == "process":
            # not daemonic: a worker may start processes (a torchrl ParallelEnv, a gymnasium
            # AsyncVectorEnv); it leads its own process group, which aclose() and _reader reap whole
            process = context(self.start_method).Process(
                target=worker_main,
                args=(child_sock, spec),
                name=f"aiocollect-worker-{spec.index}",
                daemon=False,
            )
            try:
                with anyio.CancelScope(shield=True):  # a started process is always handed back
                    await anyio.to_thread.run_sync(process.start)
                started(process)
            finally:
                child_sock.close()
        else:
            process = start_thread_worker(child_sock, spec)
        return WorkerHandle(spec.index, spec, AsyncChannel(parent_sock), process)

    # -- the reader task per worker ---------------------------------------------------------------
    async def watch(self, handle: WorkerHandle) -> None:
        """The reader task of worker ``handle`` (in the collector's task group)."""
        # Shielded: the reader lives as long as its worker, whatever the caller's cancel scopes do (a
        # cancelled consumer must not look like a dead worker); it ends at the worker's EOF, or when
        # aclose() cancels `reader_scope` after the worker was stopped.
        failed = False
        with anyio.CancelScope(shield=True) as scope:
            handle.reader_scope = scope
            try:
                failed = await self._read(handle)
            finally:
                with anyio.CancelScope(shield=True):  # also when aclose() cancelled reader_scope
                    # aclose() gave up on a thread worker stuck in a call that never returns (a hung
                    # env): it cannot be killed, so do not wait for it again
                    await anyio.to_thread.run_sync(handle.process.join, 0.0 if scope.cancel_called else 2.0)
                if isinstance(handle.process, mp.process.BaseProcess):
                    # whatever its env started and did not stop (or could not: the worker was killed)
                    signal_group(handle.process, signal.SIGKILL)
                    reaped(handle.process)
                handle.exited.set()
                cause = handle.doomed
                if cause is None and not failed and not self.closing:
                    cause = WorkerDiedError(handle.index, handle.exitcode)
                respawner = self.respawner
                if cause is not None and respawner is not None and not handle.attached:
                    pass  # a replacement lost on its way up: the replacement answers it
                elif cause is not None and respawner is not None and respawner.lost(handle, cause):
                    pass  # a replacement is on its way
                elif cause is not None and not self.closing:
                    self.lost(handle, cause)
                elif not failed:
                    handle.state = WorkerState.STOPPED
                    self._on_event(WorkerStopped(handle.index))

    async def _read(self, handle: WorkerHandle) -> bool:
        """Route the worker's messages until it exits; ``True`` if it reported a failure.

        A process's exit is its sentinel, not only its socket's EOF: processes its env forked hold copies
        of the worker's end of the socket, and may outlive it."""
        failed = False
        sentinel = getattr(handle.process, "sentinel", None)
        async with anyio.create_task_group() as tg:
            if sentinel is not None:

                async def watch_exit() -> None:
                    await anyio.wait_readable(sentinel)
                    tg.cancel_scope.cancel()

                tg.start_soon(watch_exit)
            while True:
                try:
                    msg = await handle.channel.receive()
                except (EOFError, OSError):
                    break
                failed = self._route(handle, msg) or failed
            tg.cancel_scope.cancel()
        for msg in handle.channel.receive_left():  # what it sent before it exited
            failed = self._route(handle, msg) or failed
        return failed

    def _route(self, handle: WorkerHandle, msg: Any) -> bool:
        """Dispatch one message from a worker; ``True`` if it reported a failure."""
        if isinstance(msg, BatchReady):
            if self.respawner is not None:
                handle.notices.add(id(msg))
            self.note_version(handle.index, msg.policy_version)
            handle.frames += msg.frames
            handle.time_split.add(msg.time_split)
            handle.held_slots += 1
            # with a free slot left it goes on collecting (async mode); otherwise it waits for us
            more = handle.held_slots < self.slots_per_worker
            handle.expected_since = anyio.current_time() if more else None
            self._deliveries_send.send_nowait((handle.index, msg))
        elif isinstance(msg, Result):
            self._replies.resolve(msg.request_id, msg.value)
        elif isinstance(msg, Ready):
            handle.ready = msg
            handle.policy_version = msg.policy_version
            handle.state = WorkerState.COLLECTING
            self._on_event(WorkerStarted(handle.index))
            handle.readied.set()
        elif isinstance(msg, Restarted):  # an env restart in the worker, sent as it happened: counted
            handle.restarts += 1  # where statistics() reads it, and published with it
            self._on_event(msg)
        elif isinstance(msg, Failed):
            handle.state = WorkerState.FAILED
            self._on_event(WorkerFailed(handle.index, f"{type(msg.error).__name__}: {msg.error}"))
            self.fail(msg.error)  # an error the worker raised (the policy's, a spent env budget): no restart
            return True
        else:
            self._on_message(handle.index, msg)
        return False

    def fail(self, error: BaseException) -> None:
        """Fail the pool: every waiter (batches, calls, start-up) raises ``error``."""
        if self.failure is None:
            self.failure = error
        self._deliveries_send.send_nowait(_Failure(error))
        self._replies.fail(error)
        for handle in self.workers:
            handle.readied.set()

    def lost(self, handle: WorkerHandle, cause: BaseException) -> None:
        """Worker ``handle`` exited with ``cause`` and is not replaced: the pool fails with it."""
        handle.state = WorkerState.FAILED
        if handle.doomed is None:
            self._on_event(WorkerFailed(handle.index, str(cause)))
        self.fail(cause)

    def note_version(self, index: int, version: int) -> None:
        """Worker ``index`` runs ``version`` (from a batch notice or a load acknowledgement)."""
        handle = self.workers[index]
        if version > handle.policy_version:
            self._on_event(WeightsLoaded(version, index))
        handle.policy_version = version

    # -- talking to workers -----------------------------------------------------------------------
    def check(self) -> None:
        if self.failure is not None:
            raise self.failure

    async def send(self, index: int, msg: Any) -> None:
        self.check()
        handle = self.workers[index]
        if not handle.attached and isinstance(msg, (Collect, Release, RunFree)):
            return  # a replacement starting: told what to collect once it runs (``on_replaced``)
        try:
            await handle.channel.send(msg)
        except OSError:
            # the worker is gone (it failed and exited, or was killed) and its reader has not said so
            # yet: wait for it and raise why, rather than a bare BrokenPipeError
            with anyio.move_on_after(5.0):
                await handle.exited.wait()
            self.check()
            if self.respawner is not None and handle.exited.is_set():
                return  # being replaced: the replacement is brought up to date (``on_replaced``)
            raise

    async def call(self, index: int, op: WorkerOp) -> Any:
        """Run ``op`` in worker ``index`` between batches and return its result."""
        _check_op(op)
        self.check()
        request_id = next(self._ids)
        with self._replies.expect(request_id) as waiter:
            handle = self.workers[index]
            await self.send(index, Call(request_id, op))
            with anyio.move_on_after(self.timeout if self.timeout is not None else math.inf):
                if self.respawner is None:
                    return await waiter.wait()
                return await _reply_or_exit(waiter, handle)
        error = WorkerTimeoutError(
            f"worker {index} did not answer {op!r} within worker_timeout={self.timeout} s"
        )
        self.fail(error)
        raise error

    async def call_all(self, op: WorkerOp) -> list[Any]:
        """Run ``op`` in every worker (concurrently); the results in worker order."""
        _check_op(op)
        return await gather(*[partial(self.call, i, op) for i in range(len(self.workers))])

    async def receive(self) -> tuple[int, BatchReady]:
        """The next batch notice (any worker); raises the pool's failure."""
        while True:
            item = await self.deliveries.receive()
            if isinstance(item, _Failure):
                self._deliveries_send.send_nowait(item)  # every later receive raises too
                raise item.error
            if self.respawner is None or self.respawner.current(item):
                return item

    def receive_nowait(self) -> Any:
        """The next batch notice or failure waiting (``anyio.WouldBlock`` if none); a replaced worker's
        notices are dropped."""
        while True:
            item = self.deliveries.receive_nowait()
            if isinstance(item, _Failure) or self.respawner is None or self.respawner.current(item):
                return item

    def set_stop(self, stop: torch.Tensor, indices: list[int], value: int) -> None:
        for i in indices:
            stop[i] = value

    # -- stop and reap ----------------------------------------------------------------------------
    async def aclose(self, grace: float = 5.0) -> None:
        """Ask every worker to stop, wait up to ``grace`` seconds, then terminate/kill; free the slots."""
        with anyio.CancelScope(shield=True):
            self.closing = True  # (the transport let the replacements in flight settle first)
            if self.failure is not None:
                grace = min(grace, 0.5)  # after a failure, do not wait long for the others
            # bounded: a hung worker does not read, and a full socket would block this send for ever
            with anyio.move_on_after(grace):
                for handle in self.workers:
                    if not handle.exited.is_set():
                        with contextlib.suppress(OSError, anyio.BrokenResourceError):
                            await handle.channel.send(Close())
            with anyio.move_on_after(grace):
                for handle in self.workers:
                    # a process still building its env (a start-up cancelled or failed) reads no Close: it
                    # is terminated at once below; a thread cannot be, so it gets the grace period
                    if handle.ready is not None or not isinstance(handle.process, mp.process.BaseProcess):
                        await handle.exited.wait()
            for handle in self.workers:
                if not handle.exited.is_set() and isinstance(handle.process, mp.process.BaseProcess):
                    signal_group(handle.process, signal.SIGTERM)
                    with anyio.move_on_after(1.0):
                        await handle.exited.wait()
                    if not handle.exited.is_set():
                        signal_group(handle.process, signal.SIGKILL)
                        await handle.exited.wait()
            for handle in self.workers:
                if not handle.exited.is_set() and handle.reader_scope is not None:
                    handle.reader_scope.cancel()  # a hung thread worker: give up on it
                    with anyio.move_on_after(grace):
                        await handle.exited.wait()
            for handle in self.workers:
                handle.channel.close()
                for slot in handle.slots:
                    slot.unlink()
                    slot.close()
                if isinstance(handle.process, mp.process.BaseProcess):
                    with contextlib.suppress(ValueError):
                        handle.process.close()
            if self.stack is not None:
                self.stack.close()
            self._deliveries_send.close()
            self.deliveries.close()


async def _reply_or_exit(waiter: Any, handle: WorkerHandle) -> Any:
    """The reply ``waiter`` gets, or (the worker exited first, to be replaced) why it exited."""
    result: list[Any] = []
    async with anyio.create_task_group() as tg:

        async def reply() -> None:
            result.append(await waiter.wait())
            tg.cancel_scope.cancel()

        tg.start_soon(reply)
        await handle.exited.wait()
        await anyio.lowlevel.checkpoint()  # a reply sent before the exit is routed first
        tg.cancel_scope.cancel()
    if result:
        return result[0]
    raise handle.doomed or WorkerDiedError(handle.index, handle.exitcode)
