"""Imported last by the forkserver's preload (and nowhere else): ``gc.freeze()`` before the first fork.

Every worker is forked from the forkserver and shares its heap (torch, tensordict, gymnasium: ~150 MB of
Python objects) copy-on-write. A full garbage collection in a worker writes to the header of every object
it tracks, which copies every page of that heap into the worker: +40 MB per worker, measured after one
``gc.collect()``, and one comes sooner or later in a long run. Frozen objects are left out of the
collections of the forkserver and of every process forked from it (the Python docs' advice for servers that
fork), so their pages stay shared.
"""

from __future__ import annotations

import gc

__all__: list[str] = []

gc.freeze()
