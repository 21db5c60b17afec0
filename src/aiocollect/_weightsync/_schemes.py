"""Weight-sync schemes: how the trainer's weights reach the workers' policies.

A scheme (``weight_sync=`` on every collector) is a small, picklable configuration. When a collector
starts, it opens a **sender** in the trainer process; each worker opens a **receiver** from the spec the
sender gives it. The collector owns the version counter: ``publish`` ships weights stamped with a version,
and a worker loads them at its next batch boundary (never mid-step), recording the version it runs.

* :class:`SharedMemoryWeightSync` (default): one shared-memory copy of the weights plus per-worker target
  versions, guarded by a sequence counter; publishing is a memcpy, loading is a memcpy.
* :class:`PipeWeightSync`: the weights travel pickled over each worker's control socket (for workers that
  cannot share memory with the trainer); the slow path.
* :class:`DistributedWeightSync`: a ``torch.distributed`` broadcast (gloo on CPU, nccl on GPUs).
"""

from __future__ import annotations

import abc
import pickle
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from .._policies._weights import copy_weights, flat_weights
from .._transport._flat import FlatLayout, layout_of
from .._transport._shm import SharedBlock

#: how a sender reaches worker ``i``'s control channel: ``await send(i, message)``
SendFn = Callable[[int, Any], Awaitable[None]]


class WeightReceiver(abc.ABC):
    """Worker side of a scheme."""

    @abc.abstractmethod
    def load(self, policy: torch.nn.Module, current: int) -> int:
        """Copy the newest weights meant for this worker into ``policy``, if newer than ``current``;
        return the version the policy now runs. Never blocks for long. Never an older version: a worker
        that loaded a checkpoint runs its version before the trainer publishes a newer one."""

    def on_message(self, message: Any) -> bool:
        """A control message addressed to the scheme; ``True`` if it was one."""
        return False

    def published(self) -> int | None:
        """The newest version published for this worker, when the receiver can tell."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what ``open`` acquired."""


class WeightSender(abc.ABC):
    """Trainer side of a scheme, open while the collector is."""

    #: every worker loads from one copy of the weights: publishing to some workers overwrites what the
    #: others may not have loaded yet, so the collector has those load theirs first
    one_copy: bool = False

    @abc.abstractmethod
    def receivers(self) -> list[Any]:
        """One picklable spec per worker; the worker calls ``spec.open(index)``."""

    @abc.abstractmethod
    async def publish(self, weights: TensorDictBase, version: int, worker_ids: Sequence[int]) -> None:
        """Make ``weights`` (flat keys) available to ``worker_ids`` as ``version``."""

    async def connect(self) -> None:  # noqa: B027 - optional hook
        """Runs while the workers start (their receivers open then), e.g. a rendezvous."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the sender holds (shared memory, process groups)."""


class WeightSync(abc.ABC):
    """A weight-sync scheme: a picklable configuration that opens a sender when a collector starts."""

    @abc.abstractmethod
    def open_sender(self, weights: TensorDictBase, num_workers: int, send: SendFn) -> WeightSender:
        """Called once in the trainer process with the policy's initial weights (flat keys)."""


# -- shared memory ---------------------------------------------------------------------------------
def _ctl_layout(num_workers: int) -> FlatLayout:
    return FlatLayout.build([("ctl", (1 + num_workers,), torch.int64)])


class _SharedSender(WeightSender):
    one_copy = True

    def __init__(self, weights: TensorDictBase, num_workers: int) -> None:
        self.layout = layout_of(weights)
        self.block = SharedBlock(self.layout)
        # [sequence, target version of worker 0, ..., worker N-1]; the sequence is odd while writing
        self.ctl = SharedBlock(_ctl_layout(num_workers))
        self.ctl.td["ctl"].zero_()
        copy_weights(self.block.td, weights)
        self.num_workers = num_workers

    def receivers(self) -> list[Any]:
        return [
            _SharedReceiverSpec(self.block.name, self.ctl.name, self.layout, self.num_workers)
            for _ in range(self.num_workers)
        ]

    def _write(self, weights: TensorDictBase, version: int, worker_ids: Sequence[int]) -> None:
        ctl = self.ctl.td["ctl"]
        seq = int(ctl[0])
        ctl[0] = seq + 1
        try:
            copy_weights(self.block.td, weights)
            for i in worker_ids:
                ctl[1 + i] = version
        finally:
            ctl[0] = seq + 2

    async def publish(self, weights: TensorDictBase, version: int, worker_ids: Sequence[int]) -> None:
        await anyio.to_thread.run_sync(self._write, weights, version, worker_ids)

    def close(self) -> None:
        for block in (self.block, self.ctl):
            block.unlink()
            block.close()


@dataclass(frozen=True)
class _SharedReceiverSpec:
    block_name: str
    ctl_name: str
    layout: FlatLayout
    num_workers: int

    def open(self, index: int) -> WeightReceiver:
        return _SharedReceiver(self, index)


