"""``DistributedWeightSync``: weights broadcast over a private ``torch.distributed`` process group.

The trainer is rank 0, worker ``i`` is rank ``i + 1``. The group is **private**: an authenticated store
of its own (``_transport._store``: a free port on 127.0.0.1, or ``init_method="tcp://host:port"``; its
token travels to the workers with their receiver, on their authenticated control channel) and a
process group built directly from it (``ProcessGroupGloo(store, rank, world_size, options)``;
``ProcessGroupNCCL`` for nccl). It never initialises or touches ``torch.distributed``'s default group,
so the trainer can run its own (DDP).

How an update travels:

1. the trainer packs the weights (parameters and buffers, any dtypes) into one contiguous byte buffer,
   off the event loop;
2. it tells each targeted worker, on the worker's control channel, that a transfer is coming;
3. it issues the transfer (``async_op``-style: the process group returns a ``Work`` at once): a
   ``broadcast`` from rank 0 when every worker is targeted, point-to-point ``send``s to the targeted
   workers otherwise (so a subset update never waits for the others);
4. it waits for the ``Work`` in a worker thread (gloo's point-to-point ``Work`` never reports completion
   before ``wait()``, and has no future), so the event loop keeps running;
5. a worker takes the message between batches, joins the transfer into its own buffer, and copies it into
   its policy at its next batch boundary.

Failures: every transfer is bounded by ``timeout``. When a transfer fails (a worker died: gloo reports
"connection closed by peer" at once), or when the trainer gives up on it, the trainer destroys its side
of the group, so that workers blocked in the transfer fail at once instead of waiting for the timeout;
the collector then raises the dead worker's error (``WorkerDiedError``). The group cannot be repaired:
later updates raise until the collector is rebuilt.
"""

from __future__ import annotations

import contextlib
import threading
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import torch
import torch.distributed as dist
from tensordict import TensorDictBase

from .._core._daemon import run_abandonable
from .._policies._weights import copy_weights, flat_weights
from .._transport._flat import FlatBuffer, FlatLayout, layout_of
from .._transport._groups import check_backend, local_address, new_group, timedelta
from .._transport._store import StoreAddress, StoreClient, StoreServer
from ._schemes import SendFn, WeightReceiver, WeightSender, WeightSync

__all__ = ["DistributedWeightSync"]


def _broadcast_options() -> Any:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return options


