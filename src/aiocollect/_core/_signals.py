"""``stop_on_signals``: the first SIGTERM/SIGINT asks a collector to stop after its batch in flight; the
second one does what it did before (the handler that was there, by default: terminate / KeyboardInterrupt).
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, Protocol

import anyio
import anyio.abc

__all__ = ["SignalStop", "stop_on_signals"]


class _Stoppable(Protocol):
    def request_stop(self) -> None: ...


class SignalStop:
    """What :func:`stop_on_signals` returns: an async context manager; ``received`` is the signal that
    asked for the stop (``None`` while none came)."""

    def __init__(self, collector: _Stoppable, signals: tuple[signal.Signals, ...]) -> None:
        self.collector = collector
        self.signals = signals
        self.received: signal.Signals | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self._previous: dict[signal.Signals, Any] = {}

    async def __aenter__(self) -> SignalStop:
        if self._task_group is not None:
            raise RuntimeError("stop_on_signals(...) is entered already")
        self._previous = {sig: signal.getsignal(sig) for sig in self.signals}
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._task_group = tg
        try:
            await tg.start(self._watch)
        except BaseException:
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
            self._task_group = None
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        tg, self._task_group = self._task_group, None
        assert tg is not None
        tg.cancel_scope.cancel()
        try:
            # only the signal watcher ends here: the body's exception (a worker's WorkerDiedError, the
            # trainer's own error, a cancellation) is not handed to the task group, which would wrap it in
            # an ExceptionGroup, and goes on as itself
            await tg.__aexit__(None, None, None)
        finally:
            self._restore()
        return False

    async def _watch(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        try:
            with anyio.open_signal_receiver(*self.signals) as received:
                task_status.started()
                async for sig in received:
                    self.received = signal.Signals(sig)
                    break
        finally:
            self._restore()  # first: the next signal finds the handler that was there before
        if self.received is not None:
            self.collector.request_stop()

    def _restore(self) -> None:
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            # asyncio's remove_signal_handler leaves SIG_DFL (SIGINT: Python's default handler) instead
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def stop_on_signals(
    collector: _Stoppable,
    signals: Iterable[signal.Signals | int] = (signal.SIGTERM, signal.SIGINT),
) -> SignalStop:
    """An async context manager: the first of ``signals`` calls ``collector.request_stop()`` (the
    ``async for`` ends after the batch in flight is delivered); a second signal meets the handler that
    was installed before (by default SIGTERM terminates and SIGINT raises ``KeyboardInterrupt``).

    Works under asyncio, uvloop and trio, in the main thread (where signals are delivered). The
    returned object's ``received`` tells which signal came (``None``: none).

    Example:
        >>> async def train(collector):  # doctest: +SKIP
        ...     async with collector, stop_on_signals(collector) as stop:
        ...         async for batch in collector:
        ...             update(batch)
        ...         if stop.received is not None:
        ...             save(await collector.state_dict())  # preempted: checkpoint and exit 0
    """
    request_stop: Callable[[], None] | None = getattr(collector, "request_stop", None)
    if not callable(request_stop):
        raise TypeError(f"stop_on_signals needs a collector (with request_stop()), got {collector!r}")
    chosen = tuple(signal.Signals(s) for s in signals)
    if not chosen:
        raise ValueError("stop_on_signals needs at least one signal, e.g. signals=(signal.SIGTERM,)")
    return SignalStop(collector, chosen)
