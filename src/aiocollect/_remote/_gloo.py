"""``DistributedCollector`` / ``DistributedSyncCollector``: nodes run our collectors, batches travel over a
private ``torch.distributed`` process group.

Roles: the trainer is rank 0, node ``i`` is rank ``i + 1``. Three channels connect them:

* **control**: one TCP connection per node (see ``_launchers``), framed pickles both ways: set-up,
  "collect one batch", calls (seed, state dict), weight-transfer notices, "close", and from the node its
  batch notices, results and errors. The trainer waits on it with ``anyio.wait_readable``; EOF means the
  node died. No store is polled.
* **data**: a process group of our own (an authenticated store, ``_transport._store``, and a
  ``ProcessGroupGloo``/``ProcessGroupNCCL`` built directly, never ``init_process_group``), so the
  trainer's default group (DDP) is untouched. A node packs a batch into one contiguous byte buffer and
  ``send``s it; the first notice carries the layout (keys, dtypes, shapes), the trainer allocates one
  receive buffer per node and ``recv``s into it; the ``Work`` is waited on in a thread.
* **weights**: :class:`~aiocollect.DistributedWeightSync` (its own private group): one broadcast for all
  nodes, point-to-point sends for a subset; a node loads them into its collector between batches.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
from collections.abc import Callable
from functools import partial
from typing import Any, Unpack

import anyio
import anyio.to_thread
import torch
from tensordict import TensorDict, TensorDictBase

from .._core._daemon import run_abandonable
from .._core._errors import RemoteFailure
from .._core._gather import gather
from .._core._mistakes import explicit_keywords
from .._fleet._collector import FleetCollector
from .._fleet._transport import FleetHandle
from .._policies._weights import module_weights
from .._transport._flat import FlatBuffer, layout_of
from .._transport._groups import check_backend, interface_from_env, new_group
from .._transport._messages import Result
from .._transport._store import StoreClient
from .._transport._wire import AsyncChannel
from .._weightsync._distributed import DistributedWeightSync
from ._keywords import DistributedKeywords, DistributedSyncKeywords
from ._messages import BatchNotice, CallFailed, Close, Collect, Loaded, NodeBatch, NodeReady, Request, Setup
from ._node import NodeCore
from ._nodes import Nodes, RemoteNode
from ._relaunch import GroupRelauncher
from ._trainer import NodeCollectorMixin, NodePlan

_TIMEOUT = 120.0  # seconds: rendezvous and transfers of the data group


def data_device(backend: str, rank: int) -> torch.device:
    """Where ``rank``'s batch buffers live: its GPU for nccl, else the CPU."""
    if backend == "nccl":
        count = torch.cuda.device_count()
        if not count:
            raise RuntimeError("backend='nccl' needs CUDA devices on every rank")
        return torch.device("cuda", rank % count)
    return torch.device("cpu")


def _data_group(backend: str, store: Any, rank: int, world_size: int, host: str, timeout: float) -> Any:
    """The data plane's process group (gloo binds ``host``, this rank's address, unless
    ``GLOO_SOCKET_IFNAME`` names an interface)."""
    cuda = data_device(backend, rank) if backend == "nccl" else None
    return new_group(
        backend,
        store,
        rank,
        world_size,
        timeout=timeout,
        host=host,
        interface=interface_from_env(),
        cuda_device=cuda,
    )


def _send_wait(group: Any, data: torch.Tensor, tag: int) -> None:
    group.send([data], 0, tag).wait()


