"""The fused central-inference engine of ``AsyncEnvCollector``: when every env is a ``ProcessVectorEnv`` (or
its ``split()`` parts) and the policy is a torch policy, ONE thread drives the workers' doorbells, writes
their frames and runs the policy; the event loop only receives finished batches.

``Engine`` (``_run.py``) steps each env in a task of the loop and hands each policy call to the policy
thread: per call of 64 envs that is two thread hand-offs, a doorbell awaited through the loop and the
tasks' bookkeeping, 300 to 550 µs of the trainer's CPU, and the loop and the policy thread take turns at
the GIL around every torch op (docs/async-envs.md, "Central inference"). Here the driver thread waits in
``poll`` on the workers' sockets and a wake-up pipe, and for the units that are ready (once ``min_batch``
sub-envs wait, or the oldest has waited ``max_wait``) it gathers their observations from the shared
slots, runs the policy, writes the actions and rings them; a unit's reply writes its frames (block copies
from its slots into the batch being filled). The loop hears from it once per completed batch.

Everything else stays the collector's: the batch lock, ``pause()`` (no call starts while paused; the
thread parks until a loop task sees the collector resumed and rings it), weight loads and other work "in
the policy thread" (queued to the driver and run between two calls), ``update_weights``' version (no call
while the loop holds :attr:`FusedEngine.policy_lock`), errors (a worker's error with its type and
traceback, a dead worker's ``WorkerDiedError``; ``on_env_error="drop"`` drops its unit), the frame budget,
backpressure (``1 + prefetch`` batches ahead), ``set_seed``/``reset``/``load_state_dict`` (a new engine
over the same envs, whose thread first reads the replies its predecessor left owed). The frames are those
``Engine`` writes for the same steps (tests/test_fused.py compares them bit for bit).
"""

from __future__ import annotations

import os
import select
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from time import perf_counter
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import numpy as np
import torch

from .._envs._spaces import LeafSpec, NestedKey
from .._events import WorkerFailed
from .._procenv._driven import Unit, read_reply, release
from .._timesplit import SplitClock
from .._torch_settings import TorchSettings
from ._envset import EnvSet
from ._frames import FrameBatch, Layout, PolicyCall
from ._policy import ActionCodec, BatchPolicy
from ._policy_thread import _loop_wake
from ._run import EngineConfig, Signal, _as_numpy, _dtype

__all__ = ["FusedEngine"]


class _Poller:
    """The driver's wait on its file descriptors, each with its data: ``epoll`` (a timeout in seconds,
    registrations kept in the kernel), else ``poll``."""

    def __init__(self) -> None:
        self._epoll = select.epoll() if hasattr(select, "epoll") else None
        self._poll = None if self._epoll is not None else select.poll()
        self._data: dict[int, Any] = {}

    def add(self, fd: int, data: Any) -> None:
        if self._epoll is not None:
            self._epoll.register(fd, select.EPOLLIN)
        else:
            assert self._poll is not None
            self._poll.register(fd, select.POLLIN)
        self._data[fd] = data

    def remove(self, fd: int) -> None:
        if self._data.pop(fd, _GONE) is _GONE:
            return
        if self._epoll is not None:
            self._epoll.unregister(fd)
        else:
            assert self._poll is not None
            self._poll.unregister(fd)

    def wait(self, timeout: float | None) -> list[Any]:
        """The data of the descriptors that are readable (``timeout``: seconds, ``None`` for ever)."""
        data = self._data
        if self._epoll is not None:
            events = self._epoll.poll(-1 if timeout is None else max(0.0, timeout))
        else:
            assert self._poll is not None
            events = self._poll.poll(None if timeout is None else max(0, int(timeout * 1000) + 1))
        return [data[fd] for fd, _ in events if fd in data]

    def close(self) -> None:
        if self._epoll is not None:
            self._epoll.close()
        self._data.clear()


_GONE = object()


class _Halted(Exception):
    """The driver was asked to stop (inside a wait)."""


class _Hold:
    """``policy_lock`` of the fused engine: while the loop holds it no policy call starts (a weight load
    and its new version happen between two calls), as ``Engine``'s lock around its calls."""

    def __init__(self, engine: FusedEngine) -> None:
        self._engine = engine
        self._lock = anyio.Lock(fast_acquire=True)

    async def __aenter__(self) -> None:
        await self._lock.acquire()
        self._engine.held += 1

    async def __aexit__(self, *exc: object) -> None:
        self._engine.held -= 1
        self._lock.release()
        self._engine.ring()


