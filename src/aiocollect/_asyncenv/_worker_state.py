"""Seeds, resets and checkpoints in a ``MultiAsyncEnvCollector`` worker: ``SetSeed``, ``Reset``, ``GetState``
and ``LoadState``, served by the worker's ``AsyncEnvCollector`` (``_checkpoint.py``: what it saves, how it
restarts its engine) plus the worker's own part, its counter of fresh trajectory ids.

Every one of these calls but a plain ``GetState`` restarts the worker's engine. The frames the worker took
in and did not send are dropped with those the engine collected ahead, and the worker sends no batch until
the trainer says so (``RunFree``), which it does once it has dropped the batches the worker sent before
the call (waiting in the slots): no frame collected before the call is delivered after it.

Example:
    >>> from aiocollect._transport._messages import GetState, Reset
    >>> restarts(GetState(envs=True)), restarts(GetState()), restarts(Reset())
    (True, False, True)
"""

from __future__ import annotations

from typing import Any

import anyio

from .._transport._messages import GetState, LoadState, Reset, SetSeed
from ._worker_frames import WorkerFrames

__all__ = ["CHECKPOINT_OPS", "SendGate", "restarts", "serve_checkpoint"]

#: the calls served here
CHECKPOINT_OPS = (SetSeed, Reset, GetState, LoadState)


class SendGate:
    """Orders a worker's batches against the calls that restart its engine: a batch is taken in and sent
    under :attr:`lock` (a call waits for it), and after a restart none is sent until :meth:`open`."""

    def __init__(self) -> None:
        self.lock = anyio.Lock()
        self._open = anyio.Event()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def open(self) -> None:
        self._open.set()

    def close(self) -> None:
        if self._open.is_set():
            self._open = anyio.Event()

    async def wait(self) -> None:
        await self._open.wait()


def restarts(op: Any) -> bool:
    """Whether ``op`` restarts the worker's engine (then the trainer drops what the worker sent before)."""
    return isinstance(op, (SetSeed, Reset, LoadState)) or (isinstance(op, GetState) and op.envs)


async def serve_checkpoint(hosted: Any, frames: WorkerFrames, op: Any) -> Any:
    """The reply to ``op`` (one of :data:`CHECKPOINT_OPS`) from the worker's ``AsyncEnvCollector`` (its
    :class:`~._collector.Hosted` handle) and the worker's ``frames``."""
    collector = hosted.collector
    if isinstance(op, SetSeed):
        return await collector.set_seed(op.seed)
    if isinstance(op, Reset):
        await collector.reset()
        return None
    if op.versioned:
        raise ValueError(
            f"{type(op).__name__}(versioned=True) is for hosted collectors (nodes, actors); a worker's "
            "state carries the trainer's versions already: send versioned=False"
        )
    if isinstance(op, GetState):
        # a plain state at once, not after the batch being collected: it restarts nothing
        state = await collector.state_dict(envs=True) if op.envs else await hosted.state_now()
        state.pop("policy", None)  # the trainer saves the weights once, for every worker
        state["fresh_ids"] = frames.fresh
        return state
    state = dict(op.state)
    fresh = int(state.pop("fresh_ids", 0))
    await collector.load_state_dict(state)
    frames.fresh = fresh
    return None
