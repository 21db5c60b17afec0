"""What the collectors hosted on nodes (``DistributedCollector``, ``DistributedSyncCollector``,
``RPCCollector``) share on the trainer: their keywords checked once into a :class:`NodePlan`, before any
node starts, and the node-only methods (:class:`NodeCollectorMixin`). The nodes themselves are a
transport (:class:`~._nodes.Nodes`) of the one :class:`~aiocollect._fleet._collector.FleetCollector`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from .._core._options import RolloutOptions, WeightSchedule
from .._core._restart import RestartPolicy
from .._core._validation import flag, positive_int, total_frames_arg
from .._local._collector import Collector
from .._multi._async import MultiAsyncCollector
from .._multi._sync import MultiSyncCollector
from .._observe._events import Restarted, WorkerFailed
from ._args import (
    UNSET,
    WeightPlan,
    check_keywords,
    check_policy,
    collector_kwargs_arg,
    member_rollouts,
    payloads,
    seconds_or_none,
    split_frames,
    weight_plan,
    with_restart,
)
from ._launchers import Launcher, make_launcher
from ._node import RESTARTS_ATTR

if TYPE_CHECKING:
    from .._fleet._collector import FleetCollector, Transport
    from ._nodes import Nodes

_COLLECTOR_CLASSES = (Collector, MultiSyncCollector, MultiAsyncCollector)
#: why a node that died under a restart policy ends the run all the same
NOT_REPLACED = (
    "restart=RestartPolicy(...): a {engine} node is not replaced: its process group cannot take in a new "
    'rank, so the whole group is relaunched instead, which needs a launcher that starts the nodes ("mp", '
    '"submitit"); nodes started outside the trainer ("submitit_delayed") cannot be. Their envs are '
    "restarted inside them"
)


@dataclass(frozen=True)
class NodePlan:
    """A node collector's keywords, checked: what its nodes run and how they are launched."""

    policy: Any
    total_frames: int
    sync: bool
    #: frames of one node's batch
    node_fpb: int
    num_workers_per_collector: int
    seed: int | None
    weights: WeightPlan
    #: per node: the pickled env constructors and collector arguments, and its rollout options
    payloads: list[bytes]
    rollouts: list[RolloutOptions]
    launcher: Launcher
    tcp_port: int
    trainer_address: str | None
    progress_timeout: float | None
    #: the policy the nodes' envs restart under, and the group's relaunches (``_relaunch``)
    restart: RestartPolicy | None = None

    @property
    def num_nodes(self) -> int:
        return len(self.payloads)


def node_plan(
    create_env_fn: Any,
    policy: Any,
    *,
    frames_per_batch: int,
    total_frames: int | None,
    sync: bool,
    num_collectors: int | None,
    collector_class: type,
    collector_kwargs: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None,
    num_workers_per_collector: int,
    launcher: Any,
    slurm_kwargs: Mapping[str, Any] | None,
    tcp_port: int | None,
    trainer_address: str | None,
    progress_timeout: float | None,
    update_at_each_batch: bool,
    max_weight_update_interval: int | None,
    update_after_each_batch: Any,
    weights: WeightSchedule | None,
    owner: str,
    restart: RestartPolicy | None = None,
) -> NodePlan:
    """The keywords of a node collector (``owner``, its class name in errors) checked; the env
    constructors and collector arguments pickled here (small: a bad one fails now), the policy (which can
    be large) once and in a thread when the collector is entered."""
    env_fns = _env_fns_arg(create_env_fn, num_collectors)
    n = len(env_fns)
    policy = check_policy(policy)
    if not (isinstance(collector_class, type) and issubclass(collector_class, _COLLECTOR_CLASSES)):
        raise TypeError(
            "collector_class must be Collector, MultiSyncCollector or MultiAsyncCollector, got "
            f"{collector_class!r}"
        )
    sync = flag("sync", sync)
    total = total_frames_arg(total_frames)
    node_fpb = split_frames(frames_per_batch, n, sync, "node")
    workers = positive_int("num_workers_per_collector", num_workers_per_collector)
    if collector_class is Collector and workers != 1:
        raise ValueError("num_workers_per_collector > 1 needs collector_class=MultiSyncCollector/Async")
    per_node, seed = collector_kwargs_arg(collector_kwargs, n, owner, "node")
    per_node = with_restart(per_node, restart)
    plan = weight_plan(
        policy, update_at_each_batch, max_weight_update_interval, update_after_each_batch, weights
    )
    made = make_launcher(launcher, slurm_kwargs)
    if tcp_port is not None and (
        isinstance(tcp_port, bool) or not isinstance(tcp_port, int) or not 0 <= tcp_port < 65536
    ):
        raise ValueError(f"tcp_port must be a port number or None, got {tcp_port!r}")
    if trainer_address is not None and (not isinstance(trainer_address, str) or not trainer_address):
        raise TypeError(
            f"trainer_address must be the host name or IP address the nodes reach the trainer at, got "
            f"{trainer_address!r}"
        )
    timeout = seconds_or_none("progress_timeout", progress_timeout)
    env_args = [fn if collector_class is Collector else [fn] * workers for fn in env_fns]
    check_keywords(collector_class, per_node)
    rollouts = member_rollouts(per_node, node_fpb)  # checked here, before any node starts
    return NodePlan(
        policy=policy,
        total_frames=total,
        sync=sync,
        node_fpb=node_fpb,
        num_workers_per_collector=workers,
        seed=seed,
        weights=plan,
        payloads=payloads(env_args, collector_class, per_node, "node"),
        rollouts=rollouts,
        launcher=made,
        tcp_port=tcp_port or 0,
        trainer_address=trainer_address,
        progress_timeout=timeout,
        restart=restart,
    )


