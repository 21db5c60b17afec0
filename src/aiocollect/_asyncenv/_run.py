"""The engine of ``AsyncEnvCollector``: a task per env and one policy task, on the collector's loop.

Each env task stages its observation, queues itself as ready and waits for its action; the policy task
takes the ready envs in one batch (once ``min_batch`` of them wait, or the oldest has waited ``max_wait``),
calls the policy once, hands each env its action (and the action's number), and goes on. The env task steps
its env, appends the frame to the batch being filled (its next observation and the step's values, with the
action's number, from which the batch finds the call's observation and outputs once it is complete) and
queues itself again. Completed batches wait, in order, for the consumer; at most ``1 + prefetch`` batches are
in flight (then the envs wait: backpressure).

The step path is the hot one (docs/async-envs.md, "Performance"): per step an env task allocates one future
and no tuple or dict that outlives the step (an episode's end adds one tuple), and it does its bookkeeping
in one coroutine frame.
"""

from __future__ import annotations

import asyncio
import sys
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import numpy as np
import torch

from .._envs._contract import contract_error
from .._envs._spaces import LeafSpec, NestedKey
from .._events import WorkerFailed
from .._groups import RowEpisodes
from .._timesplit import SplitClock
from ._envset import EnvSet, close_once
from ._frames import FrameBatch, Layout, PolicyCall
from ._policy import ActionCodec, BatchPolicy
from ._restarts import EnvRestarts, truncate_last_frames
from ._vector import END, IN_VECTOR, VectorSteps

__all__ = ["DISPATCH_CHUNK", "Engine", "EngineConfig", "Signal", "as_numpy", "output_dtype"]


class Signal:
    """Wakes the tasks waiting on it (no state: a waiter checks its condition first, then waits)."""

    __slots__ = ("_event",)  # not None: a task waits (read directly on the engine's hot path)

    def __init__(self) -> None:
        self._event: anyio.Event | None = None

    def set(self) -> None:
        event, self._event = self._event, None
        if event is not None:
            event.set()

    async def wait(self) -> None:
        if self._event is None:
            self._event = anyio.Event()
        await self._event.wait()


@dataclass(frozen=True)
class EngineConfig:
    frames_per_batch: int
    #: frames to collect in all (a multiple of frames_per_batch), or -1
    target: int
    min_batch: int
    max_wait: float
    prefetch: int
    max_frames_per_traj: int | None
    seed: int | None
    drop_failed_envs: bool
    track_policy_version: bool
    #: seeded episodes (``_groups.py``): in groups of this many rows, and started again at each update
    group_size: int | None = None
    restart_on_update: bool = False


