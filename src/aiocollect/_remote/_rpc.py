"""``RPCCollector``: nodes run our collectors; batches, weights and calls travel as
``torch.distributed.rpc`` calls (TensorPipe).

**torch's RPC framework is in maintenance mode** (its documentation says so, and PyTorch's distributed
overview dropped it as no longer supported); it gets no new features. Prefer
:class:`~aiocollect.DistributedCollector` (``torch.distributed`` point-to-point, same surface) or
``RayCollector``. ``RPCCollector`` is here for code that already runs an RPC deployment.

Design: the same nodes, launchers and control connection as :class:`DistributedCollector` (the
connection carries set-up, "close", weight acknowledgements and errors, and its EOF is how a dead node
is noticed at once: TensorPipe only notices at the next call, or at a timeout). What RPC carries:
the typed operations of ``_messages``: ``NextBatch`` (a batch comes back as a dict of tensors, which
TensorPipe sends without pickling them), ``StageWeights`` (the tensors), and the control operations
(seed, state dict...), all answered by the node's :class:`~._node.NodeCore`. The trainer waits for each
RPC future in a thread; nothing is polled. Every collector gets worker names of its own
(``aiocollect-<token>-node1``...) and its own store, so that collectors can follow each other in one
process; only **one** RPC agent can exist per process, so one ``RPCCollector`` at a time, and not beside
an ``init_rpc`` of your own.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import warnings
from collections.abc import Mapping
from functools import partial
from typing import Any, Unpack, cast

import anyio
import anyio.from_thread
import anyio.to_thread
import torch
import torch.distributed as dist
from tensordict import TensorDictBase

from .._core._daemon import run_abandonable
from .._core._errors import RemoteFailure, as_error
from .._core._gather import gather
from .._core._mistakes import explicit_keywords
from .._fleet._collector import FleetCollector
from .._fleet._transport import FleetHandle
from .._transport._flat import rebuild
from .._transport._store import StoreClient
from .._transport._wire import AsyncChannel
from ._keywords import RPC_TIMEOUT, RPCKeywords
from ._messages import (
    Close,
    ControlOp,
    Loaded,
    NextBatch,
    NodeBatch,
    NodeReady,
    Setup,
    StageWeights,
)
from ._node import NodeCore
from ._nodes import Nodes, RemoteNode
from ._relaunch import GroupRelauncher
from ._trainer import NodeCollectorMixin, NodePlan

_TIMEOUT = RPC_TIMEOUT
#: how long closing waits for an abandoned rendezvous (a node failed during start-up) to end once its store
#: is closed, so that no agent thread outlives the interpreter (a joinable C++ thread aborts the exit)
_ABANDONED_INIT_GRACE = 10.0
_NODE: NodeCore | None = None
_PORTAL: Any = None
_WHERE = ""


def _rpc() -> Any:
    import torch.distributed.rpc as rpc

    if not rpc.is_available():  # pragma: no cover - builds without RPC
        raise RuntimeError("this torch build has no torch.distributed.rpc")
    return rpc


#: the trainer's agent: torch keeps the first agent of a process alive for good (its RRef context holds
#: it, and ``rpc.shutdown`` cannot release it), so it gets few threads and the TCP transport only (the
#: shared-memory one keeps dozens of memfds open per connection); its peers (nodes) agree on TCP with it
_TRAINER_OPTIONS = {"num_worker_threads": 4, "_transports": ["uv"]}


def _options(options: Mapping[str, Any]) -> Any:
    rpc = _rpc()
    return rpc.TensorPipeRpcBackendOptions(init_method="tcp://unused:1", **dict(options))


def _init_agent(t: Mapping[str, Any], rank: int) -> None:
    """Join the collector's RPC group through its own store (no ``init_method`` rendezvous, no global
    init counter): a fresh set of worker names per collector."""
    rpc = _rpc()
    import torch.distributed.autograd as dist_autograd

    store = t.get("client")
    if store is None:  # a node: the store's address and token came on the control channel
        store = StoreClient(t["store"], t["timeout"])
    prefixed = dist.PrefixStore(t["prefix"], store)
    dist_autograd._init(rank)
    with warnings.catch_warnings():
        # torch's own rendezvous uses a gloo backend object as a group, and warns about it
        warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*", category=UserWarning)
        rpc._init_rpc_backend(
            rpc.BackendType.TENSORPIPE,
            prefixed,
            t["names"][rank],
            rank,
            len(t["names"]),
            _options(t["options"]),
        )


def _shutdown_agent() -> None:
    rpc = _rpc()
    if rpc.api._is_current_rpc_agent_set():
        rpc.shutdown(graceful=False)


# -- node side -------------------------------------------------------------------------------------
def _rpc_call(op: ControlOp) -> tuple[bool, Any]:
    """Runs in one of the node's RPC threads: hand the operation to the node's event loop."""
    portal = _PORTAL
    if portal is None:
        return False, RuntimeError("the node is not serving")
    try:
        return True, portal.call(_handle, op)
    except Exception as exc:
        return False, RemoteFailure(exc, _WHERE)


async def _handle(op: ControlOp) -> Any:
    core = _NODE
    assert core is not None
    value = await core.call(op)
    if isinstance(value, NodeBatch):  # as tensors TensorPipe sends without pickling them
        batch = value.batch
        leaves = {
            (k,) if isinstance(k, str) else tuple(k): v.contiguous()
            for k, v in batch.items(include_nested=True, leaves_only=True)
        }
        names = tuple(batch.names) if batch.names is not None else None
        layout = (tuple(batch.batch_size), names)
        v = value  # time_split last: a trainer reads what follows the version as optional
        return leaves, layout, v.frames, v.episodes, v.policy_version, v.time_split
    return value


async def run_node(chan: AsyncChannel, setup: Setup, where: str) -> None:
    """An RPC node: join the collector's RPC group and serve calls until ``Close`` or EOF."""
    global _NODE, _PORTAL, _WHERE
    t = setup.transport
    core = NodeCore.from_spec(setup.spec)
    async with core, anyio.from_thread.BlockingPortal() as portal:
        _NODE, _PORTAL, _WHERE = core, portal, where
        try:
            await anyio.to_thread.run_sync(_init_agent, t, setup.index + 1)
            await chan.send(NodeReady(os.getpid(), socket.gethostname(), core.frames_per_batch))

            async def loaded(version: int) -> None:
                await chan.send(Loaded(version))

            async with anyio.create_task_group() as tg:
                tg.start_soon(core.run_applier, loaded)
                tg.start_soon(core.report_restarts, chan.send)
                while True:
                    msg = await chan.receive()
                    if isinstance(msg, Close):
                        tg.cancel_scope.cancel()
                        break
                    raise TypeError(f"unexpected message {msg!r}")  # pragma: no cover - a protocol bug
        finally:
            _PORTAL = None
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(_shutdown_agent)
            _NODE = None


