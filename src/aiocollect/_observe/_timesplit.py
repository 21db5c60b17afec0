"""Where a producer's time goes: the env, the policy, the hand-off, waiting, and the rest.

A :class:`SplitClock` lives with each rollout (the ``Collector``'s rollout thread, each worker process) and
adds up wall-clock seconds per part. It costs no clock per env step: the rollout times its step loop once
per batch and each policy call (a policy call costs ~70 µs; two clock reads ~0.1 µs), and the env's share
is the loop's time less the policy's. Its owner adds the time it waits for the consumer (``waiting()``).

``totals()`` is a plain tuple (it travels with each worker's batch notice); a :class:`SplitWindow` keeps
the recent ones and reads the split of the last ``window_s`` seconds: fractions of the wall time and
microseconds per frame, keyed by :data:`PARTS`. A node or actor hosts a whole collector: it sends
:func:`producer_totals` (one ``Totals`` per producer of its collector) with each batch, and the trainer
keeps them in a :class:`SplitWindows` (one window per producer, read together).

Example:
    >>> clock = SplitClock()
    >>> window = SplitWindow()
    >>> window.add(clock.totals())
    >>> sorted(window.read()[0])
    ['env', 'other', 'policy', 'transfer', 'wait']
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from time import perf_counter
from typing import Any

__all__ = [
    "NULL_CLOCK",
    "PARTS",
    "NullClock",
    "SplitClock",
    "SplitWindow",
    "SplitWindows",
    "Totals",
    "combine_splits",
    "member_split",
    "producer_totals",
]

#: the parts of a time split, in the order they are reported
PARTS = ("env", "policy", "transfer", "wait", "other")

#: (now, started, env, policy, transfer, wait, frames): seconds on the producer's own clock
Totals = tuple[float, float, float, float, float, float, int]


class SplitClock:
    """Cumulative seconds per part of one producer (written by its thread, read by any).

    - ``env``: the rollout's step loop less its policy calls (stepping the env, storing each step);
    - ``policy``: the policy's calls;
    - ``transfer``: writing the batch out (stacking the steps into the batch or a worker's shared-memory
      slot, episode statistics, trajectory ids);
    - ``wait``: waiting for the consumer (a worker: for its next ``Collect``, a free slot or weights; the
      rollout thread: for its next batch to be asked for);
    - ``other``: the rest of the wall time (weight loads, control calls, start-up, the trainer's code in
      a worker thread of the serial backend).
    """

    __slots__ = ("_window", "env", "frames", "policy", "started", "transfer", "wait", "waiting_since")
    measures = True

    def __init__(self) -> None:
        self.started = perf_counter()
        self.env = 0.0
        self.policy = 0.0
        self.transfer = 0.0
        self.wait = 0.0
        self.frames = 0
        self.waiting_since: float | None = None
        self._window: SplitWindow | None = None

    # -- the rollout's hooks (once per batch, and around each policy call) --------------------------------
    def loop_started(self) -> tuple[float, float]:
        """Before the step loop: a mark for :meth:`loop_ended`."""
        return perf_counter(), self.policy

    def loop_ended(self, mark: tuple[float, float]) -> float:
        """After the step loop: its time, less the policy calls in it, is the env's."""
        now = perf_counter()
        self.env += (now - mark[0]) - (self.policy - mark[1])
        return now

    def batch_written(self, since: float, frames: int) -> None:
        """After the batch was written out (from ``since``, what :meth:`loop_ended` returned)."""
        self.transfer += perf_counter() - since
        self.frames += frames

    def timed_policy(self, call: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``call`` (a policy runner), adding its time to ``policy``."""

        def timed(arg: Any) -> Any:
            start = perf_counter()
            out = call(arg)  # a call that raises ends the batch: its time is not needed
            self.policy += perf_counter() - start
            return out

        return timed

    @contextlib.contextmanager
    def spent(self, part: str) -> Iterator[None]:
        """Around time that goes to ``part`` (``"env"``, ``"policy"``, ``"transfer"``): the async-env
        engine's policy task awaits the envs and the policy."""
        start = perf_counter()
        try:
            yield
        finally:
            setattr(self, part, getattr(self, part) + perf_counter() - start)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a wait for the consumer (an open wait counts in :meth:`totals` while it lasts)."""
        self.waiting_since = start = perf_counter()
        try:
            yield
        finally:
            self.waiting_since = None
            self.wait += perf_counter() - start

    def done(self) -> None:
        """The producer has collected its budget: from now on it waits (for the consumer to take it)."""
        if self.waiting_since is None:
            self.waiting_since = perf_counter()

    def totals(self) -> Totals:
        """The cumulative seconds now (an open wait counted up to now)."""
        now = perf_counter()
        since = self.waiting_since
        wait = self.wait + (now - since if since is not None else 0.0)
        return (now, self.started, self.env, self.policy, self.transfer, wait, self.frames)

    def recent(self) -> tuple[float, list[float], int]:
        """The split of the last ~10 s (:meth:`SplitWindow.seconds`), read where the clock runs."""
        if self._window is None:
            self._window = SplitWindow()
        measured = self._window.seconds(self.totals())
        assert measured is not None  # a sample was just added
        return measured


class NullClock(SplitClock):
    """A clock that measures nothing (the overhead benchmark's baseline)."""

    measures = False

    def loop_ended(self, mark: tuple[float, float]) -> float:
        return 0.0

    def batch_written(self, since: float, frames: int) -> None:
        pass

    def timed_policy(self, call: Callable[[Any], Any]) -> Callable[[Any], Any]:
        return call


NULL_CLOCK = NullClock()


class SplitWindow:
    """The recent :data:`Totals` of one producer; :meth:`read` gives the split over the last ``window_s``
    seconds (since the producer started, in a younger run)."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._samples: deque[Totals] = deque()

    def add(self, totals: Totals | Sequence[Any]) -> None:
        if len(totals) != 7:  # a sender without a clock
            return
        sample: Totals = tuple(totals)
        samples = self._samples
        samples.append(sample)
        # keep one sample at or before the window's start: the baseline
        while len(samples) > 2 and samples[1][0] <= sample[0] - self.window_s:
            samples.popleft()

    def seconds(self, live: Totals | None = None) -> tuple[float, list[float], int] | None:
        """(wall seconds, seconds per part of :data:`PARTS`, frames) over the window; ``None`` before a
        sample. ``live``: the producer's totals now (a clock in this process), newest of all."""
        samples = self._samples
        if live is not None:
            self.add(live)
        if not samples:
            return None
        new = samples[-1]
        # the baseline: the sample at or before the window's start, else the producer's start
        old = samples[0] if len(samples) > 1 else (new[1], new[1], 0.0, 0.0, 0.0, 0.0, 0)
        wall = new[0] - old[0]
        parts = [max(new[i] - old[i], 0.0) for i in range(2, 6)]
        measured = sum(parts)
        if measured > wall > 0:  # an interval read across two samples' edges: scaled to the wall time
            parts = [p * wall / measured for p in parts]
        parts.append(max(wall - sum(parts), 0.0))
        return wall, parts, new[6] - old[6]

    def read(self, live: Totals | None = None) -> tuple[dict[str, float], dict[str, float]]:
        """``(fractions of the wall time, µs per frame)``, each keyed by :data:`PARTS` (zeros before)."""
        return _split(self.seconds(live))

    def latest(self) -> Totals | tuple[()]:
        """The newest totals added (``()`` before any)."""
        return self._samples[-1] if self._samples else ()


class SplitWindows:
    """The :class:`SplitWindow` of each producer of a hosted collector (a node's, an actor's), fed with
    the :func:`producer_totals` each of its batches carries; :meth:`seconds` reads them together, as
    :func:`combine_splits` does a collector's workers.

    Example:
        >>> windows = SplitWindows()
        >>> windows.add([(10.0, 0.0, 8.0, 0.0, 0.0, 2.0, 100), ()])  # two producers, one not heard from
        >>> round(windows.read()[0]["env"], 2)
        0.8
    """

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._windows: list[SplitWindow] = []

    def add(self, totals: Sequence[Any]) -> None:
        """One batch's :func:`producer_totals` (``()`` from a sender without a split)."""
        if not isinstance(totals, tuple | list):
            return
        windows = self._windows
        while len(windows) < len(totals):
            windows.append(SplitWindow(self.window_s))
        for window, sample in zip(windows, totals, strict=False):
            if isinstance(sample, tuple | list):
                window.add(sample)

    def seconds(self) -> tuple[float, list[float], int] | None:
        """(wall seconds, seconds per part, frames) of the producers together; ``None`` before a sample."""
        return _summed([w.seconds() for w in self._windows])

    def read(self) -> tuple[dict[str, float], dict[str, float]]:
        """``(fractions of the wall time, µs per frame)``, as :meth:`SplitWindow.read`."""
        return _split(self.seconds())


def producer_totals(collector: Any) -> tuple[Totals | tuple[()], ...]:
    """The cumulative :data:`Totals` of each producer of ``collector`` now: a ``Collector``'s rollout
    thread, or each worker of a multi-worker collector (its newest batch notice; ``()`` for one not heard
    from yet); ``()`` for a collector that keeps no split. What a node or actor sends with each batch (7
    numbers per producer)."""
    clock = getattr(getattr(collector, "_rollout", None), "clock", None)
    if isinstance(clock, SplitClock):
        return (clock.totals(),)
    members = getattr(collector, "_members", None)
    if not callable(members):
        return ()
    windows = [getattr(m, "time_split", None) for m in members()]
    return tuple(w.latest() if isinstance(w, SplitWindow) else () for w in windows)


def _split(
    measured: tuple[float, list[float], int] | None,
) -> tuple[dict[str, float], dict[str, float]]:
    if measured is None:
        return dict.fromkeys(PARTS, 0.0), dict.fromkeys(PARTS, 0.0)
    wall, parts, frames = measured
    fractions = {k: (v / wall if wall > 0 else 0.0) for k, v in zip(PARTS, parts, strict=True)}
    per_frame = {k: (v * 1e6 / frames if frames > 0 else 0.0) for k, v in zip(PARTS, parts, strict=True)}
    return fractions, per_frame


def combine_splits(
    measured: Sequence[tuple[float, list[float], int] | None],
) -> tuple[dict[str, float], dict[str, float]] | None:
    """The split of several producers together: the fractions of their summed wall time, and µs of their
    summed time per frame of them all; ``None`` when none has measured anything."""
    summed = _summed(measured)
    return _split(summed) if summed is not None else None


def _summed(
    measured: Sequence[tuple[float, list[float], int] | None],
) -> tuple[float, list[float], int] | None:
    """Several producers' (wall, parts, frames) added up; ``None`` when none has measured anything."""
    known = [m for m in measured if m is not None]
    if not known:
        return None
    wall = sum(m[0] for m in known)
    parts = [sum(m[1][i] for m in known) for i in range(len(PARTS))]
    return wall, parts, sum(m[2] for m in known)


def member_split(member: Any) -> tuple[float, list[float], int] | None:
    """The measured split of a fleet member that keeps a ``time_split`` :class:`SplitWindow` (a worker
    handle) or :class:`SplitWindows` (a node, an actor), else ``None``."""
    window = getattr(member, "time_split", None)
    return window.seconds() if isinstance(window, SplitWindow | SplitWindows) else None
