"""Moved to :mod:`aiocollect._transport._wire` (framing) and :mod:`aiocollect._transport._messages`; this
re-export goes once its importers use the new paths."""

from __future__ import annotations

from .._transport._messages import Call, Collect, Failed, Release, Result, RunFree
from .._transport._wire import AsyncChannel

__all__ = ["AsyncChannel", "Call", "Collect", "Failed", "Release", "Result", "RunFree"]
