"""``trajs_per_batch`` for the multi-process collectors: :class:`Episodes`, a :class:`Delivering` over
another (``Gather`` or ``FirstReady``) that feeds its frame batches to one
:class:`~aiocollect._episodes._assembler.TrajectoryAssembler` and delivers whole trajectories instead."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tensordict import TensorDictBase

from .._core._options import RolloutOptions
from .._core._validation import lag_arg
from .._episodes._args import CHUNK_FRAMES, refuse_cuts
from .._episodes._assembler import TrajectoryAssembler
from .._fleet._transport import Arrival
from ._delivery import Delivering, WorkersView

__all__ = ["Episodes"]


class Episodes:
    """Deliver ``trajs_per_batch`` whole trajectories per batch, gathering frames with ``inner``.

    The workers collect frame chunks of about :data:`CHUNK_FRAMES` frames each (``frames_per_batch`` is
    theirs); a delivered batch counts the frames of its trajectories (``total_frames`` too). A flush
    (``update_weights(flush=True)``) drops frames: the trajectories it tears are discarded, counted in
    ``frames_discarded`` of the episode statistics.
    """

    def __init__(
        self,
        inner: Delivering,
        trajs_per_batch: int,
        lag: int | None = None,
        group_size: int | None = None,
        on_update: str = "continue",
    ) -> None:
        self.inner = inner
        self.lag = lag_arg(lag)  # an episode's oldest frame: at most this many versions old
        self.sync, self.stacked = inner.sync, inner.stacked
        # what the workers' rollouts take (RolloutOptions): seeded episodes in groups, restarted at updates
        self.for_rollouts = {"group_size": group_size, "on_update": on_update}
        self.assembler = TrajectoryAssembler(trajs_per_batch, group_size)
        self._floors: dict[int, int] = {}  # per worker, the staleness floor last seen (drop_stale)
        self._version = 0

    @staticmethod
    def over(
        delivery: Delivering,
        trajs_per_batch: int | None,
        lag: int | None = None,
        group_size: int | None = None,
        on_update: str = "continue",
    ) -> Delivering:
        """``delivery`` itself, or with ``trajs_per_batch`` an :class:`Episodes` over it."""
        if trajs_per_batch is None:
            return delivery
        return Episodes(delivery, trajs_per_batch, lag, group_size, on_update)

    @staticmethod
    def rollout_options(delivery: Delivering) -> dict[str, Any]:
        """What the workers' rollouts take of the episodes (``RolloutOptions.group_size``, ``on_update``)."""
        return delivery.for_rollouts if isinstance(delivery, Episodes) else {}

    @staticmethod
    def frames(frames_per_batch: Any, trajs_per_batch: int | None, rollout: Any, workers: Any = None) -> Any:
        """The ``frames_per_batch`` the workers collect: the user's, or with ``trajs_per_batch`` (and no
        ``rollout=`` saying it) chunks of :data:`CHUNK_FRAMES` per worker (``workers``: the sync
        collector's env fns, whose total it splits)."""
        if trajs_per_batch is None or rollout is not None:
            return frames_per_batch
        return CHUNK_FRAMES * (len(workers) if isinstance(workers, Sequence) else 1)

    @staticmethod
    def assembler_of(delivery: Delivering) -> TrajectoryAssembler | None:
        return delivery.assembler if isinstance(delivery, Episodes) else None

    @staticmethod
    def checked(delivery: Delivering, collector: str, options: RolloutOptions) -> TrajectoryAssembler | None:
        """:meth:`assembler_of`, once the rollout options that would cut its trajectories (given as
        keywords or through ``rollout=RolloutOptions(...)``) are refused, as ``Collector`` refuses them."""
        assembler = Episodes.assembler_of(delivery)
        if assembler is not None:
            refuse_cuts(collector, assembler.trajs_per_batch, options)
        return assembler

    def split_frames(self, frames_per_batch: int | Sequence[int], n: int) -> list[int]:
        return self.inner.split_frames(frames_per_batch, n)

    def slots_per_worker(self, w: WorkersView) -> int:
        return self.inner.slots_per_worker(w)

    def check_layouts(self, ready: list[Any]) -> None:
        self.inner.check_layouts(ready)

    async def started(self, w: WorkersView) -> None:
        await self.inner.started(w)

    async def drop_stale(self, w: WorkersView) -> None:
        """A flush raised the floors of some workers: their batches waiting are dropped and their
        rollouts in flight restart, so the trajectories they have in flight are torn."""
        for index, floor in enumerate(w.floors):
            if floor != self._floors.get(index, 0):
                self._floors[index] = floor
                self.assembler.taint(index)
        await self.inner.drop_stale(w)

    async def load_behind(self, w: WorkersView, raised: list[int]) -> None:
        await self.inner.load_behind(w, raised)

    async def replaced(self, w: WorkersView, index: int) -> None:
        """Worker ``index`` was replaced: its trajectories in flight are torn (never delivered)."""
        self.assembler.taint(index)
        await self.inner.replaced(w, index)

    def frames_for_buffer(self, w: WorkersView, batch: TensorDictBase) -> TensorDictBase:
        """Whole trajectories, flat over frames (or padded ``[N, T]`` with ``split_trajs``), as they are."""
        return batch

    def _ready(self, w: WorkersView) -> bool:
        """Whether a batch is ready, once the episodes whose oldest frame is too old are discarded."""
        if self.lag is not None:
            self.assembler.drop_older(w.fleet.version - self.lag)
        return self.assembler.ready()

    async def next_batch(self, w: WorkersView) -> Arrival:
        assembler = self.assembler
        while not self._ready(w):
            out = await self.inner.next_batch(w)
            assembler.push(out.batch, source=out.member or 0, version=out.policy_version)
            self._version = out.policy_version
        popped = assembler.pop()
        episodes = [(-1, r, n) for r, n in zip(popped.returns, popped.lengths, strict=True)]
        return Arrival(popped.batch, len(popped.batch), episodes, None, self._version)
