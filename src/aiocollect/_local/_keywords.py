"""``Collector``'s keywords, written once (:class:`CollectorKeywords`): the shared list of
:class:`~aiocollect._core._keywords.RolloutKeywords` and its own. ``Collector.__init__`` takes them as
``**kwargs: Unpack[CollectorKeywords]``; ``help()`` shows them (``explicit_keywords``)."""

from __future__ import annotations

from typing import Annotated, Any

from .._core._keywords import RolloutKeywords
from .._core._mistakes import Default

__all__ = ["CollectorKeywords"]


class CollectorKeywords(RolloutKeywords, total=False):
    """``Collector``'s keywords (see its docstring)."""

    frames_per_batch: Annotated[int | None, Default(None)]
    weight_sync: Annotated[Any, Default(None)]
    prefetch: Annotated[int, Default(0)]
    trajs_per_batch: Annotated[int | None, Default(None)]
    group_size: Annotated[int | None, Default(None)]
