"""Both sides of the fleet's contract with its transports, declared.

:class:`Transport` is what the fleet asks of a transport (start the members, the next delivery, publish
weights, call a member, stop). :class:`FleetHandle` is the other way: the few things a transport, and the
deliveries it holds, may do to the fleet that holds it (publish an event, fail or close the collector with a
reason, drop a stale batch, read the counters, reach the fleet's task group and its member replacements).
The fleet builds the handle and hands it to the transport it builds (``FleetCollector._init_fleet``); no
transport touches a private name of the fleet (``tests/test_layout.py`` checks it). :class:`FleetSetup` is
what a public constructor checked and hands the fleet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.abc
from tensordict import TensorDictBase

from .._core._errors import CollectorClosedError
from .._core._restart import RestartPolicy
from .._observe._events import Event
from .._transport._messages import FleetOp

if TYPE_CHECKING:
    from ._replace import Replacements

__all__ = ["Arrival", "FleetHandle", "FleetSetup", "Member", "Transport"]


class Member(Protocol):
    """The collector's view of one worker, node or actor (its version is restored by
    ``load_state_dict``)."""

    @property
    def index(self) -> int: ...
    @property
    def state(self) -> str: ...  # a WorkerState (a str enum)
    @property
    def frames(self) -> int: ...

    policy_version: int


@dataclass
class Arrival:
    """A batch a transport delivered: its frames, its finished episodes ``(member, return, length)``,
    the member it came from (``None``: one from each, stacked) and the oldest policy version in it."""

    batch: TensorDictBase
    frames: int
    episodes: list[tuple[int, float, int]]
    member: int | None
    policy_version: int


@dataclass(frozen=True)
class FleetSetup:
    """What a public constructor checked and hands the fleet (``FleetCollector._init_fleet``)."""

    size: int
    sync: bool
    total_frames: int
    frames_per_batch: int
    policy: Any
    weights_template: TensorDictBase | None
    seed: int | None
    replay_buffer: Any = None
    progress: Any = None
    #: max_policy_lag where the fleet itself drops batches too old (first-ready worker pools)
    floor_lag: int | None = None
    #: the assembler of whole trajectories (``trajs_per_batch``), if the batches are episodes
    episodes: Any = None
    #: members that die or hang are replaced under this policy (``None``: the run ends)
    restart: RestartPolicy | None = None


class Transport(Protocol):
    """How a :class:`~._collector.FleetCollector` reaches its members (workers, nodes, actors). Built by
    the fleet with its :class:`FleetHandle`; the fleet calls it, and it tells the fleet of deliveries,
    weight loads and failures through that handle."""

    #: ``state_dict``'s key of member ``i``: ``f"{state_prefix}{i}"``
    state_prefix: str
    #: members' states carry their version map, and the policy apart (``GetState(versioned=True)``)
    versioned: bool

    @property
    def started(self) -> bool:
        """Whether the members run (``async with`` entered)."""

    def members(self) -> Sequence[Member]:
        """The members (their states before start-up, as they were after shutdown)."""

    async def start(self) -> list[int]:
        """Start every member; each one's ``frames_per_batch``. Raises if one fails to start."""

    async def run(self) -> None:
        """Once the members are seeded: start collecting (ask for the first batches)."""

    async def next_delivery(self) -> Arrival:
        """The next batch (one member's, or one of each stacked), never one below its member's floor."""

    async def publish(self, weights: TensorDictBase, version: int, ids: list[int]) -> Any:
        """Send ``weights`` as ``version`` to members ``ids``, loaded before their next batch; what
        :meth:`load_now` needs of this publication (Ray: the weights' object ref), which is also what a
        replacement of one of them loads (:class:`~._replace.Replacements`)."""

    async def load_now(self, ids: list[int], version: int, published: Any) -> None:
        """Return once members ``ids`` run ``version`` (``published``: what :meth:`publish` returned)."""

    async def published(self, version: int, ids: list[int], raised: list[int]) -> None:
        """Under the weights lock, after :meth:`publish`: the floors of members ``raised`` rose
        (:attr:`FleetHandle.floors`): drop what waits below them."""

    async def load_behind(self, raised: list[int]) -> None:
        """After a publication (no ``wait``) that raised the floors of members ``raised``."""

    def discarded(self) -> int:
        """Frames the members collected and discarded themselves (restarted on newer weights)."""

    def check_env_state(self, envs: bool) -> None:
        """Raise ``ValueError`` if ``state_dict(envs=envs)`` cannot hold the members' envs."""

    async def saved_policy(self, states: list[Any]) -> Any:
        """The policy weights ``state_dict`` saves (``None``: none), from the members' ``states``
        (which it may strip)."""

    async def call_each(self, ops: Sequence[tuple[int, FleetOp]]) -> list[Any]:
        """Run each ``(member, op)`` concurrently; the replies in order (a remote exception is raised with
        its own type)."""

    async def stop(self) -> None:
        """Close the collector (:meth:`FleetHandle.close`) once no batch can start any more (worker
        pools: after the batch in flight), then stop and reap every member. Idempotent."""


