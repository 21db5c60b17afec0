"""Exceptions raised by the collectors."""

from __future__ import annotations


class CollectorClosedError(RuntimeError):
    """The collector was closed (by ``aclose()``, by leaving ``async with``, or after a failure)."""


class WorkerTimeoutError(TimeoutError):
    """A worker did not deliver (or answer) within ``worker_timeout`` seconds: a hung env or policy."""
