"""What the trainer and a hosted collector (a torch.distributed or RPC node, a Ray actor) say to each other.

Two kinds: the **messages** of a node's control connection (set-up, batch requests and notices, weight
acknowledgements, close) and the **control operations** a trainer asks of a hosted collector: the fleet's
own (seed, reset, state dict, an attribute of its env or policy), the same classes a worker answers, from
:mod:`aiocollect._transport._messages`, and the remote-only ones here (``WaitLoaded``, ``NextBatch``,
``StageWeights``), one frozen dataclass per operation. Every engine sends the same operation objects;
:meth:`aiocollect._remote._node.NodeCore.call` answers them, dispatching on their type (never on a
string).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tensordict import TensorDictBase

from .._core._errors import RemoteFailure
from .._core._options import RolloutOptions
from .._transport._messages import GetAttr, GetState, LoadState, Operation, Reset, SetSeed


# -- the set-up of a hosted collector ---------------------------------------------------------------
@dataclass(frozen=True)
class HostSpec:
    """What a node or actor builds: its rollout options (typed, checked on the trainer: frames per batch,
    its slice of the trajectory ids, the rollout keywords of ``collector_kwargs``), and the pickled env
    constructor(s), collector class, other collector keywords and policy (unpickled there, never on the
    way)."""

    index: int
    num_nodes: int
    payload: bytes  # cloudpickle of (the collector's first argument, collector_class, other kwargs)
    policy_payload: bytes  # cloudpickle of the policy (the same bytes for every node)
    rollout: RolloutOptions

    @property
    def frames_per_batch(self) -> int:
        return self.rollout.batch_frames()


@dataclass(frozen=True)
class Setup:
    """Trainer -> node, first message: what to build and how to reach the data plane."""

    engine: str  # module of aiocollect._remote that runs the node (``_gloo``, ``_rpc``)
    spec: HostSpec
    transport: dict[str, Any]

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def num_nodes(self) -> int:
        return self.spec.num_nodes


# -- node -> trainer ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeReady:
    """The node's collector runs; its own ``frames_per_batch``."""

    pid: int
    host: str
    frames_per_batch: int


@dataclass(frozen=True)
class BatchNotice:
    """A batch is on its way over the data plane (``layout`` ``None``: the previous one)."""

    seq: int
    frames: int
    layout: Any
    episodes: list[tuple[float, int]]
    policy_version: int
    #: the node's time split so far (``_timesplit.producer_totals``; empty from a node without one)
    time_split: tuple[Any, ...] = ()


@dataclass(frozen=True)
class NodeRestarts:
    """The node's collector restarted envs (or worker processes) just now: ``(env, cause, restarts)`` per
    ``Restarted`` event, sent as they happen (batch or not)."""

    records: tuple[tuple[int, str, int], ...]


@dataclass(frozen=True)
class Loaded:
    """The node's collector runs the trainer's weights ``version``."""

    version: int


@dataclass(frozen=True)
class CallFailed:
    """A call raised on the node; the node goes on."""

    error: RemoteFailure


@dataclass
class NodeBatch:
    """One batch of a hosted collector as the trainer counts it."""

    batch: TensorDictBase
    frames: int
    episodes: list[tuple[float, int]]
    policy_version: int
    #: its collector's time split so far: one ``_timesplit.Totals`` per producer (``producer_totals``)
    time_split: tuple[Any, ...] = ()

    def notice(self, seq: int, layout: Any) -> BatchNotice:
        """The :class:`BatchNotice` that announces it (``layout`` ``None``: the previous batch's); its
        collector's restarts travel apart, as they happen (:class:`NodeRestarts`)."""
        return BatchNotice(seq, self.frames, layout, self.episodes, self.policy_version, self.time_split)


# -- trainer -> node ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Collect:
    """Collect one batch and send it (the reply is a :class:`BatchNotice` with the same ``seq``)."""

    seq: int


@dataclass(frozen=True)
class Close:
    """Close the collector and exit."""


@dataclass(frozen=True)
class Request:
    """A control operation; the reply is a ``Result`` with the same ``request_id`` (its value, or a
    :class:`CallFailed`)."""

    request_id: int
    op: ControlOp


# -- control operations: the fleet's (``FleetOp``, from the transport layer) and the remote-only ones ----
@dataclass(frozen=True)
class WaitLoaded(Operation):
    """Wait until the collector runs the trainer's weights ``version``; the reply is the version it runs."""

    version: int


@dataclass(frozen=True)
class NextBatch(Operation):
    """RPC only: collect one batch and return it."""


@dataclass(frozen=True)
class StageWeights(Operation):
    """RPC only: load these flat weights (``{"a.b": tensor}``) as the trainer's ``version`` before the
    next batch."""

    weights: dict[str, Any]
    version: int


#: the operations :meth:`NodeCore.call` answers
ControlOp = SetSeed | Reset | GetState | LoadState | GetAttr | WaitLoaded | NextBatch | StageWeights


__all__ = [
    "BatchNotice",
    "CallFailed",
    "Close",
    "Collect",
    "ControlOp",
    "HostSpec",
    "Loaded",
    "NextBatch",
    "NodeBatch",
    "NodeReady",
    "NodeRestarts",
    "Request",
    "Setup",
    "StageWeights",
    "WaitLoaded",
]
