"""Moved to :mod:`aiocollect._transport._shm`; this re-export goes once its importers use the new path."""

from __future__ import annotations

from .._transport._shm import PREFIX, SharedBlock, sweep_orphans

__all__ = ["PREFIX", "SharedBlock", "sweep_orphans"]
