"""A cancellation-safe table of callers waiting for replies that arrive on another task.

A caller registers a key before it sends its request, and waits inside ``with table.expect(key) as
waiter``. Leaving that block (normally, by an exception or by cancellation) forgets the key, so that a
reply that comes later is not handed to a caller that is gone: it goes to ``on_orphan`` instead (a
batch that nobody waits for any more must still be taken off the wire, or its sender blocks). A reply that
did reach a caller that was cancelled before it took it goes to ``on_orphan`` too. A failure (``fail``)
wakes every caller with the error, and every later ``expect`` raises it.

Example:
    >>> import anyio
    >>> async def main():
    ...     table = WaiterTable()
    ...     with table.expect("answer") as waiter:
    ...         table.resolve("answer", 42)  # normally done by a reader task
    ...         return await waiter.wait()
    >>> anyio.run(main)
    42
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import anyio

__all__ = ["Waiter", "WaiterTable"]

_NOTHING: Any = object()


class Waiter:
    """One caller's slot: ``await wait()`` returns the reply (or raises the table's failure)."""

    __slots__ = ("_event", "_table", "_taken", "_value", "key")

    def __init__(self, table: WaiterTable, key: Hashable) -> None:
        self.key = key
        self._table = table
        self._event = anyio.Event()
        self._value: Any = _NOTHING
        self._taken = False

    def _set(self, value: Any) -> None:
        self._value = value
        self._event.set()

    @property
    def done(self) -> bool:
        """The reply (or a failure) has arrived."""
        return self._event.is_set()

    async def wait(self) -> Any:
        await self._event.wait()
        value = self._value
        self._taken = True
        if isinstance(value, _Failed):
            raise value.error
        return value

    def __enter__(self) -> Waiter:
        return self

    def __exit__(self, *exc: object) -> None:
        self._table._forget(self)


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class WaiterTable:
    """Callers waiting for replies, by key.

    Args:
        on_orphan: called with ``(key, value)`` for a reply that no caller takes: one for a key nobody
            waits for (never registered, or forgotten when its caller left), or one that reached a caller
            cancelled before it took it. Default: the reply is dropped.
    """

    def __init__(self, on_orphan: Callable[[Hashable, Any], None] | None = None) -> None:
        self._waiters: dict[Hashable, Waiter] = {}
        self._on_orphan = on_orphan
        self.failure: BaseException | None = None

    def __len__(self) -> int:
        return len(self._waiters)

    def expect(self, key: Hashable) -> Waiter:
        """Register ``key`` (before sending the request). Raises the table's failure, if any."""
        if self.failure is not None:
            raise self.failure
        if key in self._waiters:
            raise RuntimeError(f"a caller waits for {key!r} already")
        waiter = Waiter(self, key)
        self._waiters[key] = waiter
        return waiter

    def resolve(self, key: Hashable, value: Any) -> bool:
        """Hand ``value`` to the caller waiting for ``key``; ``False`` (and ``on_orphan``) if none does."""
        waiter = self._waiters.pop(key, None)
        if waiter is None:
            self._orphan(key, value)
            return False
        waiter._set(value)
        return True

    def fail(self, error: BaseException) -> None:
        """Wake every caller with ``error``; every later ``expect`` raises it (the first failure stays)."""
        if self.failure is None:
            self.failure = error
        waiters, self._waiters = self._waiters, {}
        for waiter in waiters.values():
            if not waiter.done:
                waiter._set(_Failed(error))

    def _forget(self, waiter: Waiter) -> None:
        if self._waiters.get(waiter.key) is waiter:
            del self._waiters[waiter.key]
        elif waiter.done and not waiter._taken and not isinstance(waiter._value, _Failed):
            waiter._taken = True
            self._orphan(waiter.key, waiter._value)

    def _orphan(self, key: Hashable, value: Any) -> None:
        if self._on_orphan is not None:
            self._on_orphan(key, value)