def _env_fns_arg(create_env_fn: Any, num_collectors: int | None) -> list[Any]:
    """One env constructor per node."""
    if isinstance(create_env_fn, Sequence) and not isinstance(create_env_fn, (str, bytes)):
        env_fns = list(create_env_fn)
        if num_collectors is None:
            num_collectors = len(env_fns)
        if len(env_fns) != num_collectors:
            raise ValueError(
                f"{len(env_fns)} env constructors for num_collectors={num_collectors}: give one per node "
                "or a single one"
            )
    else:
        if num_collectors is None:
            raise TypeError("num_collectors= is needed (or a list of env constructors, one per node)")
        env_fns = [create_env_fn] * positive_int("num_collectors", num_collectors)
    positive_int("num_collectors", num_collectors)
    for i, fn in enumerate(env_fns):
        if not callable(fn):
            raise TypeError(f"create_env_fn[{i}] must be a callable returning an env, got {fn!r}")
    return env_fns


def init_nodes(fleet: FleetCollector, nodes: Nodes, plan: NodePlan, progress: Any) -> None:
    """Hand ``nodes`` and the checked keywords to ``fleet`` (a node collector being built)."""
    fleet.num_collectors = plan.num_nodes  # type: ignore[attr-defined]
    fleet.num_workers_per_collector = plan.num_workers_per_collector  # type: ignore[attr-defined]
    fleet._init_fleet(
        nodes,
        size=plan.num_nodes,
        sync=plan.sync,
        total_frames=plan.total_frames,
        frames_per_batch=plan.node_fpb * plan.num_nodes if plan.sync else plan.node_fpb,
        policy=plan.policy,
        weights_template=plan.weights.template,
        seed=plan.seed,
        progress=progress,
    )


class NodeCollectorMixin:
    """The node collectors' own methods, beside the fleet's surface."""

    num_collectors: int
    num_workers_per_collector: int
    frames_per_batch: int
    total_frames: int
    _sync: bool
    _closed: bool

    if TYPE_CHECKING:
        _transport: Transport

    @property
    def _nodes(self) -> Nodes:
        return cast("Nodes", self._transport)

    def node_pids(self) -> list[int | None]:
        """The process id of each node (as each node reported it)."""
        return [n.pid for n in self._nodes.nodes]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_collectors={self.num_collectors}, frames_per_batch="
            f"{self.frames_per_batch}, total_frames={self.total_frames}, sync={self._sync}, "
            f"closed={self._closed})"
        )


class Hosts:
    """What the transports whose members each host a collector (``Nodes``, ``RayActors``) answer alike:
    a member collects ahead of the batch delivered (no env state in a checkpoint) and drops nothing itself;
    the collector drops what arrives below a floor."""

    fleet: FleetCollector
    versioned: bool

    def restarted(self, member: Any, records: Sequence[tuple[int, str, int]]) -> None:
        """``member`` (a node or actor) restarted its envs (``records``, as they happened: ``(env, cause,
        restarts)`` each): counted in its ``restarts``, a ``Restarted`` event each, as for a worker."""
        for env, cause, restarts in records:
            member.restarts += 1
            self.fleet._hub.publish(Restarted(member.index, int(env), str(cause), int(restarts)))

    def failed(self, member: Any, error: BaseException) -> None:
        """``member`` failed with ``error``: the restarts its collector made before (they travel with its
        error, ``RESTARTS_ATTR``), then its ``WorkerFailed`` event."""
        self.restarted(member, vars(error).pop(RESTARTS_ATTR, ()))
        self.fleet._hub.publish(WorkerFailed(member.index, f"{type(error).__name__}: {error}"))

    async def published(self, version: int, ids: list[int], raised: list[int]) -> None:
        """Nothing waits here: a stale batch is dropped when it arrives (``FleetCollector._stale``)."""

    async def load_behind(self, raised: list[int]) -> None:
        """Nothing: a member loads the new weights before its next batch."""

    def discarded(self) -> int:
        return 0

    def check_env_state(self, envs: bool) -> None:
        if envs:
            fleet = self.fleet
            raise ValueError(
                f"{type(fleet).__name__}.state_dict(envs=True): each {fleet._member_noun} collects ahead "
                "of the batch delivered, so its envs' state is past the checkpoint; save without envs=True "
                "(the envs then start from reset when the checkpoint is loaded)"
            )

    async def saved_policy(self, states: list[Any]) -> Any:
        """Versioned states carry the policy apart: the first member's is saved, once."""
        policies = [s.pop("policy", None) for s in states] if self.versioned else [None]
        return policies[0] if policies else None


__all__ = ["NOT_REPLACED", "UNSET", "Hosts", "NodeCollectorMixin", "NodePlan", "init_nodes", "node_plan"]
