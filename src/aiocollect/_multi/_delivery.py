"""How a multi-process collector gathers a batch from its workers (the :class:`Delivering` protocol:
:class:`~._sync.Gather` for ``MultiSyncCollector``, :class:`~._async.FirstReady` for the others), each
handed as an :class:`~aiocollect._fleet._transport.Arrival`; and what a delivery reaches of the worker pool
(:class:`WorkersView`, which ``_workers.Workers`` is)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tensordict import TensorDictBase

from .._core._options import RolloutOptions, WeightSchedule
from .._fleet._transport import Arrival, FleetHandle
from .._transport._shm import SharedBlock
from .._weightsync._schemes import WeightSender
from .._workers._pool import WorkerPool

__all__ = ["Delivering", "WorkersView", "episodes_of"]


def episodes_of(worker_id: int, notice: Any) -> list[tuple[int, float, int]]:
    return [(worker_id, r, n) for r, n in zip(notice.episode_returns, notice.episode_lengths, strict=True)]


class WorkersView(Protocol):
    """The worker pool as a delivery sees it: the pool, its control block and weight sender, the options,
    the fleet's handle, and the next batch notice (``receive``, under ``worker_timeout``)."""

    fleet: FleetHandle
    options: RolloutOptions
    schedule: WeightSchedule
    num_workers: int
    pool: WorkerPool | None
    control: SharedBlock | None
    sender: WeightSender | None

    @property
    def floors(self) -> Sequence[int]: ...

    def members(self) -> Sequence[Any]: ...

    async def receive(self) -> tuple[int, Any]: ...

    async def load_now(self, ids: list[int], version: int, published: Any) -> None: ...


class Delivering(Protocol):
    """How a batch is gathered from the workers: one rollout of each (``Gather``) or one worker's, the
    first ready (``FirstReady``); the worker pool (``w``, the fleet's transport) hands itself to each
    call."""

    sync: bool
    #: whether the workers write their batches as the rows of one stacked segment (``_transport/_stacked.py``)
    stacked: bool

    def split_frames(self, frames_per_batch: int | Sequence[int], n: int) -> list[int]: ...
    def slots_per_worker(self, w: WorkersView) -> int: ...
    def check_layouts(self, ready: list[Any]) -> None: ...
    async def started(self, w: WorkersView) -> None: ...
    async def drop_stale(self, w: WorkersView) -> None: ...
    async def load_behind(self, w: WorkersView, raised: list[int]) -> None: ...
    async def next_batch(self, w: WorkersView) -> Arrival: ...
    async def replaced(self, w: WorkersView, index: int) -> None: ...
    def frames_for_buffer(self, w: WorkersView, batch: TensorDictBase) -> TensorDictBase: ...
