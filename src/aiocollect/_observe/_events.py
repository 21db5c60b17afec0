"""Collector events: typed records, and bounded per-reader streams that drop the oldest for slow readers.

Events are published from the event loop (never from worker threads), only when someone reads them. A
reader that falls behind loses its oldest events, never slows the collector down.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, ClassVar

import anyio

__all__ = [
    "BatchDelivered",
    "EpisodeFinished",
    "Event",
    "EventHub",
    "EventStream",
    "LoopLag",
    "MetricsLogged",
    "Paused",
    "Restarted",
    "Resumed",
    "WeightsLoaded",
    "WeightsPublished",
    "WorkerFailed",
    "WorkerStarted",
    "WorkerStopped",
]


def _now() -> float:
    return time.time()


@dataclass(frozen=True)
class Event:
    """Base of every event: ``kind`` names it, ``time`` is a Unix timestamp."""

    kind: ClassVar[str] = "event"
    time: float = field(default_factory=_now, kw_only=True)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict with ``"kind"``."""
        return {"kind": self.kind, **self.__dict__}  # flat fields: 10x cheaper than asdict


@dataclass(frozen=True)
class BatchDelivered(Event):
    kind: ClassVar[str] = "batch"
    frames: int
    worker_id: int | None
    policy_version: int


@dataclass(frozen=True)
class EpisodeFinished(Event):
    """An episode ended; ``frames``: the collector's frame count once its batch was delivered."""

    kind: ClassVar[str] = "episode"
    episode_return: float
    length: int
    worker_id: int
    frames: int = field(default=0, kw_only=True)


@dataclass(frozen=True)
class WeightsPublished(Event):
    kind: ClassVar[str] = "weights_published"
    version: int


@dataclass(frozen=True)
class WeightsLoaded(Event):
    kind: ClassVar[str] = "weights_loaded"
    version: int
    worker_id: int


@dataclass(frozen=True)
class WorkerStarted(Event):
    kind: ClassVar[str] = "worker_started"
    worker_id: int


@dataclass(frozen=True)
class WorkerFailed(Event):
    kind: ClassVar[str] = "worker_failed"
    worker_id: int
    error: str


@dataclass(frozen=True)
class WorkerStopped(Event):
    kind: ClassVar[str] = "worker_stopped"
    worker_id: int


@dataclass(frozen=True)
class Restarted(Event):
    """An env was rebuilt after a fault (``RestartPolicy``): ``worker`` is the member that hosts it (0 for
    ``Collector`` and the async-env collectors' engine), ``env`` its index there, ``cause`` the error
    (``"Type: message"``), ``restarts`` the env's restarts so far."""

    kind: ClassVar[str] = "restarted"
    worker: int
    env: int
    cause: str
    restarts: int

    @classmethod
    def of(cls, worker: int, record: Any) -> Restarted:
        """The event of member ``worker``'s restart ``record`` (a ``_restart.Restart``)."""
        return cls(worker, record.env, record.cause, record.restarts)


@dataclass(frozen=True)
class Paused(Event):
    kind: ClassVar[str] = "paused"


@dataclass(frozen=True)
class Resumed(Event):
    kind: ClassVar[str] = "resumed"


@dataclass(frozen=True)
class MetricsLogged(Event):
    """The trainer's own numbers (``collector.log_metrics``): ``metrics`` maps names to floats, ``frames`` is
    the collector's frame count when they were logged, ``step`` the trainer's step (``None``: not given).

    Example:
        >>> MetricsLogged.of({"loss": 0.5}, frames=1000).to_dict()["metrics"]
        {'loss': 0.5}
    """

    kind: ClassVar[str] = "metrics"
    metrics: dict[str, float]
    frames: int
    step: int | None = None

    @classmethod
    def of(cls, metrics: Mapping[str, Any], *, frames: int, step: int | None = None) -> MetricsLogged:
        """Checked: names are non-empty strings, values real numbers (Python, NumPy or one-element torch
        scalars), ``step`` an int or ``None``."""
        if not isinstance(metrics, Mapping):
            raise TypeError(
                f"metrics must be a mapping of names to numbers, e.g. {{'loss': 0.5}}, got {metrics!r}"
            )
        values: dict[str, float] = {}
        for name, value in metrics.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"metric names must be non-empty strings, got {name!r}")
            if isinstance(value, bool | str | bytes):
                raise TypeError(f"metric {name!r} must be a real number, got {value!r}")
            if callable(getattr(value, "detach", None)):  # a tensor (maybe requiring grad): no warning
                value = value.detach()
            try:
                values[name] = float(value)
            except (TypeError, ValueError, RuntimeError):
                raise TypeError(
                    f"metric {name!r} must be a real number (or a one-element tensor), got {value!r}"
                ) from None
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise TypeError(f"step must be an int or None, got {step!r}")
        return cls(values, int(frames), step)


