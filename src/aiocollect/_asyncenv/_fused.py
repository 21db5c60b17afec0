"""The fused central-inference steps of ``AsyncEnvCollector``'s engine (``FusedSteps``): when every env is a
``ProcessVectorEnv`` (or its ``split()`` parts) and the policy is a torch policy, ONE thread drives the
workers' doorbells, writes their frames and runs the policy; the event loop only receives finished
batches.

On the loop (``LoopSteps``, ``_run.py``) each env steps in a task and each policy call is handed to the
policy thread: per call of 64 envs that is two thread hand-offs, a doorbell awaited through the loop and the
tasks' bookkeeping, 300 to 550 µs of the trainer's CPU, and the loop and the policy thread take turns at
the GIL around every torch op (docs/async-envs.md, "Central inference"). Here one thread (its
loop: ``_fused_driver.py``) waits on the workers' sockets, writes the frames and runs the policy; the loop
hears from it once per completed batch. This module is the loop's side: the thread's start and stop and the
hand-offs both ways.

Everything else is the engine's and the collector's, as on the loop: the batch lock, ``pause()`` (no call
starts while paused; the thread parks until a loop task sees the collector resumed and rings it), weight
loads and other work "in the policy thread" (there, between two of the driver's calls),
``update_weights``' version (no call while the loop holds the engine's ``policy_lock``), errors (a
worker's error with its type and traceback, a dead worker's ``WorkerDiedError``; ``on_env_error="drop"``
drops its unit), the frame budget, backpressure (``1 + prefetch`` batches ahead),
``set_seed``/``reset``/``load_state_dict`` (a new engine over the same envs, whose thread first reads the
replies its predecessor left owed). The frames are those the loop writes for the same steps
(tests/test_fused.py compares them bit for bit).
"""

from __future__ import annotations

import os
import selectors
import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread

from .._core._torch_settings import TorchSettings
from ._engine import Engine
from ._fused_driver import Driver, Halted, Unit
from ._policy_thread import loop_wake

__all__ = ["FusedSteps"]


class FusedSteps:
    """The engine's :class:`~._engine.Stepper` over process envs, one thread (see the module docstring)."""

    blocks = True

    def __init__(self, engine: Engine) -> None:
        if engine.restarts is not None:
            raise ValueError("the fused engine has no env restarts (restart= runs the engine on the loop)")
        self.engine = engine
        self.driver: Driver | None = None
        self._wake_w = -1
        self._call_soon: Callable[[Callable[[], object]], object] | None = None
        self._requests: Any = None  # the driver's requests to the loop (a memory object stream)
        self._scope: anyio.CancelScope | None = None
        self._ended = anyio.Event()
        self._driver_done = anyio.Event()

    # -- the Stepper ------------------------------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Claim the envs' workers and run the driver thread until it ends, is stopped or fails."""
        e = self.engine
        thread: threading.Thread | None = None
        send, receive = anyio.create_memory_object_stream[Any](float("inf"))
        poller, units, wake_r = selectors.DefaultSelector(), [], -1  # epoll where there is one
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                self._call_soon, self._requests = loop_wake(), send
                for u, (env, first) in enumerate(zip(e.envs, e.spec.firsts, strict=True)):
                    units.append(Unit(env, u, first))
                wake_r, self._wake_w = os.pipe()
                os.set_blocking(self._wake_w, False)
                poller.register(wake_r, selectors.EVENT_READ, None)
                for unit in units:  # for good: a socket is readable only with a reply owed (or gone)
                    for worker in unit.workers:
                        poller.register(worker.sock, selectors.EVENT_READ, (unit, worker))
                self.driver = driver = Driver(e, units, poller, wake_r, self.on_loop, self._request)
                settings = TorchSettings.capture()
                thread = threading.Thread(
                    target=self._drive, args=(driver, settings), name="aiocollect-fused"
                )
                thread.daemon = True
                thread.start()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._serve, receive, tg)
                    task_status.started()
                    await self._driver_done.wait()
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                if thread is not None:
                    assert self.driver is not None
                    self.driver.halt = True
                    self.wake()
                    await self._driver_done.wait()
                    await anyio.to_thread.run_sync(thread.join)  # it has only to return: no thread left
                poller.close()
                for unit in units:  # the workers back to their envs
                    for worker in unit.workers:
                        worker.waiting = False
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

    def wake(self) -> None:
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

    def oldest_action(self) -> int:
        return self.engine.next_action if self.driver is None else self.driver.oldest_action()

    # -- the thread and its hand-offs -------------------------------------------------------------
    def _drive(self, driver: Driver, settings: TorchSettings) -> None:  # the thread
        settings.apply()
        e = self.engine
        try:
            driver.start()
            driver.loop()
        except Halted:
            pass
        except BaseException as exc:
            if e.error is None:
                e.error = exc
        finally:
            e.in_flight = 0  # the steps in flight give no frame any more (their replies stay owed)
            e.acting = False
            self.on_loop(self._driver_ended)

    def _driver_ended(self) -> None:
        e = self.engine
        e.clock.done()
        e.idle_signal.set()
        e.consumer_signal.set()
        self._driver_done.set()

    def _request(self, kind: str, arg: Any) -> None:
        """Ask the loop (from the driver) to ``"park"`` or to ``"close"`` env ``arg``."""
        send = self._requests
        self.on_loop(lambda: send.send_nowait((kind, arg)))

    async def _serve(self, receive: Any, tg: anyio.abc.TaskGroup) -> None:
        """The driver's requests that need the loop: wait for the collector to resume, close a dropped
        env."""
        async for kind, arg in receive:
            if kind == "park":
                tg.start_soon(self._park)
            else:
                tg.start_soon(self.engine.close_env, arg)

    async def _park(self) -> None:
        await self.engine.resumed()
        if self.driver is not None:
            self.driver.parked = False
        self.wake()
