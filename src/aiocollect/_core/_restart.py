"""Restart policies: what may be restarted after a fault, how often, and how long to wait in between.

:class:`RestartPolicy` is the user's object (frozen, checked once, picklable: it travels in
``RolloutOptions`` to worker processes and nodes). :class:`RestartBudget` is its bookkeeping for one member
(an env): which exceptions count, the restarts within the window, the backoff, and the history that is
attached to the error when the budget runs out. Nothing here knows about envs or event loops.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._validation import is_int

__all__ = [
    "IDS_PER_GENERATION",
    "CountedStop",
    "Lost",
    "Restart",
    "RestartBudget",
    "RestartPolicy",
    "derive_seed",
    "wait_interruptibly",
]

#: the package root (this module is in its _core/ folder)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _seconds(name: str, value: Any, *, positive: bool) -> float:
    what = "a positive number of seconds" if positive else "a number of seconds >= 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"RestartPolicy {name} must be {what}, got {value!r} ({type(value).__name__})")
    if math.isnan(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"RestartPolicy {name} must be {what}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class RestartPolicy:
    """Restart an env that raises, at most ``max_restarts`` times within any ``window`` seconds.

    A failed env is closed (an error on close is logged, not raised), rebuilt from its factory, seeded
    with a seed derived from its own and its restart count (:func:`derive_seed`), and reset; its running
    trajectory ends (its last frame still in the batch being built is marked truncated and done) and the
    rebuilt env starts new trajectories. The wait before a restart is ``backoff``, doubled (up to
    ``max_backoff``) for each failure in a row: a rebuilt env that fails again before it completes a
    step (or whose build or reset fails) waits longer; one that stepped starts again at ``backoff``. The
    ``k``-th consecutive attempt (from 0) waits ``min(backoff * 2**k, max_backoff)``. Past the budget
    the run ends with the env's own error, the restart history attached as an exception note.
    ``restart=None`` (no policy) fails at the first error, as always.

    Args:
        max_restarts: restarts allowed within ``window`` seconds (``0``: none, fail as without a policy).
        window: the sliding window, in seconds, the budget counts over (``math.inf``: the whole run).
        backoff: seconds to wait before a restart; doubled for each consecutive failed attempt.
        max_backoff: the longest wait.
        on: the exception classes that count (default: any ``Exception`` raised by the env).
            ``KeyboardInterrupt``, cancellation and the collector's own argument checks never do.

    Example:
        >>> from aiocollect import RestartPolicy
        >>> policy = RestartPolicy(max_restarts=5, window=60.0, backoff=0.1)
        >>> [policy.delay(k) for k in range(4)]
        [0.1, 0.2, 0.4, 0.8]
        >>> RestartPolicy(max_restarts=-1)
        Traceback (most recent call last):
        ...
        ValueError: RestartPolicy max_restarts must be an int >= 0, got -1
    """

    max_restarts: int = 3
    window: float = 60.0
    backoff: float = 0.1
    max_backoff: float = 10.0
    on: tuple[type[Exception], ...] = (Exception,)

    def __post_init__(self) -> None:
        if not is_int(self.max_restarts):
            raise TypeError(f"RestartPolicy max_restarts must be an int >= 0, got {self.max_restarts!r}")
        if self.max_restarts < 0:
            raise ValueError(f"RestartPolicy max_restarts must be an int >= 0, got {self.max_restarts!r}")
        window = _seconds("window", self.window, positive=True)
        backoff = _seconds("backoff", self.backoff, positive=False)
        max_backoff = _seconds("max_backoff", self.max_backoff, positive=False)
        if max_backoff < backoff:
            raise ValueError(
                f"RestartPolicy max_backoff ({max_backoff}) is below backoff ({backoff}): raise max_backoff"
            )
        on = self.on if isinstance(self.on, tuple) else (self.on,)
        if not on or not all(isinstance(c, type) and issubclass(c, Exception) for c in on):
            raise TypeError(
                "RestartPolicy on must be an Exception subclass or a tuple of them (KeyboardInterrupt and "
                f"cancellation never count), got {self.on!r}"
            )
        object.__setattr__(self, "window", window)
        object.__setattr__(self, "backoff", backoff)
        object.__setattr__(self, "max_backoff", max_backoff)
        object.__setattr__(self, "on", on)

    def delay(self, k: int) -> float:
        """Seconds to wait before the ``k``-th consecutive attempt (0, 1, ...)."""
        return min(self.backoff * 2.0 ** min(k, 64), self.max_backoff)

    def counts(self, exc: BaseException) -> bool:
        """Whether ``exc`` may be answered with a restart: one of ``on``, and not a ``TypeError`` or
        ``ValueError`` raised by aiocollect's own checks (an argument or a contract the env broke: a
        restart would meet it again)."""
        if not isinstance(exc, self.on):
            return False
        return not (isinstance(exc, (TypeError, ValueError)) and _raised_here(exc))


def _raised_here(exc: BaseException) -> bool:
    """Whether the innermost frame of ``exc``'s traceback is aiocollect's own code."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PACKAGE + os.sep)


