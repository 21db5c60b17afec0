"""The data plane of ``DistributedCollector``: a batch as one flat buffer, and process groups of our own."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from math import prod
from typing import Any, cast

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase

_ALIGN = 64


# -- a batch as one flat buffer --------------------------------------------------------------------
@dataclass(frozen=True)
class _Leaf:
    key: tuple[str, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BatchLayout:
    batch_size: tuple[int, ...]
    names: tuple[str | None, ...] | None
    leaves: tuple[_Leaf, ...]
    nbytes: int


def layout_of(batch: TensorDictBase) -> BatchLayout:
    leaves, pos = [], 0
    # the stubs say (str, Tensor | TensorCollection): nested keys are tuples, and leaves are tensors
    for key, value in cast(
        "Iterator[tuple[str | tuple[str, ...], torch.Tensor]]",
        batch.items(include_nested=True, leaves_only=True),
    ):
        key = (key,) if isinstance(key, str) else tuple(key)
        nbytes = prod(value.shape) * value.element_size()
        leaves.append(_Leaf(key, value.dtype, tuple(value.shape), pos, nbytes))
        pos += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    names = None
    with contextlib.suppress(Exception):
        if batch.names is not None and any(n is not None for n in batch.names):
            names = tuple(batch.names)
    return BatchLayout(tuple(batch.batch_size), names, tuple(leaves), max(pos, _ALIGN))


class FlatBatch:
    """A contiguous ``uint8`` buffer with one typed view per leaf of a batch."""

    def __init__(self, layout: BatchLayout, device: torch.device) -> None:
        self.layout = layout
        self.data = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
        self.views: dict[tuple[str, ...], torch.Tensor] = {}
        for leaf in layout.leaves:
            if leaf.nbytes:
                chunk = self.data[leaf.offset : leaf.offset + leaf.nbytes]
                self.views[leaf.key] = chunk.view(leaf.dtype).view(leaf.shape)
            else:
                self.views[leaf.key] = torch.empty(leaf.shape, dtype=leaf.dtype, device=device)

    def pack(self, batch: TensorDictBase) -> None:
        for key, view in self.views.items():
            view.copy_(batch.get(key))

    def unpack(self) -> TensorDict:
        """A new TensorDict (its own memory) with the buffer's contents."""
        td = TensorDict(
            {k: v.clone() for k, v in self.views.items()}, batch_size=self.layout.batch_size, device=None
        )
        if self.layout.names is not None:
            td.names = list(self.layout.names)
        return td


def rebuild(leaves: Mapping[tuple[str, ...], torch.Tensor], layout: tuple[Any, ...]) -> TensorDict:
    batch_size, names = layout
    td = TensorDict(dict(leaves), batch_size=batch_size)
    if names is not None:
        td.names = list(names)
    return td


# -- the process group -----------------------------------------------------------------------------
def timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def data_device(backend: str, rank: int) -> torch.device:
    if backend == "nccl":
        count = torch.cuda.device_count()
        if not count:
            raise RuntimeError("backend='nccl' needs CUDA devices on every rank")
        return torch.device("cuda", rank % count)
    return torch.device("cpu")


def new_group(backend: str, store: Any, rank: int, world_size: int, host: str, timeout: float) -> Any:
    """A process group over ``store``, not registered with ``torch.distributed`` (the default group, if
    any, is untouched). ``host`` is this rank's own address (gloo binds there) unless
    ``GLOO_SOCKET_IFNAME`` names an interface."""
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in torch's stubs
        options._timeout = timedelta(timeout)
        interface = os.environ.get("GLOO_SOCKET_IFNAME")
        if interface:
            device = dist.ProcessGroupGloo.create_device(interface=interface.split(",")[0])
        else:
            device = dist.ProcessGroupGloo.create_device(hostname=host)
        options._devices = [device]
        return dist.ProcessGroupGloo(store, rank, world_size, options)
    if backend == "nccl":
        torch.cuda.set_device(data_device(backend, rank))
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(timeout)
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    if backend == "ucc":
        return dist.ProcessGroupUCC(store, rank, world_size, timedelta(timeout))
    raise ValueError(f"unsupported backend {backend!r}")


def check_backend(backend: str) -> None:
    if backend not in ("gloo", "nccl", "mpi", "ucc"):
        raise ValueError(f"backend must be 'gloo', 'nccl', 'mpi' or 'ucc', got {backend!r}")
    if not dist.is_available():  # pragma: no cover - torch without distributed
        raise RuntimeError("this torch build has no torch.distributed")
    if backend == "mpi":
        # an MPI communicator is made by mpirun for the processes it starts: it cannot be built for
        # ranks that our launchers start and that join later
        raise ValueError(
            "backend='mpi' is not supported: MPI ranks must all be started by mpirun, while "
            "DistributedCollector starts its nodes itself (mp, submitit); use 'gloo' (CPU) or 'nccl' (GPU)"
        )
    available = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available()}
    available["ucc"] = getattr(dist, "is_ucc_available", lambda: False)()
    if not available[backend]:
        raise RuntimeError(f"this torch build has no {backend!r} backend (torch {torch.__version__})")


__all__ = [
    "BatchLayout",
    "FlatBatch",
    "check_backend",
    "data_device",
    "layout_of",
    "new_group",
    "rebuild",
    "timedelta",
]
