"""Messages on the control channel between the trainer and a worker, and the worker operations.

Each message is one frozen dataclass; each control operation (``Call.op``) is one :class:`Operation`
subclass, dispatched by type (a table keyed by the class, never by a string).
"""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .._errors import WorkerError

__all__ = [
    "Attach",
    "BatchReady",
    "Call",
    "Close",
    "Collect",
    "Failed",
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
    "failure",
    "operation",
]


# -- parent -> worker ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Attach:
    """Shared-memory segments for the batch slots (and their layout)."""

    slot_names: tuple[str, ...]


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
    """Run control operation ``op`` (an :class:`Operation`) between batches and reply with ``Result``.

    ``args``: the arguments of a string-named operation (remote nodes' own calls); empty for a typed one."""

    request_id: int
    op: Any
    args: tuple[Any, ...] = ()


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


# -- control operations (``Call.op``) ----------------------------------------------------------------
@dataclass(frozen=True)
class Operation:
    """A control operation a worker runs between batches; its reply is the operation's value."""


@dataclass(frozen=True)
class SetSeed(Operation):
    """Seed the env, the random policy and the rollout's RNG; reply: the last seed the env used."""

    seed: int


@dataclass(frozen=True)
class Reset(Operation):
    """Reset the env: the next batch starts new episodes."""


@dataclass(frozen=True)
class GetState(Operation):
    """Reply: the rollout's state dict (and the worker's frame count)."""


@dataclass(frozen=True)
class LoadState(Operation):
    """Restore a :class:`GetState` reply."""

    state: Mapping[str, Any]


@dataclass(frozen=True)
class LoadWeights(Operation):
    """Load the newest published weights now; reply: the policy version the worker runs."""


@dataclass(frozen=True)
class GetWeights(Operation):
    """Reply: the policy's weights (flat keys, CPU copies), or ``None`` for a policy without any."""


@dataclass(frozen=True)
class GetAttr(Operation):
    """Reply: attribute ``name`` of the worker's ``env`` or ``policy``."""

    root: Literal["env", "policy"]
    name: str


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


#: the operations by the names the collectors' string-keyed helpers used (``call(i, "reset")``)
_BY_NAME: dict[str, Any] = {
    "set_seed": SetSeed,
    "reset": Reset,
    "state_dict": GetState,
    "load_state_dict": LoadState,
    "load_weights": LoadWeights,
    "policy_weights": GetWeights,
    "getattr_env": lambda name: GetAttr("env", name),
    "getattr_policy": lambda name: GetAttr("policy", name),
    "get_distant_attr": GetPath,
    "map_fn": MapFn,
}


def operation(op: Operation | str, *args: Any) -> Operation:
    """``op`` itself, or the operation a name stands for (``operation("set_seed", 3) == SetSeed(3)``)."""
    if isinstance(op, Operation):
        if args:
            raise TypeError(f"{op!r} carries its own arguments; got more: {args!r}")
        return op
    make = _BY_NAME.get(op)
    if make is None:
        raise ValueError(f"unknown worker operation {op!r}; one of {sorted(_BY_NAME)} or an Operation")
    result: Operation = make(*args)
    return result