# -- trainer side ----------------------------------------------------------------------------------
class RpcNodes(Nodes):
    """Nodes whose batches, weights and calls travel as ``torch.distributed.rpc`` calls."""

    _engine = "_rpc"
    _engine_name = "torch.distributed.rpc"

    def __init__(
        self, fleet: FleetHandle, *, plan: NodePlan, options: dict[str, Any], timeout: float
    ) -> None:
        super().__init__(fleet, plan, GroupRelauncher)
        self._tp_options = options
        self._rpc_timeout = timeout
        self._names: list[str] = []
        self._agent = False
        self._init_done: threading.Event | None = None
        self._host = "127.0.0.1"

    async def _open_transport(self, host: str) -> None:
        rpc = _rpc()
        if rpc.api._is_current_rpc_agent_set():
            raise RuntimeError(
                "an RPC agent already runs in this process (another RPCCollector, or init_rpc): torch allows "
                "one per process"
            )
        self._host = host

        await self._open_store(host, _TIMEOUT)
        tag = secrets.token_hex(4)
        self._prefix = f"aiocollect-{tag}"
        self._names = [f"aiocollect-{tag}-trainer"] + [
            f"aiocollect-{tag}-node{i}" for i in range(self.num_nodes)
        ]

    def _transport_setup(self, index: int) -> dict[str, Any]:
        return {
            "store": self._store_server.address if self._store_server is not None else None,
            "prefix": self._prefix,
            "names": self._names,
            "options": self._tp_options,
            "timeout": self._rpc_timeout,
        }

    async def _connect_transport(self) -> None:
        t = {**self._transport_setup(0), "client": self._store}
        t["options"] = {**_TRAINER_OPTIONS, **self._tp_options}
        self._agent = True
        self._init_done = done = threading.Event()

        def init() -> None:
            try:
                _init_agent(t, 0)
            finally:
                done.set()

        await run_abandonable(init)  # a daemon thread: an abandoned one cannot hold the exit

    async def _rpc_async(self, node: RemoteNode, op: ControlOp, rpc_timeout: float | None = None) -> Any:
        rpc = _rpc()
        future = rpc.rpc_async(
            self._names[node.rank],
            _rpc_call,
            args=(op,),
            timeout=self._rpc_timeout if rpc_timeout is None else rpc_timeout,
        )
        try:
            ok, value = await anyio.to_thread.run_sync(future.wait, abandon_on_cancel=True)
        except Exception as exc:
            # typically the node died (TensorPipe says "eof"): its control connection says so at once,
            # and its reader fails the collector with the node's exit code (in at most 2 s more)
            await self._verdict(node)
            if self._failure is not None:
                if self._failure.__cause__ is None:
                    self._failure.__cause__ = exc
                raise self._failure from exc
            raise
        if not ok:
            raise as_error(value)
        return value

    async def _fetch_batch(self, node: RemoteNode) -> NodeBatch:
        # no timeout: a batch takes what it takes; a dead node is noticed by its connection
        leaves, layout, frames, episodes, version, *extra = await self._within_progress_timeout(
            node, partial(self._rpc_async, node, NextBatch(), rpc_timeout=0)
        )  # extra: (time_split,), or nothing from an older node
        return NodeBatch(rebuild(leaves, *layout), frames, episodes, version, *extra)

    async def _send_weights(self, weights: TensorDictBase, version: int, ids: list[int]) -> None:
        plain = await anyio.to_thread.run_sync(
            lambda: {k: cast("torch.Tensor", v).detach().to("cpu", copy=True) for k, v in weights.items()}
        )
        op = StageWeights(plain, version)
        await gather(*[partial(self._rpc_async, self.nodes[i], op) for i in ids])

    async def _call(self, node: RemoteNode, op: ControlOp) -> Any:
        return await self._rpc_async(node, op, rpc_timeout=0)

    def _close_transport(self) -> None:
        if self._agent:
            self._agent = False
            if self._init_done is not None and not self._init_done.is_set():
                # the rendezvous was abandoned (a node failed during start-up): closing the store ends
                # it; whatever agent it made is then shut down, so none of its threads is still running
                # (joinable) when the interpreter exits, which aborts the process
                self._close_store()
                self._init_done.wait(_ABANDONED_INIT_GRACE)
            _shutdown_agent()
        self._close_store()


