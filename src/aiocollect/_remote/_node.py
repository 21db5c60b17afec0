"""One hosted collector: what a torch.distributed node, an RPC node and a Ray actor all run.

:class:`NodeCore` builds one of our collectors from a :class:`~._messages.HostSpec`, numbers the weights it
runs as the trainer does (the trainer's versions, not the inner collector's), loads weights between
batches, produces batches with their frames, episodes and version, and answers the typed control
operations (:mod:`aiocollect._transport._messages`' fleet operations and the remote-only ones of
:mod:`._messages`). The engines only carry its inputs and outputs.
"""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import cloudpickle
import torch
from tensordict import TensorDict

from .._fleet._collector import FleetCollector
from .._observe._events import BatchDelivered, EpisodeFinished
from .._observe._timesplit import producer_totals
from .._transport._messages import GetAttr, GetState, LoadState, Reset, SetSeed
from ._messages import ControlOp, HostSpec, NextBatch, NodeBatch, NodeRestarts, StageWeights, WaitLoaded

_VERSION_KEY = ("collector", "policy_version")
_BATCH_KINDS = frozenset({"batch", "episode"})
#: the attribute of a hosted collector's error that holds its restarts not reported yet: the trainer
#: publishes them before the failure (``Hosts.failed``)
RESTARTS_ATTR = "aiocollect_restarts"


def build_collector(spec: HostSpec) -> tuple[Any, Any]:
    """The hosted collector (not entered) and its policy, built from the spec's typed rollout options
    (``rollout=``). Node ``i`` of ``N`` takes trajectory ids ``i, i + N, ...``: disjoint over nodes (and
    over each node's workers, which split them again)."""
    env_arg, cls, kwargs = cloudpickle.loads(spec.payload)
    policy = cloudpickle.loads(spec.policy_payload)
    collector = cls(env_arg, policy, rollout=spec.rollout, progress=False, **dict(kwargs))
    return collector, policy


