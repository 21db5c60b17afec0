"""Env ids over the workers of ``MultiAsyncEnvCollector``: each worker reports how many (sub-)envs it built
(``EnvRows``, known only once built: a vector env's size), and learns its first env id once every worker
has; a replacement of a worker that died (``restart=``) gets its predecessor's at once.

Example:
    >>> ids = EnvIds(2)
    >>> ids.counted(1, 4), ids.counted(0, 3)  # worker 1 waits for worker 0's count
    ({}, {0: 0, 1: 3})
    >>> ids.counted(1, 4), ids.total  # worker 1 replaced: its env ids again
    ({1: 3}, 7)
"""

from __future__ import annotations

import itertools

__all__ = ["EnvIds"]


class EnvIds:
    """The (sub-)env counts the workers reported, and each one's first env id once all have."""

    def __init__(self, workers: int) -> None:
        self.rows: list[int | None] = [None] * workers
        #: per worker, its first env id over all workers (``None`` until every worker reported)
        self.firsts: list[int] | None = None

    @property
    def total(self) -> int:
        return sum(r for r in self.rows if r is not None)

    def counted(self, index: int, rows: int) -> dict[int, int]:
        """Worker ``index`` built ``rows`` (sub-)envs: the first env ids to send now, by worker (every
        worker's once all have reported; a replacement's, its predecessor's); ``RuntimeError`` if a
        replacement built another number of envs."""
        if self.firsts is not None:
            if rows != self.rows[index]:
                raise RuntimeError(
                    f"worker {index}'s replacement built {rows} (sub-)envs, its predecessor "
                    f"{self.rows[index]}: its env fns must build the same envs every time"
                )
            return {index: self.firsts[index]}
        self.rows[index] = rows
        counts = [r for r in self.rows if r is not None]
        if len(counts) < len(self.rows):
            return {}
        self.firsts = [0, *itertools.accumulate(counts[:-1])]
        return dict(enumerate(self.firsts))