class _SharedReceiver(WeightReceiver):
    def __init__(self, spec: _SharedReceiverSpec, index: int) -> None:
        self.block = SharedBlock(spec.layout, name=spec.block_name)
        self.ctl_block = SharedBlock(_ctl_layout(spec.num_workers), name=spec.ctl_name)
        self._ctl: np.ndarray = self.ctl_block.td["ctl"].numpy()
        self._index = 1 + index

    def published(self) -> int:
        return int(self._ctl[self._index])

    def load(self, policy: torch.nn.Module, current: int) -> int:
        for _ in range(100):
            seq = int(self._ctl[0])
            target = int(self._ctl[self._index])
            if seq % 2:  # being written: retry shortly
                time.sleep(1e-4)
                continue
            if target <= current:  # nothing newer (a worker that loaded a checkpoint runs a newer one)
                return current
            copy_weights(flat_weights(policy), self.block.td)
            if int(self._ctl[0]) == seq:
                return target
        return current

    def close(self) -> None:
        self.block.close()
        self.ctl_block.close()


class SharedMemoryWeightSync(WeightSync):
    """Weights in one shared-memory block; workers copy them in at their next batch boundary.

    The default for worker processes on one machine: publishing costs one copy of the weights (off the
    event loop), loading one copy per worker. Workers never alias the trainer's tensors.

    Example:
        >>> from aiocollect import MultiSyncCollector, SharedMemoryWeightSync
        >>> # MultiSyncCollector(env_fns, policy, frames_per_batch=..., weight_sync=SharedMemoryWeightSync())
    """

    def open_sender(self, weights: TensorDictBase, num_workers: int, send: SendFn) -> WeightSender:
        return _SharedSender(weights, num_workers)

    def __repr__(self) -> str:
        return "SharedMemoryWeightSync()"


# -- over the control channel ----------------------------------------------------------------------
@dataclass(frozen=True)
class WeightsMessage:
    """Pickled weights for one worker, sent on its control socket."""

    version: int
    payload: bytes


class _PipeSender(WeightSender):
    def __init__(self, num_workers: int, send: SendFn) -> None:
        self.num_workers = num_workers
        self.send = send

    def receivers(self) -> list[Any]:
        return [_PipeReceiverSpec() for _ in range(self.num_workers)]

    async def publish(self, weights: TensorDictBase, version: int, worker_ids: Sequence[int]) -> None:
        plain = {k: v.detach().cpu() for k, v in weights.items()}
        payload = await anyio.to_thread.run_sync(pickle.dumps, plain, pickle.HIGHEST_PROTOCOL)
        message = WeightsMessage(version, payload)
        for i in worker_ids:
            await self.send(i, message)


@dataclass(frozen=True)
class _PipeReceiverSpec:
    def open(self, index: int) -> WeightReceiver:
        return _PipeReceiver()


class _PipeReceiver(WeightReceiver):
    def __init__(self) -> None:
        self._pending: WeightsMessage | None = None
        self._newest = 0

    def on_message(self, message: Any) -> bool:
        if isinstance(message, WeightsMessage):
            self._pending = message
            self._newest = max(self._newest, message.version)
            return True
        return False

    def published(self) -> int:
        return self._newest

    def load(self, policy: torch.nn.Module, current: int) -> int:
        pending, self._pending = self._pending, None
        if pending is None or pending.version <= current:
            return current
        weights = TensorDict(pickle.loads(pending.payload), batch_size=[])
        copy_weights(flat_weights(policy), weights)
        return pending.version


class PipeWeightSync(WeightSync):
    """Weights pickled and sent over each worker's control socket; loaded at the next batch boundary.

    For workers that cannot share memory with the trainer. Costs a pickle in the trainer (off the loop)
    and one transfer per worker: measured slower than :class:`SharedMemoryWeightSync` (see the weight
    synchronisation guide).
    """

    def open_sender(self, weights: TensorDictBase, num_workers: int, send: SendFn) -> WeightSender:
        return _PipeSender(num_workers, send)

    def __repr__(self) -> str:
        return "PipeWeightSync()"


__all__ = [
    "PipeWeightSync",
    "SendFn",
    "SharedMemoryWeightSync",
    "WeightReceiver",
    "WeightSender",
    "WeightSync",
    "WeightsMessage",
    "weight_sync_arg",
]


def weight_sync_arg(value: Any) -> WeightSync:
    """The ``weight_sync=`` argument of a collector: a scheme, or ``None`` for shared memory."""
    if value is None:
        return SharedMemoryWeightSync()
    if not isinstance(value, WeightSync):
        raise TypeError(
            "weight_sync must be a WeightSync scheme (SharedMemoryWeightSync(), PipeWeightSync(), "
            f"DistributedWeightSync(...)), got {value!r}"
        )
    return value