async def run_node(chan: AsyncChannel, setup: Setup, where: str) -> None:
    """A ``torch.distributed`` node: serve the trainer on ``chan`` until ``Close`` or EOF."""
    t = setup.transport
    rank = setup.index + 1
    core = NodeCore.from_spec(setup.spec)  # builds the collector (and its env) here: nothing else runs yet
    async with core:
        receiver = None
        if t["weights"] is not None:
            receiver = await anyio.to_thread.run_sync(t["weights"].open, setup.index)
        my_host = chan.sock.getsockname()[0]  # the address that routes to the trainer

        def join() -> tuple[Any, Any]:
            store = StoreClient(t["store"], t["timeout"])  # its address and token came on the control channel
            group = _data_group(t["backend"], store, rank, setup.num_nodes + 1, my_host, t["timeout"])
            return store, group

        store, group = await anyio.to_thread.run_sync(join)
        device = data_device(t["backend"], rank)
        await chan.send(NodeReady(os.getpid(), socket.gethostname(), core.frames_per_batch))
        requests_send, requests = anyio.create_memory_object_stream[Collect](math.inf)
        buffer: FlatBuffer | None = None

        async def collect_loop() -> None:
            nonlocal buffer
            async for request in requests:
                out = await core.next_batch()
                batch = out.batch
                layout = layout_of(batch)
                new_layout = buffer is None or buffer.layout != layout
                if new_layout:
                    buffer = FlatBuffer(layout, device)
                assert buffer is not None
                await anyio.to_thread.run_sync(buffer.pack, batch)
                if device.type == "cuda":
                    await anyio.to_thread.run_sync(torch.cuda.synchronize, device)
                await chan.send(out.notice(request.seq, layout if new_layout else None))
                await anyio.to_thread.run_sync(_send_wait, group, buffer.data, request.seq & 0x7FFFFFFF)

        async def serve_call(msg: Request) -> None:
            try:
                value = await core.call(msg.op)
            except Exception as exc:
                await chan.send(Result(msg.request_id, CallFailed(RemoteFailure(exc, where))))
            else:
                await chan.send(Result(msg.request_id, value))

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(collect_loop)
                tg.start_soon(core.run_applier, lambda version: chan.send(Loaded(version)))
                tg.start_soon(core.report_restarts, chan.send)
                while True:
                    msg = await chan.receive()
                    if isinstance(msg, Collect):
                        requests_send.send_nowait(msg)
                    elif receiver is not None and type(msg).__name__ == "_Transfer":
                        await anyio.to_thread.run_sync(receiver.on_message, msg)
                        staging = core.staging
                        version = await anyio.to_thread.run_sync(receiver.load, staging, core.received)
                        core.stage(version, module_weights(staging).clone())
                    elif isinstance(msg, Request):
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
            group = None  # drop the node's side of the group before exiting
            store.close()


class GlooNodes(Nodes):
    """Nodes whose batches travel over a private ``torch.distributed`` process group (``backend``)."""

    _engine = "_gloo"
    _engine_name = "torch.distributed"

    def __init__(self, fleet: FleetHandle, *, plan: NodePlan, backend: str) -> None:
        super().__init__(fleet, plan, GroupRelauncher)
        self.backend = backend
        self._group: Any = None
        self._sender: Any = None
        self._receivers: list[Any] = []
        self._device = data_device(backend, 0)
        self._host = "127.0.0.1"

    async def _open_transport(self, host: str) -> None:
        self._host = host

        await self._open_store(host, _TIMEOUT)
        if self.plan.weights.template is not None:
            scheme = DistributedWeightSync(
                backend="nccl" if self.backend == "nccl" else "gloo",
                init_method=f"tcp://{host}:0",
                timeout=_TIMEOUT,
                interface=interface_from_env(),
            )
            self._sender = await anyio.to_thread.run_sync(
                scheme.open_sender, self.plan.weights.template.clone(), self.num_nodes, self._send_to
            )
            self._receivers = self._sender.receivers()

    def _transport_setup(self, index: int) -> dict[str, Any]:
        return {
            "store": self._store_server.address if self._store_server is not None else None,
            "backend": self.backend,
            "timeout": _TIMEOUT,
            "weights": self._receivers[index] if self._receivers else None,
        }

    async def _send_to(self, index: int, message: Any) -> None:
        channel = self.nodes[index].channel
        assert channel is not None
        await channel.send(message)

    async def _connect_transport(self) -> None:
        def build() -> None:
            self._group = _data_group(self.backend, self._store, 0, self.num_nodes + 1, self._host, _TIMEOUT)

        # abandoned if a node fails meanwhile: a daemon thread, which cannot hold the process's exit
        fns: list[Callable[[], Any]] = [partial(run_abandonable, build)]
        if self._sender is not None:
            fns.append(self._sender.connect)
        await gather(*fns)

    async def _fetch_batch(self, node: RemoteNode) -> NodeBatch:
        seq = next(self._ids)
        with self._expect(("batch", node.index, seq)) as waiter:
            assert node.channel is not None
            await node.channel.send(Collect(seq))
            notice: BatchNotice = await self._within_progress_timeout(node, waiter.wait)
            node.announced = notice.frames  # lost with its group unless it arrives
            # the node sends now: the transfer is seen to its end even if the caller is cancelled (its
            # data would otherwise stay on the wire, and the node would block in its send)
            with anyio.CancelScope(shield=True):
                result = await self._receive(node, notice)
            node.announced = 0
        return result

    async def _receive(self, node: RemoteNode, notice: BatchNotice) -> NodeBatch:
        if notice.layout is not None:
            node.buffer = await anyio.to_thread.run_sync(FlatBuffer, notice.layout, self._device)
        buffer: FlatBuffer = node.buffer
        tag = notice.seq & 0x7FFFFFFF

        def recv() -> TensorDict:
            # the group is never a local of these frames: the error of a node killed mid-transfer keeps them
            # (in its traceback) for as long as the user holds it, and with them the group's sockets, which
            # close() could then not release
            if self._group is None:
                raise RuntimeError("the collector's process group is closed")
            self._group.recv([buffer.data], node.rank, tag).wait()
            return buffer.unpack()

        try:
            batch = await anyio.to_thread.run_sync(recv)
        except Exception:
            # the node died mid-transfer, typically: its connection says so, then (its exit code read, up
            # to 2 s later) its reader fails the collector, unless it is closing: wait for both
            await self._verdict(node)
            if self._failure is not None:
                raise self._failure from None
            raise
        n = notice
        return NodeBatch(batch, n.frames, n.episodes, n.policy_version, n.time_split)

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
        self._close_store()


