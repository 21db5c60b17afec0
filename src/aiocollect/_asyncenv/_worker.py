"""The body of a worker process of ``MultiAsyncEnvCollector``: its own event loop running an
``AsyncEnvCollector`` over its share of the envs (through :class:`~._collector.Hosted`, on the worker's view
of the collector's options), its batches written into the parent's shared-memory slots.

It speaks the protocol of the rollout workers (``_workers/_worker.py``: the typed messages and control
operations of ``_transport/_messages.py``), after one exchange of its own: once its envs are built (before
any is reset), ``EnvRows`` tells the parent how many (sub-)envs it has and ``EnvOffset`` gives it its first
env id over all workers (the parent waits for every worker's count: a vector env's ``num_envs`` is known
only once built), from which its env ids and seeds follow. Then ``Ready`` (with the layout of the first
batch), ``Attach`` and ``RunFree``; one ``BatchReady`` per batch into a free slot, ``Release`` hands a slot
back; weights come from the weight-sync receiver between two policy calls; ``Close`` ends it. Each env
dropped (``on_env_error="drop"``) or restarted goes to the parent as its event (with its env id over all
workers). The control channel is read on the loop (fd readiness), never by a blocking call.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import cloudpickle
from tensordict import TensorDictBase

from .._core._restart import IDS_PER_GENERATION
from .._observe._events import EventStream, Restarted, WorkerFailed
from .._transport._flat import layout_of
from .._transport._messages import (
    Attach,
    BatchReady,
    Call,
    Close,
    GetState,
    LoadState,
    LoadWeights,
    Ready,
    Release,
    Reset,
    Result,
    RunFree,
    SetSeed,
)
from .._transport._shm import SharedBlock
from .._transport._wire import BlockingChannel
from .._workers._answers import READS, MemberIO, read, unversioned
from ._collector import Hosted
from ._engine import AllDropped
from ._envset import EnvSet
from ._options import AsyncEnvOptions
from ._worker_frames import VERSION, WorkerFrames

__all__ = ["EnvOffset", "EnvRows", "run_async_worker"]


@dataclass(frozen=True)
class EnvRows:
    """Worker -> parent, once its envs are built: its number of (sub-)envs (env ids)."""

    rows: int


@dataclass(frozen=True)
class EnvOffset:
    """Parent -> worker, once every worker sent ``EnvRows``: its first env id over all workers."""

    first: int


def generation(options: AsyncEnvOptions, spec: Any) -> int:
    """How many times worker ``spec.index`` was replaced before this process (``restart=``): the pool
    starts replacement ``g`` with trajectory ids ``g`` generations past the first worker's
    (``_fleet/_replace.py``)."""
    first = options.traj_id_start + spec.index * options.traj_id_stride
    return (spec.rollout.traj_id_start - first) // (IDS_PER_GENERATION * spec.rollout.traj_id_stride)


class _AsyncWorker(MemberIO):
    def __init__(self, options: AsyncEnvOptions, chan: BlockingChannel, spec: Any) -> None:
        self.chan = chan
        self.spec = spec
        self.index = spec.index
        self.generation = generation(options, spec)
        #: this worker's view of the collector's options (checked by the trainer)
        self.options = options.for_member(spec.index, generation=self.generation)
        #: this worker's first env id over all workers (EnvOffset)
        self.first = 0
        self.placed = anyio.Event()
        self.drops: EventStream | None = None
        self.fpb = self.options.frames_per_batch
        self.frames = WorkerFrames(
            self.fpb,
            env_offset=0,  # set once placed
            traj_start=spec.rollout.traj_id_start,
            traj_stride=spec.rollout.traj_id_stride,
        )
        #: the episodes that ended in the frames taken in since the last batch sent
        self.episodes: list[tuple[int, float, int]] = []
        super().__init__(spec)  # the control block, the weight receiver, the slots
        self.attached = anyio.Event()
        #: a batch is taken in and sent under ``lock`` (a call that restarts the engine waits for it), and
        #: only once ``sending`` is set: at the trainer's ``RunFree`` (again after each such call)
        self.lock, self.sending = anyio.Lock(), anyio.Event()
        #: the next batch to send (``None``: none taken yet, or dropped by a restart)
        self.batch: TensorDictBase | None = None
        self.freed = anyio.Event()
        # the version floor the trainer sets, and where this worker counts the frames it drops below it
        self.floor, self.discarded, self.progress = (
            self.array(k) for k in ("floor", "discarded", "progress")
        )
        self.own_floor = 0  # a replacement's: the version the trainer had it load (see call)
        self.frames.discarded = int(self.discarded[self.index])  # a replacement: its predecessor's count
        env_fns = cloudpickle.loads(spec.payload)()
        self.hosted = Hosted(env_fns, cloudpickle.loads(spec.policy_payload), self.options, self.place)
        self.collector = self.hosted.collector

    # -- the control channel, read on the loop ----------------------------------------------------
    async def control_loop(self, scope: anyio.CancelScope) -> None:
        """Serve the parent's messages until ``Close`` (or the parent is gone): then cancel ``scope``."""
        sock = self.chan.sock
        try:
            while True:
                msg = self.chan.poll()
                if msg is None:
                    await anyio.wait_readable(sock)
                    continue
                if isinstance(msg, Close):
                    break
                await self.handle(msg)
        except (EOFError, BrokenPipeError, ConnectionResetError):
            pass  # the parent is gone: just exit
        scope.cancel()

    async def handle(self, msg: Any) -> None:
        if self.weights is not None and self.weights.on_message(msg):
            return
        match msg:
            case Attach():
                if not self.slots:
                    self.slots = [SharedBlock(self.layout, self.batch_size, name=n) for n in msg.slot_names]
                self.free = set(range(len(self.slots)))
                self.attached.set()
            case RunFree():
                self.sending.set()
            case Release():
                self.free.add(msg.slot)
                self.freed.set()
            case Call():
                self.chan.send(Result(msg.request_id, await self.call(msg.op)))
            case EnvOffset():
                self.first = msg.first
                self.placed.set()
            case _:  # pragma: no cover - a protocol bug
                raise TypeError(f"unexpected message {msg!r}")

    async def call(self, op: Any) -> Any:
        """The reply to a control operation (``Call.op``). Seeds, resets and checkpoints are served by the
        worker's ``AsyncEnvCollector`` (``_checkpoint.py``) plus the worker's own part, its counter of
        fresh trajectory ids; every one but a plain ``GetState`` restarts its engine (:meth:`restart`)."""
        if isinstance(op, (GetState, LoadState)):
            unversioned(op)
        if isinstance(op, (SetSeed, Reset, LoadState)) or (isinstance(op, GetState) and op.envs):
            async with self.lock:  # between two batches taken in
                reply = await self.restart(op)
                if self.sending.is_set():  # none is sent until the trainer says so again
                    self.sending = anyio.Event()
                self.frames.restart(0 if self.batch is None else self.batch.shape[0])
                self.discarded[self.index] = self.frames.discarded
                self.batch, self.episodes = None, []
            return reply
        if isinstance(op, READS):
            envs = self.collector.envs
            return read(op, envs[0] if envs else None, self.collector.policy)
        match op:
            case GetState():  # at once, between two engine events: it restarts nothing
                return self.with_ids(await self.hosted.state_now())
            case LoadWeights():
                version = await self.load_weights()
                if self.generation:  # a replacement told to load (PipeWeightSync: now): no frame older
                    self.own_floor = max(self.own_floor, version)
                return version
        raise TypeError(f"{type(op).__name__} is not supported by MultiAsyncEnvCollector's workers")

    async def restart(self, op: SetSeed | Reset | GetState | LoadState) -> Any:
        """A call that restarts the engine. The frames the worker took in and did not send are dropped with
        those the engine collected ahead, and the worker sends no batch until the trainer says so
        (``RunFree``), which it does once it has dropped the batches the worker sent before the call
        (waiting in the slots): no frame collected before the call is delivered after it."""
        collector = self.collector
        match op:
            case SetSeed():
                return await collector.set_seed(op.seed)
            case Reset():
                await collector.reset()
            case GetState():
                return self.with_ids(await collector.state_dict(envs=True))
            case LoadState():
                state = dict(op.state)
                fresh = int(state.pop("fresh_ids", 0))
                await collector.load_state_dict(state)
                self.frames.fresh = fresh
        return None

    def with_ids(self, state: dict[str, Any]) -> dict[str, Any]:
        """A worker's state: its collector's, without the weights (the trainer saves them once, for every
        worker), with its counter of fresh ids (no fresh id is given twice across a resume)."""
        state.pop("policy", None)
        state["fresh_ids"] = self.frames.fresh
        return state

    async def load_weights(self) -> int:
        """Load the newest published weights between two policy calls; the version the policy runs."""
        receiver = self.weights
        if receiver is None:
            return self.collector.policy_version
        return await self.hosted.load_weights(receiver.load)

    # -- env ids, dropped and restarted envs ------------------------------------------------------
    async def place(self, spec: EnvSet) -> int:
        """Tell the parent how many env ids this worker's envs take; its first one, once every worker
        told (no env is reset before: seeds follow from it)."""
        if self.options.drop_failed or self.options.restart is not None:  # before any env steps
            self.drops = self.collector.events(kinds={"worker_failed", "restarted"})
        self.chan.send(EnvRows(spec.rows))
        await self.placed.wait()
        self.frames.env_offset = self.first
        return self.first

    async def forward_drops(self, stream: EventStream) -> None:
        """Send each env dropped (``on_env_error="drop"``) or restarted to the parent as it happens (the
        last ones as the worker ends: before its failure, if it fails)."""
        try:
            async for event in stream:
                self.send_drop(event)
        finally:
            while (left := stream.receive_nowait()) is not None:
                self.send_drop(left)
            stream.close()

    def send_drop(self, event: Any) -> None:
        """An env dropped or restarted (its env id over all workers already: ``Engine.drop``)."""
        if isinstance(event, Restarted) or (isinstance(event, WorkerFailed) and event.worker_id >= 0):
            self.chan.send(event)  # (-1: the collector failed, which the worker's own failure reports)

    # -- batches ----------------------------------------------------------------------------------
    async def next_batch(self) -> TensorDictBase:
        """The next ``frames_per_batch`` frames of a version at or above the floor, ids globalised."""
        while True:
            batch = self.frames.take(max(int(self.floor[self.index]), self.own_floor))
            self.discarded[self.index] = self.frames.discarded
            if batch is not None:
                return batch
            try:
                batch = await self.collector.__anext__()
            except AllDropped:  # the last drops first, then the worker's failure
                while self.drops is not None and (event := self.drops.receive_nowait()) is not None:
                    self.send_drop(event)
                raise
            assert batch is not None  # no replay buffer in a worker
            self.frames.add(batch)
            self.episodes += self.hosted.episodes

    async def wait_for_slot(self) -> None:
        """Until the trainer hands a slot back."""
        while not self.free:
            self.freed = anyio.Event()
            await self.freed.wait()

    def held(self) -> contextlib.AbstractContextManager[None]:
        """On-policy (one slot, the trainer's until it asks for the next batch): no policy call starts
        while this is open, as what the envs would collect is dropped at the trainer's next update.
        Entered right after a batch is taken (no checkpoint between); the steps in flight land."""
        return self.hosted.hold() if self.options.pause_when_held else contextlib.nullcontext()

    async def run(self) -> None:
        collector = self.collector
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.control_loop, tg.cancel_scope)  # first: it reads EnvOffset
            with contextlib.ExitStack() as held:
                if self.generation and self.weights is not None:  # a replacement: the newest weights
                    held.enter_context(self.hosted.hold())  # before its first policy call
                async with collector:
                    if self.generation:
                        await self.load_weights()
                        held.close()
                    if self.drops is not None:
                        tg.start_soon(self.forward_drops, self.drops)
                    await self.collect()

    async def collect(self) -> None:
        """Send batches until cancelled (``Close``); a batch is taken in and sent under :attr:`lock`, and
        sent only while :attr:`sending` is set (see :meth:`restart`)."""
        self.batch = batch = await self.next_batch()
        with self.held():
            # the slots' layout is the first batch's
            self.layout, self.batch_size = layout_of(batch), tuple(batch.batch_size)
            version = self.collector.policy_version
            self.chan.send(Ready(self.layout, self.batch_size, self.fpb, policy_version=version))
            await self.attached.wait()
            await self.sending.wait()
        if int(batch.get(VERSION).min()) < self.own_floor:  # a replacement's, before its weights came
            self.frames.discarded += batch.shape[0]
            self.batch = None
        while True:
            await self.sending.wait()
            async with self.lock:
                if not self.sending.is_set():  # a restart came meanwhile: wait for the trainer again
                    continue
                if self.batch is None:
                    self.batch = await self.next_batch()
                self.send(self.batch)
                self.batch = None
                self.note_unsent()
            with self.held():
                async with self.lock:  # not beside a call that stops the engine: both use its policy thread
                    await self.load_weights()  # between batches, as the rollout workers do
                await self.wait_for_slot()
            async with self.lock:
                if self.batch is None:
                    self.batch = await self.next_batch()
                self.note_unsent()

    def note_unsent(self) -> None:
        """The frames taken in and not sent, ``+ 1``, in the control block's "progress" (read once the
        trainer let it send: a replacement's is read before): lost should this process die, they are
        counted as discarded (as a rollout worker's steps begun)."""
        held = 0 if self.batch is None else self.batch.shape[0]
        self.progress[self.index] = 1 + held + self.frames.pending

    def send(self, batch: TensorDictBase) -> None:
        """Write ``batch`` into a free slot and tell the trainer."""
        slot = min(self.free)
        self.free.discard(slot)
        self.slots[slot].td.update_(batch)
        episodes, self.episodes = self.episodes, []
        self.chan.send(
            BatchReady(
                slot=slot,
                steps=batch.shape[0],
                frames=batch.shape[0],
                policy_version=int(batch.get(VERSION).max()),
                episode_returns=[e[1] for e in episodes],
                episode_lengths=[e[2] for e in episodes],
                time_split=self.hosted.time_split(),  # its time split goes with the notice
            )
        )


async def _main(options: AsyncEnvOptions, chan: BlockingChannel, spec: Any) -> None:
    worker = _AsyncWorker(options, chan, spec)
    try:
        await worker.run()
    finally:
        worker.close()


def run_async_worker(options: AsyncEnvOptions, chan: BlockingChannel, spec: Any) -> None:
    """A worker's body (``WorkerSpec.run``): runs its loop until ``Close``; errors propagate with their
    type (the worker sends them to the parent)."""
    backend, loop_options = options.loop, {}
    if backend == "uvloop":
        backend, loop_options = "asyncio", {"use_uvloop": True}
    try:
        anyio.run(_main, options, chan, spec, backend=backend, backend_options=loop_options)
    except BaseExceptionGroup as group:  # one error (in task groups): raise it with its own type
        error: BaseException = group
        while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
            error = error.exceptions[0]
        raise error from None
