"""The thread ``AsyncEnvCollector``'s torch policy runs in: one call at a time, handed over with as little
as a call can cost, since the collector makes one per batch of ready envs (thousands a second).

A call is a slot and two wake-ups: the loop writes the function into the slot and releases a lock the idle
thread blocks on (its doorbell); the thread runs it, writes the result into the slot and sets an
``anyio.Event`` through the loop's own thread-safe wake-up (``call_soon_threadsafe`` on asyncio and uvloop,
``run_sync_soon`` on trio), which never waits for the loop. Nothing else is made per call (the collectors'
general rollout thread, ``_rollout/_thread.py``, makes a job with two ``threading.Event``\\ s and a queue
entry per call, about twice the CPU).
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread

from .._core._torch_settings import TorchSettings
from .._rollout._thread import end_at_exit

__all__ = ["PolicyThread", "loop_wake"]

_STOP: Any = object()


def loop_wake() -> Callable[[Callable[[], object]], object]:
    """A call any thread may make to run a function on the running event loop, without waiting for it."""
    try:
        return asyncio.get_running_loop().call_soon_threadsafe
    except RuntimeError:  # not asyncio
        pass
    trio = sys.modules.get("trio")  # imported where trio runs the loop
    if trio is not None:
        return trio.lowlevel.current_trio_token().run_sync_soon
    raise RuntimeError("the policy thread needs a running asyncio or trio event loop")


class PolicyThread:
    """A daemon thread that runs one call at a time with the torch settings of the thread that started it.

    Example:
        >>> import anyio
        >>> async def main():
        ...     thread = PolicyThread("example")
        ...     thread.start()
        ...     try:
        ...         return await thread.call(lambda: 6 * 7)
        ...     finally:
        ...         await thread.stop()
        >>> anyio.run(main)
        42
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._thread: threading.Thread | None = None
        self._bell = threading.Lock()  # held while idle: a call releases it, the thread takes it back
        self._fn: Any = None
        self._result: Any = None
        self._error: BaseException | None = None
        self._done: anyio.Event | None = None
        self._wake: Callable[[Callable[[], object]], object] | None = None
        self._lock: anyio.Lock | None = None  # one call at a time

    def start(self, settings: TorchSettings | None = None) -> None:
        """Start the thread (idempotent) with ``settings`` (default: the calling thread's)."""
        if self._thread is not None:
            return
        settings = settings if settings is not None else TorchSettings.capture()
        self._bell.acquire(blocking=False)
        self._thread = threading.Thread(target=self._run, args=(settings,), name=self.name, daemon=True)
        self._thread.start()
        end_at_exit(self)  # a collector dropped unclosed: its thread ends at exit

    def _run(self, settings: TorchSettings) -> None:
        settings.apply()
        bell = self._bell
        while True:
            bell.acquire()
            fn, self._fn = self._fn, None
            if fn is _STOP:
                return
            try:
                self._result = fn()
            except BaseException as exc:
                self._error = exc
            del fn  # an idle thread holds no call (and through it, no collector)
            done, wake = self._done, self._wake
            assert done is not None
            assert wake is not None
            try:
                wake(done.set)
            except RuntimeError:  # the loop has closed: nobody waits any more
                pass

    async def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` in the thread, its result (or its exception, with its traceback). Cancelled, the call
        is waited for before the cancellation goes on: ``fn``'s inputs are never reused under it."""
        if self._thread is None:
            self.start()
        if self._lock is None:
            self._lock = anyio.Lock(fast_acquire=True)
            self._wake = loop_wake()
        async with self._lock:
            done = self._done = anyio.Event()
            self._fn = fn
            self._bell.release()
            try:
                await done.wait()
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await done.wait()
                raise
            error, self._error = self._error, None  # raised once: no cycle through the traceback kept
            result, self._result = self._result, None
        if error is not None:
            raise error
        return result

    async def stop(self) -> None:
        """End the thread after the call in flight, and join it; idempotent."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        with anyio.CancelScope(shield=True):
            if self._lock is not None:
                await self._lock.acquire()  # the call in flight is done
            self._fn = _STOP
            self._bell.release()
            await anyio.to_thread.run_sync(thread.join)  # only a thread may block
            if self._lock is not None:
                self._lock.release()
        self._lock, self._wake, self._done = None, None, None
        end_at_exit(self, live=False)

    def abandon(self) -> None:
        """End the thread when it is idle, without waiting (a collector dropped unclosed)."""
        if self._thread is not None and self._fn is None and self._bell.locked():
            self._fn = _STOP
            try:
                self._bell.release()
            except RuntimeError:  # released by a call just now: it ends at the next idle
                pass
