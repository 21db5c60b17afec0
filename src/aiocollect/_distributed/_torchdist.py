"""``DistributedCollector`` / ``DistributedSyncCollector``: nodes run our collectors, batches travel over a
private ``torch.distributed`` process group.

Roles: the trainer is rank 0, node ``i`` is rank ``i + 1``. Three channels connect them:

* **control**: one TCP connection per node (see ``_launchers``), framed pickles both ways: set-up,
  "collect one batch", calls (seed, state dict), weight-transfer notices, "close", and from the node its
  batch notices, results and errors. The trainer waits on it with ``anyio.wait_readable``; EOF means the
  node died. No store is polled.
* **data**: a process group of our own (a ``TCPStore`` and a ``ProcessGroupGloo``/``ProcessGroupNCCL``
  built directly, never ``init_process_group``), so the trainer's default group (DDP) is untouched. A node
  packs a batch into one contiguous byte buffer and ``send``s it; the first notice carries the layout
  (keys, dtypes, shapes), the trainer allocates one receive buffer per node and ``recv``s into it; the
  ``Work`` is waited on in a thread.
* **weights**: :class:`~aiocollect.DistributedWeightSync` (its own private group): one broadcast for all
  nodes, point-to-point sends for a subset; a node loads them into its collector between batches.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import itertools
import math
import os
import socket
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from math import prod
from typing import Any, cast

import anyio
import anyio.abc
import anyio.to_thread
import cloudpickle
import torch
import torch.distributed as dist
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from tensordict import TensorDict, TensorDictBase

from .._collector import Collector
from .._daemon import run_abandonable
from .._distributed_weights import DistributedWeightSync, master_store
from .._errors import RemoteFailure, WorkerTimeoutError, as_error, worker_died
from .._events import (
    EpisodeFinished,
    WeightsLoaded,
    WeightsPublished,
    WorkerFailed,
    WorkerStarted,
    WorkerStopped,
)
from .._fleet import FleetCollector, Member
from .._gather import gather
from .._multi import MultiAsyncCollector, MultiSyncCollector
from .._validation import flag, positive_int, seed_arg, total_frames_arg
from .._waiters import Waiter, WaiterTable
from .._weights import module_weights
from .._weightsync import flat_weights
from .._workers._wire import AsyncChannel, Call, Failed, Result
from ._launchers import (
    HELLO_SIZE,
    Launcher,
    NodeProcess,
    TrainerAddress,
    check_hello,
    make_launcher,
    new_token,
)

_ALIGN = 64
_RESERVED = (
    "frames_per_batch",
    "total_frames",
    "progress",
    "replay_buffer",
    "traj_id_start",
    "traj_id_stride",
)
#: seconds a node gets to close its collector (and reap its processes) after ``Close``
_CLOSE_GRACE = 15.0
#: the same for a hung node (it missed ``progress_timeout``): leaving ``async with`` takes about 3 s
_FAILED_CLOSE_GRACE = 2.0
#: default ``progress_timeout``: seconds a node may take to deliver one batch before it counts as hung
DEFAULT_PROGRESS_TIMEOUT = 600.0
_TIMEOUT = 120.0  # seconds: rendezvous and transfers of the data group


# -- messages --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """Trainer -> node, first message: what to build and how to reach the data plane."""

    engine: str  # module of aiocollect._distributed that runs the node
    index: int
    num_nodes: int
    payload: bytes  # cloudpickle of (env_fn, collector_class, collector_kwargs)
    policy_payload: bytes  # cloudpickle of the policy (the same bytes for every node)
    frames_per_batch: int
    num_workers: int
    transport: dict[str, Any]


@dataclass(frozen=True)
class NodeReady:
    pid: int
    host: str
    frames_per_batch: int


@dataclass(frozen=True)
class Collect:
    seq: int


@dataclass(frozen=True)
class BatchNotice:
    seq: int
    frames: int
    layout: Any  # None: the previous one
    episodes: list[tuple[float, int]]
    policy_version: int


@dataclass(frozen=True)
class Loaded:
    """The node's collector runs the trainer's weights ``version``."""

    version: int


@dataclass(frozen=True)
class CallFailed:
    """A call raised on the node; the node goes on."""

    error: RemoteFailure


@dataclass(frozen=True)
class Close:
    pass


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
def _timedelta(seconds: float) -> datetime.timedelta:
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
        options._timeout = _timedelta(timeout)
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
        options._timeout = _timedelta(timeout)
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    if backend == "ucc":
        return dist.ProcessGroupUCC(store, rank, world_size, _timedelta(timeout))
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


# -- the node: one of our collectors, whatever the engine ------------------------------------------
class NodeCore:
    """A node's collector, its weights (versions as the trainer numbers them) and its batches."""

    def __init__(self, setup: Setup) -> None:
        env_fn, cls, kwargs = cloudpickle.loads(setup.payload)
        policy = cloudpickle.loads(setup.policy_payload)
        kwargs = dict(kwargs)
        common = {
            "frames_per_batch": setup.frames_per_batch,
            "total_frames": -1,
            "progress": False,
            # node i of N takes trajectory ids i, i + N, ...: disjoint over nodes (and over each node's
            # workers, which split the node's ids again)
            "traj_id_start": setup.index,
            "traj_id_stride": setup.num_nodes,
        }
        if issubclass(cls, Collector):
            self.collector: Any = cls(env_fn, policy, **common, **kwargs)
        else:
            self.collector = cls([env_fn] * setup.num_workers, policy, **common, **kwargs)
        self.staging = copy.deepcopy(policy) if isinstance(policy, torch.nn.Module) else None
        self.iterator: Any = None
        self.events: Any = None
        # the trainer's version of the weights the collector runs, by the collector's own version
        self.outer_of_inner: dict[int, int] = {0: 0}
        self.received = 0  # newest trainer version received
        self.applied = 0  # newest trainer version the collector runs
        self._pending: tuple[int, TensorDictBase] | None = None
        self._wake = anyio.Event()
        self._applied_event = anyio.Event()

    async def __aenter__(self) -> NodeCore:
        await self.collector.__aenter__()
        self.events = self.collector.events(max_buffer=1 << 16)
        self.iterator = self.collector.__aiter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.events is not None:
            await self.events.aclose()
        await self.collector.__aexit__(*exc)

    # -- weights ------------------------------------------------------------------------------------
    def stage(self, version: int, weights: TensorDictBase) -> None:
        """Newest weights received (the applier task loads them into the collector)."""
        self._pending = (version, weights)
        self.received = max(self.received, version)
        self._wake.set()

    async def run_applier(self, on_loaded: Callable[[int], Any]) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            pending, self._pending = self._pending, None
            if pending is None:
                continue
            version, weights = pending
            inner = await self.collector.update_weights(weights, wait=True)
            self.outer_of_inner[int(inner)] = version
            self.applied = max(self.applied, version)
            self._applied_event.set()
            self._applied_event = anyio.Event()
            await on_loaded(version)

    async def wait_applied(self, version: int) -> None:
        while self.applied < version:
            await self._applied_event.wait()

    # -- batches ------------------------------------------------------------------------------------
    async def next_batch(self) -> tuple[TensorDictBase, int, list[tuple[float, int]], int]:
        """The next batch (weights received before the request are loaded first), its valid frames, the
        episodes that ended in it and the trainer's policy version it was collected with."""
        await self.wait_applied(self.received)
        before = self.collector.statistics().frames
        batch = await self.iterator.__anext__()
        frames = self.collector.statistics().frames - before
        episodes = []
        while (event := self.events.receive_nowait()) is not None:
            if isinstance(event, EpisodeFinished):
                episodes.append((event.episode_return, event.length))
        key = ("collector", "policy_version")
        if key in batch.keys(include_nested=True):
            inner = batch.get(key)
            table = torch.zeros(max(self.outer_of_inner) + 1, dtype=torch.int64)
            for i, o in self.outer_of_inner.items():
                table[i] = o
            batch.set(key, table[inner.clamp(0, len(table) - 1)])
        version = self.outer_of_inner.get(int(self.collector.policy_version), self.applied)
        return batch, frames, episodes, version

    # -- calls --------------------------------------------------------------------------------------
    async def call(self, op: str, args: tuple[Any, ...]) -> Any:
        c = self.collector
        if op == "set_seed":
            return await c.set_seed(*args)
        if op == "reset":
            return await c.reset()
        if op == "state_dict":
            return await c.state_dict()
        if op == "load_state_dict":
            return await c.load_state_dict(*args)
        if op == "wait_loaded":
            await self.wait_applied(*args)
            return self.applied
        if op == "getattr_env":
            return await _getattr(c, "env", *args)
        if op == "getattr_policy":
            return await _getattr(c, "policy", *args)
        raise ValueError(f"unknown node operation {op!r}")


