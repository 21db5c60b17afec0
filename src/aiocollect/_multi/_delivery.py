"""How a multi-process collector gathers a batch from its workers (the :class:`Delivering` protocol:
:class:`~._sync.Gather` for ``MultiSyncCollector``, :class:`~._async.FirstReady` for the others), each
handed as an :class:`~aiocollect._fleet._collector.Arrival`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from tensordict import TensorDictBase

if TYPE_CHECKING:
    from .._fleet._collector import Arrival
    from ._workers import Workers

__all__ = ["Delivering", "episodes_of"]


def episodes_of(worker_id: int, notice: Any) -> list[tuple[int, float, int]]:
    return [(worker_id, r, n) for r, n in zip(notice.episode_returns, notice.episode_lengths, strict=True)]


class Delivering(Protocol):
    """How a batch is gathered from the workers: one rollout of each (``Gather``) or one worker's, the
    first ready (``FirstReady``); the worker pool (``w``, the fleet's transport) hands itself to each
    call."""

    sync: bool

    def split_frames(self, frames_per_batch: int | Sequence[int], n: int) -> list[int]: ...
    def slots_per_worker(self, w: Workers) -> int: ...
    def check_layouts(self, ready: list[Any]) -> None: ...
    async def started(self, w: Workers) -> None: ...
    async def drop_stale(self, w: Workers) -> None: ...
    async def load_behind(self, w: Workers, raised: list[int]) -> None: ...
    async def next_batch(self, w: Workers) -> Arrival: ...
    async def replaced(self, w: Workers, index: int) -> None: ...
    def frames_for_buffer(self, w: Workers, batch: TensorDictBase) -> TensorDictBase: ...
