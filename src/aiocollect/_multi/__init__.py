"""The multi-process collectors: ``MultiSyncCollector``, ``MultiAsyncCollector``, ``ProcessCollector``
and the ``MultiCollector(sync=...)`` factory, each a ``FleetCollector`` over the worker pool
(``_workers.Workers``, its transport).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._args import set_worker_warnings
from ._async import MultiAsyncCollector, ProcessCollector
from ._sync import MultiSyncCollector

__all__ = [
    "MultiAsyncCollector",
    "MultiCollector",
    "MultiSyncCollector",
    "ProcessCollector",
    "set_worker_warnings",
]


def MultiCollector(
    create_env_fns: Sequence[Any], policy: Any = None, *, sync: bool, **kwargs: Any
) -> MultiSyncCollector | MultiAsyncCollector:
    """``MultiSyncCollector`` when ``sync=True``, ``MultiAsyncCollector`` when ``sync=False``."""
    if not isinstance(sync, bool):
        raise TypeError(f"sync must be True or False, got {sync!r}")
    cls = MultiSyncCollector if sync else MultiAsyncCollector
    return cls(create_env_fns, policy, **kwargs)
