"""Stacked batch slots: each round, every worker writes its batch as one row of the same shared segment, so
that the segment *is* the stacked ``[workers, ...]`` batch and can be handed to the consumer as it is.

``MultiSyncCollector(cat_results="stack")`` otherwise copies every worker's slot into a new stacked batch
(200 KB per Atari frame). Here the segment is lent instead, under one ownership rule, the one of
``_rollout/_storage.py``: a lent segment is the consumer's while any tensor (or view of one) of its batch
is alive, and the workers write only into a segment nobody holds. Whether anybody does is read from the
reference count of the segment's root array, which every tensor of its batch holds.

There is always a free segment to collect into: the last free one is lent only once another has been
added; past :attr:`StackedSlots.cap` segments, or when ``/dev/shm`` lacks room for another (Docker's
default is 64 MB), the round is copied out of its segment instead (``_multi/_copies.py``), which stays
free. A consumer that lets go of each batch before asking for the one after next (``async for``) settles on
three segments; one that keeps batches gets copies once the cap is reached.

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from aiocollect._transport._flat import layout_of
    >>> from aiocollect._transport._shm import SharedBlock
    >>> td = TensorDict({"a": torch.arange(6).view(2, 3)}, [2, 3])
    >>> slots = StackedSlots(layout_of(td), 2)
    >>> rows = [SharedBlock(row, name=slots.names[0]) for row in slots.rows]  # what the workers map
    >>> rows[1].td.update_(td)  # worker 1 writes its batch
    TensorDict(...)
    >>> slots.root(0)[slots.layout.leaf("a").offset :].view("int64")[6:12].tolist()
    [0, 1, 2, 3, 4, 5]
    >>> slots.free()
    [0]
    >>> for row in rows:
    ...     row.close()
    >>> slots.close()
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, cast

import numpy as np
import torch

from ._flat import FlatLayout, Leaf
from ._messages import Attach
from ._shm import SHM_DIR, new_name

__all__ = ["StackedSlots", "row_layout", "stacked_layout"]


def stacked_layout(layout: FlatLayout, n: int) -> FlatLayout:
    """``layout``'s leaves stacked ``n`` times along a new dim 0 (each leaf ``[n, *shape]``, contiguous)."""
    names = None if layout.names is None else (None, *layout.names)
    return FlatLayout.build(
        ((leaf.key, (n, *leaf.shape), leaf.dtype) for leaf in layout.leaves), (n, *layout.batch_size), names
    )


def row_layout(stacked: FlatLayout, i: int) -> FlatLayout:
    """Row ``i`` of a :func:`stacked_layout`: the layout a worker writes its batch with, each leaf at its
    row's offset in the whole segment (``nbytes`` is the segment's, so that the worker maps all of it)."""
    leaves = []
    for leaf in stacked.leaves:
        nbytes = leaf.nbytes // leaf.shape[0]
        leaves.append(Leaf(leaf.key, leaf.dtype, leaf.shape[1:], leaf.offset + i * nbytes, nbytes))
    names = None if stacked.names is None else stacked.names[1:]
    return FlatLayout(tuple(leaves), stacked.nbytes, stacked.batch_size[1:], names)


def _room_for(nbytes: int, directory: str = SHM_DIR) -> bool:
    """Whether ``directory`` has room for another segment of ``nbytes`` and as much again to spare."""
    try:
        stats = os.statvfs(directory)
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize >= 2 * nbytes


def _mapped(nbytes: int) -> tuple[str, np.ndarray]:
    """A new ``/dev/shm`` segment of ``nbytes`` (zeros) and its mapping as a ``uint8`` array. The mapping
    keeps no file descriptor (torch's file mapping closes it), and it is unmapped when the array and every
    view of it are gone: a batch kept after the collector closed holds memory, nothing else."""
    name = new_name()
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
    except BaseException:
        os.unlink(path)
        raise
    return name, torch.empty(0, dtype=torch.uint8).set_(cast("torch.UntypedStorage", storage)).numpy()


class StackedSlots:
    """The parent's stacked segments for ``n`` workers whose batches have ``layout`` (one to start with).

    ``free()``: the segments nobody holds; ``root(j)``: segment ``j`` as one ``uint8`` array, the base of
    the tensors of a batch lent out of it; ``grow()`` adds a segment (then every worker needs a new
    :meth:`attach`); ``close()`` unlinks them all (a kept batch's mapping stays valid until dropped).
    """

    #: the most segments (the batches kept beyond that are copies)
    cap = 4

    def __init__(self, layout: FlatLayout, n: int) -> None:
        self.layout = stacked_layout(layout, n)
        self.rows = [row_layout(self.layout, i) for i in range(n)]
        self.names: list[str] = []
        self._roots: list[np.ndarray] = []
        self._add()

    @classmethod
    def over(cls, readies: list[Any], bodies: list[Any]) -> StackedSlots | None:
        """Stacked slots for workers that sent ``readies`` and run ``bodies``, when they can have them: the
        same layout and batch size for all, each the rollout worker (no body of its own), and a
        ``/dev/shm`` (Linux) to map the segments from."""
        layouts = {(r.layout, r.batch_size) for r in readies}
        if len(layouts) != 1 or any(body is not None for body in bodies) or not os.path.isdir(SHM_DIR):
            return None
        layout, batch_size = layouts.pop()
        return cls(layout.resized(batch_size), len(readies))

    def _add(self) -> None:
        name, root = _mapped(self.layout.nbytes)
        self.names.append(name)
        self._roots.append(root)

    def grow(self) -> bool:
        """Add a segment if the cap and ``/dev/shm`` allow; whether it was added."""
        if len(self.names) >= self.cap or not _room_for(self.layout.nbytes):
            return False
        self._add()
        return True

    def free(self) -> list[int]:
        """The segments no batch holds (references to a free root: the list's and getrefcount's argument)."""
        return [j for j in range(len(self._roots)) if sys.getrefcount(self._roots[j]) == 2]

    def root(self, j: int) -> np.ndarray:
        return self._roots[j]

    def attach(self, i: int) -> Attach:
        """What worker ``i`` maps: every segment, each with its row's layout."""
        return Attach(tuple(self.names), (self.rows[i],) * len(self.names))

    def close(self) -> None:
        """Unlink every segment and drop the parent's mappings (a kept batch keeps its own until dropped)."""
        self._roots = []
        for name in self.names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
        self.names = []
