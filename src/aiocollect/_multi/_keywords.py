"""The multi-process collectors' keywords, written once: :class:`WorkersKeywords` (``ProcessCollector``'s,
and the base of the others: the shared :class:`~aiocollect._core._keywords.RolloutKeywords` and the worker
pool's), :class:`MultiSyncKeywords`, :class:`MultiAsyncKeywords`. Each constructor takes its list as
``**kwargs: Unpack[...]`` (mypy and IDEs show the keywords; ``help()`` too, through ``explicit_keywords``)
and hands it on, filled, to ``init_workers``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from .._core._keywords import RolloutKeywords
from .._core._mistakes import Default
from .._weightsync._schemes import WeightSync

__all__ = ["MultiAsyncKeywords", "MultiSyncKeywords", "WorkersKeywords"]


class WorkersKeywords(RolloutKeywords, total=False):
    """The keywords of every collector over the worker pool (``ProcessCollector``'s)."""

    frames_per_batch: Annotated[int | Sequence[int] | None, Default(None)]
    update_at_each_batch: Annotated[bool, Default(False)]
    num_threads: Annotated[int | None, Default(None)]
    num_sub_threads: Annotated[int, Default(1)]
    worker_backend: Annotated[str, Default("process")]
    start_method: Annotated[str | None, Default(None)]
    weight_sync: Annotated[WeightSync | None, Default(None)]
    backend: Annotated[str | None, Default(None)]


class _EpisodeKeywords(WorkersKeywords, total=False):
    trajs_per_batch: Annotated[int | None, Default(None)]
    group_size: Annotated[int | None, Default(None)]


class MultiSyncKeywords(_EpisodeKeywords, total=False):
    """``MultiSyncCollector``'s keywords."""

    preemptive_threshold: Annotated[float | None, Default(None)]
    cat_results: Annotated[Literal["stack"] | int, Default("stack")]


class MultiAsyncKeywords(_EpisodeKeywords, total=False):
    """``MultiAsyncCollector``'s keywords."""

    on_update: Annotated[str, Default("continue")]
