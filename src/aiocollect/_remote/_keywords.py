"""The remote collectors' keywords, written once: :class:`RemoteKeywords` (what every one takes: the frames,
the collector each member hosts and its keywords, the weight schedule, the restart policy), the node
collectors' (:class:`NodeKeywords`: how the nodes are launched and reached; ``DistributedCollector``,
``DistributedSyncCollector``, ``RPCCollector`` add theirs) and ``RayCollector``'s. Each constructor takes its
list as ``**kwargs: Unpack[...]`` (mypy and IDEs show the keywords; ``help()`` too, through
``explicit_keywords``) and hands it on, filled, to the plan it is checked into (``_trainer.node_plan``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Required, TypedDict

from .._core._mistakes import Default
from .._core._options import WeightSchedule
from .._core._restart import RestartPolicy
from .._local._collector import Collector
from ._args import UNSET

__all__ = [
    "DEFAULT_PROGRESS_TIMEOUT",
    "DistributedKeywords",
    "DistributedSyncKeywords",
    "NodeKeywords",
    "RPC_TIMEOUT",
    "RPCKeywords",
    "RayKeywords",
    "RemoteKeywords",
]

#: default ``progress_timeout``: seconds a node may take to deliver one batch before it counts as hung
DEFAULT_PROGRESS_TIMEOUT = 600.0
#: default ``rpc_timeout``: seconds for RPC's rendezvous and its calls other than batches
RPC_TIMEOUT = 120.0


class RemoteKeywords(TypedDict, total=False):
    """What every remote collector takes."""

    frames_per_batch: Required[int]
    total_frames: Annotated[int | None, Default(-1)]
    collector_class: Annotated[type, Default(Collector)]
    collector_kwargs: Annotated[Mapping[str, Any] | Sequence[Mapping[str, Any]] | None, Default(None)]
    update_at_each_batch: Annotated[bool, Default(False)]
    max_weight_update_interval: Annotated[int | None, Default(None)]
    progress_timeout: Annotated[float | None, Default(DEFAULT_PROGRESS_TIMEOUT)]
    progress: Annotated[Any, Default(None)]
    update_after_each_batch: Annotated[Any, Default(UNSET)]
    weights: Annotated[WeightSchedule | None, Default(None)]
    restart: Annotated[RestartPolicy | None, Default(None)]


class NodeKeywords(RemoteKeywords, total=False):
    """What the collectors hosted on nodes (torch.distributed, RPC) take."""

    num_collectors: Annotated[int | None, Default(None)]
    num_workers_per_collector: Annotated[int, Default(1)]
    launcher: Annotated[Any, Default("mp")]
    slurm_kwargs: Annotated[Mapping[str, Any] | None, Default(None)]
    tcp_port: Annotated[int | None, Default(None)]
    trainer_address: Annotated[str | None, Default(None)]


class DistributedKeywords(NodeKeywords, total=False):
    """``DistributedCollector``'s keywords."""

    backend: Annotated[str, Default("gloo")]
    sync: Annotated[bool, Default(False)]


class DistributedSyncKeywords(NodeKeywords, total=False):
    """``DistributedSyncCollector``'s keywords (``sync=True`` only)."""

    backend: Annotated[str, Default("gloo")]
    sync: Annotated[bool, Default(True)]


class RPCKeywords(NodeKeywords, total=False):
    """``RPCCollector``'s keywords."""

    tensorpipe_options: Annotated[Mapping[str, Any] | None, Default(None)]
    rpc_timeout: Annotated[float, Default(RPC_TIMEOUT)]
    sync: Annotated[bool, Default(False)]


class RayKeywords(RemoteKeywords, total=False):
    """``RayCollector``'s keywords."""

    num_collectors: Required[int]
    remote_config: Annotated[Mapping[str, Any] | Sequence[Mapping[str, Any]] | None, Default(None)]
    ray_init_config: Annotated[Mapping[str, Any] | None, Default(None)]
    sync: Annotated[bool, Default(False)]
    replay_buffer: Annotated[Any, Default(None)]
