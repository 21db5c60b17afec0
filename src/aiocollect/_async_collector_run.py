"""The engine of ``AsyncEnvCollector``: a task per env and one policy task, on the collector's loop.

Each env task stages its observation, queues itself as ready and waits for its action; the policy task
takes the ready envs in one batch (once ``min_batch`` of them wait, or the oldest has waited ``max_wait``),
calls the policy once, hands each env its action and a row of the batch being filled, and goes on. The env
task steps its env, writes the rest of its row and queues itself again. Completed batches wait, in order,
for the consumer; at most ``1 + prefetch`` batches are in flight (then the envs wait: backpressure).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import numpy as np
import torch

from ._async_collector_envs import EnvSet
from ._async_collector_frames import FrameBatch, Layout
from ._async_collector_policy import ActionCodec, BatchPolicy
from ._envs._spaces import LeafSpec, NestedKey
from ._events import WorkerFailed

__all__ = ["Engine", "EngineConfig", "Signal"]


class Signal:
    """Wakes the tasks waiting on it (no state: a waiter checks its condition first, then waits)."""

    __slots__ = ("_event",)

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


class Engine:
    """The running state of one entered ``AsyncEnvCollector`` (see the module docstring)."""

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
    ) -> None:
        n = len(envs)
        self.envs = envs
        self.spec = spec
        self.policy = policy
        self.codec = ActionCodec(spec.action_space)
        self.config = config
        self.hub = hub
        self.stage = spec.staging(n)
        self.traj_ids = np.arange(n, dtype=np.int64)
        self.next_traj = n
        self.env_frames = [0] * n
        self.dropped: set[int] = set()
        self.version = 0
        self.batch_sizes: list[int] = []  # of the policy calls (benchmarks read it)
        self.error: BaseException | None = None
        # hand-offs between the env tasks and the policy task
        self._ready: list[int] = []
        self._first_ready = 0.0
        self._actions: list[Any] = [None] * n  # an env's action while it steps (None: not stepping)
        self._versions = np.zeros(n, dtype=np.int64)  # the policy version of each env's action
        self._out_stage: list[Any] = []  # each env's policy outputs, per key
        self._episodes: list[tuple[int, float, int]] = []  # of the batch being filled
        self._events: list[Any] = [None] * n
        self._no_more_actions = False
        self._in_flight = 0  # envs with an action, stepping
        self._acting = False  # a policy call in flight
        self._layout: Layout | None = None
        self._filling: FrameBatch | None = None
        self.complete: deque[FrameBatch] = deque()  # ready for the consumer, in order
        self._completed = 0  # frames written
        self.delivered = 0  # frames delivered
        self.policy_signal = Signal()
        self.consumer_signal = Signal()
        self.idle_signal = Signal()
        self.policy_lock = anyio.Lock()
        self.is_paused = is_paused
        self._resumed = resumed
        self.closed_envs: set[int] = set()
        self._scope: anyio.CancelScope | None = None
        self._ended = anyio.Event()

    # -- lifecycle --------------------------------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run every env task and the policy task until cancelled or failed."""
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                async with anyio.create_task_group() as tg:
                    for i, env in enumerate(self.envs):
                        tg.start_soon(self._env_task, i, env)
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
    async def _env_task(self, i: int, env: Any) -> None:
        try:
            await self._env_loop(i, env)
        except Exception as exc:
            if not self.config.drop_failed_envs:
                self._fail(exc)
                return
            self._drop(i, exc)
            await self.close_env(i)

    async def close_env(self, i: int) -> None:
        """Close env ``i`` (once), shielded; an error closing it is dropped (it failed, or we are ending)."""
        if i in self.closed_envs:
            return
        self.closed_envs.add(i)
        with anyio.CancelScope(shield=True), anyio.move_on_after(10):
            try:
                await self.envs[i].close()
            except Exception:  # closing is best effort: the env's own error was reported
                pass

    def _drop(self, i: int, exc: Exception) -> None:
        stepping, self._actions[i] = self._actions[i] is not None, None
        self.dropped.add(i)
        self.hub.publish(WorkerFailed(i, f"{type(exc).__name__}: {exc}"))
        if stepping:  # it failed mid-step: that frame is not collected (another env's step makes it up)
            self._in_flight -= 1
        if len(self.dropped) == len(self.envs):
            error = RuntimeError(
                f"every env was dropped (on_env_error='drop'); the last one, env {i}, raised "
                f"{type(exc).__name__}: {exc}"
            )
            error.__cause__ = exc
            self._fail(error)
        self.policy_signal.set()  # fewer envs to wait for

    async def _env_loop(self, i: int, env: Any) -> None:  # the hot loop, in one piece
        seed = None if self.config.seed is None else self.config.seed + i
        obs, _ = await env.reset(seed=seed)
        stage = self.stage
        single = stage[0] if len(stage) == 1 else None
        arrays = self.spec.arrays
        ready = self._ready
        actions = self._actions
        events = self._events
        policy_signal = self.policy_signal
        min_batch = self.config.min_batch
        max_len = self.config.max_frames_per_traj
        current_time = anyio.current_time
        Event = anyio.Event
        ret, length = 0.0, 0
        while not self._no_more_actions:
            if single is not None:
                single[i] = obs
            else:
                for slot, value in zip(stage, arrays(obs), strict=True):
                    slot[i] = value
            event = events[i] = Event()
            ready.append(i)
            if len(ready) == 1:
                self._first_ready = current_time()
                policy_signal.set()
            elif len(ready) >= min_batch:
                policy_signal.set()
            await event.wait()
            action = actions[i]
            if action is _END:  # the budget is spent
                return
            obs, reward, terminated, truncated, _ = await env.step(action)
            actions[i] = None
            self._in_flight -= 1
            length += 1
            ret += reward
            done = terminated or truncated
            if max_len is not None and length >= max_len and not done:
                truncated = done = True
            self._write(i, obs, reward, terminated, truncated)
            if done:
                self._episodes.append((i, ret, length))
                ret, length = 0.0, 0
                self.traj_ids[i] = self.next_traj
                self.next_traj += 1
                obs, _ = await env.reset()

    def _write(self, i: int, next_obs: Any, reward: Any, terminated: Any, truncated: Any) -> None:
        """Write env ``i``'s step as the next row of the batch being filled."""
        batch = self._filling
        if batch is None:
            assert self._layout is not None
            batch = self._filling = FrameBatch(self._layout, self.config.frames_per_batch)
            self._episodes = batch.episodes
        row = batch.filled
        if len(batch.obs) == 1:
            slot, next_slot = batch.obs[0]
            slot[row] = self.stage[0][i]
            next_slot[row] = next_obs
        else:
            for (slot, next_slot), staged, value in zip(
                batch.obs, self.stage, self.spec.arrays(next_obs), strict=True
            ):
                slot[row] = staged[i]
                next_slot[row] = value
        for slot, staged in zip(batch.outputs, self._out_stage, strict=True):
            slot[row] = staged[i]
        batch.reward[row] = reward
        batch.terminated[row] = terminated
        batch.truncated[row] = truncated
        batch.traj_ids[row] = self.traj_ids[i]
        batch.env_ids[row] = i
        version = self._versions[i]
        if batch.version is not None:
            batch.version[row] = version
        batch.versions.add(version)
        self.env_frames[i] += 1
        self._completed += 1
        batch.filled = row + 1
        if row + 1 == batch.size:
            self._filling = None
            self._episodes = []
            self.complete.append(batch)
            self.consumer_signal.set()
            self.policy_signal.set()
        if self.is_paused() and self.idle:
            self.idle_signal.set()

    # -- the policy task --------------------------------------------------------------------------
    async def _policy_task(self) -> None:
        try:
            while True:
                n = await self._next_batch_size()
                if n == 0:
                    self._end_actions()
                    return
                await self._act(n)
        except Exception as exc:
            self._fail(exc)

    def _end_actions(self) -> None:
        """The budget is collected: the waiting envs stop, and so do the others after their step."""
        self._no_more_actions = True
        for i in self._ready:
            self._actions[i] = _END
            self._events[i].set()
        self._ready.clear()

    async def _next_batch_size(self) -> int:
        """Wait until a batch should run; how many ready envs it takes (0: the budget is collected)."""
        config = self.config
        cap = (1 + config.prefetch) * config.frames_per_batch
        while True:
            if 0 < config.target <= self._completed:
                return 0
            room = cap - (self._completed - self.delivered) - self._in_flight
            if config.target > 0:
                room = min(room, config.target - self._completed - self._in_flight)
            if self.is_paused():
                await self._resumed()
                continue
            waiting = len(self._ready)
            if room > 0 and waiting:
                need = min(config.min_batch, len(self.envs) - len(self.dropped), room)
                late = self._first_ready + config.max_wait - anyio.current_time()
                if waiting >= need or late <= 0:
                    return min(waiting, room)
                with anyio.move_on_after(late):
                    await self.policy_signal.wait()
                continue
            await self.policy_signal.wait()

    async def _act(self, n: int) -> None:
        """One policy call on the first ``n`` ready envs, and their actions handed out."""
        ids = self._ready[:n]
        del self._ready[:n]
        if self._ready:
            self._first_ready = anyio.current_time()
        idx = np.asarray(ids, dtype=np.int64)
        self._acting = True
        try:
            async with self.policy_lock:
                version = self.version
                obs = {
                    key: torch.from_numpy(slot[idx])
                    for key, slot in zip(self.spec.obs_keys, self.stage, strict=True)
                }
                out = await self.policy(obs, n)
        finally:
            self._acting = False
        self.batch_sizes.append(n)
        outputs = {key: _as_numpy(value, n) for key, value in out.items()}
        if self._layout is None:
            self._layout = self._make_layout(outputs)
            self._out_stage = [_zeros(len(self.envs), value) for value in outputs.values()]
        for staged, value in zip(self._out_stage, outputs.values(), strict=True):
            staged[idx] = value.reshape((n, *staged.shape[1:]))
        self._versions[idx] = version
        env_actions = self.codec.actions(out, n)
        actions, events = self._actions, self._events
        self._in_flight += n
        for j, i in enumerate(ids):
            actions[i] = env_actions[j]
            events[i].set()

    def _make_layout(self, outputs: dict[NestedKey, Any]) -> Layout:
        specs = {key: LeafSpec(tuple(value.shape[1:]), _dtype(value)) for key, value in outputs.items()}
        return Layout(self.spec.obs_specs, specs, track_policy_version=self.config.track_policy_version)


_END = object()  # the action of an env that is to stop


def _zeros(n: int, like: Any) -> Any:
    if isinstance(like, torch.Tensor):
        return torch.zeros((n, *like.shape[1:]), dtype=like.dtype)
    return np.zeros((n, *like.shape[1:]), like.dtype)


def _as_numpy(value: torch.Tensor, n: int) -> Any:
    if not isinstance(value, torch.Tensor) or not value.shape or value.shape[0] != n:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"a policy output has shape {shape}; it must start with the batch of {n} envs")
    value = value.detach().cpu()
    try:
        return value.numpy()
    except TypeError:  # bfloat16: kept as a tensor
        return value


def _dtype(value: Any) -> torch.dtype:
    return value.dtype if isinstance(value, torch.Tensor) else torch.from_numpy(value[:0]).dtype