class NodeCore:
    """A hosted collector, the weights it runs (versions as the trainer numbers them) and its batches.

    ``async with`` enters the collector (and must be left by the same task)."""

    def __init__(self, collector: Any, policy: Any) -> None:
        self.collector = collector
        self._policy = policy
        self._staging: torch.nn.Module | None = None
        self.iterator: Any = None
        self.events: Any = None
        # the trainer's version of the weights the collector runs, by the collector's own version
        self.outer_of_inner: dict[int, int] = {0: 0}
        self.received = 0  # newest trainer version received
        self.applied = 0  # newest trainer version the collector runs
        self._pending: tuple[int, Any] | None = None
        self._wake = anyio.Event()
        self._applied_event = anyio.Event()
        self._weights_lock = anyio.Lock()

    @classmethod
    def from_spec(cls, spec: HostSpec) -> NodeCore:
        return cls(*build_collector(spec))

    @property
    def frames_per_batch(self) -> int:
        return int(self.collector.frames_per_batch)

    async def __aenter__(self) -> NodeCore:
        await self.collector.__aenter__()
        self.events = self.collector.events(max_buffer=1 << 16, kinds=_BATCH_KINDS)
        self._restarts = self.collector.events(max_buffer=1 << 16, kinds={"restarted"})
        self.iterator = self.collector.__aiter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.events is not None:
            await self.events.aclose()
            self._restarts.close()
        await self.collector.__aexit__(*exc)

    # -- restarts, reported as they happen ------------------------------------------------------------
    def unreported_restarts(self, *first: Any) -> tuple[tuple[int, str, int], ...]:
        """The collector's ``Restarted`` events not reported yet (after ``first``), ``(env, cause,
        restarts)`` each."""
        events = [*first, *iter(self._restarts.receive_nowait, None)]
        return tuple((int(e.env), str(e.cause), int(e.restarts)) for e in events)

    async def next_restarts(self) -> tuple[tuple[int, str, int], ...]:
        """The collector's next restarts (waits for one; empty once it closed): an engine reports them to
        the trainer at once, whether or not a batch follows."""
        try:
            return self.unreported_restarts(await self._restarts.__anext__())
        except StopAsyncIteration:
            return ()

    async def report_restarts(self, send: Callable[[Any], Awaitable[Any]]) -> None:
        """``await send(NodeRestarts(records))`` (a node's control connection) with the collector's restarts
        as they happen, until cancelled (the last ones then too: before a failure the node sends)."""
        try:
            while records := await self.next_restarts():
                await send(NodeRestarts(records))
        finally:
            if records := self.unreported_restarts():
                with anyio.CancelScope(shield=True):
                    await send(NodeRestarts(records))

    # -- weights ------------------------------------------------------------------------------------
    @property
    def staging(self) -> torch.nn.Module:
        """A copy of the policy that receives weights off the collector (an ``nn.Module`` policy)."""
        if self._staging is None:
            if not isinstance(self._policy, torch.nn.Module):
                raise TypeError("weights need an nn.Module policy")
            self._staging = copy.deepcopy(self._policy)
        return self._staging

    async def apply(self, version: int, weights: Any, *, wait: bool = True) -> int:
        """Load ``weights`` as the trainer's ``version`` unless a newer one runs; the version it runs."""
        async with self._weights_lock:
            if version > self.applied:
                inner = await self.collector.update_weights(weights, wait=wait)
                self.outer_of_inner[int(inner)] = version
                self.applied = version
                self.received = max(self.received, version)
                self._applied_event.set()
                self._applied_event = anyio.Event()
            return self.applied

    def stage(self, version: int, weights: Any) -> None:
        """Newest weights received (:meth:`run_applier` loads them into the collector)."""
        self._pending = (version, weights)
        self.received = max(self.received, version)
        self._wake.set()

    async def run_applier(self, on_loaded: Callable[[int], Awaitable[Any]]) -> None:
        """Load staged weights as they come (the newest wins), then ``await on_loaded(version)``."""
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            pending, self._pending = self._pending, None
            if pending is None:
                continue
            version, weights = pending
            await self.apply(version, weights, wait=True)
            await on_loaded(version)

    async def wait_applied(self, version: int) -> int:
        while self.applied < version:
            await self._applied_event.wait()
        return self.applied

    # -- batches ------------------------------------------------------------------------------------
    async def next_batch(self) -> NodeBatch:
        """The next batch (weights received before the request are loaded first), its frames, the
        episodes that ended in it and the trainer's version it was collected with; the batch's
        ``("collector", "policy_version")`` is in the trainer's versions; its ``time_split``: the
        collector's producers' totals (``_timesplit.producer_totals``), for the trainer's split; its
        ``restarts``: the collector's ``Restarted`` events since the previous batch, for the trainer's."""
        await self.wait_applied(self.received)
        try:
            batch = await self.iterator.__anext__()
        except StopAsyncIteration:
            raise
        except Exception as exc:  # the restarts before it go with it (an engine's error travels apart)
            vars(exc).setdefault(RESTARTS_ATTR, self.unreported_restarts())
            raise
        frames, inner_version, seen, episodes = 0, 0, False, []
        while (event := self.events.receive_nowait()) is not None:
            if isinstance(event, EpisodeFinished):
                episodes.append((float(event.episode_return), int(event.length)))
            elif isinstance(event, BatchDelivered):
                frames += int(event.frames)
                inner_version, seen = int(event.policy_version), True
        if not seen:  # pragma: no cover - every collector publishes its batches
            inner_version = int(self.collector.policy_version)
        if _VERSION_KEY in batch.keys(include_nested=True):
            batch.set(_VERSION_KEY, self._outer(batch.get(_VERSION_KEY)))
        version = self.outer_of_inner.get(inner_version, self.applied)
        return NodeBatch(batch, frames, episodes, version, producer_totals(self.collector))

    def _outer(self, inner: torch.Tensor) -> torch.Tensor:
        """The trainer's versions of the collector's ``inner`` versions (unknown ones as they are)."""
        size = max(max(self.outer_of_inner), int(inner.max()) if inner.numel() else 0) + 1
        table = torch.arange(size, dtype=torch.int64)
        for i, o in self.outer_of_inner.items():
            table[i] = o
        return table.to(inner.device)[inner.clamp(0, size - 1)]

    # -- state --------------------------------------------------------------------------------------
    async def state(self, versioned: bool, envs: bool = False) -> dict[str, Any]:
        """The collector's state dict (random states included; ``envs``: the envs' own state too);
        ``versioned``: with the version map, and the policy apart."""
        c = self.collector
        inner = dict(await (c.state_dict(envs=True) if envs else c.state_dict()))
        if not versioned:
            return inner
        policy = inner.pop("policy", None)
        return {
            "inner": inner,
            "version_map": dict(self.outer_of_inner),
            "version": self.applied,
            "policy": policy,
        }

    async def load_state(self, state: Mapping[str, Any], versioned: bool) -> None:
        if not versioned:
            await self.collector.load_state_dict(state)
            return
        await self.collector.load_state_dict(state["inner"])
        self.outer_of_inner = {int(k): int(v) for k, v in state["version_map"].items()}
        self.applied = self.received = int(state["version"])

    async def get_attr(self, op: GetAttr) -> Any:
        c = self.collector
        if isinstance(c, FleetCollector):  # its env and policy live in its workers: ask worker 0
            return await (c.getattr_env(op.name) if op.root == "env" else c.getattr_policy(op.name))
        return getattr(c.env if op.root == "env" else c.policy, op.name)

    # -- control operations -------------------------------------------------------------------------
    async def call(self, op: ControlOp) -> Any:
        """Answer one control operation."""
        c = self.collector
        match op:
            case SetSeed(seed=seed):
                return await c.set_seed(seed)
            case Reset():
                return await c.reset()
            case GetState(versioned=versioned, envs=envs):
                return await self.state(versioned, envs)
            case LoadState(state=state, versioned=versioned):
                return await self.load_state(state, versioned)
            case WaitLoaded(version=version):
                return await self.wait_applied(version)
            case GetAttr():
                return await self.get_attr(op)
            case NextBatch():
                return await self.next_batch()
            case StageWeights(weights=weights, version=version):
                self.stage(version, TensorDict(weights, batch_size=[]).unflatten_keys("."))
                return None
        raise TypeError(f"not a control operation: {op!r}")  # pragma: no cover - a protocol bug


__all__ = ["RESTARTS_ATTR", "NodeCore", "build_collector"]