class RPCCollector(NodeCollectorMixin, FleetCollector):
    """Collect on many processes or machines with ``torch.distributed.rpc`` (TensorPipe).

    .. warning::
        torch's RPC framework is in maintenance mode: prefer :class:`DistributedCollector` (same
        arguments and behaviour) or ``RayCollector``. One ``RPCCollector`` per process at a time (RPC has
        one agent per process), and not beside your own ``init_rpc``.

    Arguments and behaviour are :class:`DistributedCollector`'s (``backend`` excepted), plus:

    Args:
        tensorpipe_options: keyword arguments for ``TensorPipeRpcBackendOptions`` (e.g.
            ``{"num_worker_threads": 8, "_transports": ["uv"]}``; ``init_method`` is ours). Checked here.
        rpc_timeout: seconds for the rendezvous and for calls other than batches (a batch may take any
            time; a dead node is noticed by its connection).
        restart: as for :class:`DistributedCollector`: the nodes' envs are restarted, and a node
            process that dies relaunches the whole group (an RPC group's membership is fixed once it
            started).

    Example:
        >>> from aiocollect import GymEnv, RPCCollector
        >>> # async with RPCCollector(lambda: GymEnv("CartPole-v1"), frames_per_batch=64, num_collectors=2,
        >>> #                         total_frames=256) as c: ...
    """

    _member_noun = "node"

    @explicit_keywords(keywords=RPCKeywords)
    def __init__(self, create_env_fn: Any, policy: Any = None, **kwargs: Unpack[RPCKeywords]) -> None:
        rpc_timeout = kwargs["rpc_timeout"]
        if isinstance(rpc_timeout, bool) or not isinstance(rpc_timeout, (int, float)) or not rpc_timeout > 0:
            raise ValueError(f"rpc_timeout must be a positive number of seconds, got {rpc_timeout!r}")
        options = dict(kwargs["tensorpipe_options"] or {})
        if "init_method" in options:
            raise ValueError(
                "tensorpipe_options cannot set init_method: RPCCollector runs its own rendezvous"
            )
        options.setdefault("rpc_timeout", float(rpc_timeout))
        try:
            _options(options)  # torchrl's copy(...).update(...) returned None: check them here, for real
        except TypeError as exc:
            raise TypeError(
                f"tensorpipe_options are not TensorPipeRpcBackendOptions arguments: {exc}"
            ) from exc
        rpc = partial(RpcNodes, options=options, timeout=float(rpc_timeout))
        self._init_nodes(create_env_fn, policy, kwargs, sync=kwargs["sync"], transport=rpc)


__all__ = ["RPCCollector", "RpcNodes"]