class Engine(VectorSteps):
    """The running state of one entered ``AsyncEnvCollector`` (see the module docstring).

    Its per-env state is per row: a single env has one row, a vector env of ``N`` sub-envs ``N``
    consecutive rows (``spec.firsts``); a row's index is its env id. The tasks of vector envs are
    :class:`VectorSteps`'."""

    def __init__(
        self,
        envs: list[Any],
        spec: EnvSet,
        policy: BatchPolicy,
        config: EngineConfig,
        *,
        hub: Any,
        is_paused: Callable[[], bool],
        resumed: Callable[[], Awaitable[None]],
        restarts: EnvRestarts | None = None,
    ) -> None:
        n = spec.rows
        self.restarts = restarts  # restart=RestartPolicy(...): see _restart_env
        self.rows = n
        self.envs = envs
        self.spec = spec
        self.policy = policy
        self.codec = ActionCodec(spec.action_space)
        self.config = config
        self.hub = hub
        self.stage = spec.staging(n)
        self.traj_ids = np.arange(n, dtype=np.int64)
        # seeded episodes (group_size, on_update="restart"), else None: resets unseeded but the first
        self.episodes = RowEpisodes.of(n, config.group_size, config.seed, restart=config.restart_on_update)
        self._restarting = [False] * n if self.episodes is None else self.episodes.restarting
        self.next_traj = n
        self.env_frames = [0] * n
        self.dropped: set[int] = set()
        self.version = 0
        self.batch_sizes: deque[int] = deque(maxlen=10_000)  # of the recent policy calls
        self.clock = SplitClock()  # the policy task's time: awaiting envs, the policy, the consumer
        self.error: BaseException | None = None
        # hand-offs between the env tasks and the policy task
        self._ready: list[int] = []  # rows (a vector env's all at once)
        # per row: 0 a single env's, N the first of a vector env of N sub-envs, -1 its others
        self._kinds = [0] * n
        for first, width in zip(spec.firsts, spec.widths, strict=True):
            if width:
                self._kinds[first : first + width] = [width] + [-1] * (width - 1)
        # per row: the row after its env's last one (a single env's: the next)
        self._row_stop = list(range(1, n + 1))
        for first, width in zip(spec.firsts, spec.widths, strict=True):
            self._row_stop[first : first + width] = [first + width] * width

        self._first_ready = 0.0
        # len(self._ready) at which an env becoming ready wakes the policy task (0: never; it is not waiting
        # for envs): one int compared per step instead of a signal per ready env
        self._wake_at = 1
        self._actions: list[Any] = [None] * n  # an env's action while it steps (None: not stepping)
        # actions are numbered in the order they are handed out; env i steps with action number
        # _action_no[i], and a frame records only that number (an int, which the cyclic GC does not track):
        # the call it came from is found in _calls when its batch completes
        self._action_no = [0] * n
        self._next_action = 0  # the number of the first action of the next policy call
        self._calls: deque[PolicyCall] = deque()  # the calls whose actions may still give frames
        self._waiters: list[Any] = [None] * n  # what each ready env awaits (see _waiters_for_this_loop)
        self._new_waiter: Callable[[], Any] = anyio.Event
        self._wake: Callable[[Any], Any] = _set_event
        self._no_more_actions = False
        self._in_flight = 0  # envs with an action, stepping
        self._acting = False  # a policy call in flight
        self._layout: Layout | None = None
        self._filling: FrameBatch | None = None
        self._batches_completed = 0
        self.complete: deque[FrameBatch] = deque()  # ready for the consumer, in order
        self.delivered = 0  # frames delivered
        self.policy_signal = Signal()
        self.consumer_signal = Signal()
        self.idle_signal = Signal()
        self.policy_lock = anyio.Lock(fast_acquire=True)  # free (no weight update waits): no checkpoint
        self.is_paused = is_paused
        self._resumed = resumed
        self.closed_envs: set[int] = set()
        self._scope: anyio.CancelScope | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._ended = anyio.Event()

    # -- lifecycle --------------------------------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run every env task and the policy task until cancelled or failed."""
        self._new_waiter, self._wake = _waiters_for_this_loop()
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    for u, (env, first, width) in enumerate(
                        zip(self.envs, self.spec.firsts, self.spec.widths, strict=True)
                    ):
                        if width:
                            tg.start_soon(self._vector_task, u, env, first, width)
                        else:
                            tg.start_soon(self._env_task, first, env, u)
                    tg.start_soon(self._policy_task)
                    task_status.started()
        finally:
            self._ended.set()

    async def stop(self) -> None:
        """Cancel the tasks and wait until they have ended (their steps in threads included)."""
        if self._scope is not None:
            self._scope.cancel()
            with anyio.CancelScope(shield=True):
                await self._ended.wait()

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        if self._scope is not None:
            self._scope.cancel()
        self.consumer_signal.set()
        self.idle_signal.set()  # a pause() waiting for the steps in flight

    @property
    def idle(self) -> bool:
        return not self._in_flight and not self._acting

    @property
    def exhausted(self) -> bool:
        """Every frame of the budget was delivered."""
        return 0 < self.config.target <= self.delivered

    def take_batch(self) -> FrameBatch:
        """The next complete batch; its frames no longer count against the frames in flight."""
        batch = self.complete.popleft()
        self.delivered += batch.size
        self.policy_signal.set()
        return batch

    # -- env tasks --------------------------------------------------------------------------------
    def _stage_rows(self, i: int) -> tuple[list[Any], Any]:
        """Env ``i``'s row of each staging array, as a view (assigning into one costs half of an index
        assignment; a 1-D array's row is a 1-element slice: its item would be a copy), and the row alone
        when there is one array."""
        rows = [slot[i] if slot.ndim > 1 else slot[i : i + 1] for slot in self.stage]
        return rows, rows[0] if len(rows) == 1 else None

    async def _env_task(self, i: int, env: Any, u: int) -> None:  # env u, row i: the hot loop, in one piece
        try:
            obs, _ = await env.reset(seed=self.reset_seed(i, u))
            rows, single = self._stage_rows(i)
            arrays = self.spec.arrays
            ready = self._ready
            actions = self._actions
            action_no = self._action_no
            waiters = self._waiters
            new_waiter = self._new_waiter
            is_future = new_waiter is not anyio.Event
            policy_signal = self.policy_signal
            idle_signal = self.idle_signal
            env_frames = self.env_frames
            max_len = self.config.max_frames_per_traj
            current_time = anyio.current_time
            ret, length = 0.0, 0
            restarting = self._restarting
            while not self._no_more_actions:
                if single is not None:
                    single[...] = obs
                else:
                    for row_view, value in zip(rows, arrays(obs), strict=True):
                        row_view[...] = value
                waiter = waiters[i] = new_waiter()
                ready.append(i)
                waiting = len(ready)
                if waiting == 1:
                    self._first_ready = current_time()
                if waiting == self._wake_at:
                    policy_signal.set()
                if is_future:
                    await waiter
                else:
                    await waiter.wait()
                action = actions[i]
                if action is END:  # the budget is spent
                    return
                if restarting[i]:  # on_update="restart": new weights; the action is not taken
                    obs, ret, length = await self._restart(i, env)
                    continue
                obs, reward, terminated, truncated, _ = await env.step(action)
                actions[i] = None
                self._in_flight -= 1
                length += 1
                ret += reward
                done = terminated or truncated
                if max_len is not None and length >= max_len and not done:
                    truncated = done = True
                # the frame: its next observation copied into the batch, its step's values appended; the
                # rest is gathered from its policy call when the batch completes
                batch = self._filling
                if batch is None:
                    batch = self._new_batch()
                row = batch.filled
                if single is not None:  # first: an observation that does not fit raises before any append
                    batch.next_obs[0][row] = obs
                else:
                    for slot, value in zip(batch.next_obs, arrays(obs), strict=True):
                        slot[row] = value
                batch.source.append(action_no[i])
                batch.reward.append(reward)
                batch.terminated.append(terminated)
                batch.truncated.append(truncated)
                env_frames[i] += 1
                batch.filled = row = row + 1
                if done:
                    batch.episodes.append((i, ret, length))
                    ret, length = 0.0, 0
                    self.traj_ids[i] = self.next_traj
                    self.next_traj += 1
                if row == batch.size:
                    self._complete(batch)
                if idle_signal._event is not None and self.idle:  # a pause() waits for the steps in flight
                    idle_signal.set()
                if done:
                    obs, _ = await env.reset(seed=None if self.episodes is None else self.episodes.advance(i))
        except Exception as exc:
            await self._env_failed(u, exc)

    async def _restart(self, i: int, env: Any) -> tuple[Any, float, int]:
        """Row ``i``'s episode started again from its own seed, under a new trajectory id (its frames so
        far are discarded by the trajectory assembler: a slot's trajectory cut and begun again), instead
        of a step with the action it was handed."""
        assert self.episodes is not None
        self._restarting[i] = False
        self._actions[i] = None
        self._in_flight -= 1
        self.policy_signal.set()  # room for a step
        if self.idle:
            self.idle_signal.set()  # a pause() waits for the steps in flight
        self.traj_ids[i] = self.next_traj
        self.next_traj += 1
        obs, _ = await env.reset(seed=self.episodes.seed(i))
        return obs, 0.0, 0

    def new_version(self) -> int:
        """The policy version after an update (its weights loaded); with ``on_update="restart"`` every
        episode in flight starts again."""
        self.version += 1
        if self.episodes is not None:
            self.episodes.updated()
        return self.version

    def restart_counts(self) -> list[int]:
        """Per row (env id): the restarts of its env (a vector env's, on its first row)."""
        return [0] * self.rows if self.restarts is None else self.restarts.per_row(self.rows)

    def reset_seed(self, first: int, u: int) -> int | None:
        """The seed of env ``u``'s first reset (its first row ``first``), derived anew after a restart."""
        if self.episodes is not None:
            return self.episodes.seed(first)
        seed = None if self.config.seed is None else self.config.seed + first
        return seed if self.restarts is None else self.restarts.seed(seed, u)

    async def _env_failed(self, u: int, exc: Exception) -> None:
        """An env task's error: a restart (``restart=``), the collector's end, or (``on_env_error="drop"``)
        that env's."""
        if self.restarts is not None:
            self._end_trajectories(u)
            try:
                env = await self.restarts.rebuild(u, exc, self.close_env, self.env_frames)
            except Exception as final:  # not restarted, or the budget is spent
                exc = final
            else:
                self.envs[u] = env
                self.closed_envs.discard(u)
                first, width = self.spec.firsts[u], self.spec.widths[u]
                assert self._tg is not None
                if width:
                    self._tg.start_soon(self._vector_task, u, env, first, width)
                else:
                    self._tg.start_soon(self._env_task, first, env, u)
                return
        exc = contract_error(exc, self.envs[u]) or exc  # an env that broke gymnasium's API: named
        if not self.config.drop_failed_envs:
            self._fail(exc)
            return
        self._drop(u, exc)
        await self.close_env(u)

    async def close_env(self, i: int) -> None:
        """Close env ``i`` (once), shielded; an error closing it is dropped (it failed, or we are ending)."""
        await close_once(self.envs, self.closed_envs, i)

    def _end_trajectories(self, u: int) -> None:
        """Env ``u`` failed: the action it stepped with gives no frame; the last frame of each of its rows
        in the batch being filled, if not done, is marked truncated; its rows' next frames are new
        trajectories."""
        first = self.spec.firsts[u]
        rows = set(range(first, self._row_stop[first]))
        if self._actions[first] is not None:  # mid-step: its frames will not come
            self._actions[first : first + len(rows)] = [None] * len(rows)
            self._in_flight -= len(rows)
            self.policy_signal.set()  # room for other envs' steps
            if self.idle:
                self.idle_signal.set()
        for i in rows:
            self.traj_ids[i] = self.next_traj
            self.next_traj += 1
        if self._filling is not None:  # the calls of its frames are among self._calls (see _complete)
            truncate_last_frames(self._filling, list(self._calls), rows)

    def _drop(self, u: int, exc: Exception) -> None:
        """Drop env ``u`` (a vector env: all its sub-envs): its rows read failed, an event for each."""
        first, width = self.spec.firsts[u], self.spec.widths[u]
        stop = first + max(width, 1)
        stepping = self._actions[first] is not None
        self._actions[first:stop] = [None] * (stop - first)
        message = f"{type(exc).__name__}: {exc}"
        if width:
            message += f" (vector env {u}: its sub-envs, env ids {first} to {stop - 1}, are dropped)"
        for i in range(first, stop):
            self.dropped.add(i)
            self.hub.publish(WorkerFailed(i, message))
        if stepping:  # it failed mid-step: those frames are not collected (other envs' steps make them up)
            self._in_flight -= stop - first
            if self.idle:
                self.idle_signal.set()
        if len(self.dropped) == self.rows:
            error = RuntimeError(
                f"every env was dropped (on_env_error='drop'); the last one, env {first}, raised "
                f"{type(exc).__name__}: {exc}"
            )
            error.__cause__ = exc
            self._fail(error)
        self.policy_signal.set()  # fewer envs to wait for

    # -- batches ----------------------------------------------------------------------------------
    @property
    def completed(self) -> int:
        """Frames written (into complete batches and the one being filled)."""
        filling = self._filling
        done = self._batches_completed * self.config.frames_per_batch
        return done if filling is None else done + filling.filled

    def _new_batch(self) -> FrameBatch:
        assert self._layout is not None
        batch = self._filling = FrameBatch(self._layout, self.config.frames_per_batch)
        return batch

    def _complete(self, batch: FrameBatch) -> None:
        """``batch`` is full: find the policy calls of its frames, free the calls no frame can come from
        any more, and hand it to the consumer."""
        self._filling = None
        self._batches_completed += 1
        batch.resolve(list(self._calls))
        # a frame still to come is from an env stepping now, or from a call not made yet (or being
        # handed out: _next_action is advanced once every env of a call has its action)
        low = self._next_action
        for number, action in zip(self._action_no, self._actions, strict=True):
            if action is not None and action is not END and number < low:
                low = number
        calls = self._calls
        while calls and calls[0].base + calls[0].n <= low:
            calls.popleft()
        self.complete.append(batch)
        self.consumer_signal.set()
        self.policy_signal.set()

    # -- the policy task --------------------------------------------------------------------------
    async def _policy_task(self) -> None:
        try:
            while True:
                n = await self._next_batch_size()
                if n == 0:
                    self._end_actions()
                    self.clock.done()
                    return
                await self._act(n)
        except Exception as exc:
            self._fail(exc)

    def _end_actions(self) -> None:
        """The budget is collected: the waiting envs stop, and so do the others after their step."""
        self._no_more_actions = True
        kinds = self._kinds
        for i in self._ready:
            if kinds[i] >= 0:  # a single env, or a vector env's first row (its waiter)
                self._actions[i] = END
                self._wake(self._waiters[i])
        self._ready.clear()

    async def _next_batch_size(self) -> int:
        """Wait until a batch should run; how many ready envs it takes (0: the budget is collected)."""
        config = self.config
        cap = (1 + config.prefetch) * config.frames_per_batch
        try:
            while True:
                completed = self.completed
                if 0 < config.target <= completed:
                    return 0
                room = cap - (completed - self.delivered) - self._in_flight
                if config.target > 0:
                    room = min(room, config.target - completed - self._in_flight)
                if self.is_paused():
                    self._wake_at = 0
                    with self.clock.waiting():
                        await self._resumed()
                    continue
                waiting = len(self._ready)
                if room > 0 and waiting:
                    need = min(config.min_batch, self.rows - len(self.dropped), room)
                    late = self._first_ready + config.max_wait - anyio.current_time()
                    if waiting >= need or late <= 0:
                        return min(waiting, room)
                    self._wake_at = need  # the env that makes it `need` wakes us
                    with anyio.move_on_after(late), self.clock.spent("env"):
                        await self.policy_signal.wait()
                    continue
                # no env waits (the first to be ready wakes us), or no room (a batch taken wakes us)
                self._wake_at = 1 if room > 0 else 0
                with self.clock.spent("env") if room > 0 else self.clock.waiting():
                    await self.policy_signal.wait()
        finally:
            self._wake_at = 0  # acting (or ending): the envs need not wake us

    async def _act(self, n: int) -> None:
        """One policy call on the first ``n`` ready envs (more if the ``n``-th is a vector env's sub-env:
        a vector env's rows are never split), and their actions handed out."""
        last = self._ready[n - 1]
        n += self._row_stop[last] - last - 1
        ids = self._ready[:n]
        del self._ready[:n]
        if self._ready:
            self._first_ready = anyio.current_time()
        idx = np.asarray(ids, dtype=np.int64)
        obs = [slot[idx] for slot in self.stage]
        self._acting = True
        try:
            async with self.policy_lock:
                version = self.version
                tensors = {key: torch.from_numpy(a) for key, a in zip(self.spec.obs_keys, obs, strict=True)}
                with self.clock.spent("policy"):
                    out = await self.policy(tensors, n)
        finally:
            self._acting = False
        self.batch_sizes.append(n)
        self.clock.frames += n
        outputs = {key: as_numpy(value, n) for key, value in out.items()}
        if self._layout is None:
            self._layout = self._make_layout(outputs)
        elif list(outputs) != self._layout.out_keys:
            raise KeyError(f"the policy wrote {list(outputs)}, and {self._layout.out_keys} at its first call")
        arrays = self.codec.arrays(out, n)
        base = self._next_action
        groups = self.episodes.group_ids[idx] if self._layout.group_ids and self.episodes else None
        self._calls.append(
            PolicyCall(obs, list(outputs.values()), idx, self.traj_ids[idx], version, base, groups)
        )
        self._in_flight += n
        if self.spec.has_vector:
            await self._dispatch_mixed(ids, arrays, base)
        else:
            await self._dispatch(ids, self.codec.actions(arrays, n), base)
        self._next_action = base + n

    async def _dispatch(self, ids: list[int], env_actions: list[Any], base: int) -> None:
        """Hand single envs their actions (numbered from ``base``) and wake them."""
        n = len(ids)
        actions, action_no, waiters = self._actions, self._action_no, self._waiters
        futures = self._new_waiter is not anyio.Event
        wake = self._wake
        for start in range(0, n, DISPATCH_CHUNK):
            if start:
                # let the loop run these envs (and anything else waiting) before waking more: a burst of
                # hundreds of steps at once (and of their sleeps ending together) would hold the loop
                await anyio.lowlevel.checkpoint()
            for j in range(start, min(n, start + DISPATCH_CHUNK)):
                i = ids[j]
                actions[i] = env_actions[j]
                action_no[i] = base + j
                waiter = waiters[i]
                if not futures:
                    wake(waiter)
                elif not waiter.done():  # done: its task was cancelled
                    waiter.set_result(None)

    async def _dispatch_mixed(self, ids: list[int], arrays: dict[NestedKey, Any], base: int) -> None:
        """Hand single and vector envs their actions (numbered from ``base``; a vector env's rows in a
        row, its block of actions given to its first) and wake them, as :meth:`_dispatch` does."""
        n = len(ids)
        codec, kinds = self.codec, self._kinds
        singles = codec.actions(arrays, n) if self.spec.has_single else []
        actions, action_no, waiters, wake = self._actions, self._action_no, self._waiters, self._wake
        j = woken = 0
        while j < n:  # per env, not per row
            if woken and not woken % DISPATCH_CHUNK:
                await anyio.lowlevel.checkpoint()  # see _dispatch
            i = ids[j]
            width = kinds[i]  # a vector env's first row (a call holds its rows in a row, first first)
            if width:
                actions[i] = codec.block(arrays, j, j + width)
                actions[i + 1 : i + width] = [IN_VECTOR] * (width - 1)
                action_no[i : i + width] = range(base + j, base + j + width)
                j += width
            else:
                actions[i], action_no[i] = singles[j], base + j
                j += 1
            wake(waiters[i])
            woken += 1

    def _make_layout(self, outputs: dict[NestedKey, Any]) -> Layout:
        specs = {key: LeafSpec(tuple(value.shape[1:]), output_dtype(value)) for key, value in outputs.items()}
        grouped, versions = self.config.group_size is not None, self.config.track_policy_version
        return Layout(self.spec.obs_specs, specs, track_policy_version=versions, group_ids=grouped)


