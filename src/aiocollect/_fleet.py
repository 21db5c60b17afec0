"""What the collectors that drive several members share, whatever carries their batches: worker processes
(``MultiSyncCollector``, ``MultiAsyncCollector``), torch.distributed or RPC nodes (``DistributedCollector``,
``RPCCollector``) and Ray actors (``RayCollector``).

One copy of the control surface: policy versions, per-member statistics, the seed chain, the frame and
version counters of ``state_dict``, and the checks of ``update_weights``' arguments. A subclass says how
to list its members and how to call one (:meth:`FleetCollector._members`,
:meth:`FleetCollector._call_member`, which takes a typed operation of :data:`FleetOp`); the transport is
its own.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, ClassVar, Protocol

import anyio
import anyio.to_thread
import cloudpickle
from tensordict import TensorDictBase

from ._gather import gather
from ._local._base import CollectorBase
from ._mistakes import warn_user
from ._stats import CollectorStatistics, WorkerState, WorkerStatistics
from ._timesplit import member_split
from ._transport._messages import FleetOp, Reset, SetSeed
from ._validation import seed_arg
from ._weights import as_weights, check_compatible


class Member(Protocol):
    """The collector's view of one worker, node or actor (read-only here)."""

    @property
    def index(self) -> int: ...
    @property
    def state(self) -> str: ...  # a WorkerState (a str enum)
    @property
    def frames(self) -> int: ...
    @property
    def policy_version(self) -> int: ...


class FleetCollector(CollectorBase):
    """A collector over ``_fleet_size`` members, addressed by index ``0 .. _fleet_size - 1``."""

    #: what a member is called in error messages ("worker", "node", "actor")
    _member_noun: ClassVar[str] = "worker"
    _version: int
    _weights_template: TensorDictBase | None
    _source_policy: Any
    #: the seed of the first member (``None``: unseeded)
    _seed: int | None
    #: the members' statistics as they were when the collector closed (for statistics() afterwards)
    _last_workers: tuple[WorkerStatistics, ...] = ()

    @property
    @abc.abstractmethod
    def _fleet_size(self) -> int:
        """The number of members."""

    @abc.abstractmethod
    def _members(self) -> Sequence[Member]:
        """The members while the collector holds them; empty before it is entered or after it closed
        (if it lets them go)."""

    @abc.abstractmethod
    def _active(self) -> None:
        """Raise unless the collector is open and entered (``async with``)."""

    @abc.abstractmethod
    async def _call_member(self, index: int, op: FleetOp) -> Any:
        """Run ``op`` on member ``index`` (its worker or hosted collector) and return its reply; a remote
        exception is raised with its own type."""

    async def _call_all(self, op: FleetOp) -> list[Any]:
        """Run ``op`` on every member concurrently; the replies in member order."""
        return await gather(*[partial(self._call_member, i, op) for i in range(self._fleet_size)])

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
            )
            for m in self._members()
        )

    def statistics(self) -> CollectorStatistics:
        """A frozen record of what the collector and each member (``workers[i]``) have done (see
        :class:`CollectorStatistics`)."""
        workers = self._worker_stats() or self._last_workers
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
        """Frames collected and never delivered because newer weights overtook them (0 unless a subclass
        flushes: ``update_weights(flush=True)``)."""
        return 0

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
        """Whether ``total_frames`` is a whole number of batches (else a warning at start-up)."""
        return self.total_frames % self.frames_per_batch == 0

    # -- seeds ----------------------------------------------------------------------------------------
    async def _seed_chain(self, seed: int) -> int:
        """Seed member ``i`` with the seed after the last one member ``i - 1`` used; the last seed used."""
        last = seed - 1
        for i in range(self._fleet_size):
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
            return await self._seed_chain(seed)

    async def reset(self) -> None:
        """Reset every member's envs: the next batches start new episodes."""
        self._active()
        async with self._lock:
            await self._call_all(Reset())

    # -- state dict -----------------------------------------------------------------------------------
    def _counters(self) -> dict[str, int]:
        """The collector's own part of ``state_dict``."""
        return {
            "frames": self._stats.frames,
            "batches": self._stats.batches,
            "episodes": self._stats.episodes,
            "policy_version": self._version,
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


__all__ = ["FleetCollector", "Member"]
