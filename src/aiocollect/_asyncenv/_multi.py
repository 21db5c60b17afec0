"""``MultiAsyncEnvCollector``: async envs in worker processes, each process running its own event loop
(an ``AsyncEnvCollector`` over its share of the envs), batches delivered as ``MultiAsyncCollector`` does."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any, Unpack

import anyio

from .._core._mistakes import explicit_keywords
from .._core._validation import lag_arg, optional_callable
from .._fleet._collector import FleetCollector
from .._multi._async import FirstReady
from .._multi._episodes import Episodes
from .._multi._workers import Arrival, WorkersMixin, WorkersView
from .._observe._events import WorkerFailed
from .._transport._messages import RunFree
from ._collector import Finish
from ._keywords import POOL_KEYWORDS, MultiAsyncEnvKeywords, picked
from ._options import UNSUPPORTED, AsyncEnvOptions, shares_arg
from ._restarts import restart_arg
from ._worker import EnvOffset, EnvRows, run_async_worker
from ._worker_frames import FLOOR, VERSION

__all__ = ["EnvIds", "MultiAsyncEnvCollector"]


class EnvIds:
    """Env ids over the workers: each worker reports how many (sub-)envs it built (``EnvRows``, known only
    once built: a vector env's size), and learns its first env id once every worker has; a replacement of
    a worker that died (``restart=``) gets its predecessor's at once.

    Example:
        >>> ids = EnvIds(2)
        >>> ids.counted(1, 4), ids.counted(0, 3)  # worker 1 waits for worker 0's count
        ({}, {0: 0, 1: 3})
        >>> ids.counted(1, 4), ids.total  # worker 1 replaced: its env ids again
        ({1: 3}, 7)
    """

    def __init__(self, workers: int) -> None:
        self.rows: list[int | None] = [None] * workers
        #: per worker, its first env id over all workers (``None`` until every worker reported)
        self.firsts: list[int] | None = None

    @property
    def total(self) -> int:
        return sum(r for r in self.rows if r is not None)

    def counted(self, index: int, rows: int) -> dict[int, int]:
        """Worker ``index`` built ``rows`` (sub-)envs: the first env ids to send now, by worker (every
        worker's once all have reported; a replacement's, its predecessor's); ``RuntimeError`` if a
        replacement built another number of envs."""
        if self.firsts is not None:
            if rows != self.rows[index]:
                raise RuntimeError(
                    f"worker {index}'s replacement built {rows} (sub-)envs, its predecessor "
                    f"{self.rows[index]}: its env fns must build the same envs every time"
                )
            return {index: self.firsts[index]}
        self.rows[index] = rows
        counts = [r for r in self.rows if r is not None]
        if len(counts) < len(self.rows):
            return {}
        self.firsts = [0, *itertools.accumulate(counts[:-1])]
        return dict(enumerate(self.firsts))


class _EnvsFirstReady(FirstReady):
    """First ready, first served, over async-env workers: every frame carries its policy version and the
    floor its worker knew when it was cut into a batch (see :meth:`next_batch`). The parent renames no
    trajectory: an env's trajectory may have no frame in a batch (envs step at their own pace), so the
    parent cannot tell a gap from a pause; the workers give fresh ids themselves."""

    def __init__(self, workers: int, track_versions: bool) -> None:
        super().__init__(renames=False, lazy=False)  # no set_seed or reset to wait for
        self._track_versions = track_versions
        self._cut = [0] * workers  # per worker: the newest floor one of its batches was dropped at

    def stale(self, w: WorkersView, index: int, policy_version: int) -> bool:
        stale = super().stale(w, index, policy_version)
        if stale:  # dropped: see next_batch
            self._cut[index] = max(self._cut[index], w.floors[index])
        return stale

    async def next_batch(self, w: WorkersView) -> Arrival:
        """The next batch whose every frame is at or above its worker's floor, and that continues no
        trajectory of a batch dropped here under the same id.

        A batch written before the floor rose, its newest frames above the floor and older ones below,
        is dropped whole (batches keep their size). Once a batch of a worker is dropped at floor ``f``,
        the ones it cut before it knew of ``f`` are dropped too: they may go on with trajectory ids of
        the dropped one (from ``f`` on, the worker gives the trajectories in flight fresh ids)."""
        while True:
            out = await super().next_batch(w)
            index = out.member
            assert index is not None
            batch, floor = out.batch, w.floors[index]
            if int(batch.get(VERSION).min()) < floor:
                self._cut[index] = max(self._cut[index], floor)
            elif int(batch.get(FLOOR)[0]) >= self._cut[index]:
                break
            w.fleet.discard(out.frames)
        out.batch = batch.exclude(FLOOR) if self._track_versions else batch.exclude(FLOOR, VERSION)
        return out

    async def flush(self, w: WorkersView) -> None:
        """Every worker restarted its engine and waits (see ``_worker.py``): drop the batches waiting
        in the slots (counted as discarded), hand the slots back, then let the workers send again."""
        pool = w.pool
        assert pool is not None
        with anyio.CancelScope(shield=True):
            for item in self._take_waiting(pool):
                if isinstance(item, tuple):
                    w.fleet.discard(item[1].frames)
                    await self._release(pool, item[0], item[1].slot)
                else:  # the pool's failure: raised by whoever reads next
                    self._backlog.append(item)
            for i in range(len(pool.workers)):
                await pool.send(i, RunFree(random_frames=0))

    async def load_behind(self, w: WorkersView, raised: list[int]) -> None:
        """The workers whose floor rose and that run older weights load the new ones now, not after
        their next batch (each drops the frames it holds below the floor; its next batch would be
        dropped otherwise)."""
        behind = [i for i in raised if w.members()[i].policy_version < w.floors[i]]
        if behind:
            await w.load_now(behind, w.floors[behind[0]], None)


class MultiAsyncEnvCollector(WorkersMixin, FleetCollector):
    """Async envs in worker processes: each process runs its own event loop, an
    :class:`AsyncEnvCollector` over its share of the envs with its own policy copy (dynamic batching of
    the ready envs), so that every core of the machine serves I/O-bound envs.

    Each batch is one worker's ``frames_per_batch`` frames, flat ``[frames]`` as ``AsyncEnvCollector``'s,
    first ready first served (as :class:`MultiAsyncCollector`); ``("collector", "env_id")`` is the env's
    index over all workers (worker 0's envs first, a vector env's sub-envs each one), ``("collector",
    "worker_id")`` the worker's, and trajectory ids are unique over the workers. A worker learns its first
    env id once every worker has built its envs (a vector env's size is known then), before any env is
    reset. Weights reach a worker between two of its policy calls
    (after each of its batches, or at once with ``update_weights(wait=True)``); ``statistics()`` has one
    entry per worker process. A worker's env error is raised from ``async for`` with its type, a killed
    worker raises :class:`WorkerDiedError` (unless ``restart=`` replaces it); ``async with`` ends every
    process and shared-memory segment.
    With ``on_env_error="drop"`` a failing env is dropped and the others go on; each (sub-)env dropped is a
    :class:`WorkerFailed` event with its env id over all workers, and a worker whose every env is dropped
    ends the collector with ``RuntimeError``.

    For on-policy training, ``update_weights(..., flush=True)`` (or ``max_policy_lag=0``, a flush at
    every update) delivers from then on only frames collected with the new weights: batches waiting in
    the slots are dropped, each worker drops the frames it holds below the new version (each frame
    carries its version), and the envs are not reset; a trajectory that loses frames goes on under a
    fresh trajectory id. The frames dropped are counted in ``statistics().frames_discarded``.
    ``max_policy_lag=k`` delivers nothing more than ``k`` versions old. ``MultiAsyncCollector``'s
    arguments that make no sense for async envs (``reset_at_each_iter``, ``set_truncated``, devices but
    ``storing_device``, ``compile_policy``) raise ``TypeError`` with their fix.

    Args:
        env_fns_per_worker: one list of env fns per worker process (each as ``AsyncEnvCollector``'s
            ``env_fns``: async envs, async vector envs, gymnasium envs or vector envs; cloudpickled,
            called in the worker).
        policy: as ``AsyncEnvCollector``'s (an ``nn.Module`` gets its weights from :meth:`update_weights`).
        frames_per_batch: frames in each batch (each worker's batches), or one value per worker.
        trajs_per_batch: instead of ``frames_per_batch``, batches of this many whole trajectories (as
            :class:`AsyncEnvCollector`'s); the trajectories a flush tears are discarded.
        group_size: with ``trajs_per_batch``, episodes in groups of ``group_size`` envs of one worker that
            start from the same initial state, delivered whole (as :class:`AsyncEnvCollector`'s; each
            worker's envs in whole groups; group ids unique over the workers, as trajectory ids are).
        on_update: with ``trajs_per_batch``: ``"continue"`` (default) or ``"restart"``: the episodes in
            flight when a worker loads new weights are discarded and started again from their initial
            state (docs/episodes.md).
        init_random_frames: the first ``ceil(init_random_frames / workers)`` actions of each worker
            (rounded up to whole batches of it) are random, the policy's other outputs zeros.
        max_policy_lag: deliver nothing more than this many versions older than the newest published;
            ``0``: on-policy (each worker's envs wait while the trainer holds its batch).
        total_frames, split_trajs, postproc, replay_buffer, storing_device, progress: as
            :class:`MultiAsyncCollector`'s.
        num_threads, num_sub_threads, update_at_each_batch, worker_backend, start_method: as
            :class:`MultiAsyncCollector`'s.
        weight_sync, worker_timeout, traj_id_start, traj_id_stride: as :class:`MultiAsyncCollector`'s.
        min_batch, max_wait, max_frames_per_traj, exploration_type, track_policy_version: as
            ``AsyncEnvCollector``'s, per worker (``max_frames_per_traj`` is refused with vector envs).
        on_env_error: as ``AsyncEnvCollector``'s, per worker: ``"drop"`` drops a failing env (its event
            carries its env id over all workers); a worker whose every env is dropped ends the collector.
        restart: a :class:`RestartPolicy`: each worker restarts its failing envs as ``AsyncEnvCollector``
            does (``Restarted`` events carry the worker and the env id over all workers), and a worker
            process that dies or hangs past ``worker_timeout`` is replaced within its budget (its env
            ids, seeds derived from its own, fresh trajectory ids, the newest weights: docs/faults.md).
        prefetch: as ``AsyncEnvCollector``'s, per worker (default 1; 0 with ``max_policy_lag=0``).
        seed: env ``i`` (over all workers) is first reset with ``seed + i`` (a vector env whose first
            sub-env is env ``i``: ``reset(seed=seed + i)``).
        loop: the workers' event loop: ``"asyncio"`` (default), ``"uvloop"`` or ``"trio"``.

    Example:
        >>> import anyio, numpy as np
        >>> from gymnasium import spaces
        >>> from aiocollect import MultiAsyncEnvCollector
        >>> class Ping:
        ...     observation_space = spaces.Box(0, 1, (1,), np.float32)
        ...     action_space = spaces.Discrete(2)
        ...     async def reset(self, *, seed=None, options=None):
        ...         return np.zeros(1, np.float32), {}
        ...     async def step(self, action):
        ...         await anyio.sleep(0.001)  # a network call
        ...         return np.ones(1, np.float32), 1.0, False, False, {}
        ...     async def close(self):
        ...         pass
        >>> async def main():
        ...     async with MultiAsyncEnvCollector([[Ping] * 50] * 2, frames_per_batch=100,
        ...                                       total_frames=200) as c:
        ...         async for batch in c:
        ...             print(batch.batch_size)
        >>> anyio.run(main)
        torch.Size([100])
        torch.Size([100])
    """

    #: the (sub-)envs over all workers (env ids 0 to num_envs - 1); their env fns until the workers have
    #: built them (a vector env's sub-envs are counted then)
    num_envs: int

    @explicit_keywords(refused=UNSUPPORTED, keywords=MultiAsyncEnvKeywords)
    def __init__(
        self,
        env_fns_per_worker: Sequence[Sequence[Callable[[], Any]]],
        policy: Any = None,
        **kwargs: Unpack[MultiAsyncEnvKeywords],
    ) -> None:
        kw = kwargs
        shares = shares_arg(env_fns_per_worker)
        lag = lag_arg(kw["max_policy_lag"])
        restart = restart_arg(kw["restart"], [fn for share in shares for fn in share])
        checked = {**kw, "restart": restart, "max_policy_lag": lag}
        options = AsyncEnvOptions.of("MultiAsyncEnvCollector", [len(share) for share in shares], **checked)
        trajs, group, update = options.trajs_per_batch, options.group_size, options.on_update
        self.num_envs = sum(len(share) for share in shares)
        self._env_ids = EnvIds(len(shares))  # each worker's first env id, once every worker built its envs
        first_ready = _EnvsFirstReady(len(shares), options.track_policy_version)
        delivery = Episodes.over(first_ready, trajs, group_size=group, on_update=update)
        self._init_workers(
            [functools.partial(list, share) for share in shares],  # a worker env fn: its share's env fns
            policy,
            delivery,
            picked(kw, POOL_KEYWORDS),  # worker processes that die or hang are replaced (restart=)
            # the per-worker values checked (the trainer's options are built from the same keywords)
            frames_per_batch=list(options.per_worker),
            total_frames=options.total_frames,
            init_random_frames=options.random_frames,
            postproc=Finish(options, optional_callable("postproc", kw["postproc"])),
            max_policy_lag=lag,
            body=functools.partial(run_async_worker, options),  # each worker: options.for_member()
            on_message=self._worker_message,
        )

    def _worker_message(self, index: int, msg: Any) -> None:
        if isinstance(msg, WorkerFailed):  # an env dropped, its global env id (restarts: the pool's)
            self._hub.publish(msg)
        elif isinstance(msg, EnvRows):  # a worker built its envs: once all have, each its first env id
            try:
                firsts = self._env_ids.counted(index, msg.rows)
            except RuntimeError as exc:  # a replacement that built other envs
                assert self._pool is not None
                self._pool.fail(exc)
                return
            if firsts:
                self.num_envs = self._env_ids.total
                assert self._task_group is not None
                self._task_group.start_soon(self._place_envs, firsts)

    async def _place_envs(self, firsts: dict[int, int]) -> None:
        """Give each worker (of ``firsts``) its first env id (they wait for it before resetting any env)."""
        pool = self._pool
        if pool is None:
            return
        for i, first in firsts.items():
            try:
                await pool.send(i, EnvOffset(first))
            except Exception:  # the pool failed (a worker died or raised): its start-up raises why
                return

    # -- seeds, resets, checkpoints (served by each worker's AsyncEnvCollector: _worker.py) -------------
    def _check_env_state(self, envs: bool) -> None:
        if envs and self._episodes is not None:
            raise ValueError(
                "state_dict(envs=True) with trajs_per_batch: the trajectories being assembled are not saved; "
                "save without envs (the envs then start from reset at a resume)"
            )

    async def _restarted(self) -> None:
        """The workers restarted their engines and wait: the batches they sent before are dropped, then
        they send again."""
        delivery = self._workers.delivery
        if isinstance(delivery, Episodes):  # the trajectories being assembled went with them
            for i in range(self.num_workers):
                delivery.assembler.taint(i)
            delivery = delivery.inner
        assert isinstance(delivery, _EnvsFirstReady)
        await delivery.flush(self._workers)

    def __repr__(self) -> str:
        return (
            f"MultiAsyncEnvCollector(workers={self.num_workers}, envs={self.num_envs}, "
            f"frames_per_batch={self.frames_per_batch}, total_frames={self.total_frames}, "
            f"closed={self._closed})"
        )
