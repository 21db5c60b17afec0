"""One flat-buffer codec: the leaves of a TensorDict at 64-byte-aligned offsets in one ``uint8`` buffer.

Every engine that moves a TensorDict as bytes uses it: shared-memory batch slots and weights
(:mod:`._shm`), the weights broadcast of ``DistributedWeightSync`` and the batches nodes send over gloo
or nccl. A :class:`FlatLayout` says where each leaf lives; it is small, frozen, comparable and picklable,
so it travels in control messages; a :class:`FlatBuffer` is the buffer itself (any device, or memory the
caller gives, such as a shared-memory mapping) with one typed view per leaf.

API:

- ``layout_of(td)`` (= ``FlatLayout.of``): the layout of ``td``'s leaves (nested keys are tuples), with its
  batch size and dimension names. ``FlatLayout.build([(key, shape, dtype), ...], batch_size)`` makes one
  from a list, e.g. for a control block. ``layout.nbytes`` is the buffer size (a multiple of 64, at least
  64); ``layout.leaves`` the ``Leaf(key, dtype, shape, offset, nbytes)`` entries.
- ``FlatBuffer(layout, device)`` allocates a zeroed buffer; ``FlatBuffer(layout, data=tensor)`` lays the
  views over an existing ``uint8`` tensor (``torch.frombuffer(mmap)``) of at least ``layout.nbytes``.
  ``buffer.data`` is the whole buffer (what a process group sends), ``buffer.views`` a TensorDict of views
  (write into it, or copy it out), ``buffer.pack(td)`` copies ``td``'s leaves in, ``buffer.unpack()``
  returns a TensorDict with its own memory (batch size and names restored).
- ``rebuild(leaves, batch_size, names)``: a TensorDict from ``{nested key: tensor}`` (leaves that
  travelled by other means, e.g. torch RPC).

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> td = TensorDict({"a": torch.arange(3), ("b", "c"): torch.ones(3, 2, dtype=torch.bool)}, [3])
    >>> layout = layout_of(td)
    >>> [leaf.offset for leaf in layout.leaves], layout.nbytes
    ([0, 64], 128)
    >>> buffer = FlatBuffer(layout)
    >>> buffer.pack(td)
    >>> (buffer.unpack() == td).all()
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any, cast

import torch
from tensordict import TensorDict, TensorDictBase

__all__ = ["ALIGN", "FlatBuffer", "FlatLayout", "Key", "Leaf", "layout_of", "rebuild"]

#: every leaf starts at a multiple of this many bytes (any dtype's alignment, a cache line)
ALIGN = 64

#: a leaf's key: the path of names down the nested TensorDict
Key = tuple[str, ...]


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def _as_key(key: str | Sequence[str]) -> Key:
    return (key,) if isinstance(key, str) else tuple(key)


@dataclass(frozen=True)
class Leaf:
    """One tensor of the layout: ``nbytes`` bytes at ``offset``, viewed as ``dtype`` of ``shape``."""

    key: Key
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class FlatLayout:
    """Where each leaf lives in the flat buffer, and the TensorDict's batch size and names."""

    leaves: tuple[Leaf, ...]
    nbytes: int
    batch_size: tuple[int, ...] = ()
    names: tuple[str | None, ...] | None = None

    @classmethod
    def build(
        cls,
        entries: Iterable[tuple[str | Sequence[str], Sequence[int], torch.dtype]],
        batch_size: Sequence[int] = (),
        names: Sequence[str | None] | None = None,
    ) -> FlatLayout:
        """A layout for ``(key, shape, dtype)`` entries, in order, each at the next aligned offset."""
        leaves, pos = [], 0
        for key, shape, dtype in entries:
            nbytes = prod(shape) * dtype.itemsize
            leaves.append(Leaf(_as_key(key), dtype, tuple(int(s) for s in shape), pos, nbytes))
            pos += _aligned(nbytes)
        return cls(
            tuple(leaves),
            max(pos, ALIGN),
            tuple(int(s) for s in batch_size),
            None if names is None else tuple(names),
        )

    @classmethod
    def of(cls, td: TensorDictBase) -> FlatLayout:
        """The layout of ``td``'s leaves (nested included), its batch size and its dimension names."""
        # the stubs say (str, Tensor | TensorCollection): nested keys are tuples, and leaves are tensors
        items = cast(
            "Iterator[tuple[str | tuple[str, ...], torch.Tensor]]",
            td.items(include_nested=True, leaves_only=True),
        )
        names = None
        with contextlib.suppress(Exception):  # a TensorDict without names support raises
            if td.names is not None and any(n is not None for n in td.names):
                names = tuple(td.names)
        return cls.build(((k, tuple(v.shape), v.dtype) for k, v in items), tuple(td.batch_size), names)

    def resized(self, batch_size: Sequence[int]) -> FlatLayout:
        """This layout with batch size ``batch_size`` (the leaves as they are)."""
        if tuple(batch_size) == self.batch_size:
            return self
        return FlatLayout(self.leaves, self.nbytes, tuple(int(s) for s in batch_size), self.names)

    def leaf(self, key: str | Sequence[str]) -> Leaf:
        """The leaf at ``key``."""
        wanted = _as_key(key)
        for leaf in self.leaves:
            if leaf.key == wanted:
                return leaf
        raise KeyError(f"the layout has no leaf {wanted!r}")

    def views(self, data: torch.Tensor) -> TensorDict:
        """A TensorDict of typed views on ``data`` (a ``uint8`` tensor of at least ``nbytes``)."""
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() < self.nbytes:
            raise ValueError(
                f"a flat buffer is a 1-d uint8 tensor of at least {self.nbytes} bytes, got "
                f"{data.dtype} of shape {tuple(data.shape)}"
            )
        td = TensorDict({}, batch_size=self.batch_size)
        for leaf in self.leaves:
            if leaf.nbytes:
                chunk = data[leaf.offset : leaf.offset + leaf.nbytes]
                td.set(leaf.key, chunk.view(leaf.dtype).view(leaf.shape))
            else:  # an empty tensor: nothing in the buffer
                td.set(leaf.key, torch.empty(leaf.shape, dtype=leaf.dtype, device=data.device))
        if self.names is not None:
            td.names = list(self.names)
        return td