class EventStream:
    """One reader's events: ``async for event in stream``; ends when the collector closes.

    Bounded: past ``max_buffer`` unread events the oldest are dropped (``dropped`` counts them).

    Example:
        >>> async def watch(collector):  # doctest: +SKIP
        ...     async with collector.events() as events:
        ...         async for event in events:
        ...             print(event.to_dict())
    """

    def __init__(self, hub: EventHub, max_buffer: int, kinds: Collection[str] | None = None) -> None:
        if isinstance(max_buffer, bool) or not isinstance(max_buffer, int) or max_buffer < 1:
            raise ValueError(f"max_buffer must be a positive int, got {max_buffer!r}")
        if kinds is not None and (isinstance(kinds, str) or not all(isinstance(k, str) for k in kinds)):
            raise TypeError(f"kinds must be a collection of event kinds, e.g. {{'metrics'}}, got {kinds!r}")
        self._hub = hub
        #: the event kinds this stream receives (``None``: all)
        self.kinds = None if kinds is None else frozenset(kinds)
        self._buffer: deque[Event] = deque(maxlen=max_buffer)
        self._wake = anyio.Event()
        self._closed = False
        self.dropped = 0

    def _push(self, event: Event) -> None:
        if self.kinds is not None and event.kind not in self.kinds:
            return
        if len(self._buffer) == self._buffer.maxlen:
            self.dropped += 1
        self._buffer.append(event)
        self._wake.set()

    def _end(self) -> None:
        self._closed = True
        self._wake.set()

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> Event:
        while not self._buffer:
            if self._closed:
                raise StopAsyncIteration
            await self._wake.wait()
            self._wake = anyio.Event()
        return self._buffer.popleft()

    def receive_nowait(self) -> Event | None:
        """The next buffered event, or ``None``."""
        return self._buffer.popleft() if self._buffer else None

    @property
    def ended(self) -> bool:
        """Whether the stream has ended (the collector closed, or :meth:`close`) and every event was read."""
        return self._closed and not self._buffer

    def close(self) -> None:
        """Stop receiving events (synchronous twin of :meth:`aclose`)."""
        self._hub.unsubscribe(self)
        self._end()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> EventStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class EventHub:
    """Fans events out to the open streams (event-loop thread only)."""

    def __init__(self) -> None:
        self._streams: set[EventStream] = set()
        self._closed = False

    @property
    def active(self) -> bool:
        """Whether anyone listens: build events only then."""
        return bool(self._streams)

    def subscribe(self, max_buffer: int = 1024, kinds: Collection[str] | None = None) -> EventStream:
        stream = EventStream(self, max_buffer, kinds)
        if self._closed:
            stream._end()
        else:
            self._streams.add(stream)
        return stream

    def unsubscribe(self, stream: EventStream) -> None:
        self._streams.discard(stream)

    def publish(self, event: Event) -> None:
        for stream in self._streams:
            stream._push(event)

    def close(self) -> None:
        """End every stream (the collector closed)."""
        self._closed = True
        for stream in self._streams:
            stream._end()
        self._streams.clear()


class LoopLag:
    """Measures the event loop's lag: a task sleeps ``interval`` and records how late it wakes."""

    def __init__(self, interval: float = 0.05, window: int = 200) -> None:
        self.interval = interval
        self._lags: deque[float] = deque(maxlen=window)

    async def run(self) -> None:
        """Run until cancelled (in the collector's task group)."""
        while True:
            start = anyio.current_time()
            await anyio.sleep(self.interval)
            self._lags.append(max(0.0, anyio.current_time() - start - self.interval))

    def percentiles_ms(self) -> dict[str, float] | None:
        """``{"p50": ..., "p99": ...}`` in milliseconds over the recent window, or ``None``."""
        if not self._lags:
            return None
        lags = sorted(self._lags)
        pick = lambda q: lags[min(len(lags) - 1, int(q * (len(lags) - 1) + 0.5))] * 1e3  # noqa: E731
        return {"p50": pick(0.5), "p99": pick(0.99)}
