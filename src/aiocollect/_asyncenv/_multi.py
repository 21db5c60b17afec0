"""``MultiAsyncEnvCollector``: async envs in worker processes, each process running its own event loop
(an ``AsyncEnvCollector`` over its share of the envs), batches delivered as ``MultiAsyncCollector`` does."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import anyio
import torch
from tensordict import TensorDictBase
from tensordict.nn import InteractionType

from .._core._mistakes import explicit_keywords
from .._core._restart import RestartPolicy
from .._core._validation import (
    exploration_type_arg,
    flag,
    init_random_frames_arg,
    lag_arg,
    non_negative_int,
    optional_callable,
    optional_positive_int,
    seed_arg,
)
from .._episodes._args import async_chunk, episode_args, trajs_per_batch_arg
from .._episodes._trajectories import split_trajectories
from .._fleet._collector import FleetCollector
from .._multi._async import FirstReady
from .._multi._episodes import Episodes
from .._multi._workers import Arrival, WorkersMixin, WorkersView
from .._observe._events import Restarted, WorkerFailed
from .._transport._messages import RunFree
from .._weightsync._schemes import WeightSync
from ._args import max_wait_arg, on_env_error_arg
from ._multi_args import (
    UNSUPPORTED,
    frames_arg,
    groups_arg,
    loop_arg,
    shares_arg,
    warn_envs_wait,
)
from ._restarts import restart_arg
from ._worker import EnvOffset, EnvRows, EnvShare, WorkerConfig, run_async_worker
from ._worker_envids import EnvIds
from ._worker_frames import FLOOR, VERSION

__all__ = ["MultiAsyncEnvCollector"]


class _Finish:
    """The batch as delivered: trajectories split (sorted by trajectory first: a flat batch interleaves
    its envs), then the user's ``postproc``."""

    def __init__(
        self,
        split_trajs: bool,
        postproc: Callable[[TensorDictBase], TensorDictBase] | None,
        grouped: bool = False,
    ) -> None:
        self.split_trajs = split_trajs
        self.postproc = postproc
        self.grouped = grouped  # trajs_per_batch: whole trajectories one after the other already

    def __call__(self, batch: TensorDictBase) -> TensorDictBase:
        batch.names = None  # a flat batch of frames, not a time dimension
        if self.split_trajs:
            if not self.grouped:
                batch = batch[torch.sort(batch.get(("collector", "traj_ids")), stable=True).indices]
            batch = split_trajectories(batch)
        return self.postproc(batch) if self.postproc is not None else batch


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
        """Every worker restarted its engine and waits (see ``_worker_state.py``): drop the batches waiting
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

    @explicit_keywords(refused=UNSUPPORTED)
    def __init__(
        self,
        env_fns_per_worker: Sequence[Sequence[Callable[[], Any]]],
        policy: Any = None,
        *,
        frames_per_batch: int | Sequence[int] | None = None,
        total_frames: int | None = -1,
        trajs_per_batch: int | None = None,
        min_batch: int | None = None,
        max_wait: float = 0.002,
        max_frames_per_traj: int | None = None,
        init_random_frames: int | None = None,
        split_trajs: bool = False,
        exploration_type: str | InteractionType = "random",
        seed: int | None = None,
        track_policy_version: bool = False,
        on_env_error: str = "raise",
        max_policy_lag: int | None = None,
        update_at_each_batch: bool = False,
        prefetch: int | None = None,
        loop: Literal["asyncio", "uvloop", "trio"] = "asyncio",
        postproc: Callable[[TensorDictBase], TensorDictBase] | None = None,
        replay_buffer: Any = None,
        storing_device: Any = None,
        progress: Any = None,
        num_threads: int | None = None,
        num_sub_threads: int = 1,
        worker_backend: Literal["process", "serial"] = "process",
        start_method: str | None = None,
        weight_sync: WeightSync | None = None,
        worker_timeout: float | None = None,
        traj_id_start: int = 0,
        traj_id_stride: int = 1,
        restart: RestartPolicy | None = None,
        group_size: int | None = None,
        on_update: str = "continue",
    ) -> None:
        shares = shares_arg(env_fns_per_worker)
        lag = lag_arg(max_policy_lag)
        trajs = trajs_per_batch_arg(
            "MultiAsyncEnvCollector",
            trajs_per_batch,
            frames_per_batch,
            max_policy_lag=lag,
            on_env_error="drop" if on_env_error == "drop" else None,
        )
        group, update = episode_args("MultiAsyncEnvCollector", trajs, group_size, on_update, restart)
        groups_arg(shares, group)
        frames_per_batch = async_chunk(frames_per_batch, trajs, max(len(share) for share in shares))
        fpb = frames_arg(frames_per_batch, len(shares))
        if prefetch is None:  # on-policy: what a worker collects ahead is dropped at the next update
            prefetch = 0 if lag == 0 else 1
        random_frames = init_random_frames_arg(init_random_frames)
        self._async_config = WorkerConfig(
            min_batch=optional_positive_int("min_batch", min_batch, fix="None: half of a worker's envs"),
            max_wait=max_wait_arg(max_wait),
            max_frames_per_traj=optional_positive_int("max_frames_per_traj", max_frames_per_traj),
            exploration_type=exploration_type_arg(exploration_type),
            seed=seed_arg(seed),
            prefetch=non_negative_int("prefetch", prefetch, fix="0: a batch is collected when asked for"),
            loop=loop_arg(loop),
            random_frames=math.ceil(random_frames / len(shares)),
            pause_when_held=lag == 0,
            on_env_error=on_env_error_arg(on_env_error),
            restart=restart_arg(restart, [fn for share in shares for fn in share]),
            group_size=group,
            on_update=update,
            traj_id_start=traj_id_start,
            traj_id_stride=traj_id_stride,
        )
        self._track_versions = flag("track_policy_version", track_policy_version)
        self.num_envs = sum(len(share) for share in shares)
        self._env_ids = EnvIds(len(shares))  # each worker's first env id, once every worker built its envs
        warn_envs_wait(shares, fpb, self._async_config.prefetch)
        first_ready = _EnvsFirstReady(len(shares), self._track_versions)
        delivery = Episodes.over(first_ready, trajs, group_size=group, on_update=update)
        self._init_workers(
            [EnvShare(share) for share in shares],
            policy,
            delivery,
            frames_per_batch=frames_per_batch if isinstance(frames_per_batch, int) else list(fpb),
            total_frames=total_frames,
            init_random_frames=random_frames,
            postproc=_Finish(
                flag("split_trajs", split_trajs), optional_callable("postproc", postproc), trajs is not None
            ),
            replay_buffer=replay_buffer,
            storing_device=storing_device,
            max_policy_lag=lag,
            update_at_each_batch=update_at_each_batch,
            progress=progress,
            num_threads=num_threads,
            num_sub_threads=num_sub_threads,
            worker_backend=worker_backend,
            start_method=start_method,
            weight_sync=weight_sync,
            worker_timeout=worker_timeout,
            traj_id_start=traj_id_start,
            traj_id_stride=traj_id_stride,
            restart=restart,  # worker processes that die or hang are replaced (their envs: WorkerConfig)
            body=functools.partial(run_async_worker, self._async_config),
            on_message=self._worker_message,
        )

    def _worker_message(self, index: int, msg: Any) -> None:
        if isinstance(msg, (WorkerFailed, Restarted)):  # an env dropped or restarted, its global env id
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

    # -- seeds, resets, checkpoints (served by each worker's AsyncEnvCollector: _worker_state.py) -------
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

    async def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (same number of workers) into a collector made with the same
        arguments: counters, trajectory ids, version and weights, random states, and each worker's envs,
        from their saved state (``envs=True``) or reset (a seeded collector's with a seed derived from the
        checkpoint). Each worker's engine restarts: what was collected before is dropped."""
        policy = state.get("policy")
        if policy is not None:  # each worker loads the weights before its engine restarts
            keys = [f"worker{i}" for i in range(self.num_workers) if f"worker{i}" in state]
            state = {**state, **{k: {**state[k], "policy": policy} for k in keys}}
        await super().load_state_dict(state)

    def __repr__(self) -> str:
        return (
            f"MultiAsyncEnvCollector(workers={self.num_workers}, envs={self.num_envs}, "
            f"frames_per_batch={self.frames_per_batch}, total_frames={self.total_frames}, "
            f"closed={self._closed})"
        )
