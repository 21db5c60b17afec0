"""The pauses open on a collector: ``pause()``'s, and an ``AsyncEnvCollector``'s capture and host's hold,
counted together; the wait until none is open.

Example:
    >>> pauses = Pauses()
    >>> with pauses.hold():
    ...     bool(pauses)
    True
    >>> bool(pauses)
    False
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import anyio

__all__ = ["Pauses"]


class Pauses:
    """How many pauses are open (true while any is); :meth:`resumed` waits until none is."""

    def __init__(self) -> None:
        self.count = 0
        self._none_open: anyio.Event | None = None

    def __bool__(self) -> bool:
        return self.count > 0

    @contextmanager
    def hold(self, on_last: Callable[[], None] | None = None) -> Iterator[None]:
        """One more pause open while this is; closing the last one wakes :meth:`resumed` and calls
        ``on_last``."""
        self.count += 1
        if self._none_open is None:
            self._none_open = anyio.Event()
        try:
            yield
        finally:
            self.count -= 1
            if not self.count and self._none_open is not None:
                self._none_open.set()
                self._none_open = None
                if on_last is not None:
                    on_last()

    async def resumed(self) -> None:
        """Until no pause is open (at once if none is)."""
        while self.count and self._none_open is not None:
            await self._none_open.wait()
