"""Messages on the control channel between the trainer and a worker, and the collector control operations.

Each message is one frozen dataclass; each control operation is one :class:`Operation` subclass,
dispatched by type (never by a string). :data:`FleetOp` are the operations that mean the same for every
member of a collector (a worker process, a torch.distributed or RPC node, a Ray actor: seed, reset, state
dict, an attribute of its env or policy); :data:`WorkerOp` adds the worker-only ones (``Call.op``); the
remote-only ones live in :mod:`aiocollect._remote._messages`.
"""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .._core._errors import WorkerError

__all__ = [
    "Attach",
    "BatchReady",
    "Call",
    "Close",
    "Collect",
    "Failed",
    "FleetOp",
    "GetAttr",
    "GetPath",
    "GetState",
    "GetWeights",
    "LoadState",
    "LoadWeights",
    "MapFn",
    "Operation",
    "Ready",
    "Release",
    "Reset",
    "Result",
    "RunFree",
    "SetSeed",
    "WorkerOp",
    "failure",
]


# -- parent -> worker ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Attach:
    """Shared-memory segments for the batch slots; ``layouts``: each one's layout, when it is not the
    worker's own batch at offset 0 (a row of a stacked segment, ``_stacked.py``)."""

    slot_names: tuple[str, ...]
    layouts: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class Collect:
    """Collect one batch into ``slot`` (sync mode)."""

    slot: int
    random: bool


@dataclass(frozen=True)
class RunFree:
    """Collect continuously into alternating slots (async mode); ``random_frames`` for the first ones."""

    random_frames: int


@dataclass(frozen=True)
class Release:
    """The parent is done reading ``slot`` (async mode)."""

    slot: int


@dataclass(frozen=True)
class Call:
    """Run control operation ``op`` between batches and reply with ``Result``."""

    request_id: int
    op: WorkerOp


@dataclass(frozen=True)
class Close:
    pass


# -- worker -> parent ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    """The worker built its env, policy and rollout; ``layout`` describes one batch slot."""

    layout: Any
    batch_size: tuple[int, ...]
    frames_per_batch: int
    policy_version: int


@dataclass(frozen=True)
class BatchReady:
    slot: int
    steps: int
    frames: int
    policy_version: int
    episode_returns: list[float] = field(default_factory=list)
    episode_lengths: list[int] = field(default_factory=list)
    #: trajectory ids the worker allocated and will never use, one per env: the parent names with them the
    #: trajectories this batch continues from the previous one if it drops that one (sent only when the
    #: previous batch was still unread with older weights: see ``Worker.collect``)
    spare_ids: tuple[int, ...] = ()
    #: the worker's time split so far (``_timesplit.Totals``; empty where it keeps none)
    time_split: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Result:
    request_id: int
    value: Any


@dataclass(frozen=True)
class Failed:
    """The worker raised; ``error`` is the exception itself (its notes hold the worker traceback)."""

    error: BaseException


def failure(exc: BaseException, where: str) -> Failed:
    """Wrap ``exc`` with the worker traceback as a note, keeping its type when it pickles."""
    tb = "".join(traceback.format_exception(exc))
    note = f"\n--- raised in {where}; worker traceback ---\n{tb}"
    try:
        exc.add_note(note)
        clone = pickle.loads(pickle.dumps(exc))
        if type(clone) is not type(exc):
            raise TypeError
    except Exception:
        exc = WorkerError(f"{type(exc).__name__}: {exc}{note}")
    return Failed(exc)


# -- control operations (``Call.op``, the remote ``Request.op``) --------------------------------------
@dataclass(frozen=True)
class Operation:
    """A control operation a collector member runs between batches; its reply is the operation's value."""


# the fleet-level operations: the same meaning for a worker, a node and an actor
@dataclass(frozen=True)
class SetSeed(Operation):
    """Seed the member (its env, random policy and rollout RNG); reply: the last seed its env used."""

    seed: int


@dataclass(frozen=True)
class Reset(Operation):
    """Reset the member's envs: its next batch starts new episodes."""


@dataclass(frozen=True)
class GetState(Operation):
    """Reply: the member's state dict. ``versioned`` (hosted collectors only): the hosted collector's
    state with the trainer's version map, the policy's weights apart; off, a worker's rollout state and
    frame count, or a hosted collector's own ``state_dict()``. ``envs``: with the envs' own state (and
    the trajectories in flight)."""

    versioned: bool = False
    envs: bool = False


@dataclass(frozen=True)
class LoadState(Operation):
    """Restore a :class:`GetState` reply (``versioned`` as there)."""

    state: Mapping[str, Any]
    versioned: bool = False


@dataclass(frozen=True)
class GetAttr(Operation):
    """Reply: attribute ``name`` of the member's ``env`` or ``policy`` (worker 0's, for a hosted
    multi-process collector)."""

    root: Literal["env", "policy"]
    name: str


# the worker-only operations
@dataclass(frozen=True)
class LoadWeights(Operation):
    """Load the newest published weights now; reply: the policy version the worker runs."""


@dataclass(frozen=True)
class GetWeights(Operation):
    """Reply: the policy's weights (flat keys, CPU copies), or ``None`` for a policy without any."""


@dataclass(frozen=True)
class GetPath(Operation):
    """Reply: the object at ``path`` (``"env.transform[0].max_steps"``), parsed, never evaluated."""

    path: str


@dataclass(frozen=True)
class MapFn(Operation):
    """Reply: what the method at ``path`` returns when called with ``args`` and ``kwargs``."""

    path: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)


#: the operations every member of a collector answers (``FleetCollector._call_member``)
FleetOp = SetSeed | Reset | GetState | LoadState | GetAttr

#: the operations a worker answers (``Call.op``)
WorkerOp = SetSeed | Reset | GetState | LoadState | GetAttr | LoadWeights | GetWeights | GetPath | MapFn
