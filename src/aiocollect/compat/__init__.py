"""TorchRL's collector names on top of aiocollect: a migration is a changed import plus ``async``.

``SyncDataCollector`` / ``Collector``, ``MultiSyncDataCollector`` / ``MultiSyncCollector``,
``MultiaSyncDataCollector`` / ``MultiAsyncCollector``, ``aSyncDataCollector`` / ``AsyncCollector``,
``MultiCollector`` and ``split_trajectories`` take torchrl's keyword names (``create_env_fn`` as a list,
``num_workers``, ``create_env_kwargs``, ``policy_factory``, ``init_fn``, ``post_collect_hook``, ...) and map
them onto :mod:`aiocollect`'s collectors. Every method that talks to the collection is a coroutine::

    # torchrl                                      # aiocollect.compat
    from torchrl.collectors import MultiSyncCollector  from aiocollect.compat import MultiSyncCollector
    collector = MultiSyncCollector(                    collector = MultiSyncCollector(
        [env_fn] * 2, policy,                              [env_fn] * 2, policy,
        frames_per_batch=256, total_frames=10_000)         frames_per_batch=256, total_frames=10_000)
    for data in collector:                             async for data in collector:
        ...                                                ...
        collector.update_policy_weights_()                 await collector.update_policy_weights_()
    collector.shutdown()                               await collector.shutdown()

The collector starts on the first ``async for`` step (or at ``async with collector:``, the structured
form, preferred) and stops when the iteration ends, when it raises (as torchrl shuts down on an error),
or at ``shutdown()``. A collector started by ``async for`` must be shut down by the task that iterated
it, outside any cancel scope opened after the iteration started (it holds a task group).

torchrl keywords that aiocollect does not implement raise a ``TypeError`` that says what to do instead;
see ``docs/migrating-from-torchrl.md`` for the full table.
"""

from __future__ import annotations

from ._collectors import (
    AsyncCollector,
    Collector,
    MultiAsyncCollector,
    MultiaSyncDataCollector,
    MultiCollector,
    MultiSyncCollector,
    MultiSyncDataCollector,
    SyncDataCollector,
    aSyncDataCollector,
)
from ._utils import aenumerate, split_trajectories

__all__ = [
    "AsyncCollector",
    "Collector",
    "MultiAsyncCollector",
    "MultiCollector",
    "MultiSyncCollector",
    "MultiSyncDataCollector",
    "MultiaSyncDataCollector",
    "SyncDataCollector",
    "aSyncDataCollector",
    "aenumerate",
    "split_trajectories",
]
