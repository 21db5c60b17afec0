"""``RayCollector``: each remote collector is a Ray actor running one of our collectors; the trainer awaits
their batches as Ray object refs and merges them on its own event loop.

What crosses the network: the env constructors and the policy once (``cloudpickle``, put in the object
store once and fetched by every actor), one pickled batch per delivered batch (actor -> trainer), and the
weights once per update (``ray.put`` once; each targeted actor fetches the same object with its next
request, or at once with ``update_weights(wait=True)``). Everything else is small control calls.

Ray is imported when a ``RayCollector`` is entered, never by ``import aiocollect``.
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import cloudpickle
import numpy as np
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from tensordict import TensorDict, TensorDictBase

from .._collector import Collector
from .._errors import CollectorClosedError, worker_died, worker_error
from .._events import (
    EpisodeFinished,
    WeightsLoaded,
    WeightsPublished,
    WorkerFailed,
    WorkerStarted,
    WorkerStopped,
)
from .._fleet import FleetCollector
from .._gather import gather
from .._multi import ProcessCollector, _MultiCollectorBase
from .._pids import pid_alive
from .._validation import flag, positive_int, replay_buffer_arg, seed_arg, total_frames_arg
from .._weightsync import flat_weights

#: arguments RayCollector sets on every remote collector itself
_RESERVED = (
    "frames_per_batch",
    "total_frames",
    "replay_buffer",
    "progress",
    "traj_id_start",
    "traj_id_stride",
)
#: remote options used unless ``remote_config`` says otherwise
DEFAULT_REMOTE_CONFIG: dict[str, Any] = {"num_cpus": 1}
#: ``ray.init`` arguments used when RayCollector starts a local cluster itself
#: (on loopback: Ray's own GCS and raylet still listen on every interface, behind Ray's token auth)
DEFAULT_RAY_INIT_CONFIG: dict[str, Any] = {
    "address": "local",
    "include_dashboard": False,
    "_node_ip_address": "127.0.0.1",
}
#: seconds after which actors that have not started yet are reported (a warning), e.g. lacking resources
_PENDING_WARNING_S = 60.0
#: seconds an actor gets to close its collector (and reap its worker processes) before ``ray.kill``
_CLOSE_GRACE = 10.0


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "RayCollector needs ray: pip install 'aiocollect[ray]' (or pip install 'ray>=2.9')"
        ) from exc
    return ray


# -- batches on the wire -----------------------------------------------------------------------------
@dataclass
class Wire:
    """A batch as numpy arrays, the form Ray moves fastest: its serialiser sends numpy arrays out of
    band and maps them from the object store without a copy, where pickling torch tensors costs ~5 ms
    more per batch (measured; see docs/ray.md). The arrays it returns are read-only views of the object
    store: :func:`from_wires` makes the one copy."""

    batch_size: tuple[int, ...]
    keys: list[tuple[str, ...]]
    arrays: list[np.ndarray]


def to_wire(batch: TensorDictBase) -> Wire | TensorDictBase:
    """``batch`` as a :class:`Wire`, or as it is when a leaf is not a CPU tensor numpy can hold."""
    keys: list[tuple[str, ...]] = []
    arrays: list[np.ndarray] = []
    for key, value in batch.items(include_nested=True, leaves_only=True):
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
            return batch
        try:
            arrays.append(value.detach().numpy())
        except (TypeError, RuntimeError):  # e.g. bfloat16
            return batch
        keys.append(key if isinstance(key, tuple) else (key,))
    return Wire(tuple(batch.batch_size), keys, arrays)


def _tensordict(batch_size: Sequence[int], keys: list[tuple[str, ...]], arrays: list[np.ndarray]) -> Any:
    nested: dict[str, Any] = {}
    for key, array in zip(keys, arrays, strict=True):
        node = nested
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = torch.from_numpy(array)
    return TensorDict(nested, batch_size=list(batch_size))


def from_wires(parts: list[Any], stack: bool) -> TensorDictBase:
    """One batch (``stack=False``: ``parts`` has one) or the actors' batches stacked on a new dim 0,
    copied out of Ray's read-only buffers once. Runs in a worker thread (the copy is the big cost)."""
    wires = [p for p in parts if isinstance(p, Wire)]
    same = len(wires) == len(parts) and all(
        w.keys == wires[0].keys and w.batch_size == wires[0].batch_size for w in wires
    )
    batch: Any
    if not same:
        tds = [
            _tensordict(p.batch_size, p.keys, [a.copy() for a in p.arrays]) if isinstance(p, Wire) else p
            for p in parts
        ]
        batch = torch.stack(tds, 0) if stack else tds[0]
    elif stack:
        arrays = [np.stack([w.arrays[j] for w in wires]) for j in range(len(wires[0].keys))]
        batch = _tensordict((len(wires), *wires[0].batch_size), wires[0].keys, arrays)
    else:
        (wire,) = wires
        batch = _tensordict(wire.batch_size, wire.keys, [a.copy() for a in wire.arrays])
    batch.names = [None] * (batch.ndim - 1) + ["time"]
    return batch