async def _getattr(collector: Any, what: str, name: str) -> Any:
    if isinstance(collector, Collector):
        return getattr(getattr(collector, what), name)
    return await getattr(collector, f"getattr_{what}")(name)


def _send_wait(group: Any, data: torch.Tensor, tag: int) -> None:
    group.send([data], 0, tag).wait()


async def run_node(chan: AsyncChannel, setup: Setup, where: str) -> None:
    """A ``torch.distributed`` node: serve the trainer on ``chan`` until ``Close`` or EOF."""
    t = setup.transport
    rank = setup.index + 1
    core = NodeCore(setup)  # builds the collector (and its env) here: nothing else runs yet
    async with core:
        receiver = None
        if t["weights"] is not None:
            receiver = await anyio.to_thread.run_sync(t["weights"].open, setup.index)
        my_host = chan.sock.getsockname()[0]  # the address that routes to the trainer

        def join() -> tuple[Any, Any]:
            store = dist.TCPStore(t["host"], t["port"], is_master=False, timeout=_timedelta(t["timeout"]))
            return store, new_group(t["backend"], store, rank, setup.num_nodes + 1, my_host, t["timeout"])

        store, group = await anyio.to_thread.run_sync(join)
        device = data_device(t["backend"], rank)
        collector = core.collector
        await chan.send(NodeReady(os.getpid(), socket.gethostname(), int(collector.frames_per_batch)))
        requests_send, requests = anyio.create_memory_object_stream[Collect](math.inf)
        buffer: FlatBatch | None = None

        async def collect_loop() -> None:
            nonlocal buffer
            async for request in requests:
                batch, frames, episodes, version = await core.next_batch()
                layout = layout_of(batch)
                new_layout = buffer is None or buffer.layout != layout
                if new_layout:
                    buffer = FlatBatch(layout, device)
                assert buffer is not None
                await anyio.to_thread.run_sync(buffer.pack, batch)
                if device.type == "cuda":
                    await anyio.to_thread.run_sync(torch.cuda.synchronize, device)
                notice = BatchNotice(request.seq, frames, layout if new_layout else None, episodes, version)
                await chan.send(notice)
                await anyio.to_thread.run_sync(_send_wait, group, buffer.data, request.seq & 0x7FFFFFFF)

        async def loaded(version: int) -> None:
            await chan.send(Loaded(version))

        async def serve_call(msg: Call) -> None:
            try:
                value = await core.call(msg.op, msg.args)
            except Exception as exc:
                await chan.send(Result(msg.request_id, CallFailed(RemoteFailure(exc, where))))
            else:
                await chan.send(Result(msg.request_id, value))

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(collect_loop)
                tg.start_soon(core.run_applier, loaded)
                while True:
                    msg = await chan.receive()
                    if isinstance(msg, Collect):
                        requests_send.send_nowait(msg)
                    elif receiver is not None and type(msg).__name__ == "_Transfer":
                        await anyio.to_thread.run_sync(receiver.on_message, msg)
                        assert core.staging is not None
                        staging = core.staging
                        version = await anyio.to_thread.run_sync(receiver.load, staging, core.received)
                        core.stage(version, module_weights(staging).clone())
                    elif isinstance(msg, Call):
                        tg.start_soon(serve_call, msg)
                    elif isinstance(msg, Close):
                        tg.cancel_scope.cancel()
                        break
                    else:  # pragma: no cover - a protocol bug
                        raise TypeError(f"unexpected message {msg!r}")
        finally:
            requests_send.close()
            requests.close()
            with contextlib.suppress(Exception):
                if receiver is not None:
                    receiver.close()
            store = group = None  # noqa: F841 - drop the node's side of the group before exiting


