"""Running the synchronous rollout in a worker thread without blocking, and stopping it on cancel."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")


async def run_stoppable(fn: Callable[[threading.Event], T]) -> T:
    """Run ``fn(stop)`` in a worker thread and return its result.

    If the calling task is cancelled, ``stop`` is set so that ``fn`` returns at its next step, and the
    cancellation propagates only once the thread is done: no thread outlives the call.

    Example:
        >>> import anyio, threading
        >>> anyio.run(run_stoppable, lambda stop: 42)
        42
    """
    stop = threading.Event()
    result: list[T] = []
    error: list[Exception] = []

    async def worker() -> None:
        try:
            result.append(await anyio.to_thread.run_sync(fn, stop))
        except Exception as exc:  # re-raised below, outside the task group (no ExceptionGroup)
            error.append(exc)
        finally:
            tg.cancel_scope.cancel()

    async def watch() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            stop.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker)
        tg.start_soon(watch)
    if error:
        raise error[0]
    if not result:  # cancelled from outside: the task group re-raised already; never reached
        raise RuntimeError("worker thread returned no result")  # pragma: no cover
    return result[0]