#: trajectory ids a member's generation may take before its replacement's start (ids stay disjoint:
#: ``aiocollect._fleet._replace.restarted_options``)
IDS_PER_GENERATION = 1 << 32


def derive_seed(seed: int | None, restarts: int) -> int | None:
    """The seed of an env's ``restarts``-th rebuild: reproducible, and apart from the original's stream.

    >>> derive_seed(7, 1) == derive_seed(7, 1) != derive_seed(7, 2)
    True
    >>> derive_seed(None, 1) is None
    True
    """
    if seed is None or restarts == 0:
        return seed
    state = np.random.SeedSequence([abs(seed), int(seed < 0), restarts]).generate_state(1, np.uint32)
    return int(state[0])


class Lost(Exception):
    """A member started in a lost one's place was lost on its way up (it died, hung, or its group was
    lost): another loss of its slot, answered as the first (``cause``)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


@dataclass(frozen=True)
class Restart:
    """One restart: which env (its index in its member), why, and the member's restarts so far."""

    env: int
    cause: str
    restarts: int
    time: float = field(default_factory=time.time)


class RestartBudget:
    """A policy's bookkeeping for one member: the restarts within the window, the backoff, the history.

    ``admit(exc, env, progressed)`` answers a failure: it raises ``exc`` (with the history as a note) when
    the policy does not restart it or the budget is spent, else records the restart and returns the
    seconds to wait before it (``progressed``: the env completed a step since its last restart, which
    sets the backoff back to its first value). ``pending`` holds the records not reported yet (the
    owner drains them into events).
    """

    def __init__(self, policy: RestartPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.count = 0
        self.history: list[Restart] = []
        self.pending: deque[Restart] = deque()
        self._recent: deque[float] = deque()
        self._clock = clock
        self._streak = 0  # failed attempts in a row: the backoff's exponent

    def admit(self, exc: BaseException, env: int = 0, *, progressed: bool = True) -> float:
        """The seconds to wait before restarting after ``exc``; raises ``exc`` when it may not be."""
        if not self.policy.counts(exc):
            raise exc
        now = self._clock()
        recent = self._recent
        while recent and now - recent[0] > self.policy.window:
            recent.popleft()
        if len(recent) >= self.policy.max_restarts:
            exc.add_note(self.note())
            raise exc
        self._streak = 0 if progressed else self._streak + 1
        delay = self.policy.delay(self._streak)
        recent.append(now)
        self.count += 1
        record = Restart(env, f"{type(exc).__name__}: {exc}", self.count)
        self.history.append(record)
        self.pending.append(record)
        return delay

    def spent(self) -> bool:
        """Whether the next ``admit`` would raise for want of budget."""
        now, recent = self._clock(), self._recent
        while recent and now - recent[0] > self.policy.window:
            recent.popleft()
        return len(recent) >= self.policy.max_restarts

    def drain(self) -> list[Restart]:
        """The records not reported yet (thread-safe against ``admit`` in another thread)."""
        out = []
        while self.pending:
            out.append(self.pending.popleft())
        return out

    def note(self) -> str:
        p = self.policy
        head = f"restart budget spent: {p.max_restarts} restart(s) within {p.window:g} s (RestartPolicy)"
        lines = [
            f"  restart {r.restarts} (env {r.env}, {time.ctime(r.time)}): {r.cause}" for r in self.history
        ]
        return "\n".join([head, *lines[-10:]]) if lines else head


def wait_interruptibly(seconds: float, stop: Any) -> None:
    """Sleep ``seconds`` (a restart's backoff, in a rollout thread or worker), cut short once ``stop`` is
    set: a ``threading.Event`` is waited on, another stop signal (a worker's shared flag) read every
    20 ms."""
    if seconds <= 0:
        return
    wait = getattr(stop, "wait", None)
    if wait is not None:
        wait(seconds)
        return
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if stop is not None and stop.is_set():
            return
        time.sleep(min(left, 0.02))


class CountedStop:
    """A stop signal that counts its reads: the rollout reads it once at the start of every step, so
    after an exception ``calls - 1`` steps (from the segment's first) were completed."""

    __slots__ = ("calls", "stop")

    def __init__(self, stop: Any) -> None:
        self.stop = stop
        self.calls = 0

    def is_set(self) -> bool:
        self.calls += 1
        return self.stop is not None and bool(self.stop.is_set())