class DistributedCollector(NodeCollectorMixin, FleetCollector):
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
        update_at_each_batch: the node that delivered (``sync=False``) or every node (``sync=True``)
            gets the current weights before its next batch (``update_after_each_batch``: the deprecated
            spelling).
        max_weight_update_interval: a node that produced this many batches without a weight update gets
            one before its next batch (``None``: off; ``0`` and ``-1`` are deprecated spellings of it).
        weights: a :class:`~aiocollect.WeightSchedule` instead of the two keywords above.
        progress: as for :class:`Collector`.
        restart: a :class:`~aiocollect.RestartPolicy` for every node's envs (unless ``collector_kwargs``
            gives one of its own): each node's collector restarts an env that raises, and the trainer
            sees those restarts. A node **process** that dies or hangs relaunches the whole group (a
            torch.distributed group cannot take in a new rank): every node closed and launched again
            on a new port and store, the newest weights loaded first; one budget for the group. Nodes
            of ``"submitit_delayed"`` cannot be relaunched. See docs/faults.md.

    Example:
        >>> import anyio
        >>> from aiocollect import DistributedCollector, GymEnv
        >>> async def main():  # doctest: +SKIP
        ...     async with DistributedCollector(lambda: GymEnv("CartPole-v1"), frames_per_batch=64,
        ...                                     total_frames=256, num_collectors=2) as c:
        ...         async for batch in c:
        ...             print(batch.batch_size)
    """

    _member_noun = "node"

    @explicit_keywords(keywords=DistributedKeywords)
    def __init__(self, create_env_fn: Any, policy: Any = None, **kwargs: Unpack[DistributedKeywords]) -> None:
        check_backend(kwargs["backend"])
        self.backend = kwargs["backend"]
        gloo = partial(GlooNodes, backend=self.backend)
        self._init_nodes(create_env_fn, policy, kwargs, sync=kwargs["sync"], transport=gloo)


class DistributedSyncCollector(NodeCollectorMixin, FleetCollector):
    """:class:`DistributedCollector` with ``sync=True``: every batch stacks one batch per node
    (``[num_collectors, ...]``), all collected with the same weights.

    Example:
        >>> from aiocollect import DistributedSyncCollector, GymEnv
        >>> # DistributedSyncCollector(lambda: GymEnv("CartPole-v1"), frames_per_batch=128, num_collectors=2)
    """

    _member_noun = "node"

    @explicit_keywords(keywords=DistributedSyncKeywords)
    def __init__(
        self, create_env_fn: Any, policy: Any = None, **kwargs: Unpack[DistributedSyncKeywords]
    ) -> None:
        if kwargs["sync"] is not True:
            raise ValueError("DistributedSyncCollector is sync=True; use DistributedCollector for sync=False")
        check_backend(kwargs["backend"])
        self.backend = kwargs["backend"]
        gloo = partial(GlooNodes, backend=self.backend)
        self._init_nodes(create_env_fn, policy, kwargs, sync=kwargs["sync"], transport=gloo)


__all__ = ["DistributedCollector", "DistributedSyncCollector", "GlooNodes"]
