"""The one collector over several members, whatever carries their batches: worker processes
(``MultiSyncCollector``, ``MultiAsyncCollector``, ``ProcessCollector``, ``MultiAsyncEnvCollector``),
torch.distributed or RPC nodes (``DistributedCollector``, ``DistributedSyncCollector``, ``RPCCollector``)
and Ray actors (``RayCollector``).

One copy of the collector surface: iteration, ``update_weights`` (lock, versions, staleness floors,
events, ``wait``), ``state_dict``, the seed chain, ``getattr_*``, per-member statistics, the trajectory
renames after a dropped batch, and the replacement of lost members (``_replace.Replacements``). What
differs per family is a :class:`~._transport.Transport` the collector holds (the worker pool of
``_multi/_workers.py``, the nodes of ``_remote/_nodes.py``, the actors of ``_remote/_ray_fleet.py``),
built with the collector's :class:`~._transport.FleetHandle` (``_Handle`` here): what the transport may
do to the collector, declared. The trainer side mirror of ``NodeCore``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, ClassVar, TypeVar

import anyio
import anyio.abc
import anyio.to_thread
import cloudpickle
from tensordict import TensorDictBase

from .._core._errors import CollectorClosedError
from .._core._gather import gather
from .._core._mistakes import name_coroutines, warn_rounded, warn_user
from .._core._validation import flag, policy_arg, replay_buffer_arg, seed_arg
from .._episodes._renames import DroppedBatchRenames
from .._local._base import CollectorBase
from .._observe._events import WeightsPublished
from .._observe._stats import CollectorStatistics, WorkerState, WorkerStatistics
from .._observe._timesplit import member_split
from .._policies._weights import as_weights, check_compatible
from .._transport._messages import FleetOp, GetAttr, GetState, LoadState, Reset, SetSeed
from ._replace import Replacements
from ._transport import FleetHandle, FleetSetup, Member, Transport

__all__ = ["FleetCollector"]

T = TypeVar("T", bound=Transport)


class FleetCollector(CollectorBase):
    """A collector over ``_fleet_size`` members, addressed by index ``0 .. _fleet_size - 1``, reached
    through a :class:`~._transport.Transport` (``_init_fleet``)."""

    #: what a member is called in error messages ("worker", "node", "actor")
    _member_noun: ClassVar[str] = "worker"
    _version: int
    _weights_template: TensorDictBase | None
    _source_policy: Any
    #: the seed of the first member (``None``: unseeded)
    _seed: int | None
    _transport: Transport
    _size: int
    #: frames delivered to the consumer were too stale (``update_weights(flush=True)``) and dropped
    _dropped_frames: int = 0
    #: max_policy_lag where the collector itself drops batches too old (first-ready worker pools)
    _floor_lag: int | None = None
    #: each member's frames per batch, once started
    _member_frames: list[int]
    #: set by members that collect ahead (``FirstReady``): after ``request_stop()`` they stop collecting;
    #: ``drain`` (on the loop): what they sent, never to be delivered, is counted as discarded
    _halt_ahead: Callable[[bool], None] | None = None
    _delivering = False  # a batch is on its way (__anext__): a stop requested meanwhile waits for it
    #: replaces members that die or hang (``restart=``; ``None``: the run ends)
    _replacements: Replacements | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name_coroutines(cls, FleetCollector)  # "coroutine 'MultiSyncCollector.update_weights' was never..."

    def _init_fleet(self, setup: FleetSetup, transport: Callable[[FleetHandle], T]) -> T:
        """What every transport's collector sets up (counters, versions, floors), then its transport,
        built with the collector's handle (``transport(handle)``), which it returns."""
        self._size, self._sync = setup.size, setup.sync
        self.total_frames, self.frames_per_batch = setup.total_frames, setup.frames_per_batch
        self._source_policy, self._weights_template = policy_arg(setup.policy), setup.weights_template
        self._seed, self._floor_lag, self._episodes = setup.seed, setup.floor_lag, setup.episodes
        self.replay_buffer = replay_buffer_arg(setup.replay_buffer)
        self._init_base(setup.progress)
        self._version = self._issued = 0  # _issued: the last version handed to a publish
        self._published: TensorDictBase | None = None  # a copy of the newest weights for member 0
        self._weights_lock = anyio.Lock()
        self._entered = self._progress_closed = False
        #: per member, the oldest version a delivered batch may have (update_weights(flush=True))
        self._floors = [0] * setup.size
        #: the seed each member was last given (a replaced member's is derived from it)
        self.member_seeds: dict[int, int] = {}
        #: trajectories that go on after a dropped batch take fresh ids (no delivered id spans a gap)
        self._renames = DroppedBatchRenames()
        handle = _Handle(self)
        if setup.restart is not None:
            self._replacements = Replacements(
                setup.restart,
                publish=self._hub.publish,
                seed_of=self.member_seeds.get,
                task_group=lambda: handle.task_group,
            )
        built = transport(handle)
        self._transport = built
        return built

    @property
    def _fleet_size(self) -> int:
        """The number of members."""
        return self._size

    def _members(self) -> Sequence[Member]:
        """The members while the collector holds them."""
        return self._transport.members()

    def _active(self) -> None:
        """Raise unless the collector is open and entered (``async with``)."""
        self._check_open()
        if self._task_group is None or not self._transport.started:
            name = type(self).__name__
            raise RuntimeError(
                f"{name} starts its {self._member_noun}s in `async with`: write "
                f"`async with {name}(...) as collector: async for batch in collector:`"
            )

    async def _call_member(self, index: int, op: FleetOp) -> Any:
        """Run ``op`` on member ``index`` (its worker or hosted collector) and return its reply; a remote
        exception is raised with its own type."""
        return (await self._transport.call_each([(index, op)]))[0]

    async def _call_all(self, op: FleetOp) -> list[Any]:
        """Run ``op`` on every member concurrently; the replies in member order."""
        return await gather(*[partial(self._call_member, i, op) for i in range(self._fleet_size)])

    # -- lifecycle --------------------------------------------------------------------------------
    async def _on_enter(self) -> None:
        if self._entered:
            raise RuntimeError(f"the collector was entered already: a {type(self).__name__} is entered once")
        self._entered, requested = True, self.frames_per_batch
        self._member_frames = fpbs = await self._transport.start()
        self.frames_per_batch = (sum if self._sync else max)(fpbs)
        warn_rounded(requested, self.frames_per_batch, f"the {self._member_noun}s' env batch sizes")
        await self._members_started()
        await self._transport.run()

    async def aclose(self) -> None:
        """Stop every member (each closes its collector and reaps its processes), then reap the members.
        Idempotent; ``async with`` does it."""
        with anyio.CancelScope(shield=True):
            if self._background is not None:
                self._background.cancel()
            if self._stop_requested:
                self._stopping(drain=True)
            await self._transport.stop()
            self._close()
            self._hub.close()
            if not self._progress_closed:
                self._progress_closed = True
                self._finish_progress()

    # -- iteration --------------------------------------------------------------------------------
    def _stopping(self, drain: bool = False) -> None:
        """A stop was requested (``drain``: on the event loop): the members stop collecting ahead, unless
        a batch is being delivered (then once it is)."""
        if self._halt_ahead is not None and not self._delivering:
            self._halt_ahead(drain)

    async def __anext__(self) -> TensorDictBase | None:
        await self._batch_turn()
        try:
            self._delivering = True
            out = await self._transport.next_delivery()
            self._delivering = False
            if self._stop_requested:  # asked for while this batch was on its way: it is the last
                self._stopping(drain=True)
            self._record(out.frames, out.episodes, worker_id=out.member, policy_version=out.policy_version)
            if self.replay_buffer is not None:
                await anyio.to_thread.run_sync(self.replay_buffer.extend, out.batch)
                return None
            return out.batch
        finally:
            self._delivering = False
            self._lock.release()

    def _stale(self, index: int, policy_version: int, frames: int) -> bool:
        """Whether a batch of member ``index`` was collected below its floor (before an
        ``update_weights(flush=True)`` reached it): then it is counted as discarded and must be dropped."""
        if policy_version >= self._floors[index]:
            return False
        self._dropped_frames += frames
        self._renames.dropped(index)
        return True

    def _delivered(self, index: int, batch: TensorDictBase) -> None:
        """Member ``index``'s ``batch`` goes to the consumer: its trajectories renamed past any drop."""
        self._renames.delivered(index, batch)

    # -- weights ----------------------------------------------------------------------------------
    async def update_weights(
        self,
        policy_or_weights: Any = None,
        *,
        worker_ids: Sequence[int] | None = None,
        wait: bool = False,
        flush: bool = False,
    ) -> int:
        """Send weights to the members and return the new policy version.

        A member loads them before its next batch (never mid-step); ``wait=True`` returns once every
        targeted member runs them. Concurrent calls are serialised (versions strictly increase).

        ``flush=True`` makes every batch delivered from then on (from the targeted members) one
        collected entirely with the new weights; the frames this discards are counted in
        ``statistics().frames_discarded``. Worker processes drop the batches waiting in their slots
        and restart their rollouts in flight on the new weights (the envs are not reset);
        ``MultiAsyncEnvCollector``'s workers drop the frames they hold below the floor and load the
        new weights before this returns; a node or actor finishes its batch in flight, which is then
        dropped. ``max_policy_lag=0`` on ``MultiAsyncCollector`` flushes at every update.

        Args:
            policy_or_weights: an ``nn.Module``, a TensorDict of weights or a state dict; ``None``: the
                policy the collector was built with (its current weights). Parameters and buffers.
            worker_ids: the members to update (indices ``0 .. n - 1``; default: all).
            wait: also wait until those members run the new weights.
            flush: deliver nothing collected with older weights from now on.

        Example:
            >>> async def train(collector, policy):  # doctest: +SKIP
            ...     async for batch in collector:
            ...         ppo_update(policy, batch)
            ...         await collector.update_weights(policy, flush=True)  # the next batch is on-policy
        """
        flag("flush", flush)
        self._check_open()  # a closed collector says so first, an un-entered one after the policy check
        weights = self._weights_to_publish(policy_or_weights)
        flag("wait", wait)
        self._active()
        return await self._publish(weights, self._target_ids(worker_ids), wait=wait, flush=flush)

    async def _publish(
        self, weights: TensorDictBase, ids: list[int], *, wait: bool, flush: bool, version: int | None = None
    ) -> int:
        """Publish ``weights`` to members ``ids`` as ``version`` (``None``: the next number)."""
        async with self._weights_lock:
            # numbers are never reused: an update interrupted midway may still reach some members
            version = self._issued = self._issued + 1 if version is None else version
            published = await self._transport.publish(weights, version, ids)
            if self._replacements is not None:  # a replacement of one of them loads these
                self._replacements.published(version, ids, published)
            self._version = version
            if 0 in ids:
                self._published = weights.detach().clone()
            self._hub.publish(WeightsPublished(version))
            floor, raised = self._floor_after(version, flush), []
            if floor is not None:
                raised = [i for i in ids if floor > self._floors[i]]
                for i in raised:
                    self._floors[i] = floor
            await self._transport.published(version, ids, raised)
        if wait:
            await self._transport.load_now(ids, version, published)
        elif raised:
            await self._transport.load_behind(raised)
        return version

    def _floor_after(self, version: int, flush: bool) -> int | None:
        """The oldest version delivered after publishing ``version`` (``None``: as before)."""
        lag = self._floor_lag
        if flush or lag == 0:
            return version
        return version - lag if lag is not None and version > lag else None

    # -- arguments ------------------------------------------------------------------------------------
    def _target_ids(self, worker_ids: Sequence[int] | None) -> list[int]:
        """``worker_ids`` checked and sorted, without repeats (``None``: every member)."""
        n = self._fleet_size
        if worker_ids is None:
            return list(range(n))
        ids = sorted(set(worker_ids))
        if not ids or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n for i in ids):
            raise ValueError(
                f"worker_ids must be {self._member_noun} indices in [0, {n}), got {worker_ids!r}"
            )
        return ids

    def _weights_to_publish(self, policy_or_weights: Any) -> TensorDictBase:
        """``policy_or_weights`` (``None``: the collector's policy) as flat weights that fit the policy."""
        if self._weights_template is None:
            raise TypeError(
                f"the collector's policy ({type(self._source_policy).__name__}) has no weights to "
                "update; update_weights needs an nn.Module policy"
            )
        source = self._source_policy if policy_or_weights is None else policy_or_weights
        weights = as_weights(source).flatten_keys(".")
        check_compatible(self._weights_template, weights)
        return weights

    # -- versions and statistics ------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        """The version last published by ``update_weights``."""
        return self._version

    def worker_policy_versions(self) -> list[int]:
        """The version each member runs, as of its last delivered batch or ``update_weights(wait=True)``."""
        return [m.policy_version for m in self._members()]

    def _worker_stats(self) -> tuple[WorkerStatistics, ...]:
        return tuple(
            WorkerStatistics(
                m.index,
                WorkerState.PAUSED if self.paused and m.state == WorkerState.COLLECTING else m.state,
                m.frames,
                m.policy_version,
                restarts=getattr(m, "restarts", 0),  # env restarts (worker pools; nodes report none yet)
            )
            for m in self._members()
        )

    def statistics(self) -> CollectorStatistics:
        """A frozen record of what the collector and each member (``workers[i]``) have done (see
        :class:`CollectorStatistics`)."""
        workers = self._worker_stats()
        snapshot = self._stats.snapshot(
            self._version,
            workers=workers,
            paused=self.paused,
            loop_lag_ms=self._lag.percentiles_ms(),
            splits=[member_split(m) for m in self._members()],
        )
        discarded = self._frames_discarded()
        return replace(snapshot, frames_discarded=discarded) if discarded else snapshot

    def _frames_discarded(self) -> int:
        """Frames collected and never delivered because newer weights overtook them
        (``update_weights(flush=True)``, ``max_policy_lag``): dropped here or by the members."""
        return self._dropped_frames + self._transport.discarded()

    # -- start-up -------------------------------------------------------------------------------------
    async def _pickled_policy(self, for_whom: str) -> bytes:
        """The policy, pickled once for every member, in a thread (a large one would hold the loop);
        ``TypeError`` naming ``for_whom`` if it does not pickle."""

        def dumps() -> bytes:
            try:
                return cloudpickle.dumps(self._source_policy)
            except Exception as exc:
                raise TypeError(f"the policy cannot be pickled for {for_whom}: {exc}") from exc

        return await anyio.to_thread.run_sync(dumps)

    async def _members_started(self) -> None:
        """Once every member runs and ``frames_per_batch`` is known: say if the budget is not a whole
        number of batches, then seed the members (``seed=`` given to the constructor)."""
        if self.total_frames > 0 and not self._budget_fits_batches():
            warn_user(
                f"total_frames={self.total_frames} is not a multiple of the batch size "
                f"{self.frames_per_batch}: the last batch is not cut"
            )
        if self._seed is not None:
            await self._seed_chain(self._seed)

    def _budget_fits_batches(self) -> bool:
        """Whether ``total_frames`` is a whole number of batches (else a warning at start-up); batches
        of whole trajectories, or of members' different sizes arriving in no set order, never warn."""
        varied = not self._sync and len(set(self._member_frames)) > 1
        whole_trajectories = getattr(self, "_episodes", None) is not None
        return varied or whole_trajectories or self.total_frames % self.frames_per_batch == 0

    # -- seeds ----------------------------------------------------------------------------------------
    async def _seed_chain(self, seed: int) -> int:
        """Seed member ``i`` with the seed after the last one member ``i - 1`` used; the last seed used."""
        last = seed - 1
        for i in range(self._fleet_size):
            self.member_seeds[i] = last + 1
            last = int(await self._call_member(i, SetSeed(last + 1)))
        return last

    async def set_seed(self, seed: int) -> int:
        """Seed member ``i`` after member ``i - 1`` (distinct, reproducible seeds); returns the last seed
        used. Applied between batches: with an asynchronous collector a batch in flight was collected
        before the seed, and the batches after it are the seeded ones."""
        if seed_arg(seed) is None:
            raise TypeError("set_seed needs an int")
        self._active()
        async with self._lock:
            last = await self._seed_chain(seed)
            await self._restarted()
            return last

    async def reset(self) -> None:
        """Reset every member's envs: the next batches start new episodes."""
        self._active()
        async with self._lock:
            await self._call_all(Reset())
            await self._restarted()

    async def _restarted(self) -> None:
        """Under the batch lock, after a seed, a reset, a load or a checkpoint with env state: members that
        restart their collection then drop the batches they sent before (``MultiAsyncEnvCollector``)."""

    def _check_env_state(self, envs: bool) -> None:
        """Raise ``ValueError`` if ``state_dict(envs=envs)`` cannot hold the members' envs."""
        self._transport.check_env_state(envs)

    async def getattr_env(self, name: str, node: int = 0) -> Any:
        """An attribute of member ``node``'s env (worker 0's, for a multi-process node)."""
        self._active()
        return await self._call_member(node, GetAttr("env", name))

    async def getattr_policy(self, name: str, node: int = 0) -> Any:
        """An attribute of member ``node``'s policy."""
        self._active()
        return await self._call_member(node, GetAttr("policy", name))

    # -- state dict -----------------------------------------------------------------------------------
    async def state_dict(self, *, envs: bool = False) -> dict[str, Any]:
        """Each member's collector state (trajectory-id counters, versions, random states; ``envs``: the
        envs' own state, see ``Collector.state_dict``, where the members can stop at the batch
        delivered) plus the counters and the policy's weights."""
        transport = self._transport
        self._check_env_state(envs)
        self._active()
        async with self._lock:
            states = await self._call_all(GetState(versioned=transport.versioned, envs=envs))
            if envs:
                await self._restarted()
            if self._stop_requested:  # what members sent before their state: never delivered
                self._stopping(drain=True)
        policy = await transport.saved_policy(states)
        if self._published is not None:  # the newest weights, not those a member may still run
            policy = dict(self._published.items())
        out: dict[str, Any] = {f"{transport.state_prefix}{i}": s for i, s in enumerate(states)}
        out.update(self._counters())
        if policy is not None:
            out["policy"] = policy
        return out

    async def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (same number of members); the frame budget continues
        from the saved count (and saved weights are loaded into every member)."""
        versioned, prefix = self._transport.versioned, self._transport.state_prefix
        self._check_state(state, prefix)
        self._active()
        weights = state.get("policy") if self._weights_template is not None else None
        saved = int(state.get("policy_version", 0))  # kept, unless this collector numbered it already
        version = saved if saved > self._issued or not self._issued else self._issued + 1
        extra = {} if weights is None or versioned else {"policy": weights, "policy_version": version}
        async with self._lock:
            ops = [(i, LoadState({**state[f"{prefix}{i}"], **extra}, versioned)) for i in range(self._size)]
            await self._transport.call_each(ops)
            await self._restarted()
            self._load_counters(state)
            for member, restarts in zip(self._members(), state.get("member_restarts", ()), strict=False):
                member.restarts = int(restarts)  # type: ignore[attr-defined]
            if versioned:
                for member in self._transport.members():
                    member.policy_version = int(state[f"{prefix}{member.index}"].get("version", 0))
        if weights is not None and (versioned or version):  # workers run them already: the transport's copy
            ids, version_or_next = list(range(self._size)), None if versioned else version
            weights = self._weights_to_publish(weights)
            await self._publish(weights, ids, wait=True, flush=False, version=version_or_next)

    def _counters(self) -> dict[str, Any]:
        """The collector's own part of ``state_dict``."""
        return {
            "frames": self._stats.frames,
            "batches": self._stats.batches,
            "episodes": self._stats.episodes,
            "policy_version": self._version,
            "member_restarts": [getattr(m, "restarts", 0) for m in self._members()],
        }

    def _check_state(self, state: Mapping[str, Any], prefix: str) -> None:
        """Raise ``KeyError`` unless ``state`` has ``{prefix}{i}`` for every member and the counters."""
        missing = [f"{prefix}{i}" for i in range(self._fleet_size) if f"{prefix}{i}" not in state]
        if missing or "frames" not in state:
            raise KeyError(f"state dict lacks {missing or ['frames']}")

    def _load_counters(self, state: Mapping[str, Any]) -> None:
        """Continue the budget from the saved counters; versions never go back."""
        self._stats.load(int(state["frames"]), int(state.get("batches", 0)), int(state.get("episodes", 0)))
        self._version = max(self._version, int(state.get("policy_version", 0)))
        self._issued = max(self._issued, self._version)  # version numbers are never reused