def weights_to_wire(weights: TensorDictBase) -> dict[str, Any]:
    """Flat weights as numpy arrays where numpy holds the dtype (Ray's fast path, as for batches)."""
    out: dict[str, Any] = {}
    for key, value in weights.items():
        value = value.detach().cpu()
        try:
            out[key] = value.numpy()
        except (TypeError, RuntimeError):  # e.g. bfloat16: pickled as a tensor
            out[key] = value
    return out


def weights_from_wire(weights: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Tensors again; Ray's arrays are read-only views of its object store: copied (then copied into
    the policy), not aliased."""
    return {k: torch.from_numpy(v.copy()) if isinstance(v, np.ndarray) else v for k, v in weights.items()}


# -- the actor ---------------------------------------------------------------------------------------
class _RemoteCollector:
    """The actor (an async actor: Ray runs its methods as tasks on one asyncio loop in the actor).

    One host task enters the collector (``async with``) and leaves it on :meth:`close`: anyio's task
    groups must be left by the task that entered them, and every Ray call is a task of its own.
    """

    def __init__(
        self,
        index: int,
        num_collectors: int,
        collector_class: type,
        frames_per_batch: int,
        policy_blob: bytes,
        payload: bytes,
        sync: bool,
    ) -> None:
        self._index = index
        self._num = num_collectors
        self._cls = collector_class
        self._fpb = frames_per_batch
        self._policy_blob = policy_blob
        self._payload = payload
        self._sync = sync
        self._collector: Any = None
        self._events: Any = None
        self._stop = asyncio.Event()
        self._ready = asyncio.Event()
        self._host_task: asyncio.Task[None] | None = None
        self._host_error: BaseException | None = None
        # the version the trainer gave the weights this actor runs, by the inner collector's version
        self._outer_of_inner: dict[int, int] = {0: 0}
        self._outer_version = 0
        self._weights_lock = asyncio.Lock()
        self._batches_in_flight: set[asyncio.Task[Any]] = set()

    def _build(self) -> Any:
        env_fn, kwargs = cloudpickle.loads(self._payload)
        policy = cloudpickle.loads(self._policy_blob)
        self._payload = self._policy_blob = b""
        return self._cls(
            env_fn,
            policy,
            frames_per_batch=self._fpb,
            total_frames=-1,
            progress=False,
            traj_id_start=self._index,
            traj_id_stride=self._num,
            **kwargs,
        )

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
        self._collector = await anyio.to_thread.run_sync(self._build)
        self._events = self._collector.events(max_buffer=1 << 16)
        self._host_task = asyncio.get_running_loop().create_task(self._host())
        await self._ready.wait()
        if self._host_error is not None:
            raise self._host_error
        return int(self._collector.frames_per_batch)

    async def _host(self) -> None:
        try:
            async with self._collector:
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:
            self._host_error = exc
        finally:
            self._ready.set()

    async def _apply(self, version: int, weights: Any, wait: bool) -> int:
        async with self._weights_lock:
            if version > self._outer_version:
                inner = await self._collector.update_weights(weights_from_wire(weights), wait=wait)
                self._outer_of_inner[int(inner)] = version
                self._outer_version = version
            return self._outer_version

    async def load_weights(self, version: int, weights: Any) -> int:
        """Load ``weights`` as ``version`` now (``update_weights(wait=True)``); the version it runs."""
        return await self._apply(version, weights, True)

    async def next(self, version: int | None, weights: Any) -> tuple[Wire | TensorDictBase, dict[str, Any]]:
        """One batch (weights given with the request are loaded first) and what the trainer counts."""
        if weights is not None:
            await self._apply(int(version), weights, False)  # type: ignore[arg-type]
        task = asyncio.current_task()
        assert task is not None
        self._batches_in_flight.add(task)
        try:
            batch = await self._collector.__anext__()
        finally:
            self._batches_in_flight.discard(task)
        frames, inner_version, episodes = 0, 0, []
        while (event := self._events.receive_nowait()) is not None:
            if isinstance(event, EpisodeFinished):
                episodes.append((float(event.episode_return), int(event.length)))
            elif event.kind == "batch":
                frames += int(event.frames)
                inner_version = int(event.policy_version)
        key = ("collector", "policy_version")
        if key in batch.keys(include_nested=True):
            inner = batch.get(key)
            outer = inner.clone()
            for v in inner.unique().tolist():
                outer[inner == v] = self._outer_of_inner.get(int(v), int(v))
            batch.set(key, outer)
        if not self._sync:
            batch.set(
                ("collector", "worker_id"), torch.full(batch.batch_size, self._index, dtype=torch.int64)
            )
        meta = {
            "frames": frames,
            "episodes": episodes,
            "policy_version": self._outer_of_inner.get(inner_version, self._outer_version),
        }
        return to_wire(batch), meta

    async def set_seed(self, seed: int) -> int:
        return int(await self._collector.set_seed(seed))

    async def reset(self) -> None:
        await self._collector.reset()

    async def state_dict(self) -> dict[str, Any]:
        inner = dict(await self._collector.state_dict())
        policy = inner.pop("policy", None)
        return {
            "inner": inner,
            "version_map": dict(self._outer_of_inner),
            "version": self._outer_version,
            "policy": policy,
        }

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        await self._collector.load_state_dict(state["inner"])
        self._outer_of_inner = {int(k): int(v) for k, v in state["version_map"].items()}
        self._outer_version = int(state["version"])

    async def close(self) -> list[int]:
        """Leave the collector (its workers are reaped); the trainer kills the actor afterwards.

        Returns the pids of the processes still under this actor (multiprocessing's forkserver and
        resource tracker end with it), for the trainer to wait on when it shares the machine."""
        for task in list(self._batches_in_flight):
            task.cancel()  # the rollout stops at its next step instead of finishing the batch
        self._stop.set()
        if self._host_task is not None:
            await asyncio.shield(self._host_task)
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


def _actor_class() -> Any:
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        _ACTOR_CLASS = _import_ray().remote(_RemoteCollector)
    return _ACTOR_CLASS


# -- errors ------------------------------------------------------------------------------------------
def unwrap_ray_error(exc: BaseException, where: str, actor: _Actor | None = None) -> BaseException:
    """Ray's errors in the shared vocabulary: a ``RayTaskError`` is the remote exception with its own
    type (the remote traceback as a note); an exception Ray could not deserialise is a ``WorkerError``
    (type name, message, traceback text); a dead actor is a ``WorkerDiedError`` (Ray's error as its
    ``__cause__``). Other errors (a lost object) are returned as they are."""
    ray = _import_ray()
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


# -- the trainer side --------------------------------------------------------------------------------
@dataclass
class _Actor:
    index: int
    handle: Any
    info: dict[str, Any] = field(default_factory=dict)
    state: str = "starting"
    frames: int = 0
    policy_version: int = 0
    #: batches delivered since this actor was last sent weights (max_weight_update_interval)
    since_update: int = 0
    #: weights to send with its next request: (version, object ref)
    pending: tuple[int, Any] | None = None
    #: processes that were still under the actor when its collector closed
    leftover: list[int] = field(default_factory=list)


@dataclass
class _Delivery:
    batch: TensorDictBase
    frames: int
    episodes: list[tuple[int, float, int]]
    worker_id: int | None
    policy_version: int


def _per_actor(name: str, value: Any, n: int, kind: type | tuple[type, ...]) -> list[Any]:
    """``value`` for every actor, or a sequence of ``n`` values, one per actor."""
    if isinstance(value, kind):
        return [value] * n
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for num_collectors={n}: give one per actor")
        return list(value)
    raise TypeError(f"{name} must be a {getattr(kind, '__name__', kind)} or a list of one per actor")


class RayCollector(FleetCollector):
    """Collect with ``num_collectors`` Ray actors, each running one of our collectors.

    ``async with RayCollector(...) as c: async for batch in c:`` as with every collector. Entering starts
    a local Ray cluster (or connects to ``ray_init_config["address"]``; or uses the one ``ray.init`` made
    already), starts the actors and waits until each one's collector runs; leaving closes every remote
    collector (its worker processes are reaped), kills every actor (``ray.kill``) and shuts down the
    cluster only if this collector started it.

    Args:
        create_env_fn: an env constructor for every actor, or a list of ``num_collectors``, one per actor.
            With a multi-process ``collector_class``, an actor's entry is the list of its workers' env
            constructors (a single constructor means one worker). They and the policy are pickled with
            ``cloudpickle``: functions and classes are pickled by reference, so their modules must be
            importable on the Ray nodes (``runtime_env={"py_modules": [...]}`` in ``remote_config`` or
            ``ray_init_config``), unless registered with ``cloudpickle.register_pickle_by_value``.
        policy: as for :class:`Collector` (an ``nn.Module``, a ``TensorDictModule``, a callable or None).
        frames_per_batch: frames per delivered batch. ``sync=True``: split evenly over the actors (each
            collects ``ceil(frames_per_batch / num_collectors)``); ``sync=False``: each actor's batch.
        total_frames: frames to deliver before ``async for`` ends; ``-1`` for endless.
        num_collectors: how many actors.
        collector_class: what each actor runs: :class:`Collector` (default), :class:`MultiSyncCollector`
            or :class:`MultiAsyncCollector` (worker processes inside the actor), or
            :class:`ProcessCollector`.
        collector_kwargs: keyword arguments of ``collector_class``, one dict for all or a list, one per
            actor. A ``seed`` in a shared dict seeds actor ``i`` after actor ``i - 1`` (distinct seeds,
            as :meth:`set_seed`); an ``init_random_frames`` in a shared dict is split over the actors.
        remote_config: Ray actor options (``num_cpus``, ``num_gpus``, ``memory``, ``resources``,
            ``runtime_env``, ``scheduling_strategy``...), one dict or one per actor; default
            ``{"num_cpus": 1}``.
        ray_init_config: ``ray.init`` arguments when Ray is not initialised yet; with ``"address"`` it
            connects to that cluster, otherwise it starts a local one (``address="local"``).
        sync: ``True``: every batch stacks one batch of each actor (``[num_collectors, ...]``), asked
            for together; ``False``: each actor's batch as it arrives, with ``("collector",
            "worker_id")``, while the actor collects its next one.
        update_after_each_batch: send the trainer's current weights before every request: to the actor
            that delivered (``sync=False``, its next batch is asked for when ``async for`` asks for the
            next batch, after the training step) or to all actors (``sync=True``).
        max_weight_update_interval: an actor that delivered this many batches without receiving
            weights is sent the trainer's current weights before its next batch (``-1``: never).
        replay_buffer: batches go there (``extend`` runs in a worker thread) and ``async for`` yields
            ``None``; :meth:`start` collects into it in the background.
        progress: as for :class:`Collector`.

    Example:
        >>> import anyio
        >>> from aiocollect import GymEnv, RayCollector
        >>> async def main():  # doctest: +SKIP
        ...     async with RayCollector(lambda: GymEnv("CartPole-v1"), frames_per_batch=256,
        ...                             total_frames=1024, num_collectors=2) as c:
        ...         async for batch in c:
        ...             print(batch.batch_size, batch["collector", "worker_id"][0].item())
        >>> anyio.run(main)  # doctest: +SKIP
    """

    _member_noun = "actor"

    def __init__(
        self,
        create_env_fn: Any,
        policy: Any = None,
        *,
        frames_per_batch: int,
        total_frames: int | None = -1,
        num_collectors: int,
        collector_class: type = Collector,
        collector_kwargs: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        remote_config: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        ray_init_config: Mapping[str, Any] | None = None,
        sync: bool = False,
        update_after_each_batch: bool = False,
        max_weight_update_interval: int = -1,
        replay_buffer: Any = None,
        progress: Any = None,
    ) -> None:
        n = self.num_collectors = positive_int("num_collectors", num_collectors)
        self._requested_fpb = positive_int("frames_per_batch", frames_per_batch)
        self.total_frames = total_frames_arg(total_frames)
        self._sync = flag("sync", sync)
        self._update_after_each_batch = flag("update_after_each_batch", update_after_each_batch)
        interval = max_weight_update_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or (interval < 1 and interval != -1):
            raise ValueError(f"max_weight_update_interval must be a positive int or -1, got {interval!r}")
        self._interval = interval
        if self._update_after_each_batch and interval > 0:
            raise ValueError(
                "update_after_each_batch=True sends weights before every batch already: drop "
                "max_weight_update_interval"
            )
        self.replay_buffer = replay_buffer_arg(replay_buffer)
        if not isinstance(collector_class, type) or not issubclass(
            collector_class, (Collector, _MultiCollectorBase)
        ):
            raise TypeError(
                "collector_class must be Collector, MultiSyncCollector, MultiAsyncCollector or "
                f"ProcessCollector, got {collector_class!r}"
            )
        self._collector_class = collector_class
        multi = issubclass(collector_class, _MultiCollectorBase) and not issubclass(
            collector_class, ProcessCollector
        )
        if policy is not None and not callable(policy):
            raise TypeError(
                f"policy must be a TensorDictModule, an nn.Module, a callable td -> td or None, got "
                f"{policy!r}"
            )
        if (self._update_after_each_batch or interval > 0) and not isinstance(policy, torch.nn.Module):
            raise TypeError(
                "update_after_each_batch and max_weight_update_interval send the policy's weights: they "
                f"need an nn.Module policy, got {type(policy).__name__}"
            )
        self._source_policy = policy
        self._weights_template = flat_weights(policy) if isinstance(policy, torch.nn.Module) else None

        # -- per-actor env constructors, collector kwargs and remote options -------------------------
        if callable(create_env_fn) and not isinstance(create_env_fn, Sequence):
            env_fns = [create_env_fn] * n
        else:
            env_fns = _per_actor("create_env_fn", create_env_fn, n, ())
        for i, fn in enumerate(env_fns):
            if multi:
                if callable(fn) and not isinstance(fn, Sequence):
                    env_fns[i] = [fn]
                elif not (isinstance(fn, Sequence) and fn and all(callable(f) for f in fn)):
                    raise TypeError(
                        f"create_env_fn[{i}] must be an env constructor or a list of them (the actor's "
                        f"{collector_class.__name__} workers), got {fn!r}"
                    )
            elif not callable(fn):
                raise TypeError(f"create_env_fn[{i}] must be a callable returning an env, got {fn!r}")
        kwargs_list = _per_actor("collector_kwargs", collector_kwargs or {}, n, Mapping)
        self._seed: int | None = None
        if isinstance(collector_kwargs, Mapping) or collector_kwargs is None:
            shared = dict(kwargs_list[0])
            self._seed = seed_arg(shared.pop("seed", None))
            if shared.get("init_random_frames"):
                shared["init_random_frames"] = math.ceil(int(shared["init_random_frames"]) / n)
            kwargs_list = [shared] * n
        for i, kw in enumerate(kwargs_list):
            if not isinstance(kw, Mapping):
                raise TypeError(f"collector_kwargs[{i}] must be a dict, got {kw!r}")
            reserved = sorted(set(kw) & set(_RESERVED))
            if reserved:
                raise ValueError(
                    f"collector_kwargs cannot set {reserved}: RayCollector sets them on every actor "
                    "(give frames_per_batch, total_frames, replay_buffer and progress to RayCollector)"
                )
        remote_list = _per_actor("remote_config", remote_config or {}, n, Mapping)
        self._remote_configs = [{**DEFAULT_REMOTE_CONFIG, **dict(rc)} for rc in remote_list]
        if ray_init_config is not None and not isinstance(ray_init_config, Mapping):
            raise TypeError(f"ray_init_config must be a dict of ray.init arguments, got {ray_init_config!r}")
        self._ray_init_config = dict(ray_init_config) if ray_init_config is not None else None
        if self._sync:
            per_actor = math.ceil(self._requested_fpb / n)
            if self._requested_fpb % n:
                warnings.warn(
                    f"frames_per_batch={self._requested_fpb} is not divisible by {n} actors: each "
                    f"collects {per_actor}",
                    UserWarning,
                    stacklevel=2,
                )
        else:
            per_actor = self._requested_fpb
        self._per_actor_fpb = per_actor
        self.frames_per_batch = per_actor * n if self._sync else per_actor
        self._env_fns = env_fns
        self._kwargs_list = [dict(kw) for kw in kwargs_list]

        self._init_base(progress)
        self._ray: Any = None
        self._started_ray = False
        self._entered = False
        self._actors: list[_Actor] = []
        self._version = 0
        self._weights_lock = anyio.Lock()
        self._results_send: MemoryObjectSendStream[tuple[int, Any]] | None = None
        self._results_receive: MemoryObjectReceiveStream[tuple[int, Any]] | None = None
        self._due: list[int] = []  # async mode: actors to ask for their next batch
        self._limiter: anyio.CapacityLimiter | None = None
        self._torn_down = False
        self._progress_closed = False
        self._delivered = 0

    # -- lifecycle (CollectorBase's async with: __aenter__ calls _on_enter, __aexit__ calls aclose) ----
    async def _on_enter(self) -> None:
        if self._entered:
            raise RuntimeError("the collector was entered already: a RayCollector is entered once")
        self._entered = True
        await self._start()

    async def aclose(self) -> None:
        """Close every remote collector (a grace period for their workers), kill every actor and shut
        down the Ray cluster if this collector started it. Idempotent; ``async with`` does it."""
        await self._shutdown()

    async def _start(self) -> None:
        ray = self._ray = _import_ray()
        self._limiter = anyio.CapacityLimiter(2 * self.num_collectors + 2)
        if not ray.is_initialized():
            config = dict(DEFAULT_RAY_INIT_CONFIG)
            if self._ray_init_config is not None:
                config = (
                    dict(self._ray_init_config)
                    if "address" in self._ray_init_config
                    else {**config, **self._ray_init_config}
                )
            await anyio.to_thread.run_sync(partial(ray.init, **config))
            self._started_ray = True
        elif self._ray_init_config is not None:
            warnings.warn(
                "ray is initialised already: ray_init_config is ignored (this collector uses that cluster)",
                UserWarning,
                stacklevel=3,
            )
        self._actors = await anyio.to_thread.run_sync(self._create_actors)
        # the actors' processes start (or wait for the resources they ask for: Ray queues them)
        where = [a.handle.where.remote() for a in self._actors]

        async def placed() -> list[Any]:
            return await gather(
                *[
                    partial(self._call, a, lambda ref=ref: ref, what="start")
                    for a, ref in zip(self._actors, where, strict=True)
                ]
            )

        infos: list[Any] | None = None
        with anyio.move_on_after(_PENDING_WARNING_S):
            infos = await placed()
        if infos is None:
            ray = self._ray
            warnings.warn(
                f"RayCollector: the actors have not started after {_PENDING_WARNING_S:.0f} s; Ray may lack "
                f"the resources they ask for (remote_config={self._remote_configs[0]}, available now: "
                f"{ray.available_resources()}). Still waiting: cancel (e.g. anyio.fail_after) to give up",
                UserWarning,
                stacklevel=3,
            )
            infos = await placed()
        for actor, info in zip(self._actors, infos, strict=True):
            actor.info = info
        fpbs = await gather(
            *[partial(self._call, a, a.handle.start.remote, what="start") for a in self._actors]
        )
        for actor, fpb in zip(self._actors, fpbs, strict=True):
            actor.info["frames_per_batch"] = int(fpb)
            actor.state = "collecting"
            self._hub.publish(WorkerStarted(actor.index))
        self.frames_per_batch = sum(fpbs) if self._sync else fpbs[0]
        await self._members_started()
        if not self._sync:
            self._results_send, self._results_receive = anyio.create_memory_object_stream[tuple[int, Any]](
                self.num_collectors
            )
            for actor in self._actors:
                await self._submit(actor)

    def _create_actors(self) -> list[_Actor]:
        """In a worker thread: pickle the arguments, put them in the object store, create the actors."""
        ray = self._ray
        try:
            policy_blob = cloudpickle.dumps(self._source_policy)
        except Exception as exc:
            raise TypeError(f"the policy cannot be pickled for the Ray actors: {exc}") from exc
        policy_ref = ray.put(policy_blob)
        cls = _actor_class()
        actors = []
        payload_refs: dict[bytes, Any] = {}
        for i in range(self.num_collectors):
            try:
                payload = cloudpickle.dumps((self._env_fns[i], self._kwargs_list[i]))
            except Exception as exc:
                raise TypeError(
                    f"create_env_fn or collector_kwargs of actor {i} cannot be pickled: {exc}"
                ) from exc
            if payload not in payload_refs:  # the same constructor for every actor: one object
                payload_refs[payload] = ray.put(payload)
            ref = payload_refs[payload]
            handle = cls.options(**self._remote_configs[i]).remote(
                i,
                self.num_collectors,
                self._collector_class,
                self._per_actor_fpb,
                policy_ref,
                ref,
                self._sync,
            )
            actors.append(_Actor(i, handle))
        return actors

    async def _shutdown(self) -> None:
        with anyio.CancelScope(shield=True):
            if self._background is not None:
                self._background.cancel()
            self._closed = True
            await self._teardown()
            self._hub.close()
            if not self._progress_closed:
                self._progress_closed = True
                self._finish_progress()

    async def _teardown(self) -> None:
        """Close the remote collectors (a grace period), kill the actors, end a cluster we started."""
        with anyio.CancelScope(shield=True):
            if self._torn_down:
                return
            self._torn_down = True
            for stream in (self._results_send, self._results_receive):
                if stream is not None:
                    stream.close()
            actors = [a for a in self._actors if a.state != "stopped"]
            if actors:
                with anyio.move_on_after(_CLOSE_GRACE):
                    await gather(*[partial(self._close_one, a) for a in actors])
                await anyio.to_thread.run_sync(self._kill, actors)
                for actor in actors:
                    if actor.state != "failed":
                        actor.state = "stopped"
                    self._hub.publish(WorkerStopped(actor.index))
            if self._started_ray:
                self._started_ray = False
                await anyio.to_thread.run_sync(self._ray.shutdown)

    async def _close_one(self, actor: _Actor) -> None:
        try:
            actor.leftover = list(await self._await(actor.handle.close.remote()))
        except Exception:
            pass  # a dead or failed actor: it is killed next anyway

    def _kill(self, actors: list[_Actor]) -> None:
        ray = self._ray
        for actor in actors:
            try:
                ray.kill(actor.handle, no_restart=True)
            except Exception:
                pass
        # ray.kill returns at once and the process ends a little later: on this machine, wait (a
        # bounded time) until the actors and what ran under them are gone, so that leaving
        # `async with` leaves nothing of ours behind
        here = socket.gethostname()
        pids = [
            pid
            for a in actors
            if a.info.get("hostname") == here and "pid" in a.info
            for pid in [a.info["pid"], *a.leftover]
        ]
        deadline = time.monotonic() + _CLOSE_GRACE
        while pids and time.monotonic() < deadline:
            pids = [pid for pid in pids if pid_alive(pid)]
            if pids:
                time.sleep(0.01)

    # -- awaiting Ray ------------------------------------------------------------------------------
    async def _await(self, ref: Any) -> Any:
        """``await ref`` on asyncio (Ray deserialises the result in its own thread); elsewhere (trio),
        ``ray.get`` in a worker thread, since Ray's futures belong to asyncio."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return await anyio.to_thread.run_sync(
                self._ray.get, ref, abandon_on_cancel=True, limiter=self._limiter
            )
        return await ref

    async def _call(self, actor: _Actor, method: Any, *args: Any, what: str) -> Any:
        """Call an actor method and await it; a remote exception is raised with its own type."""
        try:
            return await self._await(method(*args))
        except Exception as exc:
            error = unwrap_ray_error(exc, f"actor {actor.index} ({what})", actor)
            raise error from error.__cause__  # Ray's error stays the cause of a WorkerDiedError

    # -- iteration --------------------------------------------------------------------------------
    def _active(self) -> None:
        self._check_open()
        if not self._actors or self._task_group is None:
            raise RuntimeError(
                "RayCollector starts its actors in `async with`: write `async with RayCollector(...) as "
                "collector: async for batch in collector:`"
            )

    async def __anext__(self) -> TensorDictBase | None:
        self._active()
        if self._budget_reached():
            raise StopAsyncIteration
        await self._acquire_batch_lock()
        try:
            self._active()
            if self._budget_reached():
                raise StopAsyncIteration
            try:
                out = await (self._next_sync() if self._sync else self._next_async())
            except Exception as exc:
                if self._closed and not self._failed:  # closed under us (aclose from another task)
                    raise CollectorClosedError(f"the collector is closed: {self._closed_reason}") from exc
                self._failed = True
                self._closed = True
                self._closed_reason = f"a remote collector failed with {type(exc).__name__}: {exc}"
                await self._teardown()
                self._hub.close()
                raise
            self._delivered += 1
            self._record(out.frames, out.episodes, worker_id=out.worker_id, policy_version=out.policy_version)
            if self.replay_buffer is not None:
                await anyio.to_thread.run_sync(self.replay_buffer.extend, out.batch)
                return None
            return out.batch
        finally:
            self._lock.release()

    async def _submit(self, actor: _Actor) -> Any:
        """Ask ``actor`` for its next batch, sending weights with the request when some are due."""
        if self._interval > 0 and actor.since_update >= self._interval and actor.pending is None:
            await self.update_weights(worker_ids=[actor.index])
        version, weights = actor.pending if actor.pending is not None else (None, None)
        if actor.pending is not None:
            actor.pending = None
            actor.since_update = 0
        ref = actor.handle.next.remote(version, weights)
        if not self._sync:
            assert self._task_group is not None
            self._task_group.start_soon(self._wait_one, actor, ref)
        return ref

    async def _wait_one(self, actor: _Actor, ref: Any) -> None:
        """Async mode, in the task group: await one batch and hand it (or its error) to ``__anext__``."""
        try:
            out: Any = await self._await(ref)
        except Exception as exc:
            out = exc
        send = self._results_send
        if send is not None:
            try:
                await send.send((actor.index, out))
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass

    def _delivered_by(self, actor: _Actor, meta: dict[str, Any]) -> list[tuple[int, float, int]]:
        actor.frames += int(meta["frames"])
        actor.since_update += 1
        version = int(meta["policy_version"])
        if version > actor.policy_version:
            actor.policy_version = version
            self._hub.publish(WeightsLoaded(version, actor.index))
        return [(actor.index, r, n) for r, n in meta["episodes"]]

    def _failed_actor(self, actor: _Actor, exc: BaseException, what: str) -> BaseException:
        actor.state = "failed"
        error = unwrap_ray_error(exc, f"actor {actor.index} ({what})", actor)
        self._hub.publish(WorkerFailed(actor.index, f"{type(error).__name__}: {error}"))
        return error

    async def _next_async(self) -> _Delivery:
        due, self._due = self._due, []
        for index in due:
            if self._update_after_each_batch:
                await self.update_weights(worker_ids=[index])
            await self._submit(self._actors[index])
        assert self._results_receive is not None
        index, out = await self._results_receive.receive()
        actor = self._actors[index]
        if isinstance(out, BaseException):
            error = self._failed_actor(actor, out, "next batch")
            raise error from error.__cause__
        wire, meta = out
        batch = await anyio.to_thread.run_sync(from_wires, [wire], False)
        episodes = self._delivered_by(actor, meta)
        if self._update_after_each_batch:
            self._due.append(index)  # asked for again at the next __anext__: after the training step
        else:
            await self._submit(actor)
        return _Delivery(batch, int(meta["frames"]), episodes, index, int(meta["policy_version"]))

    async def _next_sync(self) -> _Delivery:
        if self._update_after_each_batch and self._delivered:
            await self.update_weights()
        due = [
            a.index
            for a in self._actors
            if self._interval > 0 and a.since_update >= self._interval and a.pending is None
        ]
        if due:  # one put for every actor due (max_weight_update_interval)
            await self.update_weights(worker_ids=due)
        refs = [await self._submit(actor) for actor in self._actors]

        async def one(actor: _Actor, ref: Any) -> Any:
            try:
                return await self._await(ref)
            except Exception as exc:
                error = self._failed_actor(actor, exc, "next batch")
                raise error from error.__cause__

        outs = await gather(*[partial(one, a, r) for a, r in zip(self._actors, refs, strict=True)])
        parts = [b for b, _ in outs]
        episodes: list[tuple[int, float, int]] = []
        for actor, (_, meta) in zip(self._actors, outs, strict=True):
            episodes.extend(self._delivered_by(actor, meta))
        shapes = {tuple(b.batch_size) for b in parts}
        if len(shapes) > 1:
            raise ValueError(
                f"sync=True stacks one batch per actor, but the actors' batches differ: {sorted(shapes)}; "
                "give every actor the same env batch size, or use sync=False"
            )
        # the one copy of the batch on the trainer, off the loop (a pixel batch copies for milliseconds)
        batch = await anyio.to_thread.run_sync(from_wires, parts, True)
        return _Delivery(
            batch,
            sum(int(m["frames"]) for _, m in outs),
            episodes,
            None,
            min(int(m["policy_version"]) for _, m in outs),
        )

    # -- weights ----------------------------------------------------------------------------------
    async def update_weights(
        self,
        policy_or_weights: Any = None,
        *,
        worker_ids: Sequence[int] | None = None,
        wait: bool = False,
    ) -> int:
        """Put the weights in Ray's object store once and return the new policy version.

        Each targeted actor fetches them with its next batch request and loads them before that batch
        (never mid-batch); ``wait=True`` sends them at once and returns when every targeted actor runs
        them (an actor collecting a batch finishes it first).

        Args:
            policy_or_weights: an ``nn.Module``, a TensorDict of weights or a state dict; ``None`` means
                the policy the collector was built with (its current weights).
            worker_ids: the actors to update (default: all).
            wait: wait until those actors run the new weights.
        """
        self._active()
        weights = self._weights_to_publish(policy_or_weights)
        flag("wait", wait)
        ids = self._target_ids(worker_ids)

        def put() -> Any:  # the copy out of the trainer's tensors and the pickling, off the loop
            return self._ray.put(weights_to_wire(weights))

        async with self._weights_lock:
            ref = await anyio.to_thread.run_sync(put)
            version = self._version = self._version + 1
            for i in ids:
                self._actors[i].pending = (version, ref)
            self._hub.publish(WeightsPublished(version))
        if wait:
            actors = [self._actors[i] for i in ids]
            loaded = await gather(
                *[
                    partial(self._call, a, a.handle.load_weights.remote, version, ref, what="weights")
                    for a in actors
                ]
            )
            for actor, v in zip(actors, loaded, strict=True):
                if actor.pending is not None and actor.pending[0] <= v:
                    actor.pending = None
                    actor.since_update = 0
                if v > actor.policy_version:
                    actor.policy_version = int(v)
                    self._hub.publish(WeightsLoaded(int(v), actor.index))
        return version

    # -- control ----------------------------------------------------------------------------------
    @property
    def _fleet_size(self) -> int:
        return self.num_collectors

    def _members(self) -> Sequence[_Actor]:
        return self._actors

    async def _call_member(self, index: int, method: str, *args: Any) -> Any:
        actor = self._actors[index]
        return await self._call(actor, getattr(actor.handle, method).remote, *args, what=method)

    async def reset(self) -> None:
        """Reset every actor's envs: their next batches start new episodes."""
        self._active()
        async with self._lock:
            await gather(*[partial(self._call, a, a.handle.reset.remote, what="reset") for a in self._actors])

    async def state_dict(self) -> dict[str, Any]:
        """Each actor's collector state (trajectory-id counters, versions), the counters, and the
        policy's weights (from actor 0)."""
        self._active()
        async with self._lock:
            states = await gather(
                *[partial(self._call, a, a.handle.state_dict.remote, what="state_dict") for a in self._actors]
            )
        state: dict[str, Any] = {
            f"worker{i}": {k: v for k, v in s.items() if k != "policy"} for i, s in enumerate(states)
        }
        state.update(self._counters())
        if states and states[0]["policy"] is not None:
            state["policy"] = states[0]["policy"]
        return state

    async def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (same ``num_collectors``); the budget continues from the
        saved count and the saved weights are loaded into every actor."""
        self._check_state(state, "worker")
        self._active()
        async with self._lock:
            await gather(
                *[
                    partial(
                        self._call,
                        a,
                        a.handle.load_state_dict.remote,
                        dict(state[f"worker{a.index}"]),
                        what="load_state_dict",
                    )
                    for a in self._actors
                ]
            )
            self._load_counters(state)
            for actor in self._actors:
                actor.policy_version = int(state[f"worker{actor.index}"].get("version", 0))
        if "policy" in state and self._weights_template is not None:
            await self.update_weights(state["policy"], wait=True)

    # -- introspection ----------------------------------------------------------------------------
    @property
    def actors(self) -> list[Any]:
        """The Ray actor handles (while the collector is entered)."""
        return [a.handle for a in self._actors]

    def actor_info(self) -> list[dict[str, Any]]:
        """Where each actor runs: ``pid``, ``node_id``, ``hostname`` and its ``frames_per_batch``."""
        return [dict(a.info) for a in self._actors]

    def __repr__(self) -> str:
        return (
            f"RayCollector(num_collectors={self.num_collectors}, collector_class="
            f"{self._collector_class.__name__}, frames_per_batch={self.frames_per_batch}, "
            f"total_frames={self.total_frames}, sync={self._sync}, closed={self._closed})"
        )
