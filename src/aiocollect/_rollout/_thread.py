"""One long-lived thread per in-process collector that runs its rollout and control calls, in order.

The thread is started with the torch settings of the thread that enters the collector (see
``_core/_torch_settings.py``) and keeps them: a pool thread per batch would run with torch's defaults, and a
new
one may appear at any batch. Jobs run first in, first out. A finished job rings its :class:`Doorbell` (a
thread-safe wake-up of the awaiting task through its event loop, which never blocks the ringing thread):
the thread never waits for the loop, so it goes on collecting (``prefetch``, background collection into a
replay buffer) while the loop is busy or blocked.
"""

from __future__ import annotations

import asyncio
import atexit
import queue
import socket
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

from .._core._errors import WorkerTimeoutError
from .._core._torch_settings import TorchSettings
from .._episodes._assembler import TrajectoryAssembler
from .._observe._timesplit import SplitClock
from ._core import RolloutResult

__all__ = ["Doorbell", "Flag", "Job", "RolloutThread", "collect_episodes", "end_at_exit"]

T = TypeVar("T")


class Doorbell:
    """Threads ``ring()`` it, one task at a time awaits ``wait()``; a ring is kept until a ``wait`` takes it.

    A ring wakes the waiting task through its event loop's own thread-safe wake-up
    (``call_soon_threadsafe`` on asyncio and uvloop, ``run_sync_soon`` on trio), which never waits for
    the loop: on this project's 2-core VM it cost the loop about half the CPU of a socket pair read with
    ``wait_readable`` (which registers and unregisters the socket at every wait). Under another backend
    it falls back to a socket pair and ``anyio.wait_readable``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rung = False
        #: the waiting task's wake-up (a thread-safe call that sets its event), while one waits
        self._wake: Callable[[], None] | None = None
        self._pair: tuple[socket.socket, socket.socket] | None = None  # the fallback, made on first use

    def ring(self) -> None:
        with self._lock:
            self._rung = True
            wake, self._wake = self._wake, None
            pair = self._pair
        if wake is not None:
            try:
                wake()
            except Exception:  # the loop has closed: nobody waits any more
                pass
        elif pair is not None:
            try:
                pair[1].send(b"\0")
            except OSError:  # full (a ring is pending anyway) or closed
                pass

    async def wait(self) -> None:
        """Wait for at least one ring since the last ``wait`` (and take them all).

        Always a checkpoint, even when a ring is already there: a thread that rings faster than the
        waiting task handles its rings must not keep that task from yielding to the loop (its other
        tasks, and a cancellation, would never get their turn). Cancelled, a ring already there stays.
        """
        suspended = False
        while True:
            with self._lock:
                rung = self._rung
                if not rung:
                    event = anyio.Event()
                    wake = _thread_safe_wake(event)
                    if wake is None:
                        pair = self._pair = self._pair or _socket_pair()
                    else:
                        self._wake = wake
            if rung:
                if not suspended:
                    await anyio.lowlevel.checkpoint()
                with self._lock:
                    self._rung = False
                return
            suspended = True
            if wake is None:
                await _wait_socket(pair[0])
                continue
            try:
                await event.wait()
            finally:
                with self._lock:
                    if self._wake is wake:  # cancelled before a ring: no wake-up for a task gone
                        self._wake = None

    def close(self) -> None:
        with self._lock:
            self._wake = None
            pair, self._pair = self._pair, None
        if pair is not None:
            pair[0].close()
            pair[1].close()


def _thread_safe_wake(event: anyio.Event) -> Callable[[], None] | None:
    """A call that any thread may make to set ``event`` (made in the waiting task) on its event loop,
    without waiting for the loop; ``None`` under a backend other than asyncio and trio."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not asyncio
        pass
    else:

        def wake_asyncio() -> None:
            loop.call_soon_threadsafe(event.set)

        return wake_asyncio
    trio = sys.modules.get("trio")  # imported where trio runs the loop
    if trio is not None:
        try:
            token = trio.lowlevel.current_trio_token()
        except RuntimeError:
            return None

        def wake_trio() -> None:
            token.run_sync_soon(event.set)

        return wake_trio
    return None


