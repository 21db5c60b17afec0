"""The collector surface every engine that hosts our collectors on nodes shares (``DistributedCollector``,
``RPCCollector``): its arguments, the iteration (sync and async), weights and control. The nodes
themselves (launching, connections, failures) are :class:`~._nodes.NodeFleet`'s."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, cast

import anyio.to_thread
import torch
from tensordict import TensorDictBase

from .._events import WeightsPublished
from .._fleet import Member
from .._gather import gather
from .._local._collector import Collector
from .._multi._async import MultiAsyncCollector
from .._multi._renames import DroppedBatchRenames
from .._multi._sync import MultiSyncCollector
from .._options import WeightSchedule
from .._stats import WorkerState
from .._transport._messages import FleetOp, GetAttr, GetState, LoadState
from .._transport._store import StoreClient, StoreServer
from .._validation import flag, positive_int, total_frames_arg
from ._args import (
    UNSET,
    check_keywords,
    check_policy,
    collector_kwargs_arg,
    member_rollouts,
    payloads,
    seconds_or_none,
    split_frames,
    weight_plan,
)
from ._launchers import (
    Launcher,
    make_launcher,
)
from ._messages import NodeBatch
from ._nodes import DEFAULT_PROGRESS_TIMEOUT, Failure, NodeFleet, RemoteNode

_COLLECTOR_CLASSES = (Collector, MultiSyncCollector, MultiAsyncCollector)


class RemoteCollectorBase(NodeFleet):
    """What :class:`DistributedCollector` and :class:`RPCCollector` share: arguments, launching and
    reaping nodes, the control connections, the iteration (sync and async), weights, control, statistics.
    Subclasses supply the transport of batches and weights."""

    def __init__(
        self,
        create_env_fn: Any,
        policy: Any = None,
        *,
        frames_per_batch: int,
        total_frames: int | None = -1,
        sync: bool = False,
        num_collectors: int | None = None,
        collector_class: type = Collector,
        collector_kwargs: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        num_workers_per_collector: int = 1,
        launcher: Any = "mp",
        slurm_kwargs: Mapping[str, Any] | None = None,
        tcp_port: int | None = None,
        trainer_address: str | None = None,
        progress_timeout: float | None = DEFAULT_PROGRESS_TIMEOUT,
        update_at_each_batch: bool = False,
        max_weight_update_interval: int | None = None,
        progress: Any = None,
        update_after_each_batch: Any = UNSET,
        weights: WeightSchedule | None = None,
    ) -> None:
        env_fns = self._env_fns_arg(create_env_fn, num_collectors)
        n = self.num_collectors = len(env_fns)
        check_policy(policy)
        if not (isinstance(collector_class, type) and issubclass(collector_class, _COLLECTOR_CLASSES)):
            raise TypeError(
                "collector_class must be Collector, MultiSyncCollector or MultiAsyncCollector, got "
                f"{collector_class!r}"
            )
        self._sync = flag("sync", sync)
        self.total_frames = total_frames_arg(total_frames)
        self._node_fpb = split_frames(frames_per_batch, n, self._sync, "node")
        self.frames_per_batch = self._node_fpb * n if self._sync else self._node_fpb
        self.num_workers_per_collector = positive_int("num_workers_per_collector", num_workers_per_collector)
        if collector_class is Collector and self.num_workers_per_collector != 1:
            raise ValueError("num_workers_per_collector > 1 needs collector_class=MultiSyncCollector/Async")
        per_node, self._seed = collector_kwargs_arg(collector_kwargs, n, type(self).__name__, "node")
        # -- weights
        self._source_policy = policy
        plan = weight_plan(
            policy, update_at_each_batch, max_weight_update_interval, update_after_each_batch, weights
        )
        self._weights_template = plan.template
        self._after_each, self._interval = plan.at_each_batch, plan.interval or 0
        self._launch_args(launcher, slurm_kwargs, tcp_port, trainer_address, progress_timeout)
        # the env constructors and collector arguments are pickled here (small: a bad one fails now); the
        # policy, which can be large, once and in a thread when the collector is entered
        workers = self.num_workers_per_collector
        env_args = [fn if collector_class is Collector else [fn] * workers for fn in env_fns]
        check_keywords(collector_class, per_node)
        self._rollouts = member_rollouts(per_node, self._node_fpb)  # checked here, before any node starts
        self._payloads = payloads(env_args, collector_class, per_node, "node")
        self._policy_payload = b""
        self.replay_buffer = None
        self._init_base(progress)
        self._init_state()
        #: per node, the oldest trainer version a delivered batch may have (update_weights(flush=True)),
        #: and the frames of the batches dropped below it
        self._floors = [0] * n
        self._dropped_frames = 0
        #: trajectories that go on after a dropped batch take fresh ids (no delivered id spans a gap)
        self._renames = DroppedBatchRenames()
        #: the authenticated store of the collector's groups, served here, and the trainer's own client
        self._store_server: StoreServer | None = None
        self._store: StoreClient | None = None

    @staticmethod
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

    def _launch_args(
        self,
        launcher: Any,
        slurm_kwargs: Mapping[str, Any] | None,
        tcp_port: int | None,
        trainer_address: str | None,
        progress_timeout: float | None,
    ) -> None:
        self._launcher: Launcher = make_launcher(launcher, slurm_kwargs)
        if tcp_port is not None and (
            isinstance(tcp_port, bool) or not isinstance(tcp_port, int) or not 0 <= tcp_port < 65536
        ):
            raise ValueError(f"tcp_port must be a port number or None, got {tcp_port!r}")
        self._tcp_port = tcp_port or 0
        if trainer_address is not None and (not isinstance(trainer_address, str) or not trainer_address):
            raise TypeError(
                f"trainer_address must be the host name or IP address the nodes reach the trainer at, got "
                f"{trainer_address!r}"
            )
        self._trainer_address = trainer_address
        self._progress_timeout = seconds_or_none("progress_timeout", progress_timeout)

    # -- iteration ------------------------------------------------------------------------------------
    async def __anext__(self) -> TensorDictBase | None:
        await self._batch_turn()
        try:
            if self._failure is not None:
                raise self._failure
            if self._sync:
                batch, frames, episodes, worker, version = await self._next_sync()
            else:
                batch, frames, episodes, worker, version = await self._next_async()
            self._record(frames, episodes, worker_id=worker, policy_version=version)
            return batch
        finally:
            self._lock.release()

    async def _fetch(self, node: RemoteNode) -> NodeBatch:
        result = await self._fetch_batch(node)
        node.frames += result.frames
        node.since_update += 1
        node.fresh = True
        return result

    def _update_due(self, node: RemoteNode) -> bool:
        return (self._after_each and node.fresh) or (
            self._interval > 0 and node.since_update >= self._interval
        )

    async def _next_sync(self) -> tuple[TensorDictBase, int, list[Any], int | None, int]:
        due = [node.index for node in self._nodes if self._update_due(node)]
        if due:
            await self.update_weights(worker_ids=due)
        results = await self._guard(lambda: gather(*[partial(self._fetch, node) for node in self._nodes]))
        shapes = {tuple(r.batch.batch_size) for r in results}
        if len(shapes) > 1:
            raise ValueError(
                f"sync=True stacks one batch per node; the nodes' batches differ: {sorted(shapes)}"
            )
        batch = cast("TensorDictBase", torch.stack([r.batch for r in results], 0))
        batch.names = [None] * (batch.ndim - 1) + ["time"]
        episodes = [(i, ret, n) for i, r in enumerate(results) for ret, n in r.episodes]
        frames = sum(r.frames for r in results)
        return batch, frames, episodes, None, min(r.policy_version for r in results)

    def _node_frames(self, node: RemoteNode) -> int:
        return node.ready.frames_per_batch if node.ready is not None else self._node_fpb

    async def _top_up(self, eager: bool) -> None:
        """Ask idle nodes for their next batch (what the budget still needs); nodes due for weights get
        them first. ``eager`` (right after a delivery) leaves ``update_at_each_batch`` nodes for the
        next ``__anext__``, so that they get the weights trained on that batch."""
        chosen, due = [], []
        for node in self._nodes:
            if node.in_flight or node.state != WorkerState.COLLECTING:
                continue
            if eager and self._after_each and node.fresh:
                continue
            if 0 < self.total_frames <= self._stats.frames + self._outstanding:
                break
            chosen.append(node)
            self._outstanding += self._node_frames(node)
            node.in_flight = True
            if self._update_due(node):
                due.append(node.index)
        if due:
            await self.update_weights(worker_ids=due)
        assert self._io is not None
        for node in chosen:
            self._io.start_soon(self._fetch_task, node)

    async def _fetch_task(self, node: RemoteNode) -> None:
        try:
            result = await self._fetch(node)
        except Exception as exc:
            if self._failure is None:
                self._fail(node, exc)
            return
        finally:
            node.in_flight = False
        self._deliveries_send.send_nowait((node.index, result))

    async def _next_async(self) -> tuple[TensorDictBase, int, list[Any], int | None, int]:
        while True:
            await self._top_up(eager=False)
            item = await self._deliveries.receive()
            if isinstance(item, Failure):
                self._deliveries_send.send_nowait(item)
                raise item.error
            index, result = item
            node = self._nodes[index]
            self._outstanding -= self._node_frames(node)
            if result.policy_version >= self._floors[index]:
                break
            # collected before an update_weights(flush=True) reached its node: dropped, asked for again
            self._dropped_frames += result.frames
            self._renames.dropped(index)
        batch = result.batch
        self._renames.delivered(index, batch)
        batch.set(("collector", "node_id"), torch.full(batch.batch_size, index, dtype=torch.int64))
        batch.names = [None] * (batch.ndim - 1) + ["time"]
        await self._top_up(eager=True)
        episodes = [(index, ret, n) for ret, n in result.episodes]
        return batch, result.frames, episodes, index, result.policy_version

    # -- weights --------------------------------------------------------------------------------------
    async def update_weights(
        self,
        policy_or_weights: Any = None,
        *,
        worker_ids: Sequence[int] | None = None,
        wait: bool = False,
        flush: bool = False,
    ) -> int:
        """Send weights to the nodes and return the new policy version.

        A node loads them into its collector before its next batch; ``wait=True`` returns once every
        targeted node's collector runs them. Concurrent calls are serialised (versions strictly increase).
        ``flush=True`` (``sync=False``): a batch a targeted node collected with older weights is dropped
        when it arrives (counted in ``statistics().frames_discarded``) and the node asked for another, so
        every batch delivered afterwards runs the new weights. Rollouts in flight on the nodes finish
        before they are dropped (they are not preempted, as in ``MultiAsyncCollector``).

        Args:
            policy_or_weights: an ``nn.Module``, a TensorDict of weights or a state dict; ``None``: the
                policy the collector was built with (its current weights).
            worker_ids: the nodes to update (indices ``0 .. num_collectors - 1``; default: all).
            wait: also wait until those nodes run the new weights.
            flush: deliver nothing collected with older weights from now on.
        """
        self._active()
        weights = self._weights_to_publish(policy_or_weights)
        flag("wait", wait)
        flag("flush", flush)
        ids = self._target_ids(worker_ids)
        async with self._weights_lock:
            if self._failure is not None:
                raise self._failure
            version = self._version + 1
            await self._guard(partial(self._send_weights, weights, version, ids))
            self._version = version
            for i in ids:
                self._nodes[i].since_update = 0
                self._nodes[i].fresh = False
                if flush:
                    self._floors[i] = version
            self._hub.publish(WeightsPublished(version))
        if wait:
            await self._guard(
                lambda: gather(*[partial(self._wait_loaded, self._nodes[i], version) for i in ids])
            )
        return version

    def _frames_discarded(self) -> int:
        return self._dropped_frames

    async def _open_store(self, host: str, client_timeout: float) -> None:
        """Serve the collector's authenticated store on ``host`` and connect the trainer's client (whose
        operations time out after ``client_timeout`` seconds)."""
        self._store_server = server = StoreServer(host)
        self._store = await anyio.to_thread.run_sync(server.client, client_timeout)

    def _close_store(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._store_server is not None:
            self._store_server.close()
            self._store_server = None

    async def _wait_loaded(self, node: RemoteNode, version: int) -> None:
        while node.policy_version < version:
            await node.loaded_event.wait()

    # -- control --------------------------------------------------------------------------------------
    @property
    def _fleet_size(self) -> int:
        return self.num_collectors

    def _members(self) -> Sequence[Member]:
        return self._nodes

    async def _call_member(self, index: int, op: FleetOp) -> Any:
        return await self._guard(partial(self._call, self._nodes[index], op))

    async def _call_all(self, op: FleetOp) -> list[Any]:
        # one guard over the gather: a node failure ends every call at once
        calls = [partial(self._call, n, op) for n in self._nodes]
        replies: list[Any] = await self._guard(lambda: gather(*calls))
        return replies

    async def state_dict(self) -> dict[str, Any]:
        """Each node's collector state (``"node{i}"``) plus the counters and the policy version."""
        self._active()
        async with self._lock:
            states = await self._call_all(GetState())
        out: dict[str, Any] = {f"node{i}": s for i, s in enumerate(states)}
        out.update(self._counters())
        return out

    async def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; the frame budget continues from the saved count."""
        self._check_state(state, "node")
        self._active()
        async with self._lock:
            await self._guard(
                lambda: gather(
                    *[partial(self._call, n, LoadState(dict(state[f"node{n.index}"]))) for n in self._nodes]
                )
            )
            self._load_counters(state)

    async def getattr_env(self, name: str, node: int = 0) -> Any:
        """An attribute of node ``node``'s env (worker 0's, for a multi-process node)."""
        self._active()
        return await self._guard(partial(self._call, self._nodes[node], GetAttr("env", name)))

    async def getattr_policy(self, name: str, node: int = 0) -> Any:
        """An attribute of node ``node``'s policy."""
        self._active()
        return await self._guard(partial(self._call, self._nodes[node], GetAttr("policy", name)))

    def node_pids(self) -> list[int | None]:
        """The process id of each node (as each node reported it)."""
        return [n.pid for n in self._nodes]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_collectors={self.num_collectors}, frames_per_batch="
            f"{self.frames_per_batch}, total_frames={self.total_frames}, sync={self._sync}, "
            f"closed={self._closed})"
        )


__all__ = ["RemoteCollectorBase"]