# -- the trainer -----------------------------------------------------------------------------------
@dataclass
class _NodeBatch:
    batch: TensorDictBase
    frames: int
    episodes: list[tuple[float, int]]
    policy_version: int


@dataclass
class _Failure:
    error: BaseException


@dataclass
class RemoteNode:
    """The trainer's view of one node."""

    index: int
    process: NodeProcess | None = None
    channel: AsyncChannel | None = None
    pid: int | None = None
    host: str | None = None
    ready: NodeReady | None = None
    state: str = "starting"
    frames: int = 0
    policy_version: int = 0
    #: batches delivered since its last weight update
    since_update: int = 0
    #: delivered a batch since its last weight update (update_after_each_batch)
    fresh: bool = False
    in_flight: bool = False
    #: missed progress_timeout: stopped without the full grace period
    hung: bool = False
    buffer: Any = None
    connected: anyio.Event = field(default_factory=anyio.Event)
    gone: anyio.Event = field(default_factory=anyio.Event)
    ready_event: anyio.Event = field(default_factory=anyio.Event)
    loaded_event: anyio.Event = field(default_factory=anyio.Event)

    @property
    def rank(self) -> int:
        return self.index + 1


_COLLECTOR_CLASSES = (Collector, MultiSyncCollector, MultiAsyncCollector)


