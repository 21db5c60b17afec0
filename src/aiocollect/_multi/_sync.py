"""``MultiSyncCollector``: every batch holds one rollout from each worker, gathered (with preemption)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, Unpack

import anyio
from tensordict import TensorDictBase

from .._core._mistakes import explicit_keywords, warn_user
from .._episodes._args import group_size_arg, trajs_per_batch_arg
from .._fleet._collector import FleetCollector
from .._fleet._transport import Arrival
from .._transport._messages import Collect
from .._workers._pool import WorkerPool
from ._copies import BatchCopies
from ._delivery import WorkersView, episodes_of
from ._episodes import Episodes
from ._keywords import MultiSyncKeywords
from ._workers import WorkersMixin

__all__ = ["Gather", "MultiSyncCollector"]


class Gather:
    """Each batch holds one rollout of every worker, asked for when the trainer asks for the batch
    (workers idle between batches); ``threshold``: deliver once ``ceil(threshold * N)`` workers finished,
    the others stopped at their next step; ``cat_results``: how the rollouts are joined."""

    sync = True

    def __init__(self, threshold: float | None, cat_results: Literal["stack"] | int) -> None:
        self._threshold = threshold
        self._cat_results = cat_results
        #: stacked batches are written by the workers as the rows of one segment, then lent as they are
        #: (``_transport/_stacked.py``) or copied out when no segment could be spared
        self.stacked = cat_results == "stack"
        self._slot = 0  # the slot the workers collect into this round
        #: while a batch is gathered: the notices so far, and whether its frames are random
        self._notices: dict[int, Any] | None = None
        self._random = False
        self._copies = BatchCopies()  # the batches copied out of the slots (_copies.py)

    @staticmethod
    def slots_per_worker(w: WorkersView) -> int:
        return 1  # a worker collects when asked

    async def started(self, w: WorkersView) -> None:
        """Nothing: a worker collects when a batch is asked for."""

    async def drop_stale(self, w: WorkersView) -> None:
        """Nothing waits: batches are collected when asked for."""

    async def load_behind(self, w: WorkersView, raised: list[int]) -> None:
        """Nothing: workers load the new weights before their next rollout."""

    async def replaced(self, w: WorkersView, index: int) -> None:
        """Worker ``index`` was replaced: during a gather, its share is collected again (its notice, if
        any, went with its slot)."""
        notices, pool = self._notices, w.pool
        if notices is None or pool is None:
            return
        notices.pop(index, None)
        await pool.send(index, Collect(slot=self._slot, random=self._random))
        pool.workers[index].expected_since = anyio.current_time()

    @staticmethod
    def split_frames(frames_per_batch: int | Sequence[int], n: int) -> list[int]:
        if not isinstance(frames_per_batch, int):  # checked already (RolloutOptions): one per worker
            if len(frames_per_batch) != n:
                raise ValueError(
                    f"frames_per_batch has {len(frames_per_batch)} values for {n} workers; give one per "
                    "worker or an int"
                )
            return list(frames_per_batch)
        total = frames_per_batch
        if total % n:
            warn_user(
                f"frames_per_batch={total} is not divisible by {n} workers: each collects "
                f"{math.ceil(total / n)}"
            )
        return [math.ceil(total / n)] * n

    def check_layouts(self, ready: list[Any]) -> None:
        shapes = [tuple(r.batch_size) for r in ready]
        if self._cat_results == "stack" and len(set(shapes)) > 1:
            raise ValueError(
                f"cat_results='stack' needs equal worker batches, got {shapes}; use cat_results=-1"
            )
        if self._cat_results == -1 and len({s[:-1] for s in shapes}) > 1:
            raise ValueError(
                f"cat_results=-1 needs workers whose envs have the same batch size, got batches {shapes}"
            )
        if self._cat_results == 0 and len({s[1:] for s in shapes}) > 1:
            raise ValueError(
                f"cat_results=0 needs worker batches that differ in dim 0 only, got {shapes}; "
                "use cat_results=-1"
            )
        if self._cat_results == 0 and self._threshold is not None and any(len(s) > 1 for s in shapes):
            # a preempted batch holds fewer steps for the late workers: [B, t_i] cannot be stacked on dim
            # 0. Said at start-up, not at the first preemption, which may come hours into a run.
            raise ValueError(
                f"cat_results=0 with preemptive_threshold={self._threshold} cannot concatenate the "
                f"preempted batches of batched envs (worker batches {shapes}); use cat_results=-1 or 'stack'"
            )

    async def next_batch(self, w: WorkersView) -> Arrival:
        n, fleet, pool = w.num_workers, w.fleet, w.pool
        assert pool is not None
        assert w.control is not None
        if w.schedule.update_at_each_batch and w.sender is not None:
            await fleet.update_weights()
        init_random = w.options.init_random_frames
        random = fleet.frames < math.ceil(init_random / fleet.frames_per_batch) * fleet.frames_per_batch
        stop = w.control.td["stop"]
        stop.zero_()
        notices: dict[int, Any] = {}
        lend = await self._pick(pool)
        self._notices, self._random = notices, random
        for i in range(n):
            await pool.send(i, Collect(slot=self._slot, random=random))
            pool.workers[i].expected_since = anyio.current_time()
        need = n if self._threshold is None else math.ceil(self._threshold * n)
        try:
            # preemption: the wait for the first `need` workers is a cancel scope; the late ones are then
            # told to stop at their next step and deliver what they have
            with anyio.CancelScope() as gather:
                while len(notices) < n:
                    index, notice = await w.receive()
                    notices[index] = notice
                    if len(notices) >= need and len(notices) < n:
                        gather.cancel()
            if len(notices) < n:
                pool.set_stop(stop, [i for i in range(n) if i not in notices], 1)
                while len(notices) < n:
                    index, notice = await w.receive()
                    notices[index] = notice
        except BaseException:
            # cancelled or failed mid-gather: stop the stragglers and drain them so that the next
            # batch starts clean
            with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                if pool.failure is None:
                    pool.set_stop(stop, list(range(n)), 1)
                    while len(notices) < n:
                        index, notice = await w.receive()
                        notices[index] = notice
            raise
        finally:
            self._notices = None
        batch, valid = self._combine(pool, notices, lend)
        return Arrival(
            batch,
            valid,
            [e for i in range(n) for e in episodes_of(i, notices[i])],
            None,
            min(notices[i].policy_version for i in range(n)),
        )

    async def _pick(self, pool: WorkerPool) -> bool:
        """With stacked slots: the segment no batch holds that the workers collect into this round
        (``_slot``), and whether its batch may be lent: yes, if another segment is free for the next
        round, or one could be added (every worker then maps it; a replacement starting maps it once it
        is ready). So there is always a free segment: a batch is lent only with another free one left."""
        stack = pool.stack
        if stack is None:
            return False
        free = stack.free()
        self._slot = free[0]
        if len(free) > 1:
            return True
        if not stack.grow():
            return False  # the cap, or no room in /dev/shm: this round is copied out
        for handle in pool.workers:
            if handle.attached:
                await pool.send(handle.index, pool.attach_message(handle))
        return True

    def frames_for_buffer(self, w: WorkersView, batch: TensorDictBase) -> TensorDictBase:
        """The stacked ``[workers, ..., T]`` batch with its worker dim folded into the next one: the entries
        torchrl's workers add when each extends the buffer with its own rollout (frames for single envs,
        ``[B, T]`` rows for batched ones), in worker order; frames a preempted worker did not collect are
        left out when the entries are frames."""
        if self._cat_results != "stack" or w.options.split_trajs or batch.ndim < 2:
            return batch
        flat = batch.flatten(0, 1)
        mask_key = ("collector", "mask")
        if flat.ndim == 1 and mask_key in flat.keys(include_nested=True):
            mask = flat.get(mask_key)
            if not bool(mask.all()):
                flat = flat[mask]
        return flat

    def _combine(self, pool: WorkerPool, notices: dict[int, Any], lend: bool) -> tuple[TensorDictBase, int]:
        n, stack = len(pool.workers), pool.stack
        valid = sum(notices[i].frames for i in range(n))
        blocks = [w.slots[0] for w in pool.workers] if stack is None else []
        steps = [b.batch_size[-1] for b in blocks] if stack is None else [stack.layout.batch_size[-1]] * n
        partial = any(notices[i].steps < steps[i] for i in range(n))
        if self._cat_results != "stack":
            parts = [b.td[..., : notices[i].steps] if partial else b.td for i, b in enumerate(blocks)]
            uneven = partial and len({p.batch_size for p in parts}) > 1
            if self._cat_results == 0 and uneven and parts[0].ndim > 1:
                raise RuntimeError(
                    "preempted batches of batched envs cannot be concatenated along dim 0; use cat_results=-1"
                )
            return self._copies.cat(parts, 0 if self._cat_results == 0 else -1), valid
        batch: TensorDictBase
        if stack is None:
            batch = self._copies.stack(blocks)  # the one copy out of shared memory
        else:  # the workers wrote the stacked batch: lent as it is, or (no segment to spare) copied out
            root = stack.root(self._slot)
            batch = self._copies.views(root, stack.layout) if lend else self._copies.copy(root, stack.layout)
        if partial or self._threshold is not None:
            batch.set(("collector", "mask"), batch.get(("collector", "traj_ids")) != -1)
        return batch, valid


class MultiSyncCollector(WorkersMixin, FleetCollector):
    """Every batch holds one rollout from each worker, collected in parallel and stacked.

    ``frames_per_batch`` is the total per batch, split evenly over the workers (or a list, one value per
    worker). Workers idle between batches, so each batch is collected with the weights current when it
    was asked for. With ``preemptive_threshold=p`` the batch is delivered once ``ceil(p * N)`` workers
    finished; the others stop at their next step and their missing frames are marked invalid.

    Args:
        create_env_fns: one env constructor per worker.
        cat_results: ``"stack"`` (``[N, ..., T]``), ``0`` (cat along dim 0) or ``-1`` (cat along time).
        preemptive_threshold: fraction of workers to wait for, in ``(0, 1]``.
        trajs_per_batch: instead of ``frames_per_batch``, batches of this many whole trajectories, in
            the order they started (see :class:`Collector`); the workers collect chunks of frames.
        group_size: with ``trajs_per_batch``, episodes in groups that start from the same initial
            state, delivered whole (see :class:`Collector`); each worker's env slots in whole groups.
        update_at_each_batch: publish the policy's weights before every batch.
        worker_backend: ``"process"`` (default) or ``"serial"`` (same workers as threads, for
            debugging). ``backend=`` is its deprecated spelling.
        update_at_each_batch, max_policy_lag, track_policy_version: :class:`WeightSchedule`'s, given flat
            (or ``weights=WeightSchedule(...)``).
        worker_timeout: seconds a worker may take to deliver a batch or answer a control call before
            :class:`WorkerTimeoutError` is raised and the workers are stopped (``None``: wait forever).
        traj_id_start, traj_id_stride: the collector's trajectory ids are ``traj_id_start + k *
            traj_id_stride``; worker ``i`` of ``N`` takes ``k = i, i + N, i + 2N, ...``.

    The other arguments are :class:`Collector`'s.

    Example:
        >>> import anyio
        >>> from aiocollect import GymEnv, MultiSyncCollector
        >>> async def main():
        ...     async with MultiSyncCollector([lambda: GymEnv("CartPole-v1")] * 2, frames_per_batch=64,
        ...                                   total_frames=128, worker_backend="serial") as c:
        ...         async for batch in c:
        ...             print(batch.batch_size)
        >>> anyio.run(main)
        torch.Size([2, 32])
        torch.Size([2, 32])
    """

    @explicit_keywords(keywords=MultiSyncKeywords)
    def __init__(
        self, create_env_fns: Sequence[Any], policy: Any = None, **kwargs: Unpack[MultiSyncKeywords]
    ) -> None:
        threshold, cat_results = kwargs["preemptive_threshold"], kwargs["cat_results"]
        trajs = trajs_per_batch_arg(
            "MultiSyncCollector",
            kwargs["trajs_per_batch"],
            kwargs["frames_per_batch"],
            preemptive_threshold=threshold,
            cat_results=cat_results if cat_results == -1 else None,
            max_policy_lag=kwargs["max_policy_lag"],
        )
        group = group_size_arg("MultiSyncCollector", kwargs["group_size"], trajs)
        delivery = Episodes.over(Gather(threshold, cat_results), trajs, group_size=group)
        if threshold is not None and (
            isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 1
        ):
            raise ValueError(f"preemptive_threshold must be in (0, 1] or None, got {threshold!r}")
        if cat_results != "stack" and (isinstance(cat_results, bool) or cat_results not in (0, -1)):
            raise ValueError(f"cat_results must be 'stack', 0 or -1, got {cat_results!r}")
        frames = Episodes.frames(kwargs["frames_per_batch"], trajs, kwargs["rollout"], create_env_fns)
        self._init_workers(create_env_fns, policy, delivery, {**kwargs, "frames_per_batch": frames})