#: envs woken per loop iteration after a policy call (see ``Engine._act``)
DISPATCH_CHUNK = 64


def _wake_future(future: asyncio.Future[None]) -> None:
    if not future.done():  # done: its task was cancelled
        future.set_result(None)


def _set_event(event: anyio.Event) -> None:
    event.set()


def _waiters_for_this_loop() -> tuple[Callable[[], Any], Callable[[Any], Any]]:
    """How a ready env waits for its action: a bare future on asyncio (a third of an ``anyio.Event``'s
    cost, paid at every step), else an ``anyio.Event``. Returns ``(new_waiter, wake)``."""
    if _on_asyncio():
        return asyncio.get_running_loop().create_future, _wake_future
    return anyio.Event, _set_event


def _on_asyncio() -> bool:
    """Whether the calling task runs on asyncio (uvloop included) rather than trio, without sniffio (not a
    dependency): a trio task is recognised first, since trio in guest mode runs on top of an asyncio loop."""
    trio = sys.modules.get("trio")  # trio's tasks can only run if trio was imported
    if trio is not None:
        try:
            trio.lowlevel.current_task()
            return False
        except RuntimeError:  # not in a trio task
            pass
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def as_numpy(value: torch.Tensor, n: int) -> Any:
    if not isinstance(value, torch.Tensor) or not value.shape or value.shape[0] != n:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"a policy output has shape {shape}; it must start with the batch of {n} envs")
    value = value.detach().cpu()
    try:
        return value.numpy()
    except TypeError:  # bfloat16: kept as a tensor
        return value


def output_dtype(value: Any) -> torch.dtype:
    return value.dtype if isinstance(value, torch.Tensor) else torch.from_numpy(value[:0]).dtype