class FusedEngine:
    """The running state of an ``AsyncEnvCollector`` whose envs are process envs, driven by one thread (see
    the module docstring). It has ``Engine``'s interface for the collector and its checkpoints."""

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
        restarts: Any = None,
    ) -> None:
        if restarts is not None:
            raise ValueError("the fused engine has no env restarts (restart= runs the engine on the loop)")
        n = spec.rows
        self.rows, self.envs, self.spec, self.policy = n, envs, spec, policy
        self.config, self.hub = config, hub
        self.restarts = None
        self.codec = ActionCodec(spec.action_space)
        self.traj_ids = np.arange(n, dtype=np.int64)
        self.next_traj = n
        self.episodes = None  # seeded groups need single envs (refused with vector envs)
        self._frame_counts = np.zeros(n, np.int64)
        self.dropped: set[int] = set()
        self.version = 0
        self.batch_sizes: deque[int] = deque(maxlen=10_000)
        self.clock = SplitClock()
        self.error: BaseException | None = None
        self.complete: deque[FrameBatch] = deque()
        self.delivered = 0
        self.policy_signal = Signal()  # (set by the checkpoints' pause hook; nothing waits on it here)
        self.consumer_signal = Signal()
        self.idle_signal = Signal()
        self.policy_lock = _Hold(self)
        self.held = 0  # the loop holds policy_lock
        self.is_paused = is_paused
        self._resumed = resumed
        self.closed_envs: set[int] = set()
        self._ready: list[int] = []  # (Engine's: the rows waiting; the checkpoints read it for envs=True)
        # the driver's state
        self._units: list[Unit] = []
        self._queue: deque[Unit] = deque()  # ready units, in the order they became ready
        self._queued_rows = 0
        self._first_ready = 0.0
        self._in_flight = 0
        self._acting = False
        self._next_action = 0
        self._calls: deque[PolicyCall] = deque()
        self._layout: Layout | None = None
        self._filling: FrameBatch | None = None
        self._batches_completed = 0
        self._ret = np.zeros(n)
        self._iota = np.arange(max(spec.widths), dtype=np.int64)  # a unit's rows, numbered from 0
        self._len = np.zeros(n, np.int64)
        self._halt = False
        self._jobs: deque[tuple[Callable[[], Any], list[Any], anyio.Event]] = deque()
        self._jobs_lock = threading.Lock()
        self._accepting = False  # the driver runs jobs (else they go to the policy's own thread)
        self._parked = False
        self._wake_r = self._wake_w = -1
        self._poller = _Poller()
        self._call_soon: Callable[[Callable[[], object]], object] | None = None
        self._requests: Any = None  # the driver's requests to the loop (a memory object stream)
        self._scope: anyio.CancelScope | None = None
        self._ended = anyio.Event()
        self._driver_done = anyio.Event()

    # -- lifecycle (the loop) ---------------------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Claim the envs' workers and run the driver thread until it ends, is stopped or fails."""
        thread: threading.Thread | None = None
        send, receive = anyio.create_memory_object_stream[Any](float("inf"))
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                self._call_soon = _loop_wake()
                self._requests = send
                self._units = []
                for u, (env, first) in enumerate(zip(self.envs, self.spec.firsts, strict=True)):
                    self._units.append(Unit(env, u, first))
                self._wake_r, self._wake_w = os.pipe()
                os.set_blocking(self._wake_w, False)
                self._poller.add(self._wake_r, None)
                for unit in self._units:  # for good: a socket is readable only with a reply owed (or gone)
                    for worker in unit.workers:
                        self._poller.add(worker.sock.fileno(), (unit, worker))
                self.policy.route_calls(self._job)
                thread = threading.Thread(
                    target=self._drive, args=(TorchSettings.capture(),), name="aiocollect-fused", daemon=True
                )
                self._accepting = True
                thread.start()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._serve, receive, tg)
                    task_status.started()
                    await self._driver_done.wait()
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                if thread is not None:
                    self._halt = True
                    self.ring()
                    await self._driver_done.wait()
                    await anyio.to_thread.run_sync(thread.join)  # it has only to return: no thread left
                self.policy.route_calls(None)
                self._poller.close()
                release(self._units)
                for fd in (self._wake_r, self._wake_w):
                    if fd >= 0:
                        os.close(fd)
                self._wake_r = self._wake_w = -1
                send.close()
                receive.close()
                self._ended.set()

    async def stop(self) -> None:
        """Stop the driver (after the policy call in flight) and wait until it has ended."""
        if self._scope is not None:
            self._scope.cancel()
            with anyio.CancelScope(shield=True):
                await self._ended.wait()

    async def _serve(self, receive: Any, tg: anyio.abc.TaskGroup) -> None:
        """The driver's requests that need the loop: wait for the collector to resume, close a dropped
        env."""
        async for kind, arg in receive:
            if kind == "park":
                tg.start_soon(self._park)
            else:
                tg.start_soon(self.close_env, arg)

    async def _park(self) -> None:
        await self._resumed()
        self._parked = False
        self.ring()

    def ring(self) -> None:
        """Wake the driver (from any thread)."""
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"\0")
            except (BlockingIOError, OSError):  # full: it is rung already (closed: it has ended)
                pass

    def _on_loop(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` on the loop (from the driver), never waiting for it."""
        call_soon = self._call_soon
        assert call_soon is not None
        try:
            call_soon(fn)
        except RuntimeError:  # the loop has closed: nobody waits any more
            pass

    def _request(self, kind: str, arg: Any = None) -> None:
        send = self._requests
        self._on_loop(lambda: send.send_nowait((kind, arg)))

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

    # -- what the collector reads -----------------------------------------------------------------
    @property
    def env_frames(self) -> list[int]:
        """Frames written per row (env id)."""
        return self._frame_counts.tolist()

    @env_frames.setter
    def env_frames(self, counts: list[int]) -> None:  # a restarted engine goes on counting
        self._frame_counts = np.array(counts, np.int64)

    @property
    def idle(self) -> bool:
        return not self._in_flight and not self._acting

    @property
    def exhausted(self) -> bool:
        return 0 < self.config.target <= self.delivered

    @property
    def completed(self) -> int:
        """Frames written (into complete batches and the one being filled)."""
        filling = self._filling
        done = self._batches_completed * self.config.frames_per_batch
        return done if filling is None else done + filling.filled

    def take_batch(self) -> FrameBatch:
        """The next complete batch; its frames no longer count against the frames in flight."""
        batch = self.complete.popleft()
        self.delivered += batch.size
        self.ring()  # room for more steps
        return batch

    def new_version(self) -> int:
        self.version += 1
        return self.version

    def restart_counts(self) -> list[int]:
        return [0] * self.rows

    def reset_seed(self, first: int, u: int) -> int | None:
        return None if self.config.seed is None else self.config.seed + first

    async def _job(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` in the driver thread between two policy calls (the policy's ``in_thread``); once the
        driver has ended, in the policy's own thread."""
        done = anyio.Event()
        box: list[Any] = []
        with self._jobs_lock:
            queued = self._accepting
            if queued:
                self._jobs.append((fn, box, done))
        if not queued:
            return await self.policy.in_own_thread(fn)
        self.ring()
        try:
            await done.wait()
        except BaseException:
            with anyio.CancelScope(shield=True):  # fn's inputs are never reused under it
                await done.wait()
            raise
        ok, value = box
        if not ok:
            raise value
        return value

    # -- the driver thread ------------------------------------------------------------------------
    def _drive(self, settings: TorchSettings) -> None:
        settings.apply()
        try:
            self._start()
            self._loop()
        except _Halted:
            pass
        except BaseException as exc:
            self._fail(exc)
        finally:
            with self._jobs_lock:
                self._accepting = False
            self._run_jobs()
            self._in_flight = 0  # the steps in flight give no frame any more (their replies stay owed)
            self._acting = False
            self._on_loop(self._ended_on_loop)

    def _ended_on_loop(self) -> None:
        self.clock.done()
        self.idle_signal.set()
        self.consumer_signal.set()
        self._driver_done.set()

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc

    def _run_jobs(self) -> None:
        while self._jobs:
            fn, box, done = self._jobs.popleft()
            try:
                box[:] = [True, fn()]
            except BaseException as exc:
                box[:] = [False, exc]
            del fn
            self._on_loop(done.set)

    def _start(self) -> None:
        """Read the replies a stopped engine (or a cancelled call) left owed, then reset every unit."""
        for unit in self._units:
            unit.pending, unit.stepping = sum(1 for w in unit.workers if w.owed), False
        self._wait_units()
        for unit in self._units:
            unit.write_seed(self.reset_seed(unit.first, unit.index))
            try:
                unit.ring(b"R")
            except Exception as exc:
                self._unit_failed(unit, exc)
        self._wait_units()
        for unit in self._units:
            self._queue_unit(unit)

    def _wait_units(self) -> None:
        """Until no unit awaits a reply (before the first step)."""
        while any(u.pending for u in self._units if not u.dead):
            self._wait(None, queue=False)

    def _loop(self) -> None:
        config = self.config
        cap = (1 + config.prefetch) * config.frames_per_batch
        target, clock = config.target, self.clock
        while True:
            if self._halt:
                return
            if self._jobs:
                self._run_jobs()
                continue
            completed = self.completed
            if 0 < target <= completed:
                return
            room = cap - (completed - self.delivered) - self._in_flight
            if target > 0:
                room = min(room, target - completed - self._in_flight)
            timeout: float | None = None
            waiting = self._queued_rows
            if self.is_paused():
                if not self._parked:
                    self._parked = True
                    self._request("park")
                room = 0
            elif self.held:
                room = 0
            elif room > 0 and waiting:
                need = min(config.min_batch, self.rows - len(self.dropped), room)
                late = self._first_ready + config.max_wait - perf_counter()
                if waiting >= need or late <= 0:
                    self._act(min(waiting, room))
                    continue
                timeout = late
            if room > 0:
                start = perf_counter()
                self._wait(timeout)
                clock.env += perf_counter() - start
            else:
                with clock.waiting():
                    self._wait(timeout)

    def _wait(self, timeout: float | None, *, queue: bool = True) -> None:
        """Wait for replies (or a ring, or ``timeout`` s) and take them: a unit whose workers have all
        replied writes its frames and queues for the policy (``queue``)."""
        for data in self._poller.wait(timeout):
            if data is None:
                os.read(self._wake_r, 4096)
                if self._halt:
                    raise _Halted
                continue
            unit, worker = data
            if unit.dead:
                continue
            try:
                if read_reply(worker) is None:
                    continue
            except Exception as exc:
                self._unit_failed(unit, unit.fail(worker, exc))
                continue
            if worker.owed:
                continue
            unit.pending -= 1
            if unit.pending:
                continue
            if unit.stepping:
                self._frames(unit)
            if queue:
                self._queue_unit(unit)

    def _queue_unit(self, unit: Unit) -> None:
        if unit.dead:
            return
        if not self._queue:
            self._first_ready = perf_counter()
        self._queue.append(unit)
        self._queued_rows += unit.width

    def _unit_failed(self, unit: Unit, exc: BaseException) -> None:
        """A worker of ``unit`` failed: the collector's error, or (``on_env_error="drop"``) the unit's."""
        unit.dead = True
        if not self.config.drop_failed_envs:
            raise exc
        for worker in unit.workers:  # its sockets may hang up from now on; its other replies stay owed
            self._poller.remove(worker.sock.fileno())
        if unit.stepping and unit.pending:
            self._in_flight -= unit.width
        unit.pending, unit.stepping = 0, False
        if unit in self._queue:
            self._queue.remove(unit)
            self._queued_rows -= unit.width
        first, stop = unit.first, unit.first + unit.width
        message = f"{type(exc).__name__}: {exc} (vector env {unit.index}: its sub-envs, env ids {first} to "
        message += f"{stop - 1}, are dropped)"
        self.dropped.update(range(first, stop))
        hub = self.hub
        self._on_loop(lambda: [hub.publish(WorkerFailed(i, message)) for i in range(first, stop)])
        self._request("close", unit.index)
        self._idle_maybe()
        if len(self.dropped) == self.rows:
            error = RuntimeError(
                f"every env was dropped (on_env_error='drop'); the last one, env {first}, raised "
                f"{type(exc).__name__}: {exc}"
            )
            error.__cause__ = exc
            raise error

    def _idle_maybe(self) -> None:
        """Tell a ``pause()`` (or a weight load) waiting for the steps in flight that they are done."""
        if self.idle and (self._parked or self.held or self.is_paused()):
            self._on_loop(self.idle_signal.set)

    # -- a policy call ----------------------------------------------------------------------------
    def _act(self, n: int) -> None:
        """One policy call on the first ready units holding ``n`` sub-envs (a unit is never split), its
        actions written into their slots and the units rung."""
        units: list[Unit] = []
        taken = 0
        queue = self._queue
        while taken < n:
            unit = queue.popleft()
            units.append(unit)
            taken += unit.width
        self._queued_rows -= taken
        if queue:
            self._first_ready = perf_counter()
        keys = self.spec.obs_keys
        if len(units) == 1:
            unit = units[0]
            obs = [unit.obs(key).copy() for key in keys]
            idx = np.arange(unit.first, unit.first + unit.width)
        else:
            obs = [np.concatenate([u.obs(key) for u in units]) for key in keys]
            idx = np.concatenate([np.arange(u.first, u.first + u.width) for u in units])
        version = self.version
        tensors = {key: torch.from_numpy(a) for key, a in zip(keys, obs, strict=True)}
        self._acting = True
        start = perf_counter()
        try:
            out = self.policy._call_torch(tensors, taken)
        finally:
            self._acting = False
            self.clock.policy += perf_counter() - start
        self.batch_sizes.append(taken)
        self.clock.frames += taken
        outputs = {key: _as_numpy(value, taken) for key, value in out.items()}
        if self._layout is None:
            self._layout = self._make_layout(outputs)
        elif list(outputs) != self._layout.out_keys:
            raise KeyError(f"the policy wrote {list(outputs)}, and {self._layout.out_keys} at its first call")
        arrays = self.codec.arrays(outputs, taken)
        base = self._next_action
        self._calls.append(PolicyCall(obs, list(outputs.values()), idx, self.traj_ids[idx], version, base))
        self._in_flight += taken
        j = 0
        for unit in units:
            unit.write_actions(arrays, j)
            unit.action_no = base + j
            j += unit.width
        self._next_action = base + taken
        for unit in units:
            try:
                unit.ring(b"S")
            except Exception as exc:
                self._unit_failed(unit, exc)

    def _make_layout(self, outputs: dict[NestedKey, Any]) -> Layout:
        specs = {key: LeafSpec(tuple(value.shape[1:]), _dtype(value)) for key, value in outputs.items()}
        return Layout(self.spec.obs_specs, specs, track_policy_version=self.config.track_policy_version)

    # -- frames -----------------------------------------------------------------------------------
    def _frames(self, unit: Unit) -> None:
        """Append the frames of ``unit``'s step (block copies from its slots), count its episodes and
        give its ended sub-envs new trajectory ids."""
        first, width = unit.first, unit.width
        stop = first + width
        reward, terminated, truncated, ended = unit.flags()
        done = terminated | truncated
        ends = done.nonzero()[0].tolist() if np.count_nonzero(done) else []
        keys = self.spec.obs_keys
        blocks = [unit.obs(key) for key in keys]
        finals = [unit.final(key) for key in keys] if np.count_nonzero(ended) else None
        ret, length = self._ret[first:stop], self._len[first:stop]
        ret += reward
        length += 1
        config = self.config
        number = unit.action_no
        off = 0
        while off < width:
            if 0 < config.target <= self._batches_completed * config.frames_per_batch:
                break  # the budget is collected: the rest of the step is no frame
            batch = self._filling
            if batch is None:
                assert self._layout is not None
                batch = self._filling = FrameBatch(self._layout, config.frames_per_batch, blocks=True)
            row = batch.filled
            m = min(width - off, batch.size - row)
            end, stop_row = off + m, row + m
            for slot, block in zip(batch.next_obs, blocks, strict=True):
                slot[row:stop_row] = block[off:end]
            if finals is not None:
                rows = ended[off:end].nonzero()[0]
                if len(rows):
                    for slot, final in zip(batch.next_obs, finals, strict=True):
                        slot[row + rows] = final[off + rows]
            np.add(self._iota[off:end], number, out=batch.source[row:stop_row])
            batch.reward[row:stop_row] = reward[off:end]
            batch.terminated[row:stop_row] = terminated[off:end]
            batch.truncated[row:stop_row] = truncated[off:end]
            batch.filled = stop_row
            for k in ends:
                if off <= k < end:
                    batch.episodes.append((first + k, float(ret[k]), int(length[k])))
            if stop_row == batch.size:
                self._complete(batch)
            off = end
        if off:
            self._frame_counts[first : first + off] += 1
        if ends:
            self.traj_ids[first + np.asarray(ends)] = np.arange(self.next_traj, self.next_traj + len(ends))
            self.next_traj += len(ends)
            ret[done] = 0.0
            length[done] = 0
        unit.stepping = False
        self._in_flight -= width
        self._idle_maybe()

    def _complete(self, batch: FrameBatch) -> None:
        """``batch`` is full: find its frames' calls, free the calls no frame can come from any more, and
        hand it to the loop."""
        self._filling = None
        self._batches_completed += 1
        batch.resolve(list(self._calls))
        low = self._next_action
        for unit in self._units:  # (the unit being written is still stepping: its rest may need its call)
            if unit.stepping and unit.action_no < low:
                low = unit.action_no
        calls = self._calls
        while calls and calls[0].base + calls[0].n <= low:
            calls.popleft()
        self.complete.append(batch)
        self._on_loop(self.consumer_signal.set)
