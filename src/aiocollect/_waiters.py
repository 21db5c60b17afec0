"""Moved to :mod:`aiocollect._transport._waiters`; this re-export goes once its importers use the new path."""

from __future__ import annotations

from ._transport._waiters import Waiter, WaiterTable

__all__ = ["Waiter", "WaiterTable"]