class FleetHandle(Protocol):
    """What a transport (and a delivery of its) may do to the fleet that holds it: read its counters,
    publish events, drop what came in below a floor, fail or close the collector, start tasks in its task
    group, replace lost members; never more."""

    @property
    def name(self) -> str:
        """The collector's class name (for messages)."""

    @property
    def member_noun(self) -> str:
        """What a member is called in messages (``"worker"``, ``"node"``, ``"actor"``)."""

    @property
    def total_frames(self) -> int:
        """The frame budget (``-1``: endless)."""

    @property
    def frames_per_batch(self) -> int: ...

    @property
    def frames(self) -> int:
        """Frames delivered to the consumer so far."""

    @property
    def version(self) -> int:
        """The policy version last published."""

    @property
    def floors(self) -> Sequence[int]:
        """Per member, the oldest policy version a delivered batch may have (``update_weights(flush=True)``,
        ``max_policy_lag``)."""

    @property
    def task_group(self) -> anyio.abc.TaskGroup:
        """The collector's task group (``async with`` entered)."""

    @property
    def batch_lock(self) -> anyio.Lock:
        """Held while a batch is delivered (a stop waits for the batch in flight)."""

    @property
    def closed(self) -> bool: ...

    @property
    def failed(self) -> bool: ...

    @property
    def replacements(self) -> Replacements | None:
        """The fleet's replacement of lost members (``restart=``), ``None`` without one."""

    def publish(self, event: Event) -> None:
        """Publish ``event`` to the collector's readers."""

    def end_events(self) -> None:
        """End the collector's event streams (the run failed)."""

    def fail(self, reason: str, *, close: bool = False) -> None:
        """The run failed: any use once the collector is closed says ``reason``; ``close``: closed now."""

    def close(self) -> None:
        """Nothing new starts (the transport stops)."""

    def closed_error(self) -> CollectorClosedError:
        """The error a use of the closed collector raises."""

    def discard(self, frames: int) -> None:
        """``frames`` collected are never delivered (counted in ``statistics().frames_discarded``)."""

    def stale(self, index: int, policy_version: int, frames: int) -> bool:
        """Whether a batch of member ``index`` was collected below its floor; then it is counted as
        discarded (the trajectories that go on take fresh ids) and must be dropped."""

    def delivered(self, index: int, batch: TensorDictBase) -> None:
        """Member ``index``'s ``batch`` goes to the consumer: its trajectories renamed past any drop."""

    def on_stop(self, halt: Callable[[bool], None]) -> None:
        """``halt(drain)`` once a stop is requested (members that collect ahead stop; ``drain``: on the
        event loop, the batches waiting are counted as discarded)."""

    async def pickled_policy(self, for_whom: str) -> bytes:
        """The policy pickled once for every member, in a thread (``TypeError`` naming ``for_whom``)."""

    async def update_weights(self, worker_ids: Sequence[int] | None = None) -> int:
        """Publish the policy's current weights (``update_at_each_batch``, intervals)."""