class _Handle:
    """The collector's :class:`~._transport.FleetHandle`: what its transport may do to it (built by
    ``_init_fleet``, handed to the transport). What never changes is bound once; the rest is read live."""

    def __init__(self, fleet: FleetCollector) -> None:
        self._fleet = fleet
        self.name, self.member_noun = type(fleet).__name__, fleet._member_noun
        self.floors: Sequence[int] = fleet._floors  # (updated in place)
        self.batch_lock = fleet._lock
        self.publish, self.end_events = fleet._hub.publish, fleet._hub.close
        self.stale, self.delivered = fleet._stale, fleet._delivered
        self.pickled_policy = fleet._pickled_policy

    @property
    def total_frames(self) -> int:
        return self._fleet.total_frames

    @property
    def frames_per_batch(self) -> int:
        return self._fleet.frames_per_batch

    @property
    def frames(self) -> int:
        return self._fleet._stats.frames

    @property
    def version(self) -> int:
        return self._fleet._version

    @property
    def task_group(self) -> anyio.abc.TaskGroup:
        tg = self._fleet._task_group
        if tg is None:
            raise RuntimeError(f"the {self.name} is not entered (async with)")
        return tg

    @property
    def closed(self) -> bool:
        return self._fleet._closed

    @property
    def failed(self) -> bool:
        return self._fleet._failed

    @property
    def replacements(self) -> Replacements | None:
        return self._fleet._replacements

    def fail(self, reason: str, *, close: bool = False) -> None:
        self._fleet._close(reason, failed=True, now=close)

    def close(self) -> None:
        self._fleet._close()

    def closed_error(self) -> CollectorClosedError:
        return CollectorClosedError(f"the collector is closed: {self._fleet._closed_reason}")

    def discard(self, frames: int) -> None:
        self._fleet._dropped_frames += int(frames)

    def on_stop(self, halt: Callable[[bool], None]) -> None:
        self._fleet._halt_ahead = halt

    async def update_weights(self, worker_ids: Sequence[int] | None = None) -> int:
        return await self._fleet.update_weights(worker_ids=worker_ids)
