"""The trainer's copy of a batch out of its workers' shared-memory slots: a handful of large copies into
memory that is reused from batch to batch.

A worker writes its batch into a slot, one flat buffer (``_transport/_flat.py``), and collects into it again
once the trainer hands the slot back; so the trainer copies the batch out first. ``TensorDict.clone()`` did
that with one new tensor per entry: for pixels the kernel then maps and zeroes fresh pages for every batch,
six times the cost of the copy itself (a 26 MB batch of 8 x 16 Atari frames: 136 against 21 CPU-µs per
frame, measured). Here one worker's batch is one ``memcpy`` into a buffer of a :class:`StoragePool`, whose
pages stay warm once the consumer has let go of an earlier batch, and the batch's tensors are views of that
buffer at the slot's own offsets. Concatenated batches (``MultiSyncCollector``) take one copy per entry and
worker, into the tensors of one pooled buffer; stacked ones are not copied at all where the workers wrote
them as the rows of one segment (``_transport/_stacked.py``): :meth:`BatchCopies.views` lends the segment
as the batch, under that module's ownership rule. A copied batch owns its memory: the slot is
free for the worker as soon as the copy is made, and the consumer may keep the batch as long as it likes
(a kept batch only keeps its buffer from being reused).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from .._rollout._batch import nested_td
from .._rollout._storage import StoragePool, tensor_at
from .._transport._flat import FlatLayout, Key
from .._transport._shm import SharedBlock

__all__ = ["BatchCopies"]


def _td_key(key: Key) -> Any:
    return key[0] if len(key) == 1 else key


def _time_last(ndim: int) -> list[str | None]:
    """A batch's dim names: the last one ``"time"`` (given to the constructor: cheaper than set after)."""
    return [None] * (ndim - 1) + ["time"]


class BatchCopies:
    """Copies batches out of shared-memory slots into pooled memory (one pool per collector).

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from aiocollect._transport._flat import layout_of
        >>> from aiocollect._transport._shm import SharedBlock
        >>> td = TensorDict({"a": torch.arange(6).view(2, 3), ("b", "c"): torch.ones(2, 3, 1)}, [2, 3])
        >>> slot = SharedBlock(layout_of(td))
        >>> slot.td.update_(td)  # what a worker writes
        TensorDict(...)
        >>> copies = BatchCopies()
        >>> batch = copies.one(slot)
        >>> bool((batch == td).all()), batch.get("a").data_ptr() != slot.td.get("a").data_ptr()
        (True, True)
        >>> bool((copies.stack([slot, slot]).get("a")[1] == td.get("a")).all())
        True
        >>> del batch
        >>> slot.close(); slot.unlink()
    """

    def __init__(self) -> None:
        self._pool = StoragePool()

    def one(self, block: SharedBlock) -> TensorDict:
        """A copy of ``block``'s batch (its last dim named ``"time"``): one copy of the whole block, the
        entries views of it."""
        return self.copy(block.data, block.layout)

    def copy(self, data: torch.Tensor | np.ndarray, layout: FlatLayout) -> TensorDict:
        """A copy of the batch of ``layout`` in ``data`` (a flat ``uint8`` buffer): :meth:`one`'s, one copy
        into a pooled buffer and :meth:`views` of it."""
        buffer = self._pool.take_buffer(layout.nbytes)
        torch.from_numpy(buffer).copy_(torch.as_tensor(data))
        return self.views(buffer, layout)

    @staticmethod
    def views(root: np.ndarray, layout: FlatLayout) -> TensorDict:
        """The batch of ``layout`` in ``root`` (a ``uint8`` array: a pooled copy, or a stacked segment lent as
        it is, ``_transport/_stacked.py``): new views, each holding ``root``, so that ``root`` counts as in
        use while any is alive."""
        tensors = {
            _td_key(leaf.key): tensor_at(root, leaf.offset, leaf.nbytes, leaf.shape, leaf.dtype)[0]
            for leaf in layout.leaves
        }
        return nested_td(tensors, layout.batch_size, _time_last(len(layout.batch_size)))

    def stack(self, blocks: Sequence[SharedBlock]) -> TensorDict:
        """The blocks' batches (one layout) stacked along a new dim 0, as ``torch.stack`` gives them (the
        last dim named ``"time"``)."""
        layout = blocks[0].layout
        specs = [((len(blocks), *leaf.shape), leaf.dtype) for leaf in layout.leaves]
        tensors: dict[Any, torch.Tensor] = {}
        for leaf, (out, _) in zip(layout.leaves, self._pool.take_arrays(specs), strict=True):
            for i, block in enumerate(blocks):
                out[i].copy_(block.td.get(leaf.key))
            tensors[_td_key(leaf.key)] = out
        return nested_td(tensors, (len(blocks), *layout.batch_size), _time_last(len(layout.batch_size) + 1))

    def cat(self, parts: Sequence[TensorDictBase], dim: int) -> TensorDict:
        """The batches ``parts`` (views of the blocks, maybe cut short along time) concatenated along
        batch dim ``dim`` (0, or -1 for time), as ``torch.cat`` gives them (the last dim named
        ``"time"``)."""
        ndim = parts[0].batch_dims
        d = dim % ndim
        sizes = [p.batch_size[d] for p in parts]
        batch_size = list(parts[0].batch_size)
        batch_size[d] = sum(sizes)
        keys = list(parts[0].keys(include_nested=True, leaves_only=True))
        firsts = [parts[0].get(key) for key in keys]
        specs = []
        for value in firsts:
            shape = list(value.shape)
            shape[d] = batch_size[d]
            specs.append((tuple(shape), value.dtype))
        tensors: dict[Any, torch.Tensor] = {}
        for key, (out, _) in zip(keys, self._pool.take_arrays(specs), strict=True):
            start = 0
            for part, size in zip(parts, sizes, strict=True):
                out.narrow(d, start, size).copy_(part.get(key))
                start += size
            tensors[key] = out
        return nested_td(tensors, tuple(batch_size), _time_last(ndim))
