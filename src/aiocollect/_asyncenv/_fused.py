"""The fused central-inference engine of ``AsyncEnvCollector``: when every env is a ``ProcessVectorEnv`` (or
its ``split()`` parts) and the policy is a torch policy, ONE thread drives the workers' doorbells, writes
their frames and runs the policy; the event loop only receives finished batches.

``Engine`` (``_run.py``) steps each env in a task of the loop and hands each policy call to the policy
thread: per call of 64 envs that is two thread hand-offs, a doorbell awaited through the loop and the
tasks' bookkeeping, 300 to 550 µs of the trainer's CPU, and the loop and the policy thread take turns at
the GIL around every torch op (docs/async-envs.md, "Central inference"). Here one thread (its
loop: ``_fused_driver.py``) waits on the workers' sockets, writes the frames and runs the policy; the loop
hears from it once per completed batch. This module is the loop's side: the thread's start and stop, the
hand-offs both ways, and ``Engine``'s interface for the collector and its checkpoints.

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
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import numpy as np

from .._core._torch_settings import TorchSettings
from .._observe._timesplit import SplitClock
from .._procenv._driven import Poller, Unit, release
from ._envset import EnvSet, close_once
from ._frames import FrameBatch
from ._fused_driver import Driver, Halted
from ._policy import ActionCodec, BatchPolicy
from ._policy_thread import loop_wake
from ._run import EngineConfig, Signal

__all__ = ["FusedEngine"]


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
        self.config, self.hub, self.restarts = config, hub, None
        self.codec = ActionCodec(spec.action_space)
        self.traj_ids = np.arange(n, dtype=np.int64)
        self.next_traj = n
        self.episodes = None  # seeded groups need single envs (refused with vector envs)
        self.frame_counts = np.zeros(n, np.int64)
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
        self.halt = False  # the driver is to stop
        self.jobs: deque[tuple[Callable[[], Any], list[Any], anyio.Event]] = deque()
        self._jobs_lock = threading.Lock()
        self._accepting = False  # the driver runs jobs (else they go to the policy's own thread)
        self._driver: Driver | None = None
        self._wake_w = -1
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
        poller, units, wake_r = Poller(), [], -1
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                self._call_soon, self._requests = loop_wake(), send
                for u, (env, first) in enumerate(zip(self.envs, self.spec.firsts, strict=True)):
                    units.append(Unit(env, u, first))
                wake_r, self._wake_w = os.pipe()
                os.set_blocking(self._wake_w, False)
                poller.add(wake_r, None)
                for unit in units:  # for good: a socket is readable only with a reply owed (or gone)
                    for worker in unit.workers:
                        poller.add(worker.sock.fileno(), (unit, worker))
                self._driver = driver = Driver(self, units, poller, wake_r)
                self.policy.route_calls(self._job)
                settings = TorchSettings.capture()
                thread = threading.Thread(
                    target=self._drive, args=(driver, settings), name="aiocollect-fused"
                )
                thread.daemon = True
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
                    self.halt = True
                    self.ring()
                    await self._driver_done.wait()
                    await anyio.to_thread.run_sync(thread.join)  # it has only to return: no thread left
                self.policy.route_calls(None)
                poller.close()
                release(units)
                for fd in (wake_r, self._wake_w):
                    if fd >= 0:
                        os.close(fd)
                self._wake_w = -1
                send.close()
                receive.close()
                self._ended.set()

    async def stop(self) -> None:
        """Stop the driver (after the policy call in flight) and wait until it has ended."""
        if self._scope is not None:
            self._scope.cancel()
            with anyio.CancelScope(shield=True):
                await self._ended.wait()

    def _drive(self, driver: Driver, settings: TorchSettings) -> None:  # the thread
        settings.apply()
        try:
            driver.start()
            driver.loop()
        except Halted:
            pass
        except BaseException as exc:
            if self.error is None:
                self.error = exc
        finally:
            with self._jobs_lock:
                self._accepting = False
            self.run_jobs()
            driver.in_flight = 0  # the steps in flight give no frame any more (their replies stay owed)
            driver.acting = False
            self.on_loop(self._driver_ended)

    def _driver_ended(self) -> None:
        self.clock.done()
        self.idle_signal.set()
        self.consumer_signal.set()
        self._driver_done.set()

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
        if self._driver is not None:
            self._driver.parked = False
        self.ring()

    # -- hand-offs between the loop and the driver ------------------------------------------------
    def ring(self) -> None:
        """Wake the driver (from any thread)."""
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"\0")
            except OSError:  # full: it is rung already (closed: it has ended)
                pass

    def on_loop(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` on the loop (from the driver), never waiting for it."""
        call_soon = self._call_soon
        assert call_soon is not None
        try:
            call_soon(fn)
        except RuntimeError:  # the loop has closed: nobody waits any more
            pass

    def request(self, kind: str, arg: Any = None) -> None:
        """Ask the loop (from the driver) to ``"park"`` or to ``"close"`` env ``arg``."""
        send = self._requests
        self.on_loop(lambda: send.send_nowait((kind, arg)))

    async def _job(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` in the driver thread between two policy calls (the policy's ``in_thread``); once the
        driver has ended, in the policy's own thread."""
        done = anyio.Event()
        box: list[Any] = []
        with self._jobs_lock:
            queued = self._accepting
            if queued:
                self.jobs.append((fn, box, done))
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

    def run_jobs(self) -> None:
        """The jobs queued (in the driver thread)."""
        while self.jobs:
            fn, box, done = self.jobs.popleft()
            try:
                box[:] = [True, fn()]
            except BaseException as exc:
                box[:] = [False, exc]
            del fn
            self.on_loop(done.set)

    async def close_env(self, i: int) -> None:
        """Close env ``i`` (once), shielded; an error closing it is dropped (it failed, or we are ending)."""
        await close_once(self.envs, self.closed_envs, i)

    # -- what the collector reads -----------------------------------------------------------------
    @property
    def env_frames(self) -> list[int]:
        """Frames written per row (env id)."""
        return self.frame_counts.tolist()

    @env_frames.setter
    def env_frames(self, counts: list[int]) -> None:  # a restarted engine goes on counting
        self.frame_counts = np.array(counts, np.int64)

    @property
    def idle(self) -> bool:
        return self._driver is None or self._driver.idle

    @property
    def exhausted(self) -> bool:
        return 0 < self.config.target <= self.delivered

    @property
    def completed(self) -> int:
        """Frames written (into complete batches and the one being filled)."""
        return 0 if self._driver is None else self._driver.completed

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
