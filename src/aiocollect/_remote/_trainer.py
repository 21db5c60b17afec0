"""What the collectors hosted on nodes (``DistributedCollector``, ``DistributedSyncCollector``,
``RPCCollector``) share on the trainer: their keywords checked once into a :class:`NodePlan`, before any
node starts, and the node-only methods (:class:`NodeCollectorMixin`). The nodes themselves are a
transport (:class:`~._nodes.Nodes`) of the one :class:`~aiocollect._fleet._collector.FleetCollector`;
what they and the actors answer alike is :class:`Hosts`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from .._core._options import RolloutOptions
from .._core._restart import RestartPolicy
from .._core._validation import flag, positive_int, total_frames_arg
from .._fleet._transport import FleetHandle, FleetSetup, Transport
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
from ._keywords import NodeKeywords
from ._launchers import Launcher, make_launcher
from ._node import RESTARTS_ATTR

T = TypeVar("T", bound=Transport)

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

    def setup(self, progress: Any) -> FleetSetup:
        """What the fleet over these nodes is set up with (a group is relaunched only by a launcher that
        starts its nodes)."""
        n, sync = self.num_nodes, self.sync
        return FleetSetup(
            size=n,
            sync=sync,
            total_frames=self.total_frames,
            frames_per_batch=self.node_fpb * n if sync else self.node_fpb,
            policy=self.policy,
            weights_template=self.weights.template,
            seed=self.seed,
            progress=progress,
            restart=self.restart if self.launcher.relaunchable else None,
        )


def node_plan(create_env_fn: Any, policy: Any, kw: NodeKeywords, *, sync: bool, owner: str) -> NodePlan:
    """The keywords of a node collector (``owner``, its class name in errors; ``kw`` filled) checked; the
    env constructors and collector arguments pickled here (small: a bad one fails now), the policy (which
    can be large) once and in a thread when the collector is entered."""
    env_fns = _env_fns_arg(create_env_fn, kw["num_collectors"])
    n, collector_class = len(env_fns), kw["collector_class"]
    policy = check_policy(policy)
    if not (isinstance(collector_class, type) and issubclass(collector_class, _COLLECTOR_CLASSES)):
        raise TypeError(
            "collector_class must be Collector, MultiSyncCollector or MultiAsyncCollector, got "
            f"{collector_class!r}"
        )
    sync = flag("sync", sync)
    node_fpb = split_frames(kw["frames_per_batch"], n, sync, "node")
    workers = positive_int("num_workers_per_collector", kw["num_workers_per_collector"])
    if collector_class is Collector and workers != 1:
        raise ValueError("num_workers_per_collector > 1 needs collector_class=MultiSyncCollector/Async")
    per_node, seed = collector_kwargs_arg(kw["collector_kwargs"], n, owner, "node")
    per_node = with_restart(per_node, kw["restart"])
    weights = weight_plan(policy, kw)
    launcher = make_launcher(kw["launcher"], kw["slurm_kwargs"])
    tcp_port, trainer_address = kw["tcp_port"], kw["trainer_address"]
    if tcp_port is not None and (
        isinstance(tcp_port, bool) or not isinstance(tcp_port, int) or not 0 <= tcp_port < 65536
    ):
        raise ValueError(f"tcp_port must be a port number or None, got {tcp_port!r}")
    if trainer_address is not None and (not isinstance(trainer_address, str) or not trainer_address):
        raise TypeError(
            f"trainer_address must be the host name or IP address the nodes reach the trainer at, got "
            f"{trainer_address!r}"
        )
    timeout = seconds_or_none("progress_timeout", kw["progress_timeout"])
    env_args = [fn if collector_class is Collector else [fn] * workers for fn in env_fns]
    check_keywords(collector_class, per_node)
    rollouts = member_rollouts(per_node, node_fpb)  # checked here, before any node starts
    return NodePlan(
        policy,
        total_frames_arg(kw["total_frames"]),
        sync,
        node_fpb,
        workers,
        seed,
        weights,
        payloads(env_args, collector_class, per_node, "node"),
        rollouts,
        launcher,
        tcp_port or 0,
        trainer_address,
        timeout,
        kw["restart"],
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


class _Node(Protocol):
    @property
    def pid(self) -> int | None: ...


class _NodeTransport(Transport, Protocol):
    @property
    def nodes(self) -> Sequence[_Node]: ...


class NodeCollectorMixin:
    """The node collectors' own methods, beside the fleet's surface (the collector keeps its plan and its
    nodes, ``_plan`` and ``_nodes``)."""

    frames_per_batch: int
    total_frames: int
    _sync: bool
    _closed: bool
    _plan: NodePlan
    _nodes: _NodeTransport

    if TYPE_CHECKING:

        def _init_fleet(self, setup: FleetSetup, transport: Callable[[FleetHandle], T]) -> T: ...

    def _init_nodes(
        self,
        create_env_fn: Any,
        policy: Any,
        kw: NodeKeywords,
        *,
        sync: bool,
        transport: Callable[..., _NodeTransport],
    ) -> None:
        """The keywords checked into the collector's plan, then the fleet set up over its nodes
        (``transport(handle, plan=plan)``)."""
        self._plan = plan = node_plan(create_env_fn, policy, kw, sync=sync, owner=type(self).__name__)
        self._nodes = self._init_fleet(plan.setup(kw["progress"]), partial(transport, plan=plan))

    @property
    def num_collectors(self) -> int:
        return self._plan.num_nodes

    @property
    def num_workers_per_collector(self) -> int:
        return self._plan.num_workers_per_collector

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

    fleet: FleetHandle
    versioned: bool

    def restarted(self, member: Any, records: Sequence[tuple[int, str, int]]) -> None:
        """``member`` (a node or actor) restarted its envs (``records``, as they happened: ``(env, cause,
        restarts)`` each): counted in its ``restarts``, a ``Restarted`` event each, as for a worker."""
        for env, cause, restarts in records:
            member.restarts += 1
            self.fleet.publish(Restarted(member.index, int(env), str(cause), int(restarts)))

    def failed(self, member: Any, error: BaseException) -> None:
        """``member`` failed with ``error``: the restarts its collector made before (they travel with its
        error, ``RESTARTS_ATTR``), then its ``WorkerFailed`` event."""
        self.restarted(member, vars(error).pop(RESTARTS_ATTR, ()))
        self.fleet.publish(WorkerFailed(member.index, f"{type(error).__name__}: {error}"))

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
                f"{fleet.name}.state_dict(envs=True): each {fleet.member_noun} collects ahead "
                "of the batch delivered, so its envs' state is past the checkpoint; save without envs=True "
                "(the envs then start from reset when the checkpoint is loaded)"
            )

    async def saved_policy(self, states: list[Any]) -> Any:
        """Versioned states carry the policy apart: the first member's is saved, once."""
        policies = [s.pop("policy", None) for s in states] if self.versioned else [None]
        return policies[0] if policies else None


__all__ = ["NOT_REPLACED", "UNSET", "Hosts", "NodeCollectorMixin", "NodePlan", "node_plan"]