def _settle(device: torch.device) -> None:
    """After ``Work.wait()``: nccl only orders the current stream after the transfer; wait for it."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


@dataclass(frozen=True)
class _Transfer:
    """Control message: join the transfer of weights ``version`` (a broadcast, or a recv with ``tag``)."""

    version: int
    collective: bool
    tag: int


# -- trainer side ----------------------------------------------------------------------------------
class _Job:
    """One transfer: claimed by the thread that runs it, or abandoned by a cancelled update first."""

    def __init__(self, ids: list[int], collective: bool, tag: int) -> None:
        self.ids = ids
        self.collective = collective
        self.tag = tag
        self.error: str | None = None
        self._lock = threading.Lock()
        self._state = "new"

    def start(self) -> bool:
        with self._lock:
            if self._state == "new":
                self._state = "started"
            return self._state == "started"

    def abandon(self) -> bool:
        """``True`` if the transfer had not started (and now never will)."""
        with self._lock:
            if self._state == "new":
                self._state = "abandoned"
            return self._state == "abandoned"


class _DistributedSender(WeightSender):
    def __init__(
        self, config: DistributedWeightSync, weights: TensorDictBase, num_workers: int, send: SendFn
    ) -> None:
        self._config = config
        self._num_workers = num_workers
        self._send = send
        self._layout = layout_of(weights)
        self._device = config._device(0)
        self._buffer = FlatBuffer(self._layout, self._device)
        host, port = config._address()
        self._host = host
        self._server: StoreServer | None = StoreServer(host, port)
        self._address = self._server.address
        try:
            self._store: StoreClient | None = self._server.client(config.timeout)
        except BaseException:
            self._server.close()
            raise
        self._group: Any = None
        self._lock = threading.Lock()
        self._idle = threading.Event()  # no transfer in flight (set) or one is (cleared)
        self._idle.set()
        self._broken: str | None = None
        self._closed = False

    def receivers(self) -> list[Any]:
        return [
            _DistributedReceiverSpec(
                backend=self._config.backend,
                store=self._address,
                world_size=self._num_workers + 1,
                timeout=self._config.timeout,
                interface=self._config.interface,
                device=str(self._config._device(i + 1)),
                layout=self._layout,
            )
            for i in range(self._num_workers)
        ]

    # -- rendezvous -------------------------------------------------------------------------------
    async def connect(self) -> None:
        """Wait (in a thread, blocked in the store's ``wait``: no polling) until every worker is about to
        join, then build rank 0 in a thread. If this is cancelled (a worker failed to start), the
        workers still waiting are told to give up, and the waiting thread is woken."""
        ready = [f"ready/{rank}" for rank in range(1, self._num_workers + 1)]
        timeout = self._config.timeout

        def wait_ready() -> None:
            # a client of its own: a store client runs one operation at a time, and this one blocks
            store = StoreClient(self._address, timeout)
            try:
                store.wait(ready, timedelta(timeout))
            except RuntimeError as exc:  # DistStoreError on timeout
                raise TimeoutError(
                    f"DistributedWeightSync: {self._num_workers} workers did not all join within "
                    f"{timeout:g} s: {exc}"
                ) from None
            finally:
                store.close()

        store = self._store
        assert store is not None
        try:
            await run_abandonable(wait_ready)
            store.set("go", "1")
            await run_abandonable(self._build_group)
        except BaseException:
            # a fresh client: ours may be blocked in the abandoned group build
            address = self._address
            with contextlib.suppress(Exception), contextlib.closing(StoreClient(address, 5.0)) as aborter:
                aborter.set("abort", "1")
                aborter.set("go", "1")  # wakes the workers that wait for it: they see the abort
                for key in ready:  # and our own waiting thread, if it still waits
                    aborter.set(key, "abort")
            raise

    def _build_group(self) -> None:
        config = self._config
        group = new_group(
            config.backend,
            self._store,
            0,
            self._num_workers + 1,
            timeout=config.timeout,
            host=self._host,
            interface=config.interface,
        )
        with self._lock:
            if self._closed:  # the collector gave up meanwhile
                del group
                return
            self._group = group

    # -- updates ----------------------------------------------------------------------------------
    async def publish(self, weights: TensorDictBase, version: int, worker_ids: Sequence[int]) -> None:
        self._check_usable()
        if not self._idle.is_set():  # a transfer left by a cancelled update still owns the buffer
            await anyio.to_thread.run_sync(self._idle.wait, abandon_on_cancel=True)
            self._check_usable()
        await anyio.to_thread.run_sync(self._pack, weights)
        ids = sorted(set(worker_ids))
        job = _Job(ids, ids == list(range(self._num_workers)), version & 0x7FFFFFFF)
        self._idle.clear()
        try:
            # the workers must take part: tell them first (they join between batches)
            for i in ids:
                await self._send(i, _Transfer(version, job.collective, job.tag))
            # the transfer is issued and waited for in a worker thread: gloo's point-to-point Work has no
            # future and never reports completion before wait(), so a thread is the one way not to block
            # the loop. Cancelling this leaves a started transfer to its thread (it completes, or fails
            # and breaks the group)
            await anyio.to_thread.run_sync(self._transfer, job, abandon_on_cancel=True)
        except BaseException as exc:
            if job.abandon():  # never started: the workers told of it would wait for it until the timeout
                self._break(f"an update was interrupted before its transfer started ({exc!r})")
                self._idle.set()
            raise
        if job.error is not None:
            raise RuntimeError(f"DistributedWeightSync: the weight transfer failed: {job.error}")

    def _pack(self, weights: TensorDictBase) -> None:
        copy_weights(self._buffer.views, weights)
        _settle(self._device)

    def _transfer(self, job: _Job) -> None:
        """In a worker thread: issue the broadcast (or sends) and wait for it; on failure, break the group
        (destroying rank 0 makes the workers' side fail at once)."""
        if not job.start():
            return
        try:
            try:
                works = self._issue(job)
                while works:
                    works[0].wait()
                    del works[0]
                _settle(self._device)
            except Exception as exc:
                job.error = f"{type(exc).__name__}: {exc}"
            # out of the except clause: no traceback keeps a Work (and the group's sockets) alive
            works = []
            if job.error is not None:
                self._break(f"a weight transfer failed ({job.error})")
        finally:
            self._idle.set()

    def _issue(self, job: _Job) -> list[Any]:
        group, data = self._group, self._buffer.data
        if group is None:
            raise RuntimeError(f"the process group is gone ({self._broken})")
        if job.collective:
            return [group.broadcast([data], _broadcast_options())]
        return [group.send([data], 1 + i, job.tag) for i in job.ids]

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise RuntimeError(
                f"DistributedWeightSync's process group is broken: {self._broken}; build a new collector"
            )
        if self._group is None:
            raise RuntimeError("DistributedWeightSync is not connected (the collector is not running)")

    def _break(self, reason: str) -> None:
        """Destroy rank 0 of the group: the workers' pending transfers fail at once."""
        with self._lock:
            if self._broken is None:
                self._broken = reason
            group, self._group = self._group, None
        del group

    def close(self) -> None:
        with self._lock:
            self._closed = True
        # the workers are gone by now, so a transfer still in flight fails quickly
        self._idle.wait(self._config.timeout)
        with self._lock:
            group, self._group = self._group, None
            store, self._store = self._store, None
            server, self._server = self._server, None
            if self._broken is None:
                self._broken = "it was closed"
        del group
        if store is not None:
            store.close()
        if server is not None:
            server.close()  # every worker's connection and thread ends here


# -- worker side -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _DistributedReceiverSpec:
    backend: str
    store: StoreAddress  # with its token: the spec travels on an authenticated channel only
    world_size: int
    timeout: float
    interface: str | None
    device: str
    layout: FlatLayout

    def open(self, index: int) -> WeightReceiver:
        return _DistributedReceiver(self, index)


class _DistributedReceiver(WeightReceiver):
    def __init__(self, spec: _DistributedReceiverSpec, index: int) -> None:
        rank = index + 1
        self._device = torch.device(spec.device)
        store = StoreClient(spec.store, spec.timeout)
        self._store: StoreClient | None = store
        try:
            self._group: Any = self._join_group(spec, store, rank)
        except BaseException:
            store.close()
            raise
        self._buffer = FlatBuffer(spec.layout, self._device)
        self._pending: int | None = None
        self._newest = 0

    def _join_group(self, spec: _DistributedReceiverSpec, store: StoreClient, rank: int) -> Any:
        # announce, then wait for the trainer's go (it also sets it after an abort, when another worker
        # failed to start)
        store.set(f"ready/{rank}", "1")
        try:
            store.wait(["go"], timedelta(spec.timeout))
        except RuntimeError as exc:  # DistStoreError on timeout
            raise TimeoutError(
                f"DistributedWeightSync: no rendezvous with the trainer within {spec.timeout:g} s: {exc}"
            ) from None
        if store.check(["abort"]):
            raise RuntimeError("DistributedWeightSync: the trainer abandoned the rendezvous")
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        return new_group(
            spec.backend,
            store,
            rank,
            spec.world_size,
            timeout=spec.timeout,
            host=local_address(spec.store.host, spec.store.port),
            interface=spec.interface,
        )

    def on_message(self, message: Any) -> bool:
        if not isinstance(message, _Transfer):
            return False
        error = self._join(message)
        if error is not None:
            self.close()  # the trainer's side is gone (or broken): so is ours
            raise RuntimeError(
                f"DistributedWeightSync: receiving weights version {message.version} failed: {error}"
            )
        # the buffer now holds the newest weights; they are copied in at the next batch boundary
        self._pending = message.version
        self._newest = max(self._newest, message.version)
        return True

    def _join(self, message: _Transfer) -> str | None:
        """Take part in the transfer (blocking, bounded by the group's timeout); the error, if any."""
        group = self._group
        if group is None:
            return "the receiver is closed"
        data = self._buffer.data
        try:
            if message.collective:
                work = group.broadcast([data], _broadcast_options())
            else:
                work = group.recv([data], 0, message.tag)
            work.wait()
            _settle(self._device)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def published(self) -> int:
        return self._newest

    def load(self, policy: torch.nn.Module, current: int) -> int:
        pending, self._pending = self._pending, None
        if pending is None or pending <= current:
            return current
        copy_weights(flat_weights(policy), self._buffer.views)
        return pending

    def close(self) -> None:
        self._group = None
        store, self._store = self._store, None
        if store is not None:
            store.close()


# -- the scheme ------------------------------------------------------------------------------------
class DistributedWeightSync(WeightSync):
    """Weights broadcast from the trainer (rank 0) to the workers (ranks 1..N) over a private
    ``torch.distributed`` process group; workers load them at their next batch boundary.

    The group has its own store (authenticated with a random token, unlike torch's ``TCPStore``) and
    never touches ``torch.distributed``'s default group, so the
    trainer may run its own (DDP). All weights travel as one contiguous buffer; an update to every worker
    is one ``broadcast``, an update to a subset (``worker_ids=``) one point-to-point ``send`` per targeted
    worker. The trainer waits for the transfer in a thread: the event loop keeps running.

    A worker joins a transfer between batches, so ``await update_weights()`` returns once every targeted
    worker has received the weights: at once for idle workers (``MultiSyncCollector``), after the batch in
    progress for free-running ones (``MultiAsyncCollector``). A worker that dies during an update makes
    ``update_weights`` raise its error (``WorkerDiedError``); the group is then broken for good.

    Args:
        backend: ``"gloo"`` (CPU tensors; tested) or ``"nccl"`` (GPU workers, one CUDA device per rank;
            not tested here).
        init_method: ``"tcp://host:port"`` where the trainer opens the group's store (port 0: a free
            one); the host must be an address the workers reach. Default: a free port on 127.0.0.1.
        timeout: seconds; bounds the rendezvous and every transfer. With ``MultiAsyncCollector`` it must
            exceed a worker's batch (a worker joins a transfer after its batch in progress).
        interface: network interface gloo binds (e.g. ``"eth0"``); default: the trainer binds the store's
            host, a worker its own address on the route to it (127.0.0.1 on one machine).
        devices: nccl only: one CUDA device per rank (the trainer's first); default ``cuda:rank % count``.

    Example:
        >>> from aiocollect import DistributedWeightSync, MultiSyncCollector
        >>> # MultiSyncCollector(env_fns, policy, frames_per_batch=..., weight_sync=DistributedWeightSync())
    """

    def __init__(
        self,
        backend: str = "gloo",
        init_method: str | None = None,
        timeout: float = 60.0,
        *,
        interface: str | None = None,
        devices: Sequence[Any] | None = None,
    ) -> None:
        check_backend(backend, ("gloo", "nccl"))
        if init_method is not None:
            _parse_init_method(init_method)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if interface is not None and not isinstance(interface, str):
            raise TypeError(f"interface must be a network interface name or None, got {interface!r}")
        if devices is not None and backend != "nccl":
            raise ValueError("devices= is for backend='nccl' (gloo transfers go through CPU memory)")
        self.backend = backend
        self.init_method = init_method
        self.timeout = float(timeout)
        self.interface = interface
        self.devices = None if devices is None else tuple(str(torch.device(d)) for d in devices)

    def _address(self) -> tuple[str, int]:
        if self.init_method is None:
            return "127.0.0.1", 0
        return _parse_init_method(self.init_method)

    def _device(self, rank: int) -> torch.device:
        if self.backend == "gloo":
            return torch.device("cpu")
        if self.devices is not None:
            if rank >= len(self.devices):
                raise ValueError(f"devices= names {len(self.devices)} devices, rank {rank} needs one")
            return torch.device(self.devices[rank])
        count = torch.cuda.device_count()
        if not count:
            raise RuntimeError("DistributedWeightSync(backend='nccl') needs CUDA devices")
        return torch.device("cuda", rank % count)

    def open_sender(self, weights: TensorDictBase, num_workers: int, send: SendFn) -> WeightSender:
        return _DistributedSender(self, weights, num_workers, send)

    def __repr__(self) -> str:
        args = [f"backend={self.backend!r}"]
        if self.init_method is not None:
            args.append(f"init_method={self.init_method!r}")
        args.append(f"timeout={self.timeout:g}")
        if self.interface is not None:
            args.append(f"interface={self.interface!r}")
        return f"DistributedWeightSync({', '.join(args)})"


def _parse_init_method(init_method: str) -> tuple[str, int]:
    url = urllib.parse.urlparse(init_method) if isinstance(init_method, str) else None
    if url is None or url.scheme != "tcp" or not url.hostname or url.port is None:
        raise ValueError(f"init_method must be 'tcp://host:port', got {init_method!r}")
    return url.hostname, url.port