def layout_of(td: TensorDictBase) -> FlatLayout:
    """The layout of ``td``'s leaves (see :meth:`FlatLayout.of`)."""
    return FlatLayout.of(td)


class FlatBuffer:
    """A contiguous ``uint8`` buffer (``data``) and a TensorDict of typed views on it (``views``).

    Args:
        layout: where the leaves live.
        device: where to allocate the buffer (zeroed), unless ``data`` is given.
        data: an existing 1-d ``uint8`` tensor of at least ``layout.nbytes`` bytes to lay the views over
            (e.g. ``torch.frombuffer`` on a shared-memory mapping).
    """

    def __init__(
        self, layout: FlatLayout, device: torch.device | str = "cpu", *, data: torch.Tensor | None = None
    ) -> None:
        self.layout = layout
        self.data = data if data is not None else torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
        self.views = layout.views(self.data)

    def pack(self, td: TensorDictBase) -> None:
        """Copy the leaves of ``td`` (same keys and shapes as the layout) into the buffer."""
        for leaf in self.layout.leaves:
            if leaf.nbytes:
                self.views.get(leaf.key).copy_(td.get(leaf.key))

    def unpack(self) -> TensorDict:
        """A new TensorDict (its own memory) with the buffer's contents, batch size and names."""
        leaves = {leaf.key: self.views.get(leaf.key).clone() for leaf in self.layout.leaves}
        return rebuild(leaves, self.layout.batch_size, self.layout.names)


def rebuild(
    leaves: Mapping[Any, torch.Tensor],
    batch_size: Sequence[int],
    names: Sequence[str | None] | None = None,
) -> TensorDict:
    """A TensorDict from ``{key: tensor}`` (keys str or tuples for nested entries)."""
    td = TensorDict({}, batch_size=tuple(batch_size))
    for key, value in leaves.items():
        td.set(key, value)
    if names is not None:
        td.names = list(names)
    return td
