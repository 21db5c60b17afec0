"""The body of a worker process of ``MultiAsyncEnvCollector``: its own event loop running an
``AsyncEnvCollector`` over its share of the envs, its batches written into the parent's shared-memory slots.

It speaks the protocol of the rollout workers (``_workers/_worker.py``), after one exchange of its own:
once its envs are built (before any is reset), ``EnvRows`` tells the parent how many (sub-)envs it has and
``EnvOffset`` gives it its first env id over all workers (the parent waits for every worker's count: a vector
env's ``num_envs`` is known only once built), from which its env ids and seeds follow. Then ``Ready`` (with
the layout of the first batch), ``Attach`` and ``RunFree``; one ``BatchReady`` per batch into a free slot,
``Release`` hands a slot back; weights come from the weight-sync receiver between two policy calls; ``Close``
ends it. With ``on_env_error="drop"``, each env dropped goes to the parent as its ``WorkerFailed`` event
(with its env id over all workers).
The control channel is read on the loop (fd readiness), never by a blocking call.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import anyio
import anyio.abc
import cloudpickle
import torch
from tensordict import TensorDictBase

from .._core._restart import IDS_PER_GENERATION, RestartPolicy
from .._observe._events import EventStream, Restarted, WorkerFailed
from .._policies._weights import flat_weights
from .._transport._flat import layout_of
from .._transport._messages import (
    Attach,
    BatchReady,
    Call,
    Close,
    GetAttr,
    GetPath,
    GetState,
    GetWeights,
    LoadWeights,
    MapFn,
    Ready,
    Release,
    Result,
    RunFree,
)
from .._transport._shm import SharedBlock
from .._transport._wire import BlockingChannel
from .._workers._paths import resolve
from .._workers._worker import control_layout
from ._envset import EnvSet
from ._worker_frames import VERSION, WorkerFrames
from ._worker_inner import InnerCollector
from ._worker_state import CHECKPOINT_OPS, SendGate, restarts, serve_checkpoint

__all__ = ["EnvOffset", "EnvRows", "EnvShare", "WorkerConfig", "run_async_worker"]


@dataclass(frozen=True)
class EnvRows:
    """Worker -> parent, once its envs are built: its number of (sub-)envs (env ids)."""

    rows: int


@dataclass(frozen=True)
class EnvOffset:
    """Parent -> worker, once every worker sent ``EnvRows``: its first env id over all workers."""

    first: int


class EnvShare:
    """One worker's envs: a callable (as a worker's env constructor must be) holding its env fns."""

    def __init__(self, env_fns: Sequence[Callable[[], Any]]) -> None:
        self.env_fns = list(env_fns)

    def __call__(self) -> list[Callable[[], Any]]:
        return self.env_fns


@dataclass(frozen=True)
class WorkerConfig:
    """The ``AsyncEnvCollector`` arguments every worker shares."""

    min_batch: int | None
    max_wait: float
    max_frames_per_traj: int | None
    exploration_type: Any
    seed: int | None
    prefetch: int
    loop: str  # "asyncio", "uvloop" or "trio"
    #: init_random_frames per worker (each rounds it up to whole batches of its own)
    random_frames: int = 0
    #: on-policy (max_policy_lag=0): the worker's envs wait while its one slot is the trainer's
    pause_when_held: bool = False
    #: on_env_error: "raise" or "drop"
    on_env_error: str = "raise"
    #: restart=: each worker restarts its own envs (``RestartPolicy``), or ``None``
    restart: RestartPolicy | None = None
    #: seeded episodes (``_episodes/_groups.py``): in groups of this many of the worker's envs, and started
    #: again
    #: when the worker loads new weights (``on_update="restart"``)
    group_size: int | None = None
    on_update: str = "continue"
    #: the collector's ``traj_id_start`` and ``traj_id_stride``: a replacement's generation follows from
    #: its own start (see :func:`generation`)
    traj_id_start: int = 0
    traj_id_stride: int = 1


def generation(config: WorkerConfig, spec: Any) -> int:
    """How many times worker ``spec.index`` was replaced before this process (``restart=``): the pool
    starts replacement ``g`` with trajectory ids ``g`` generations past the first worker's
    (``_fleet/_replace.py``)."""
    first = config.traj_id_start + spec.index * config.traj_id_stride
    return (spec.rollout.traj_id_start - first) // (IDS_PER_GENERATION * spec.rollout.traj_id_stride)


class _AsyncWorker:
    def __init__(self, config: WorkerConfig, chan: BlockingChannel, spec: Any) -> None:
        self.config = config
        self.chan = chan
        self.spec = spec
        self.index = spec.index
        #: this worker's first env id over all workers (EnvOffset), and its envs once built
        self.first = 0
        self.placed = anyio.Event()
        self.env_set: EnvSet | None = None
        self.env_fns = cloudpickle.loads(spec.payload)()
        self.policy = cloudpickle.loads(spec.policy_payload)
        self.fpb = int(spec.rollout.frames_per_batch)
        self.frames = WorkerFrames(
            self.fpb,
            env_offset=0,  # set once placed
            traj_start=spec.rollout.traj_id_start,
            traj_stride=spec.rollout.traj_id_stride,
        )
        #: the episodes that ended in the frames taken in since the last batch sent
        self.episodes: list[tuple[int, float, int]] = []
        self.weights = spec.weights.open(spec.index) if spec.weights is not None else None
        self.slots: list[SharedBlock] = []
        self.free: set[int] = set()
        self.attached = anyio.Event()
        #: open once the trainer says ``RunFree`` (again after each call that restarted the engine)
        self.gate = SendGate()
        #: the next batch to send (``None``: none taken yet, or dropped by a restart)
        self.batch: TensorDictBase | None = None
        self.freed = anyio.Event()
        # the version floor the trainer sets, and where this worker counts the frames it drops below it
        self.control = SharedBlock(control_layout(spec.num_workers), (), name=spec.control_name)
        self.floor = self.control.td["floor"].numpy()
        self.discarded = self.control.td["discarded"].numpy()
        self.progress = self.control.td["progress"].numpy()
        self.generation = generation(config, spec)
        self.own_floor = 0  # a replacement's: the version the trainer had it load (see call)
        self.frames.discarded = int(self.discarded[self.index])  # a replacement: its predecessor's count
        self.collector: InnerCollector | None = None

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
        if isinstance(msg, Attach):
            if not self.slots:
                self.slots = [SharedBlock(self.layout, self.batch_size, name=n) for n in msg.slot_names]
            self.free = set(range(len(self.slots)))
            self.attached.set()
        elif isinstance(msg, RunFree):
            self.gate.open()
        elif isinstance(msg, Release):
            self.free.add(msg.slot)
            self.freed.set()
        elif isinstance(msg, Call):
            self.chan.send(Result(msg.request_id, await self.call(msg.op)))
        elif isinstance(msg, EnvOffset):
            self.first = msg.first
            self.placed.set()
        else:  # pragma: no cover - a protocol bug
            raise TypeError(f"unexpected message {msg!r}")

    async def call(self, op: Any) -> Any:
        collector = self.collector
        assert collector is not None
        if isinstance(op, LoadWeights):
            version = await self.load_weights()
            if self.generation:  # a replacement told to load (PipeWeightSync: now): no frame older
                self.own_floor = max(self.own_floor, version)
            return version
        if isinstance(op, GetState) and not op.envs:  # no restart: at once (between two engine events)
            return await serve_checkpoint(collector, self.frames, op)
        if isinstance(op, CHECKPOINT_OPS):
            async with self.gate.lock:  # between two batches taken in
                reply = await serve_checkpoint(collector, self.frames, op)
                if restarts(op):  # what was taken in and not sent is dropped; wait for RunFree
                    self.gate.close()
                    self.frames.restart(0 if self.batch is None else self.batch.shape[0])
                    self.discarded[self.index] = self.frames.discarded
                    self.batch, self.episodes = None, []
            return reply
        module = collector.policy
        if isinstance(op, GetWeights):
            if not isinstance(module, torch.nn.Module):
                return None
            return {k: v.detach().cpu().clone() for k, v in flat_weights(module).items()}
        roots = {"env": collector.envs[0] if collector.envs else None, "policy": module}
        if isinstance(op, GetAttr):
            return getattr(roots[op.root], op.name)
        if isinstance(op, GetPath):
            return resolve(roots, op.path)
        if isinstance(op, MapFn):
            return resolve(roots, op.path)(*op.args, **op.kwargs)
        raise TypeError(f"{type(op).__name__} is not supported by MultiAsyncEnvCollector's workers")

    async def load_weights(self) -> int:
        """Load the newest published weights between two policy calls; the version the policy runs."""
        collector = self.collector
        assert collector is not None
        assert collector._engine is not None
        assert collector._policy is not None
        engine, batch_policy, receiver = collector._engine, collector._policy, self.weights
        module = batch_policy.module
        if receiver is None or module is None:
            return engine.version
        async with engine.policy_lock:
            before = engine.version
            engine.version = await batch_policy.in_thread(
                functools.partial(receiver.load, module, engine.version)
            )
            if engine.version != before and engine.episodes is not None:  # on_update="restart"
                engine.episodes.updated()
        return engine.version

    # -- env ids, dropped envs ----------------------------------------------------------------------
    async def place(self, spec: EnvSet) -> int:
        """Tell the parent how many env ids this worker's envs take; its first one, once every worker
        told (no env is reset before: seeds follow from it)."""
        self.env_set = spec
        self.chan.send(EnvRows(spec.rows))
        await self.placed.wait()
        self.frames.env_offset = self.first
        return self.first

    async def forward_drops(self, stream: EventStream) -> None:
        """Send each env dropped (``on_env_error="drop"``) to the parent as its ``WorkerFailed``."""
        try:
            async for event in stream:
                self.send_drop(event)
        finally:
            stream.close()

    def send_drop(self, event: Any) -> None:
        if isinstance(event, Restarted):  # as the parent numbers them: this worker, a global env id
            self.chan.send(replace(event, worker=self.index, env=self.first + event.env))
            return
        if not isinstance(event, WorkerFailed) or event.worker_id < 0:
            return  # -1: the collector failed, which the worker's own failure reports
        local = event.worker_id
        error = event.error
        spec = self.env_set
        assert spec is not None
        for u, (first, width) in enumerate(zip(spec.firsts, spec.widths, strict=True)):
            suffix = f" (vector env {u}: its sub-envs, env ids {first} to {first + width - 1}, are dropped)"
            if width and first <= local < first + width and error.endswith(suffix):
                error = error[: -len(suffix)] + (
                    f" (worker {self.index}'s vector env {u}: its sub-envs, env ids {self.first + first} to "
                    f"{self.first + first + width - 1}, are dropped)"
                )
        self.chan.send(replace(event, worker_id=self.first + local, error=error))

    def all_dropped(self, exc: RuntimeError) -> RuntimeError:
        """``exc`` (the inner collector's error) with this worker's env ids if every env was dropped."""
        collector = self.collector
        assert collector is not None
        engine = collector._engine
        if not collector._drop_failed or engine is None or len(engine.dropped) < engine.rows:
            return exc
        if collector.drops is not None:  # the last drops, before the worker's failure
            while (event := collector.drops.receive_nowait()) is not None:
                self.send_drop(event)
        cause = exc.__cause__
        error = RuntimeError(
            f"every env was dropped in worker {self.index} (env ids {self.first} to "
            f"{self.first + engine.rows - 1}; on_env_error='drop'); the last one raised "
            f"{type(cause).__name__}: {cause}"
        )
        error.__cause__ = cause
        return error

    # -- batches ----------------------------------------------------------------------------------
    async def next_batch(self) -> TensorDictBase:
        """The next ``frames_per_batch`` frames of a version at or above the floor, ids globalised."""
        collector = self.collector
        assert collector is not None
        while True:
            batch = self.frames.take(max(int(self.floor[self.index]), self.own_floor))
            self.discarded[self.index] = self.frames.discarded
            if batch is not None:
                return batch
            try:
                batch = await collector.__anext__()
            except RuntimeError as exc:
                error = self.all_dropped(exc)
                if error is exc:
                    raise
                raise error from exc.__cause__
            assert batch is not None  # no replay buffer in a worker
            self.frames.add(batch)
            self.episodes += collector.episodes

    async def wait_for_slot(self) -> None:
        """Until the trainer hands a slot back."""
        while not self.free:
            self.freed = anyio.Event()
            await self.freed.wait()

    def held(self) -> contextlib.AbstractContextManager[None]:
        """On-policy (one slot, the trainer's until it asks for the next batch): no policy call starts
        while this is open, as what the envs would collect is dropped at the trainer's next update.
        Entered right after a batch is taken (no checkpoint between); the steps in flight land."""
        assert self.collector is not None
        return self.collector.holding() if self.config.pause_when_held else contextlib.nullcontext()

    async def run(self) -> None:
        config = self.config
        collector = self.collector = InnerCollector(
            self.env_fns,
            self.policy,
            frames_per_batch=self.fpb,
            min_batch=config.min_batch,
            max_wait=config.max_wait,
            max_frames_per_traj=config.max_frames_per_traj,
            exploration_type=config.exploration_type,
            seed=config.seed,  # + this worker's first env id, once placed
            track_policy_version=True,  # each frame's version: the floor, the trainer's checks
            on_env_error=config.on_env_error,
            restart=config.restart,
            prefetch=config.prefetch,
        )
        # seeded episodes: the engine's (the trainer assembles the trajectories: the worker sends frames)
        collector._group_size, collector._on_update = config.group_size, config.on_update
        # init_random_frames: this worker's share, rounded up to whole batches (as MultiAsyncCollector's);
        # a replacement's are its predecessor's, taken already
        random = 0 if self.generation else config.random_frames
        collector.random_actions = math.ceil(random / self.fpb) * self.fpb
        collector.random_seed = config.seed
        collector.place = self.place
        collector.generation = self.generation
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.control_loop, tg.cancel_scope)  # first: it reads EnvOffset
            with contextlib.ExitStack() as held:
                if self.generation and self.weights is not None:  # a replacement: the newest weights
                    held.enter_context(collector.holding())  # before its first policy call
                async with collector:
                    if self.generation:
                        await self.load_weights()
                        held.close()
                    if collector.drops is not None:
                        tg.start_soon(self.forward_drops, collector.drops)
                    await self.collect(collector)

    async def collect(self, collector: InnerCollector) -> None:
        """Send batches until cancelled (``Close``); a batch is taken in and sent under the gate's lock,
        and sent only while the gate is open (see ``_worker_state.py``)."""
        self.batch = batch = await self.next_batch()
        with self.held():
            # the slots' layout is the first batch's
            self.layout, self.batch_size = layout_of(batch), tuple(batch.batch_size)
            self.chan.send(
                Ready(self.layout, self.batch_size, self.fpb, policy_version=collector.policy_version)
            )
            await self.attached.wait()
            await self.gate.wait()
        if int(batch.get(VERSION).min()) < self.own_floor:  # a replacement's, before its weights came
            self.frames.discarded += batch.shape[0]
            self.batch = None
        gate = self.gate
        while True:
            await gate.wait()
            async with gate.lock:
                if not gate.is_open:  # a restart came meanwhile: wait for the trainer again
                    continue
                if self.batch is None:
                    self.batch = await self.next_batch()
                self.send(self.batch)
                self.batch = None
                self.note_unsent()
            with self.held():
                async with gate.lock:  # not beside a call that stops the engine: both use its policy thread
                    await self.load_weights()  # between batches, as the rollout workers do
                await self.wait_for_slot()
            async with gate.lock:
                if self.batch is None:
                    self.batch = await self.next_batch()
                self.note_unsent()

    def note_unsent(self) -> None:
        """The frames taken in and not sent, ``+ 1``, in the control block's "progress" (read once the
        trainer opened the gate: a replacement's is read before): lost should this process die, they are
        counted as discarded (as a rollout worker's steps begun)."""
        held = 0 if self.batch is None else self.batch.shape[0]
        self.progress[self.index] = 1 + held + self.frames.pending

    def send(self, batch: TensorDictBase) -> None:
        """Write ``batch`` into a free slot and tell the trainer."""
        slot = min(self.free)
        self.free.discard(slot)
        self.slots[slot].td.update_(batch)
        episodes, self.episodes = self.episodes, []
        engine = getattr(self.collector, "_engine", None)  # its time split goes with the notice
        self.chan.send(
            BatchReady(
                slot=slot,
                steps=batch.shape[0],
                frames=batch.shape[0],
                policy_version=int(batch.get(VERSION).max()),
                episode_returns=[e[1] for e in episodes],
                episode_lengths=[e[2] for e in episodes],
                time_split=engine.clock.totals() if engine is not None else (),
            )
        )

    def close(self) -> None:
        for slot in self.slots:
            slot.close()
        self.control.close()
        if self.weights is not None:
            self.weights.close()


async def _main(config: WorkerConfig, chan: BlockingChannel, spec: Any) -> None:
    worker = _AsyncWorker(config, chan, spec)
    try:
        await worker.run()
    finally:
        worker.close()


def run_async_worker(config: WorkerConfig, chan: BlockingChannel, spec: Any) -> None:
    """A worker's body (``WorkerSpec.run``): runs its loop until ``Close``; errors propagate with their
    type (the worker sends them to the parent)."""
    backend, options = config.loop, {}
    if backend == "uvloop":
        backend, options = "asyncio", {"use_uvloop": True}
    try:
        anyio.run(_main, config, chan, spec, backend=backend, backend_options=options)
    except BaseExceptionGroup as group:  # one error (in task groups): raise it with its own type
        error: BaseException = group
        while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
            error = error.exceptions[0]
        raise error from None