def _socket_pair() -> tuple[socket.socket, socket.socket]:
    rx, tx = socket.socketpair()
    rx.setblocking(False)
    tx.setblocking(False)
    return rx, tx


async def _wait_socket(rx: socket.socket) -> None:
    await anyio.wait_readable(rx)
    try:
        rx.recv(4096)
    except BlockingIOError:
        pass


class Flag:
    """``threading.Event``'s ``set`` and ``is_set`` without its ``Condition`` (no thread ever waits on a
    job's flags: the loop waits on the job's :class:`Doorbell`, the rollout reads ``stop`` at every step).
    One attribute under the GIL: a job made per batch costs 1 µs instead of 10 (two Events)."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


class Job(Generic[T]):
    """A call to run in the rollout thread. ``stop`` asks a stoppable call to return at its next step."""

    def __init__(self, fn: Callable[[Flag], T], bell: Doorbell) -> None:
        self.fn = fn
        self.bell = bell
        self.stop = Flag()
        self.done = Flag()
        self.started = False
        self._result: Any = None
        self._error: BaseException | None = None

    def run(self) -> None:
        self.started = True
        fn, self.fn = self.fn, None  # type: ignore[assignment]  # no reference to the collector kept
        try:
            self._result = fn(self.stop)
        except BaseException as exc:
            self._error = exc
        finally:
            del fn
            self.done.set()
            self.bell.ring()

    def result(self) -> T:
        if self._error is not None:
            error, self._error = self._error, None  # raised once: no reference cycle through the traceback
            raise error
        return self._result

    async def stop_and_wait(self) -> None:
        """Ask the job to stop at its next step and wait until it has, shielded from cancellation."""
        self.stop.set()
        with anyio.CancelScope(shield=True):
            while not self.done.is_set():
                await self.bell.wait()

    async def wait(self, *, timeout: float | None = None) -> T:  # noqa: ASYNC109 (it stops the job)
        """Wait for the job and return its result (or raise its exception).

        Cancelled (or interrupted: trio raises ``KeyboardInterrupt`` into the main task), the job is asked to
        stop and waited for before the exception goes on, so the rollout never runs on unseen. After
        ``timeout`` seconds the job is asked to stop and given one more second; then
        :class:`WorkerTimeoutError` is raised (a call that never returns cannot be stopped).
        """
        try:
            if timeout is None:  # no cancel scope to enter and leave at every batch
                while not self.done.is_set():
                    await self.bell.wait()
                timed_out = False
            else:
                with anyio.move_on_after(timeout) as scope:
                    while not self.done.is_set():
                        await self.bell.wait()
                timed_out = scope.cancelled_caught
        except BaseException:
            await self.stop_and_wait()
            raise
        if timed_out:
            self.stop.set()
            with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                while not self.done.is_set():
                    await self.bell.wait()
            if not self.done.is_set():
                raise WorkerTimeoutError(
                    f"the rollout did not finish a batch within worker_timeout={timeout} s"
                )
        return self.result()


_STOP = object()
#: the threads to end at interpreter exit (``end_at_exit``): this module's and the async-env policy thread
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def end_at_exit(owner: Any, live: bool = True) -> None:
    """Have ``owner`` (an object with ``abandon()`` and its ``threading.Thread`` as ``_thread``) ended at
    interpreter exit if its collector was never closed (``live=False``: no longer)."""
    if live:
        _LIVE.add(owner)
    else:
        _LIVE.discard(owner)


@atexit.register
def _end_idle_threads() -> None:
    """At interpreter exit, end the threads of collectors that were never closed: a daemon thread still
    holding torch's per-thread state when C++ runs its static destructors aborts the process
    ("terminate called without an active exception")."""
    threads = list(_LIVE)
    for thread in threads:
        thread.abandon()
    for thread in threads:
        if thread._thread is not None:
            thread._thread.join(timeout=1.0)


class RolloutThread:
    """A daemon thread that runs :class:`Job`\\ s in order with the torch settings it was started with.

    Example:
        >>> import anyio
        >>> async def main():
        ...     thread = RolloutThread("example")
        ...     bell = Doorbell()
        ...     try:
        ...         return await thread.submit(lambda stop: 6 * 7, bell).wait()
        ...     finally:
        ...         await thread.stop()
        ...         bell.close()
        >>> anyio.run(main)
        42
    """

    def __init__(self, name: str, *, clock: SplitClock | None = None) -> None:
        self.name = name
        #: adds the thread's idle time (no job queued: no batch asked for) to its ``wait``
        self.clock = clock
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._exited = threading.Event()
        self._exit_bell: Doorbell | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self, settings: TorchSettings | None = None) -> None:
        """Start the thread (idempotent) with ``settings`` (default: the calling thread's)."""
        if self._thread is not None:
            return
        settings = settings if settings is not None else TorchSettings.capture()
        self._thread = threading.Thread(target=self._run, args=(settings,), name=self.name, daemon=True)
        self._thread.start()
        end_at_exit(self)

    def submit(self, fn: Callable[[Flag], T], bell: Doorbell) -> Job[T]:
        """Queue ``fn(stop)``; the thread starts now if it has not yet."""
        self.start()
        job: Job[T] = Job(fn, bell)
        self._jobs.put(job)
        return job

    def pending(self) -> bool:
        """Whether jobs wait in the queue (a long job may yield the thread to them)."""
        return not self._jobs.empty()

    def _run(self, settings: TorchSettings) -> None:
        settings.apply()
        get = self._jobs.get
        try:
            while True:
                if self.clock is None:
                    job = get()
                else:
                    with self.clock.waiting():
                        job = get()
                if job is _STOP:
                    return
                job.run()
                del job  # an idle thread holds no job (and through it, no collector)
        finally:
            self._exited.set()
            if self._exit_bell is not None:
                self._exit_bell.ring()

    async def stop(self) -> None:
        """End the thread after the jobs queued before this call, and join it. A thread stuck in a call
        that never returns is left to finish on its own (it is a daemon thread)."""
        thread = self._thread
        if thread is None or self._exited.is_set():
            return
        bell = Doorbell()
        self._exit_bell = bell
        try:
            self._jobs.put(_STOP)
            with anyio.CancelScope(shield=True):
                while not self._exited.is_set():
                    await bell.wait()
                # it has left its loop: join returns at once, but only a thread may block
                await anyio.to_thread.run_sync(thread.join)
        finally:
            bell.close()

    def abandon(self) -> None:
        """End the thread after its queued jobs, without waiting (a collector dropped unclosed)."""
        if self._thread is not None and not self._exited.is_set():
            self._jobs.put(_STOP)

    def alive(self) -> bool:
        return self._thread is not None and not self._exited.is_set()


def collect_episodes(
    assembler: TrajectoryAssembler,
    collect: Callable[[], RolloutResult],
    stop: Flag | None,
    version: int,
) -> RolloutResult:
    """In a rollout thread: frame batches from ``collect()`` into ``assembler`` until a batch of whole
    trajectories is ready; that batch as a :class:`RolloutResult` (``frames``: its frames, episodes: its
    trajectories). If ``stop`` is set first, the last frame batch (the caller discards it: its frames
    stay in the assembler)."""
    while not assembler.ready():
        result = collect()
        version = result.policy_version
        assembler.push(result.batch)
        if stop is not None and stop.is_set():
            return result
    out = assembler.pop()
    frames = out.batch.shape[0]
    return RolloutResult(
        out.batch,
        steps=frames,
        frames=frames,
        episode_returns=out.returns,
        episode_lengths=out.lengths,
        policy_version=version,
    )
