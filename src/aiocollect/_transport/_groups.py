"""Private ``torch.distributed`` process groups, built on a store (``_store``'s authenticated one).

A group made here is never registered with ``torch.distributed`` (its default group, if the trainer runs
one for DDP, is untouched): it is built straight from a store (``_store.StoreClient``) with
``ProcessGroupGloo`` / ``ProcessGroupNCCL`` / ``ProcessGroupUCC``. Used by ``DistributedWeightSync``
and by the ``torch.distributed`` collectors.

API: ``check_backend(backend, choices)`` (ValueError for a backend out of ``choices``, RuntimeError for
one this torch lacks); ``new_group(backend, store, rank, world_size, timeout=...,
host=..., interface=..., cuda_device=...)``; ``interface_from_env()`` (``GLOO_SOCKET_IFNAME``'s first
entry); ``local_address(host, port)`` (this machine's address on the route to ``host``); ``timedelta``.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "ALL_BACKENDS",
    "check_backend",
    "interface_from_env",
    "local_address",
    "new_group",
    "timedelta",
]

#: every backend name ``check_backend`` knows
ALL_BACKENDS = ("gloo", "nccl", "mpi", "ucc")


def timedelta(seconds: float) -> datetime.timedelta:
    """``seconds`` as the ``timedelta`` torch.distributed takes."""
    return datetime.timedelta(seconds=seconds)


def _quoted(choices: Sequence[str]) -> str:
    names = [repr(c) for c in choices]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def check_backend(backend: str, choices: Sequence[str] = ALL_BACKENDS) -> None:
    """Raise ``ValueError`` unless ``backend`` is one of ``choices`` and usable here (``mpi`` never is),
    ``RuntimeError`` when this torch build lacks it."""
    if backend not in choices:
        raise ValueError(f"backend must be {_quoted(choices)}, got {backend!r}")
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


def interface_from_env() -> str | None:
    """The first interface named by ``GLOO_SOCKET_IFNAME``, if set."""
    names = os.environ.get("GLOO_SOCKET_IFNAME")
    return names.split(",")[0] if names else None


def local_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (what gloo binds on a worker): 127.0.0.1 for a
    trainer on this machine, the right interface's address for a remote one. No packet is sent."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            return str(probe.getsockname()[0])
    except OSError:
        return host


def new_group(
    backend: str,
    store: Any,
    rank: int,
    world_size: int,
    *,
    timeout: float,
    host: str,
    interface: str | None = None,
    cuda_device: torch.device | None = None,
) -> Any:
    """A process group over ``store``, not registered with ``torch.distributed``.

    Args:
        backend: ``"gloo"``, ``"nccl"`` or ``"ucc"``.
        timeout: seconds, for every collective and point-to-point operation.
        host: gloo: this rank's own address, bound unless ``interface`` is given.
        interface: gloo: the network interface to bind (e.g. ``interface_from_env()``).
        cuda_device: nccl: made the current CUDA device first.
    """
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in torch's stubs
        options._timeout = timedelta(timeout)
        if interface:
            device = dist.ProcessGroupGloo.create_device(interface=interface)
        else:
            device = dist.ProcessGroupGloo.create_device(hostname=host)
        options._devices = [device]
        return dist.ProcessGroupGloo(store, rank, world_size, options)
    if backend == "nccl":
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None:  # pragma: no cover - CPU builds of torch
            raise RuntimeError("backend='nccl' needs a CUDA build of torch")
        if cuda_device is not None:
            torch.cuda.set_device(cuda_device)
        options = nccl.Options()
        options._timeout = timedelta(timeout)
        return nccl(store, rank, world_size, options)
    if backend == "ucc":
        return dist.ProcessGroupUCC(store, rank, world_size, timedelta(timeout))
    raise ValueError(f"unsupported backend {backend!r}")