class RemoteCollectorBase(FleetCollector):
    """What :class:`DistributedCollector` and :class:`RPCCollector` share: arguments, launching and
    reaping nodes, the control connections, the iteration (sync and async), weights, control, statistics.
    Subclasses supply the transport of batches and weights."""

    _member_noun = "node"
    #: the module that runs a node (``_torchdist``, ``_rpc``), and the engine's name in errors
    _engine: str
    _engine_name: str

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
        update_after_each_batch: bool = False,
        max_weight_update_interval: int = -1,
        progress: Any = None,
    ) -> None:
        name = type(self).__name__
        # -- nodes and their env constructors
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
                raise TypeError(f"{name} needs num_collectors= (or a list of env constructors, one per node)")
            env_fns = [create_env_fn] * positive_int("num_collectors", num_collectors)
        self.num_collectors = n = positive_int("num_collectors", num_collectors)
        for i, fn in enumerate(env_fns):
            if not callable(fn):
                raise TypeError(f"create_env_fn[{i}] must be a callable returning an env, got {fn!r}")
        if policy is not None and not callable(policy):
            raise TypeError(
                "policy must be a TensorDictModule, an nn.Module, a callable td -> td or None, got "
                f"{policy!r}"
            )
        if not (isinstance(collector_class, type) and issubclass(collector_class, _COLLECTOR_CLASSES)):
            raise TypeError(
                "collector_class must be Collector, MultiSyncCollector or MultiAsyncCollector, got "
                f"{collector_class!r}"
            )
        self._sync = flag("sync", sync)
        self.total_frames = total_frames_arg(total_frames)
        fpb = positive_int("frames_per_batch", frames_per_batch)
        if self._sync:
            if fpb % n:
                warnings.warn(
                    f"frames_per_batch={fpb} is not divisible by {n} nodes: each collects "
                    f"{math.ceil(fpb / n)}",
                    UserWarning,
                    stacklevel=3,
                )
            self._node_fpb = math.ceil(fpb / n)
        else:
            self._node_fpb = fpb
        self.frames_per_batch = self._node_fpb * n if self._sync else fpb
        self.num_workers_per_collector = positive_int("num_workers_per_collector", num_workers_per_collector)
        if collector_class is Collector and self.num_workers_per_collector != 1:
            raise ValueError("num_workers_per_collector > 1 needs collector_class=MultiSyncCollector/Async")
        # -- per-node collector kwargs
        if collector_kwargs is None or isinstance(collector_kwargs, Mapping):
            per_node = [dict(collector_kwargs or {}) for _ in range(n)]
        else:
            per_node = [dict(k) for k in collector_kwargs]
            if len(per_node) != n:
                raise ValueError(f"collector_kwargs has {len(per_node)} dicts for {n} nodes")
        seeds = set()
        for kwargs in per_node:
            bad = sorted(set(kwargs) & set(_RESERVED))
            if bad:
                raise ValueError(f"collector_kwargs cannot set {bad}: {name} sets them itself")
            seeds.add(kwargs.pop("seed", None))
        if len(seeds) > 1:
            raise ValueError("collector_kwargs: give one seed for all nodes (each node gets its own from it)")
        self._seed = seed_arg(seeds.pop())
        # -- weights
        self._source_policy = policy
        self._weights_template = flat_weights(policy) if isinstance(policy, torch.nn.Module) else None
        self._after_each = flag("update_after_each_batch", update_after_each_batch)
        if isinstance(max_weight_update_interval, bool) or not isinstance(max_weight_update_interval, int):
            raise TypeError(f"max_weight_update_interval must be an int, got {max_weight_update_interval!r}")
        self._interval = max_weight_update_interval if max_weight_update_interval > 0 else 0
        if self._after_each and self._interval:
            raise ValueError("update_after_each_batch and max_weight_update_interval exclude each other")
        if (self._after_each or self._interval) and self._weights_template is None:
            raise ValueError(
                "update_after_each_batch / max_weight_update_interval need an nn.Module policy (weights)"
            )
        # -- launching
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
        self._progress_timeout = _seconds_or_none("progress_timeout", progress_timeout)
        for kwargs in per_node:
            if "worker_timeout" in kwargs:  # checked here, not only on the nodes once they started
                _seconds_or_none("collector_kwargs['worker_timeout']", kwargs["worker_timeout"])
        # the env constructors and collector arguments are pickled here (small: a bad one fails now); the
        # policy, which can be large, once and in a thread when the collector is entered
        self._payloads = []
        for i in range(n):
            try:
                self._payloads.append(cloudpickle.dumps((env_fns[i], collector_class, per_node[i])))
            except Exception as exc:
                raise TypeError(
                    f"the env constructor or collector_kwargs of node {i} do not pickle: {exc}"
                ) from exc
        self._policy_payload = b""
        self.replay_buffer = None
        self._init_base(progress)
        self._nodes = [RemoteNode(i) for i in range(n)]
        self._version = 0
        self._weights_lock = anyio.Lock()
        self._failure: BaseException | None = None
        self._failed_event = anyio.Event()
        self._entered = False
        self._closing = False
        self._listener: socket.socket | None = None
        self._address: TrainerAddress | None = None
        #: callers waiting for a node's reply: ("call", id) -> Result value, ("batch", node, seq) -> notice
        self._waiters = WaiterTable(on_orphan=self._on_orphan)
        self._ids = itertools.count(1)
        send, receive = anyio.create_memory_object_stream[Any](math.inf)
        self._deliveries_send: MemoryObjectSendStream[Any] = send
        self._deliveries: MemoryObjectReceiveStream[Any] = receive
        self._outstanding = 0  # frames requested from nodes and not yet delivered to the consumer
        self._io: anyio.abc.TaskGroup | None = None
        self._io_stop = anyio.Event()
        self._io_closed = anyio.Event()

    # -- transport hooks ----------------------------------------------------------------------------
    async def _open_transport(self, host: str) -> None:
        """Trainer side of the data plane, before nodes are set up."""

    def _transport_setup(self, index: int) -> dict[str, Any]:
        return {}

    async def _connect_transport(self) -> None:
        """Runs while the nodes join the data plane."""

    async def _fetch_batch(self, node: RemoteNode) -> _NodeBatch:
        raise NotImplementedError

    async def _send_weights(self, weights: TensorDictBase, version: int, ids: list[int]) -> None:
        raise NotImplementedError

    async def _call(self, node: RemoteNode, op: str, *args: Any) -> Any:
        request_id = next(self._ids)
        with self._expect(("call", request_id)) as waiter:
            assert node.channel is not None
            await node.channel.send(Call(request_id, op, args))
            value = await waiter.wait()
        if isinstance(value, CallFailed):
            raise as_error(value.error)
        return value

    async def _on_notice(self, node: RemoteNode, msg: Any) -> None:
        raise TypeError(f"unexpected message from node {node.index}: {msg!r}")

    def _close_transport(self) -> None:
        """Release the trainer's side of the data plane (nodes are gone)."""

    # -- waiting --------------------------------------------------------------------------------------
    def _expect(self, key: Any) -> Waiter:
        if self._failure is not None:
            raise self._failure
        return self._waiters.expect(key)

    def _on_orphan(self, key: Any, value: Any) -> None:
        """A reply nobody takes (its caller was cancelled): a batch is still taken off the wire, or its
        node would block in its send for ever; a call's result is dropped."""
        if key[0] == "batch" and self._io is not None and not self._io_closed.is_set():
            self._io.start_soon(self._drain, self._nodes[key[1]], value)

    async def _drain(self, node: RemoteNode, notice: Any) -> None:
        """Receive a batch nobody waits for any more, and drop it (transports with a data plane)."""

    async def _guard(self, fn: Callable[[], Any]) -> Any:
        """``await fn()``, ended by a node failure (raised instead)."""
        out: list[tuple[bool, Any]] = []
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                try:
                    out.append((True, await fn()))
                except Exception as exc:
                    out.append((False, exc))
                tg.cancel_scope.cancel()

            async def watch() -> None:
                await self._failed_event.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(run)
            tg.start_soon(watch)
        if out:
            ok, value = out[0]
            if ok:
                return value
            if self._failure is not None and not isinstance(value, type(self._failure)):
                raise self._failure from None
            raise value
        assert self._failure is not None
        raise self._failure

    def _died(
        self, node: RemoteNode, exitcode: int | None, cause: BaseException | None = None
    ) -> BaseException:
        return worker_died(
            node.index,
            exitcode,
            member="node",
            engine=self._engine_name,
            rank=node.rank,
            host=node.host,
            cause=cause,
        )

    async def _within_progress_timeout(self, node: RemoteNode, fn: Callable[[], Any]) -> Any:
        """``await fn()`` (a node's next batch); a node that takes longer than ``progress_timeout``
        fails the collector with ``WorkerTimeoutError`` naming it."""
        timeout = self._progress_timeout
        if timeout is None:
            return await fn()
        with anyio.move_on_after(timeout) as scope:
            return await fn()
        assert scope.cancelled_caught
        node.hung = True
        where = f"node {node.index} ({self._engine_name} rank {node.rank}" + (
            f", {node.host}, pid {node.pid})" if node.host else ")"
        )
        error = WorkerTimeoutError(
            f"{where} delivered no batch within progress_timeout={timeout:g} s: a hung env or policy? "
            "(give a larger progress_timeout for slower batches, or None for no limit)"
        )
        self._fail(node, error)
        raise error

    def _fail(self, node: RemoteNode | None, error: BaseException) -> None:
        if node is not None and node.state not in ("failed", "stopped"):
            node.state = "failed"
            self._hub.publish(WorkerFailed(node.index, f"{type(error).__name__}: {error}"))
        if self._failure is not None:
            return
        self._failure = error
        self._failed = True
        self._closed_reason = f"a node failed with {type(error).__name__}: {error}"
        self._failed_event.set()
        self._waiters.fail(error)
        self._deliveries_send.send_nowait(_Failure(error))

    # -- lifecycle ------------------------------------------------------------------------------------
    async def _on_enter(self) -> None:
        if self._entered:
            raise RuntimeError("the collector was entered already")
        self._entered = True
        assert self._task_group is not None
        self._policy_payload = await self._pickled_policy("the nodes")
        await self._task_group.start(self._io_host)
        await self._start()

    async def _io_host(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Owns the collector's I/O tasks (listener, connections, transfers); once they ended at
        shutdown, closes the sockets they waited on."""
        try:
            async with anyio.create_task_group() as tg:
                self._io = tg
                task_status.started()
                await self._io_stop.wait()
                tg.cancel_scope.cancel()
        finally:
            for node in self._nodes:
                if node.channel is not None:
                    node.channel.close()
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            self._io_closed.set()

    async def aclose(self) -> None:
        """Stop every node (each closes its collector and reaps its processes), then reap the nodes."""
        await self._shutdown()

    async def _start(self) -> None:
        tg = self._io
        assert tg is not None
        launcher = self._launcher
        # the address every port of the trainer binds and the nodes connect to: loopback for nodes on
        # this machine; for jobs on other machines the interface that routes out (or trainer_address)
        host = self._trainer_address or ("127.0.0.1" if launcher.local else _trainer_host())
        listener = socket.create_server((host, self._tcp_port), backlog=max(16, self.num_collectors))
        listener.setblocking(False)
        self._listener = listener
        self._address = address = TrainerAddress(host, listener.getsockname()[1], new_token())
        tg.start_soon(self._accept_loop, listener, address.token)
        await self._open_transport(host)
        processes = await launcher.launch(address, [node.rank for node in self._nodes])
        for node in self._nodes:
            node.process = processes[node.rank]
            tg.start_soon(self._watch_process, node)

        async def all_ready() -> None:
            for node in self._nodes:
                await node.connected.wait()
            for node in self._nodes:
                setup = Setup(
                    engine=self._engine,
                    index=node.index,
                    num_nodes=self.num_collectors,
                    payload=self._payloads[node.index],
                    policy_payload=self._policy_payload,
                    frames_per_batch=self._node_fpb,
                    num_workers=self.num_workers_per_collector,
                    transport=self._transport_setup(node.index),
                )
                assert node.channel is not None
                await node.channel.send(setup, encode_in_thread=True)  # it carries the pickled policy

            async def ready() -> None:
                for node in self._nodes:
                    await node.ready_event.wait()

            await gather(self._connect_transport, ready)

        await self._guard(all_ready)
        for node in self._nodes:
            assert node.ready is not None
            node.state = "collecting"
            self._hub.publish(WorkerStarted(node.index))
        fpbs = {node.ready.frames_per_batch for node in self._nodes if node.ready is not None}
        if self._sync:
            self.frames_per_batch = sum(n.ready.frames_per_batch for n in self._nodes if n.ready is not None)
        elif len(fpbs) == 1:
            self.frames_per_batch = fpbs.pop()
        await self._members_started()

    async def _accept_loop(self, listener: socket.socket, token: str) -> None:
        assert self._io is not None
        while True:
            await anyio.wait_readable(listener)
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                continue
            self._io.start_soon(self._handshake, sock, token)

    async def _handshake(self, sock: socket.socket, token: str) -> None:
        sock.setblocking(False)
        data = b""
        with anyio.move_on_after(30):
            while len(data) < HELLO_SIZE:
                await anyio.wait_readable(sock)
                try:
                    chunk = sock.recv(HELLO_SIZE - len(data))
                except BlockingIOError:
                    continue
                if not chunk:
                    break
                data += chunk
        hello = check_hello(data, token)
        rank = hello[0] if hello else -1
        if hello is None or not 1 <= rank <= self.num_collectors or self._nodes[rank - 1].channel is not None:
            sock.close()  # not one of ours (nothing of it was unpickled)
            return
        node = self._nodes[rank - 1]
        node.pid = hello[1]
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        node.channel = AsyncChannel(sock)
        node.connected.set()
        await self._reader(node)

    async def _watch_process(self, node: RemoteNode) -> None:
        """A node that ends before it connected (import error, killed, job failed) fails the start."""
        assert node.process is not None
        await node.process.wait()
        if not node.connected.is_set() and not self._closing:
            self._fail(node, self._died(node, node.process.exitcode))

    async def _reader(self, node: RemoteNode) -> None:
        channel = node.channel
        assert channel is not None
        failed = False
        try:
            while True:
                try:
                    msg = await channel.receive()
                except (EOFError, OSError):
                    break
                if isinstance(msg, Result):
                    self._waiters.resolve(("call", msg.request_id), msg.value)
                elif isinstance(msg, Loaded):
                    if msg.version > node.policy_version:
                        node.policy_version = msg.version
                        self._hub.publish(WeightsLoaded(msg.version, node.index))
                    node.loaded_event.set()
                    node.loaded_event = anyio.Event()
                elif isinstance(msg, NodeReady):
                    node.ready, node.pid, node.host = msg, msg.pid, msg.host
                    node.ready_event.set()
                elif isinstance(msg, Failed):
                    failed = True
                    self._fail(node, as_error(msg.error))
                else:
                    await self._on_notice(node, msg)
        finally:
            node.gone.set()
            if not failed and not self._closing:
                exitcode = None
                if node.process is not None:
                    with anyio.move_on_after(2.0, shield=True):
                        await node.process.wait()
                    exitcode = node.process.exitcode
                self._fail(node, self._died(node, exitcode))
            elif not failed and node.state != "failed":
                node.state = "stopped"
                self._hub.publish(WorkerStopped(node.index))

    async def _shutdown(self) -> None:
        with anyio.CancelScope(shield=True):
            if self._background is not None:
                self._background.cancel()
            if self._closing:
                return
            self._closing = True
            self._closed = True
            for node in self._nodes:
                if node.channel is not None and not node.gone.is_set():
                    with contextlib.suppress(Exception):
                        await node.channel.send(Close())

            # a node closes its collector (reaping its workers) in the grace period; a hung one (it
            # missed progress_timeout) gets a short one, then is terminated
            async def close(node: RemoteNode) -> None:
                grace = _FAILED_CLOSE_GRACE if node.hung else _CLOSE_GRACE
                if node.channel is not None:
                    with anyio.move_on_after(grace):
                        await node.gone.wait()
                if node.process is not None:
                    await node.process.stop(0.5 if node.hung else 5.0)

            await gather(*[partial(close, node) for node in self._nodes])
            for node in self._nodes:
                if node.state not in ("failed", "stopped"):
                    node.state = "stopped"
            await anyio.to_thread.run_sync(self._close_transport)
            if self._io is not None:
                self._io_stop.set()
                await self._io_closed.wait()
            self._deliveries_send.close()
            self._deliveries.close()
            self._hub.close()
            self._finish_progress()

    def _active(self) -> None:
        self._check_open()
        if self._task_group is None:
            name = type(self).__name__
            raise RuntimeError(
                f"{name} starts its nodes in `async with`: write "
                f"`async with {name}(...) as collector: async for batch in collector:`"
            )

    # -- iteration ------------------------------------------------------------------------------------
    async def __anext__(self) -> TensorDictBase | None:
        self._active()
        if self._budget_reached():
            raise StopAsyncIteration
        await self._acquire_batch_lock()
        try:
            self._active()
            if self._budget_reached():
                raise StopAsyncIteration
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

    async def _fetch(self, node: RemoteNode) -> _NodeBatch:
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
        them first. ``eager`` (right after a delivery) leaves ``update_after_each_batch`` nodes for the
        next ``__anext__``, so that they get the weights trained on that batch."""
        chosen, due = [], []
        for node in self._nodes:
            if node.in_flight or node.state != "collecting":
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
        await self._top_up(eager=False)
        item = await self._deliveries.receive()
        if isinstance(item, _Failure):
            self._deliveries_send.send_nowait(item)
            raise item.error
        index, result = item
        node = self._nodes[index]
        self._outstanding -= self._node_frames(node)
        batch = result.batch
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
    ) -> int:
        """Send weights to the nodes and return the new policy version.

        A node loads them into its collector before its next batch; ``wait=True`` returns once every
        targeted node's collector runs them. Concurrent calls are serialised (versions strictly increase).

        Args:
            policy_or_weights: an ``nn.Module``, a TensorDict of weights or a state dict; ``None``: the
                policy the collector was built with (its current weights).
            worker_ids: the nodes to update (indices ``0 .. num_collectors - 1``; default: all).
            wait: also wait until those nodes run the new weights.
        """
        self._active()
        weights = self._weights_to_publish(policy_or_weights)
        flag("wait", wait)
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
            self._hub.publish(WeightsPublished(version))
        if wait:
            await self._guard(
                lambda: gather(*[partial(self._wait_loaded, self._nodes[i], version) for i in ids])
            )
        return version

    async def _wait_loaded(self, node: RemoteNode, version: int) -> None:
        while node.policy_version < version:
            await node.loaded_event.wait()

    # -- control --------------------------------------------------------------------------------------
    @property
    def _fleet_size(self) -> int:
        return self.num_collectors

    def _members(self) -> Sequence[Member]:
        return self._nodes

    async def _call_member(self, index: int, method: str, *args: Any) -> Any:
        return await self._guard(partial(self._call, self._nodes[index], method, *args))

    async def reset(self) -> None:
        """Reset every node's envs: the next batches start new episodes."""
        self._active()
        async with self._lock:
            await self._guard(lambda: gather(*[partial(self._call, n, "reset") for n in self._nodes]))

    async def state_dict(self) -> dict[str, Any]:
        """Each node's collector state (``"node{i}"``) plus the counters and the policy version."""
        self._active()
        async with self._lock:
            states = await self._guard(
                lambda: gather(*[partial(self._call, n, "state_dict") for n in self._nodes])
            )
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
                    *[
                        partial(self._call, n, "load_state_dict", dict(state[f"node{n.index}"]))
                        for n in self._nodes
                    ]
                )
            )
            self._load_counters(state)

    async def getattr_env(self, name: str, node: int = 0) -> Any:
        """An attribute of node ``node``'s env (worker 0's, for a multi-process node)."""
        self._active()
        return await self._guard(partial(self._call, self._nodes[node], "getattr_env", name))

    async def getattr_policy(self, name: str, node: int = 0) -> Any:
        """An attribute of node ``node``'s policy."""
        self._active()
        return await self._guard(partial(self._call, self._nodes[node], "getattr_policy", name))

    def node_pids(self) -> list[int | None]:
        """The process id of each node (as each node reported it)."""
        return [n.pid for n in self._nodes]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_collectors={self.num_collectors}, frames_per_batch="
            f"{self.frames_per_batch}, total_frames={self.total_frames}, sync={self._sync}, "
            f"closed={self._closed})"
        )


