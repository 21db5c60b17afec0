"""A private torch RNG state for a rollout, swapped in around each batch.

Policies sample with torch's global generator; a collector with a seed keeps its own state so that its
batches are reproducible whatever else draws random numbers between batches. torch's generator is one per
process: a seeded batch swaps its state in, runs and swaps it back holding :data:`TORCH_RNG_LOCK`
exclusively, so seeded collectors in one process (in-process collectors, serial workers, async-env
collectors' policy threads) take turns, and each draws only from its own state. An unseeded batch draws
from the global state itself: it holds the lock shared, so unseeded batches run at the same time as each
other but never while a seeded one has its state swapped in (its draws would advance the seeded state, and
the seeded run would no longer be reproducible).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

__all__ = ["TORCH_RNG_LOCK", "RNGLock", "RolloutRNG", "forked_rng"]

T = TypeVar("T")

_INSIDE, _NESTED, _COUNTED = 0, 1, 2  # RNGLock.enter_shared's tokens


class RNGLock:
    """A lock on torch's global RNG: held exclusively to swap a state in (``with lock:``, ``acquire``),
    shared to draw from the global state (``with lock.shared():``). Both re-entrant per thread; a thread
    that holds it shared may take it exclusively (it lets go of its share while it waits, when it draws
    nothing), so a dry call that forks the RNG works inside an unseeded batch.

    Example:
        >>> lock = RNGLock()
        >>> with lock.shared(), lock:  # a fork inside an unseeded batch
        ...     lock.acquire(blocking=False)
        True
        >>> lock.release()
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0  # threads holding it shared (not counting one that is upgrading)
        self._owner: int | None = None  # the thread holding it exclusively
        self._depth = 0  # its exclusive re-entries
        self._waiting = 0  # threads waiting to take it exclusively
        self._local = threading.local()  # this thread's shared depth

    def _shares(self) -> int:
        return int(getattr(self._local, "shares", 0))

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        token = self.enter_shared()
        try:
            yield
        finally:
            self.exit_shared(token)

    def enter_shared(self) -> int:
        """Take it shared; returns the token :meth:`exit_shared` takes (the hot path's form of
        :meth:`shared`)."""
        local = self._local
        shares = getattr(local, "shares", 0)
        if shares:
            local.shares = shares + 1
            return _NESTED
        if self._owner == threading.get_ident():
            return _INSIDE  # held exclusively: nothing to count
        with self._cond:
            while self._owner is not None or self._waiting:  # a seeded batch waiting goes first
                self._cond.wait()
            self._readers += 1
        local.shares = 1
        return _COUNTED

    def exit_shared(self, token: int) -> None:
        if token == _INSIDE:
            return
        local = self._local
        local.shares -= 1
        if token == _COUNTED:
            with self._cond:
                self._readers -= 1
                if self._waiting:
                    self._cond.notify_all()

    def acquire(self, blocking: bool = True) -> bool:
        me = threading.get_ident()
        if self._owner == me:
            self._depth += 1
            return True
        mine = 1 if self._shares() else 0
        with self._cond:
            # an upgrading reader lets go of its share while it waits (two upgrading at once would wait
            # for each other otherwise): it draws nothing meanwhile
            self._readers -= mine
            free = lambda: self._owner is None and self._readers == 0  # noqa: E731
            if not free():
                if not blocking:
                    self._readers += mine
                    return False
                self._waiting += 1
                try:
                    self._cond.wait_for(free)
                except BaseException:
                    self._readers += mine
                    raise
                finally:
                    self._waiting -= 1
                    if not self._waiting:
                        self._cond.notify_all()  # the readers held back for it
            self._owner, self._depth = me, 1
        return True

    def release(self) -> None:
        if self._owner != threading.get_ident():
            raise RuntimeError("release of an RNG lock this thread does not hold")
        self._depth -= 1
        if self._depth:
            return
        with self._cond:
            self._owner = None
            if self._shares():
                self._readers += 1  # back to the shared hold it came from
            self._cond.notify_all()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


#: held exclusively while a seeded batch runs with its own state swapped in (re-entrant: a batch may fork
#: the RNG), shared while an unseeded one draws from the global state
TORCH_RNG_LOCK = RNGLock()


class RolloutRNG:
    """``run(fn)`` calls ``fn`` with the collector's own torch RNG state (none: the global one).

    Example:
        >>> import torch
        >>> rng = RolloutRNG(seed=0)
        >>> a = rng.run(lambda: torch.rand(2))
        >>> torch.equal(a, RolloutRNG(seed=0).run(lambda: torch.rand(2)))
        True
    """

    def __init__(self, seed: int | None = None) -> None:
        self.state: torch.Tensor | None = None
        if seed is not None:
            self.seed(seed)

    def seed(self, seed: int) -> None:
        self.state = torch.Generator().manual_seed(seed).get_state()

    def run(self, fn: Callable[[], T]) -> T:
        if self.state is None:
            token = TORCH_RNG_LOCK.enter_shared()
            try:
                return fn()
            finally:
                TORCH_RNG_LOCK.exit_shared(token)
        with TORCH_RNG_LOCK:
            outer = torch.get_rng_state()
            torch.set_rng_state(self.state)
            try:
                return fn()
            finally:
                self.state = torch.get_rng_state()
                torch.set_rng_state(outer)


@contextlib.contextmanager
def forked_rng() -> Iterator[None]:
    """``torch.random.fork_rng`` (CPU) holding :data:`TORCH_RNG_LOCK` shared: a dry call that draws numbers
    and puts the global state back must not do so while a seeded batch has its own state swapped in. Shared,
    not exclusive: a collector built on the event loop waits for no unseeded batch running elsewhere."""
    with TORCH_RNG_LOCK.shared(), torch.random.fork_rng(devices=[]):
        yield
