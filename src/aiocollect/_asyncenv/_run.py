"""The engine's steps on the collector's loop (``LoopSteps``): a task per env and one policy task.

Each env task stages its observation, queues itself as ready and waits for its action; the policy task
takes the ready envs in one batch (once ``min_batch`` of them wait, or the oldest has waited ``max_wait``),
calls the policy once, hands each env its action (and the action's number), and goes on. The env task steps
its env, appends the frame to the batch being filled (its next observation and the step's values, with the
action's number, from which the batch finds the call's observation and outputs once it is complete) and
queues itself again. Completed batches wait, in order, for the consumer; at most ``1 + prefetch`` batches are
in flight (then the envs wait: backpressure). A vector env's task does the same for its ``N`` rows at once
(its step's values as blocks of rows: ``EnvSet``, ``_envset.py``).

The step path is the hot one (docs/async-envs.md, "Performance"): per step an env task allocates one future
and no tuple or dict that outlives the step (an episode's end adds one tuple), and it does its bookkeeping
in one coroutine frame.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import numpy as np
import torch

from .._envs._contract import contract_error
from .._envs._spaces import NestedKey
from .._procenv._doorbell import running_asyncio_loop
from ._engine import Engine
from ._restarts import truncate_last_frames

__all__ = ["DISPATCH_CHUNK", "END", "LoopSteps"]

END = object()  # the action of an env that is to stop
IN_VECTOR = object()  # the action slot of a vector env's rows after its first one, while it steps


class LoopSteps:
    """The engine's :class:`~._engine.Stepper` on the loop (see the module docstring)."""

    blocks = False

    def __init__(self, engine: Engine) -> None:
        e = self.engine = engine
        n, spec = e.rows, e.spec
        self.stage = spec.staging(n)  # each row's observation, for the next policy call
        self._restarting = [False] * n if e.episodes is None else e.episodes.restarting
        # hand-offs between the env tasks and the policy task
        self.ready: list[int] = []  # rows (a vector env's all at once)
        # per row: 0 a single env's, N the first of a vector env of N sub-envs, -1 its others
        self._kinds = [0] * n
        # per row: the row after its env's last one (a single env's: the next)
        self._row_stop = list(range(1, n + 1))
        for first, width in zip(spec.firsts, spec.widths, strict=True):
            if width:
                self._kinds[first : first + width] = [width] + [-1] * (width - 1)
                self._row_stop[first : first + width] = [first + width] * width
        self._first_ready = 0.0
        # len(self.ready) at which an env becoming ready wakes the policy task (0: never; it is not waiting
        # for envs): one int compared per step instead of a signal per ready env
        self.wake_at = 1
        self._actions: list[Any] = [None] * n  # a row's action while it steps (None: not stepping)
        self._action_no = [0] * n  # the number of each row's action (see Engine.calls)
        self._waiters: list[Any] = [None] * n  # what each ready env awaits (see _waiters_for_this_loop)
        self._new_waiter: Callable[[], Any] = anyio.Event
        self._wake: Callable[[Any], Any] = _set_event
        self._no_more_actions = False
        self.parked = False  # the policy task waits for the collector to resume
        self._scope: anyio.CancelScope | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._ended = anyio.Event()

    # -- the Stepper ------------------------------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run every env task and the policy task until cancelled or failed."""
        self._new_waiter, self._wake = _waiters_for_this_loop()
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    for u, env in enumerate(self.engine.envs):
                        self._start_env(u, env)
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

    def wake(self) -> None:
        self.engine.policy_signal.set()

    def on_loop(self, fn: Callable[[], object]) -> None:
        fn()

    def oldest_action(self) -> int:
        # a frame still to come is from an env stepping now, or from a call not made yet (or being handed
        # out: next_action is advanced once every env of a call has its action)
        low = self.engine.next_action
        for number, action in zip(self._action_no, self._actions, strict=True):
            if action is not None and action is not END and number < low:
                low = number
        return low

    def _start_env(self, u: int, env: Any) -> None:
        first, width = self.engine.spec.firsts[u], self.engine.spec.widths[u]
        assert self._tg is not None
        if width:
            self._tg.start_soon(self._vector_task, u, env, first, width)
        else:
            self._tg.start_soon(self._env_task, first, env, u)

    def _fail(self, exc: BaseException) -> None:
        e = self.engine
        if e.error is None:
            e.error = exc
        if self._scope is not None:
            self._scope.cancel()
        e.consumer_signal.set()
        e.policy_signal.set()  # a capture waiting for the envs
        e.idle_signal.set()  # a pause() waiting for the steps in flight

    def _freed(self, rows: int) -> None:
        """``rows`` rows that had an action step no more (room for other envs' steps)."""
        e = self.engine
        e.in_flight -= rows
        e.policy_signal.set()
        if e.idle:
            e.idle_signal.set()  # a pause() waits for the steps in flight

    # -- env tasks --------------------------------------------------------------------------------
    def _stage_rows(self, i: int) -> tuple[list[Any], Any]:
        """Env ``i``'s row of each staging array, as a view (assigning into one costs half of an index
        assignment; a 1-D array's row is a 1-element slice: its item would be a copy), and the row alone
        when there is one array."""
        rows = [slot[i] if slot.ndim > 1 else slot[i : i + 1] for slot in self.stage]
        return rows, rows[0] if len(rows) == 1 else None

    async def _env_task(self, i: int, env: Any, u: int) -> None:  # env u, row i: the hot loop, in one piece
        e = self.engine
        try:
            obs, _ = await env.reset(seed=e.reset_seed(i, u))
            rows, single = self._stage_rows(i)
            arrays = e.spec.arrays
            ready = self.ready
            actions, action_no, waiters = self._actions, self._action_no, self._waiters
            new_waiter = self._new_waiter
            is_future = new_waiter is not anyio.Event
            policy_signal = e.policy_signal
            idle_signal = e.idle_signal
            env_frames = e.env_frames
            max_len = e.options.max_frames_per_traj
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
                if waiting == self.wake_at:
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
                e.in_flight -= 1
                length += 1
                ret += reward
                done = terminated or truncated
                if max_len is not None and length >= max_len and not done:
                    truncated = done = True
                # the frame: its next observation copied into the batch, its step's values appended; the
                # rest is gathered from its policy call when the batch completes
                batch = e.filling
                if batch is None:
                    batch = e.new_batch()
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
                    e.traj_ids[i] = e.next_traj
                    e.next_traj += 1
                if row == batch.size:
                    e.finish(batch)
                if idle_signal._event is not None and e.idle:  # a pause() waits for the steps in flight
                    idle_signal.set()
                if done:
                    obs, _ = await env.reset(seed=None if e.episodes is None else e.episodes.advance(i))
        except Exception as exc:
            await self._env_failed(u, exc)

    async def _restart(self, i: int, env: Any) -> tuple[Any, float, int]:
        """Row ``i``'s episode started again from its own seed, under a new trajectory id (its frames so
        far are discarded by the trajectory assembler: a slot's trajectory cut and begun again), instead
        of a step with the action it was handed."""
        e = self.engine
        assert e.episodes is not None
        self._restarting[i] = False
        self._actions[i] = None
        self._freed(1)
        e.traj_ids[i] = e.next_traj
        e.next_traj += 1
        obs, _ = await env.reset(seed=e.episodes.seed(i))
        return obs, 0.0, 0

    async def _vector_task(self, u: int, env: Any, first: int, width: int) -> None:
        """Step vector env ``u`` (rows ``first`` to ``first + width - 1``) until the budget is spent."""
        e = self.engine
        stop = first + width
        rows = range(first, stop)
        try:
            obs, _ = await env.reset(seed=e.reset_seed(first, u))
            blocks = e.spec.blocks(obs, width)
            stage = [slot[first:stop] for slot in self.stage]
            is_future = self._new_waiter is not anyio.Event
            ret = np.zeros(width)
            length = np.zeros(width, np.int64)
            while not self._no_more_actions:
                for view, block in zip(stage, blocks, strict=True):
                    view[...] = block
                waiter = self._waiters[first] = self._new_waiter()
                ready = self.ready
                before = len(ready)
                ready.extend(rows)
                if not before:
                    self._first_ready = anyio.current_time()
                wake_at = self.wake_at
                if wake_at and before < wake_at <= before + width:
                    e.policy_signal.set()
                if is_future:
                    await waiter
                else:
                    await waiter.wait()
                action = self._actions[first]
                if action is END:  # the budget is spent
                    return
                obs, reward, terminated, truncated, info = await env.step(action)
                blocks = e.spec.blocks(obs, width)
                self._vector_frames(first, blocks, (reward, terminated, truncated), info, ret, length)
                if e.idle_signal._event is not None and e.idle:  # a pause() waits for the steps
                    e.idle_signal.set()
        except Exception as exc:
            await self._env_failed(u, exc)

    def _vector_frames(
        self,
        first: int,
        blocks: list[np.ndarray],
        step: tuple[Any, Any, Any],
        info: Any,
        ret: Any,
        length: Any,
    ) -> None:
        """Append a vector step's frames (every value checked before the first is written), then free
        its rows' actions."""
        e, width = self.engine, len(ret)
        column = e.spec.column
        reward = column(step[0], np.float64, width, "reward")
        terminated = column(step[1], np.bool_, width, "terminated")
        truncated = column(step[2], np.bool_, width, "truncated")
        done = terminated | truncated
        nxt = e.spec.final_obs(blocks, done, info) if np.count_nonzero(done) else blocks
        e.append(first, self._action_no[first], nxt, (reward, terminated, truncated), (ret, length))
        # the actions are freed last: a batch completed above may still need their calls
        self._actions[first : first + width] = [None] * width

    async def _env_failed(self, u: int, exc: Exception) -> None:
        """An env task's error: a restart (``restart=``), the collector's end, or (``on_env_error="drop"``)
        that env's."""
        e = self.engine
        if e.restarts is not None:
            self._end_trajectories(u)
            try:
                env = await e.restarts.rebuild(u, exc, e.close_env, e.env_frames)
            except Exception as final:  # not restarted, or the budget is spent
                exc = final
            else:
                e.envs[u] = env
                e.closed_envs.discard(u)
                self._start_env(u, env)
                return
        exc = contract_error(exc, e.envs[u]) or exc  # an env that broke gymnasium's API: named
        if not e.options.drop_failed:
            self._fail(exc)
            return
        first, width = e.spec.firsts[u], e.spec.widths[u]
        self._stop_stepping(first, first + max(width, 1))  # other envs' steps make its frames up
        error = e.drop(u, exc)
        if error is not None:
            self._fail(error)
        e.policy_signal.set()  # fewer envs to wait for
        await e.close_env(u)

    def _stop_stepping(self, first: int, stop: int) -> None:
        """The rows ``first:stop`` (one env's) failed: a step in flight gives no frame."""
        if self._actions[first] is not None:  # mid-step: its frames will not come
            self._actions[first:stop] = [None] * (stop - first)
            self._freed(stop - first)

    def _end_trajectories(self, u: int) -> None:
        """Env ``u`` failed: the action it stepped with gives no frame; the last frame of each of its rows
        in the batch being filled, if not done, is marked truncated; its rows' next frames are new
        trajectories."""
        e = self.engine
        first = e.spec.firsts[u]
        rows = set(range(first, self._row_stop[first]))
        self._stop_stepping(first, first + len(rows))
        for i in rows:
            e.traj_ids[i] = e.next_traj
            e.next_traj += 1
        if e.filling is not None:  # the calls of its frames are among e.calls (see Engine.finish)
            truncate_last_frames(e.filling, list(e.calls), rows)

    # -- the policy task --------------------------------------------------------------------------
    async def _policy_task(self) -> None:
        try:
            while True:
                n = await self._next_batch_size()
                if n == 0:
                    self._end_actions()
                    self.engine.clock.done()
                    return
                await self._act(n)
        except Exception as exc:
            self._fail(exc)

    def _end_actions(self) -> None:
        """The budget is collected: the waiting envs stop, and so do the others after their step."""
        self._no_more_actions = True
        kinds = self._kinds
        for i in self.ready:
            if kinds[i] >= 0:  # a single env, or a vector env's first row (its waiter)
                self._actions[i] = END
                self._wake(self._waiters[i])
        self.ready.clear()

    async def _next_batch_size(self) -> int:
        """Wait until a batch should run; how many ready envs it takes (0: the budget is collected)."""
        e = self.engine
        try:
            while True:
                if e.collected():
                    return 0
                room = e.room()
                if e.is_paused():
                    self.wake_at = 0
                    with e.clock.waiting():
                        await self._park()
                    continue
                waiting = len(self.ready)
                if room > 0 and waiting:
                    need = e.need(room)
                    late = self._first_ready + e.options.max_wait - anyio.current_time()
                    if waiting >= need or late <= 0:
                        return min(waiting, room)
                    self.wake_at = need  # the env that makes it `need` wakes us
                    with anyio.move_on_after(late), e.clock.spent("env"):
                        await e.policy_signal.wait()
                    continue
                # no env waits (the first to be ready wakes us), or no room (a batch taken wakes us)
                self.wake_at = 1 if room > 0 else 0
                with e.clock.spent("env") if room > 0 else e.clock.waiting():
                    await e.policy_signal.wait()
        finally:
            self.wake_at = 0  # acting (or ending): the envs need not wake us

    async def _park(self) -> None:
        """Paused: wait here (no call is in flight) until the collector resumes."""
        self.parked = True
        self.engine.policy_signal.set()  # a capture waiting for the policy task to park
        try:
            await self.engine.resumed()
        finally:
            self.parked = False

    async def _act(self, n: int) -> None:
        """One policy call on the first ``n`` ready envs (more if the ``n``-th is a vector env's sub-env:
        a vector env's rows are never split), and their actions handed out."""
        e = self.engine
        last = self.ready[n - 1]
        n += self._row_stop[last] - last - 1
        ids = self.ready[:n]
        del self.ready[:n]
        if self.ready:
            self._first_ready = anyio.current_time()
        idx = np.asarray(ids, dtype=np.int64)
        obs = [slot[idx] for slot in self.stage]
        e.acting = True
        try:
            async with e.policy_lock:
                version = e.version
                tensors = {key: torch.from_numpy(a) for key, a in zip(e.spec.obs_keys, obs, strict=True)}
                with e.clock.spent("policy"):
                    out = await e.policy(tensors, n)
        finally:
            e.acting = False
        arrays, base = e.called(obs, idx, out, version)
        await self._dispatch(ids, arrays, base)
        e.next_action = base + n

    async def _dispatch(self, ids: list[int], arrays: dict[NestedKey, Any], base: int) -> None:
        """Hand the envs their actions (numbered from ``base``; a vector env's rows in a row, its block of
        actions given to its first) and wake them."""
        n = len(ids)
        codec, kinds = self.engine.codec, self._kinds
        singles = codec.actions(arrays, n) if self.engine.spec.has_single else []
        actions, action_no, waiters, wake = self._actions, self._action_no, self._waiters, self._wake
        futures = self._new_waiter is not anyio.Event  # asyncio: a future set here, no call per env
        j = woken = 0
        while j < n:  # per env, not per row
            if woken and not woken % DISPATCH_CHUNK:
                # let the loop run these envs (and anything else waiting) before waking more: a burst of
                # hundreds of steps at once (and of their sleeps ending together) would hold the loop
                await anyio.lowlevel.checkpoint()
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
            waiter = waiters[i]
            if not futures:
                wake(waiter)
            elif not waiter.done():  # done: its task was cancelled
                waiter.set_result(None)
            woken += 1


#: envs woken per loop iteration after a policy call (see ``LoopSteps._act``)
DISPATCH_CHUNK = 64


def _wake_future(future: asyncio.Future[None]) -> None:
    if not future.done():  # done: its task was cancelled
        future.set_result(None)


def _set_event(event: anyio.Event) -> None:
    event.set()


def _waiters_for_this_loop() -> tuple[Callable[[], Any], Callable[[Any], Any]]:
    """How a ready env waits for its action: a bare future on asyncio (a third of an ``anyio.Event``'s
    cost, paid at every step), else an ``anyio.Event``. Returns ``(new_waiter, wake)``."""
    loop = running_asyncio_loop()
    if loop is not None:
        return loop.create_future, _wake_future
    return anyio.Event, _set_event