def _seconds_or_none(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive number of seconds or None (no limit), got {value!r}")
    return float(value)


def _trainer_host() -> str:
    from ._launchers import routable_host

    return routable_host()


class DistributedCollector(RemoteCollectorBase):
    """Collect on many processes or machines with ``torch.distributed``; the trainer is rank 0.

    Each node (rank ``i + 1``) runs one of our collectors (``collector_class``) and sends its batches to
    the trainer over a private process group (point-to-point ``send``/``recv`` of one flat buffer per
    batch, awaited in a thread); weights go through :class:`~aiocollect.DistributedWeightSync`. The
    trainer's own default process group (DDP) is never touched.

    ``sync=False`` (default): each batch is one node's (``frames_per_batch`` frames, with
    ``("collector", "node_id")``), first come first served; a node collects its next batch while the
    trainer trains. ``sync=True``: each batch stacks one batch per node (``[num_collectors, ...]``,
    ``frames_per_batch`` in total).

    Args:
        create_env_fn: an env constructor for every node, or a list of them (one per node).
        policy: as for :class:`Collector`; it is pickled to every node.
        frames_per_batch: frames per delivered batch.
        total_frames: the budget; ``-1`` for endless.
        backend: ``"gloo"`` (CPU; tested), ``"nccl"`` (one GPU per rank; not tested here), ``"ucc"`` (if
            this torch has it). ``"mpi"`` raises: MPI ranks must all be started by ``mpirun``.
        launcher: ``"mp"`` (processes on this machine), ``"submitit"`` (one job per node; see
            ``slurm_kwargs``) or ``"submitit_delayed"`` (inside :func:`submitit_delayed_launcher`).
        sync: see above.
        num_collectors: the number of nodes (default: ``len(create_env_fn)`` for a list).
        collector_class: :class:`Collector`, :class:`MultiSyncCollector` or :class:`MultiAsyncCollector`.
        collector_kwargs: keyword arguments for every node's collector, or a list (one dict per node).
            ``seed`` seeds node ``i`` after node ``i - 1`` (as :meth:`set_seed`).
        num_workers_per_collector: worker processes per node (Multi collector classes).
        slurm_kwargs: for ``"submitit"``: ``executor.update_parameters(...)`` arguments, plus ``folder``
            (submitit's, shared by the machines) and ``cluster`` (``None``: Slurm if available, or
            ``"local"``); for ``"submitit_delayed"``: optionally ``rendezvous`` (the file).
        progress_timeout: seconds a node may take to deliver one batch (default 600: generous, so that
            a hung env or policy is noticed without any setting); then the collector fails with
            ``WorkerTimeoutError`` naming the node. ``None``: no limit. (``collector_kwargs=
            {"worker_timeout": ...}`` also limits each worker inside the nodes.)
        tcp_port: the trainer's control port (default: a free one). Nodes connect to it; the data and
            weight groups use free ports of their own.
        trainer_address: the address the trainer's ports (control, data and weights stores, gloo) bind
            to and the nodes connect to. Default: ``127.0.0.1`` for nodes on this machine (``"mp"``,
            submitit's ``cluster="local"``); for jobs on other machines, this machine's address on its
            outgoing route (the interface of the default route): give the cluster network's address
            here when that is not it. Nothing listens on a wildcard address.
        update_after_each_batch: the node that delivered (``sync=False``) or every node (``sync=True``)
            gets the current weights before its next batch.
        max_weight_update_interval: a node that produced this many batches without a weight update gets
            one before its next batch (``-1``: off).
        progress: as for :class:`Collector`.

    Example:
        >>> import anyio
        >>> from aiocollect import DistributedCollector, GymEnv
        >>> async def main():  # doctest: +SKIP
        ...     async with DistributedCollector(lambda: GymEnv("CartPole-v1"), frames_per_batch=64,
        ...                                     total_frames=256, num_collectors=2) as c:
        ...         async for batch in c:
        ...             print(batch.batch_size)
    """

    _engine = "_torchdist"
    _engine_name = "torch.distributed"

    def __init__(
        self, create_env_fn: Any, policy: Any = None, *, backend: str = "gloo", **kwargs: Any
    ) -> None:
        check_backend(backend)
        self.backend = backend
        super().__init__(create_env_fn, policy, **kwargs)
        self._store: Any = None
        self._group: Any = None
        self._sender: Any = None
        self._receivers: list[Any] = []
        self._device = data_device(backend, 0)
        self._host = "127.0.0.1"

    async def _open_transport(self, host: str) -> None:
        self._host = host

        self._store = await anyio.to_thread.run_sync(master_store, host, 0, _TIMEOUT)
        if self._weights_template is not None:
            scheme = DistributedWeightSync(
                backend="nccl" if self.backend == "nccl" else "gloo",
                init_method=f"tcp://{host}:0",
                timeout=_TIMEOUT,
                interface=(os.environ.get("GLOO_SOCKET_IFNAME") or "").split(",")[0] or None,
            )
            self._sender = await anyio.to_thread.run_sync(
                scheme.open_sender, self._weights_template.clone(), self.num_collectors, self._send_to
            )
            self._receivers = self._sender.receivers()

    def _transport_setup(self, index: int) -> dict[str, Any]:
        return {
            "host": self._host,
            "port": int(self._store.port),
            "backend": self.backend,
            "timeout": _TIMEOUT,
            "weights": self._receivers[index] if self._receivers else None,
        }

    async def _send_to(self, index: int, message: Any) -> None:
        channel = self._nodes[index].channel
        assert channel is not None
        await channel.send(message)

    async def _connect_transport(self) -> None:
        def build() -> None:
            self._group = new_group(
                self.backend, self._store, 0, self.num_collectors + 1, self._host, _TIMEOUT
            )

        # abandoned if a node fails meanwhile: a daemon thread, which cannot hold the process's exit
        fns: list[Callable[[], Any]] = [partial(run_abandonable, build)]
        if self._sender is not None:
            fns.append(self._sender.connect)
        await gather(*fns)

    async def _fetch_batch(self, node: RemoteNode) -> _NodeBatch:
        seq = next(self._ids)
        with self._expect(("batch", node.index, seq)) as waiter:
            assert node.channel is not None
            await node.channel.send(Collect(seq))
            notice: BatchNotice = await self._within_progress_timeout(node, waiter.wait)
            # the node sends now: the transfer is seen to its end even if the caller is cancelled (its
            # data would otherwise stay on the wire, and the node would block in its send)
            with anyio.CancelScope(shield=True):
                result = await self._receive(node, notice)
        return result

    async def _receive(self, node: RemoteNode, notice: BatchNotice) -> _NodeBatch:
        if notice.layout is not None:
            node.buffer = await anyio.to_thread.run_sync(FlatBatch, notice.layout, self._device)
        buffer: FlatBatch = node.buffer
        group, tag = self._group, notice.seq & 0x7FFFFFFF

        def recv() -> TensorDict:
            group.recv([buffer.data], node.rank, tag).wait()
            return buffer.unpack()

        try:
            batch = await anyio.to_thread.run_sync(recv)
        except Exception:
            # typically the node died mid-transfer: its connection is about to say so
            with anyio.move_on_after(2.0):
                await node.gone.wait()
            if self._failure is not None:
                raise self._failure from None
            raise
        return _NodeBatch(batch, notice.frames, notice.episodes, notice.policy_version)

    async def _on_notice(self, node: RemoteNode, msg: Any) -> None:
        if not isinstance(msg, BatchNotice):
            raise TypeError(f"unexpected message from node {node.index}: {msg!r}")
        # a notice nobody waits for any more (the request was cancelled) is drained (_on_orphan)
        self._waiters.resolve(("batch", node.index, msg.seq), msg)

    async def _drain(self, node: RemoteNode, notice: Any) -> None:
        with contextlib.suppress(Exception):
            await self._receive(node, notice)

    async def _send_weights(self, weights: TensorDictBase, version: int, ids: list[int]) -> None:
        assert self._sender is not None
        await self._sender.publish(weights, version, ids)

    def _close_transport(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        self._group = None
        self._store = None


class DistributedSyncCollector(DistributedCollector):
    """:class:`DistributedCollector` with ``sync=True``: every batch stacks one batch per node
    (``[num_collectors, ...]``), all collected with the same weights.

    Example:
        >>> from aiocollect import DistributedSyncCollector, GymEnv
        >>> # DistributedSyncCollector(lambda: GymEnv("CartPole-v1"), frames_per_batch=128, num_collectors=2)
    """

    def __init__(self, create_env_fn: Any, policy: Any = None, **kwargs: Any) -> None:
        if kwargs.pop("sync", True) is not True:
            raise ValueError("DistributedSyncCollector is sync=True; use DistributedCollector for sync=False")
        super().__init__(create_env_fn, policy, sync=True, **kwargs)


__all__ = ["DistributedCollector", "DistributedSyncCollector"]
