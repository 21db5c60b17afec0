"""The Ray actor of :class:`~aiocollect.RayCollector`: a thin adapter that hosts one
:class:`~._node.NodeCore` (the hosted-collector core every engine shares) on Ray's asyncio loop, and Ray's
errors in the shared vocabulary."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import anyio.to_thread
import torch
from tensordict import TensorDictBase

from .._core._errors import WorkerDiedError, WorkerTimeoutError, worker_died, worker_error
from .._core._options import RolloutOptions
from ._launchers import stop_forkserver
from ._messages import ControlOp, HostSpec
from ._node import NodeCore, build_collector
from ._ray_wire import Wire, to_wire, weights_from_wire


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "RayCollector needs ray: pip install 'aiocollect[ray]' (or pip install 'ray>=2.9')"
        ) from exc
    return ray


class RemoteCollectorActor:
    """The actor (an async actor: Ray runs its methods as tasks on one asyncio loop in the actor).

    One host task enters the collector (``async with``) and leaves it on :meth:`close`: anyio's task
    groups must be left by the task that entered them, and every Ray call is a task of its own.
    """

    def __init__(
        self,
        index: int,
        num_collectors: int,
        policy_blob: bytes,
        payload: bytes,
        rollout: RolloutOptions,
        sync: bool,
    ) -> None:
        # Ray hands the object refs among the arguments over as their values (the pickled bytes)
        spec = HostSpec(index, num_collectors, payload, policy_blob, rollout)
        self._spec: HostSpec | None = spec
        self._index = index
        self._sync = sync
        self._core: NodeCore | None = None
        self._stop = asyncio.Event()
        self._ready = asyncio.Event()
        self._host_task: asyncio.Task[None] | None = None
        self._host_error: BaseException | None = None
        self._batches_in_flight: set[asyncio.Task[Any]] = set()

    @property
    def core(self) -> NodeCore:
        assert self._core is not None, "start() first"
        return self._core

    async def where(self) -> dict[str, Any]:
        """Where this actor runs."""
        import ray

        return {
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "hostname": socket.gethostname(),
        }

    async def start(self) -> int:
        """Build the collector and enter it; its ``frames_per_batch``."""
        spec, self._spec = self._spec, None  # the pickled arguments are not kept
        assert spec is not None
        collector, policy = await anyio.to_thread.run_sync(build_collector, spec)
        self._core = NodeCore(collector, policy)
        self._host_task = asyncio.get_running_loop().create_task(self._host())
        await self._ready.wait()
        if self._host_error is not None:
            raise self._host_error
        return self.core.frames_per_batch

    async def _host(self) -> None:
        try:
            async with self.core:
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:
            self._host_error = exc
        finally:
            self._ready.set()

    async def load_weights(self, version: int, weights: Any) -> int:
        """Load ``weights`` as ``version`` now (``update_weights(wait=True)``); the version it runs."""
        return await self.core.apply(version, weights_from_wire(weights), wait=True)

    async def next(self, version: int | None, weights: Any) -> tuple[Wire | TensorDictBase, dict[str, Any]]:
        """One batch (weights given with the request are loaded first) and what the trainer counts."""
        core = self.core
        if weights is not None and version is not None and version > core.applied:
            await core.apply(version, weights_from_wire(weights), wait=False)
        task = asyncio.current_task()
        assert task is not None
        self._batches_in_flight.add(task)
        try:
            out = await core.next_batch()
        finally:
            self._batches_in_flight.discard(task)
        batch = out.batch
        if not self._sync:
            batch.set(
                ("collector", "worker_id"), torch.full(batch.batch_size, self._index, dtype=torch.int64)
            )
        meta = {"frames": out.frames, "episodes": out.episodes, "policy_version": out.policy_version}
        meta["time_split"] = out.time_split  # the actor's collector's split so far (producer_totals)
        return to_wire(batch), meta

    async def restarts(self) -> tuple[tuple[int, str, int], ...]:
        """The collector's next restarts, once it makes them (the trainer keeps one call waiting: they
        reach it as they happen); empty once the collector closed."""
        return await self.core.next_restarts()

    async def call(self, op: ControlOp) -> Any:
        """Answer a control operation (seed, reset, state dict...)."""
        return await self.core.call(op)

    async def close(self) -> list[int]:
        """Leave the collector (its workers are reaped); the trainer kills the actor afterwards.

        Returns the pids of the processes still under this actor (multiprocessing's resource tracker
        ends with it), for the trainer to wait on when it shares the machine. The forkserver of its
        workers is killed here (left alone, it took 3-5 s, more under load, to shut down its
        interpreter after the actor's death: longer than the trainer waits)."""
        for task in list(self._batches_in_flight):
            task.cancel()  # the rollout stops at its next step instead of finishing the batch
        self._stop.set()
        if self._host_task is not None:
            await asyncio.shield(self._host_task)
        stop_forkserver()  # its workers are reaped by now
        return _descendants(os.getpid())


def _descendants(pid: int) -> list[int]:
    """Pids of the processes under ``pid`` (Linux ``/proc``; empty elsewhere)."""
    parents: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        parents[int(entry)] = int(stat.rsplit(b")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parents.items() if pp == parent]
        found.extend(children)
        frontier.extend(children)
    return found


_ACTOR_CLASS: Any = None


def actor_class() -> Any:
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        _ACTOR_CLASS = import_ray().remote(RemoteCollectorActor)
    return _ACTOR_CLASS


def unwrap_ray_error(exc: BaseException, where: str, actor: Any = None) -> BaseException:
    """Ray's errors in the shared vocabulary: a ``RayTaskError`` is the remote exception with its own
    type (the remote traceback as a note); an exception Ray could not deserialise is a ``WorkerError``
    (type name, message, traceback text); a dead actor is a ``WorkerDiedError`` (Ray's error as its
    ``__cause__``). Other errors (a lost object) are returned as they are."""
    ray = import_ray()
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause
        if isinstance(cause, ray.exceptions.UnserializableException):
            exc = cause
        elif isinstance(cause, BaseException) and not isinstance(cause, ray.exceptions.RayTaskError):
            # str() of Ray's error (a plain RayTaskError or the dual "RayTaskError(Type)" class, whose
            # other attributes are the cause's) is the remote traceback
            cause.add_note(f"raised in {where}; the remote traceback:\n{str(exc).strip()}")
            return cause
    if isinstance(exc, ray.exceptions.UnserializableException):
        text = str(getattr(exc, "_original_stack_trace", "") or "").strip()
        last = text.splitlines()[-1] if text else "Exception: (unknown)"
        type_name, _, message = last.partition(": ")
        return worker_error(type_name.strip() or "Exception", message, text, where)
    if isinstance(exc, ray.exceptions.RayActorError) and actor is not None:
        actor_id = getattr(getattr(actor.handle, "_actor_id", None), "hex", lambda: None)()
        return worker_died(actor.index, member="actor", engine="ray", actor=actor_id, cause=exc)
    return exc


def actor_lost(error: BaseException) -> bool:
    """Whether ``error`` says the actor itself is gone (killed, its node lost) or hung past
    ``progress_timeout``: what a new actor answers. An exception raised in the actor (its env's past the
    env budget, its policy's, a worker of its own that died) is not."""
    if isinstance(error, WorkerTimeoutError):
        return True
    return isinstance(error, WorkerDiedError) and error.engine == "ray"


__all__ = ["RemoteCollectorActor", "actor_class", "actor_lost", "import_ray", "unwrap_ray_error"]
