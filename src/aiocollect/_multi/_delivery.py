"""How a multi-process collector gathers a batch from its workers (the :class:`Delivering` protocol:
:class:`~._sync.Gather` for ``MultiSyncCollector``, :class:`~._async.FirstReady` for the others) and what
a delivery hands back (:class:`Delivery`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tensordict import TensorDictBase

if TYPE_CHECKING:
    from .._workers._pool import WorkerPool
    from ._base import MultiCollectorBase

__all__ = ["Delivering", "Delivery", "episodes_of"]


@dataclass
class Delivery:
    batch: TensorDictBase
    frames: int
    per_worker_episodes: list[list[tuple[int, float, int]]]
    worker_id: int | None
    policy_version: int

    @property
    def episodes(self) -> list[tuple[int, float, int]]:
        return [e for episodes in self.per_worker_episodes for e in episodes]


def episodes_of(worker_id: int, notice: Any) -> list[tuple[int, float, int]]:
    return [(worker_id, r, n) for r, n in zip(notice.episode_returns, notice.episode_lengths, strict=True)]


class Delivering(Protocol):
    """How a batch is gathered from the workers: one rollout of each (``Gather``) or one worker's, the
    first ready (``FirstReady``); the collector hands itself (``fleet``) to each call."""

    sync: bool

    def split_frames(self, frames_per_batch: int | Sequence[int], n: int) -> list[int]: ...
    def slots_per_worker(self, fleet: MultiCollectorBase) -> int: ...
    def check_layouts(self, ready: list[Any]) -> None: ...
    async def started(self, fleet: MultiCollectorBase, pool: WorkerPool) -> None: ...
    def floor_after(self, fleet: MultiCollectorBase, version: int, flush: bool) -> int | None: ...
    async def drop_stale(self, fleet: MultiCollectorBase, pool: WorkerPool) -> None: ...
    async def load_behind(self, fleet: MultiCollectorBase, pool: WorkerPool, raised: list[int]) -> None: ...
    async def next_batch(self, fleet: MultiCollectorBase, pool: WorkerPool) -> Delivery: ...
    def frames_for_buffer(self, fleet: MultiCollectorBase, batch: TensorDictBase) -> TensorDictBase: ...
