"""The body of a worker process of ``MultiAsyncEnvCollector``: its own event loop running an
``AsyncEnvCollector`` over its share of the envs, its batches written into the parent's shared-memory slots.

It speaks the protocol of the rollout workers (``_workers/_worker.py``): ``Ready`` (with the layout of the
first batch), then ``Attach`` and ``RunFree``; one ``BatchReady`` per batch into a free slot, ``Release``
hands a slot back; weights come from the weight-sync receiver between two policy calls; ``Close`` ends it.
The control channel is read on the loop (fd readiness), never by a blocking call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import cloudpickle
import torch
from tensordict import TensorDictBase

from ._async_collector import AsyncEnvCollector
from ._transport._flat import layout_of
from ._transport._messages import (
    Attach,
    BatchReady,
    Call,
    Close,
    GetAttr,
    GetPath,
    GetWeights,
    LoadWeights,
    MapFn,
    Ready,
    Release,
    Result,
    RunFree,
)
from ._transport._shm import SharedBlock
from ._transport._wire import BlockingChannel
from ._weights import flat_weights
from ._workers._paths import resolve

__all__ = ["EnvShare", "WorkerConfig", "run_async_worker"]

_VERSION = ("collector", "policy_version")
_ENV_ID = ("collector", "env_id")
_TRAJ = ("collector", "traj_ids")


class EnvShare:
    """One worker's envs: a callable (as a worker's env constructor must be) holding its env fns."""

    def __init__(self, env_fns: Sequence[Callable[[], Any]]) -> None:
        self.env_fns = list(env_fns)

    def __call__(self) -> list[Callable[[], Any]]:
        return self.env_fns


@dataclass(frozen=True)
class WorkerConfig:
    """The ``AsyncEnvCollector`` arguments every worker shares, and each worker's first env index."""

    offsets: tuple[int, ...]
    min_batch: int | None
    max_wait: float
    max_frames_per_traj: int | None
    exploration_type: Any
    seed: int | None
    track_policy_version: bool
    prefetch: int
    loop: str  # "asyncio", "uvloop" or "trio"


class _Inner(AsyncEnvCollector):
    """An ``AsyncEnvCollector`` that keeps each delivered batch's episodes and newest policy version."""

    episodes: list[tuple[int, float, int]] = []  # noqa: RUF012 - replaced per batch
    batch_version = 0

    def _record(
        self,
        frames: int,
        episodes: list[tuple[int, float, int]],
        *,
        worker_id: int | None,
        policy_version: int,
    ) -> None:
        self.episodes = list(episodes)
        self.batch_version = policy_version
        super()._record(frames, episodes, worker_id=worker_id, policy_version=policy_version)


class _AsyncWorker:
    def __init__(self, config: WorkerConfig, chan: BlockingChannel, spec: Any) -> None:
        self.config = config
        self.chan = chan
        self.spec = spec
        self.index = spec.index
        self.offset = config.offsets[spec.index]
        self.env_fns = cloudpickle.loads(spec.payload)()
        self.policy = cloudpickle.loads(spec.policy_payload)
        self.fpb = int(spec.rollout.frames_per_batch)
        self.traj_start = spec.rollout.traj_id_start
        self.traj_stride = spec.rollout.traj_id_stride
        self.weights = spec.weights.open(spec.index) if spec.weights is not None else None
        self.slots: list[SharedBlock] = []
        self.free: set[int] = set()
        self.attached = anyio.Event()
        self.running = anyio.Event()
        self.freed = anyio.Event()
        self.collector: _Inner | None = None

    # -- the control channel, read on the loop ----------------------------------------------------
    async def control(self, scope: anyio.CancelScope) -> None:
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
            self.running.set()
        elif isinstance(msg, Release):
            self.free.add(msg.slot)
            self.freed.set()
        elif isinstance(msg, Call):
            self.chan.send(Result(msg.request_id, await self.call(msg.op)))
        else:  # pragma: no cover - a protocol bug
            raise TypeError(f"unexpected message {msg!r}")

    async def call(self, op: Any) -> Any:
        collector = self.collector
        assert collector is not None
        if isinstance(op, LoadWeights):
            return await self.load_weights()
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
        raise TypeError(
            f"{type(op).__name__} is not supported by MultiAsyncEnvCollector's workers (async envs are "
            "seeded with seed=, and keep no resumable state)"
        )

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
            engine.version = await batch_policy.in_thread(
                functools.partial(receiver.load, module, engine.version)
            )
        return engine.version

    # -- batches ----------------------------------------------------------------------------------
    def globalise(self, batch: TensorDictBase) -> TensorDictBase:
        """Env ids offset by this worker's first env; trajectory ids unique over the workers."""
        batch.set_(_ENV_ID, batch.get(_ENV_ID) + self.offset)
        batch.set_(_TRAJ, batch.get(_TRAJ) * self.traj_stride + self.traj_start)
        if not self.config.track_policy_version:
            batch = batch.exclude(_VERSION)
        return batch

    async def run(self) -> None:
        config = self.config
        collector = self.collector = _Inner(
            self.env_fns,
            self.policy,
            frames_per_batch=self.fpb,
            min_batch=config.min_batch,
            max_wait=config.max_wait,
            max_frames_per_traj=config.max_frames_per_traj,
            exploration_type=config.exploration_type,
            seed=None if config.seed is None else config.seed + self.offset,
            track_policy_version=True,  # the batch's newest version, reported to the parent
            prefetch=config.prefetch,
        )
        async with anyio.create_task_group() as tg, collector:
            tg.start_soon(self.control, tg.cancel_scope)
            first = True
            async for batch in collector:
                assert batch is not None
                batch = self.globalise(batch)
                if first:  # the slots' layout is the first batch's
                    first = False
                    self.layout, self.batch_size = layout_of(batch), tuple(batch.batch_size)
                    self.chan.send(
                        Ready(self.layout, self.batch_size, self.fpb, policy_version=collector.policy_version)
                    )
                    await self.attached.wait()
                    await self.running.wait()
                while not self.free:
                    self.freed = anyio.Event()
                    await self.freed.wait()
                slot = min(self.free)
                self.free.discard(slot)
                self.slots[slot].td.update_(batch)
                episodes = collector.episodes
                self.chan.send(
                    BatchReady(
                        slot=slot,
                        steps=batch.shape[0],
                        frames=batch.shape[0],
                        policy_version=collector.batch_version,
                        episode_returns=[e[1] for e in episodes],
                        episode_lengths=[e[2] for e in episodes],
                    )
                )
                await self.load_weights()  # between batches, as the rollout workers do

    def close(self) -> None:
        for slot in self.slots:
            slot.close()
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
