"""Running the synchronous rollout in a worker thread without blocking, and stopping it on cancel."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread

from ._errors import WorkerTimeoutError

T = TypeVar("T")


async def run_stoppable(fn: Callable[[threading.Event], T], *, give_up_after: float | None = None) -> T:
    """Run ``fn(stop)`` in a worker thread and return its result.

    If the calling task is cancelled (or interrupted: trio raises ``KeyboardInterrupt`` into the main task),
    ``stop`` is set so that ``fn`` returns at its next step, and the exception propagates only once the
    thread is done: no thread outlives the call.

    With ``give_up_after`` (seconds), a call that has not returned by then gets ``stop`` set and one more
    second to return; then :class:`WorkerTimeoutError` is raised. A thread stuck inside a call that never
    returns (a hung ``env.step``) cannot be stopped by Python: it is left to finish on its own.

    Example:
        >>> import anyio, threading
        >>> anyio.run(run_stoppable, lambda stop: 42)
        42
    """
    stop = threading.Event()
    done = threading.Event()
    guard = threading.Lock()
    state = {"started": False, "dropped": False}

    def target() -> T:
        with guard:
            if state["dropped"]:  # cancelled before this thread picked the job up: do nothing
                raise RuntimeError("run_stoppable: cancelled before start")
            state["started"] = True
        try:
            return fn(stop)
        finally:
            done.set()

    async def wait_for_thread(limit: float | None) -> None:
        with guard:
            if not state["started"]:  # anyio may drop a job it never started: nothing to wait for
                state["dropped"] = True
                return
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(done.wait, limit)

    try:
        with anyio.move_on_after(give_up_after if give_up_after is not None else float("inf")) as scope:
            return await anyio.to_thread.run_sync(target, abandon_on_cancel=True)
    except BaseException:
        # cancelled, or a KeyboardInterrupt that trio raises into the main task as itself (asyncio turns
        # Ctrl-C into a cancellation): either way the thread stops at its next step and is waited for, so
        # that no rollout thread still runs the env or torch while the interpreter shuts down
        stop.set()
        await wait_for_thread(None)
        raise
    assert scope.cancelled_caught
    stop.set()
    await wait_for_thread(1.0)
    raise WorkerTimeoutError(f"the rollout did not finish a batch within worker_timeout={give_up_after} s")
