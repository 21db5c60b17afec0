"""What both worker bodies share: the rollout worker (``_worker.py``) and ``MultiAsyncEnvCollector``'s
(``_asyncenv/_worker.py``) hold the same shared memory with the trainer (:class:`MemberIO`: the control
block, the weight receiver, the batch slots) and serve the same typed operations of
``_transport/_messages.py``; the ones that only read the worker's env or policy are answered here, and a
state asked for with the trainer's versions is refused here."""

from __future__ import annotations

from typing import Any

import torch

from .._policies._weights import flat_weights
from .._transport._flat import FlatLayout
from .._transport._messages import Attach, GetAttr, GetPath, GetState, GetWeights, LoadState, MapFn
from .._transport._shm import SharedBlock
from ._paths import resolve

__all__ = ["HALTED", "READS", "MemberIO", "control_layout", "read", "unversioned"]


def control_layout(num_workers: int) -> FlatLayout:
    """Per-worker arrays shared with the parent: stop flags (preemption; in async mode also "start no
    batch": 1 at shutdown, :data:`HALTED` after ``request_stop()``), published weight versions,
    version floors (the oldest version a batch may still be delivered with: a rollout that falls below
    its floor is restarted on the newer weights) and the frames each worker discarded that way."""
    return FlatLayout.build(
        [
            ("stop", (num_workers,), torch.int64),
            ("published", (num_workers,), torch.int64),
            ("floor", (num_workers,), torch.int64),
            ("discarded", (num_workers,), torch.int64),
            # steps begun in the batch being collected (with a restart policy only): a worker that dies
            # loses them (statistics().frames_discarded)
            ("progress", (num_workers,), torch.int64),
        ]
    )


#: a stop flag's value after ``request_stop()`` (async mode): the batch in flight ends at its next step and
#: is not sent (its frames are counted as discarded), and no batch starts any more
HALTED = 2


class MemberIO:
    """A worker body's shared memory with the trainer: the control block (:func:`control_layout`, its
    arrays by name: :meth:`array`), its weight receiver (``None`` for a policy without weights) and its
    batch slots (mapped at ``Attach``), with the ones free."""

    def __init__(self, spec: Any) -> None:
        self.control = SharedBlock(control_layout(spec.num_workers), (), name=spec.control_name)
        self.weights = spec.weights.open(spec.index) if spec.weights is not None else None
        self.slots: list[SharedBlock] = []
        self.free: set[int] = set()

    def map_slots(self, msg: Attach, layout: FlatLayout, batch_size: tuple[int, ...]) -> None:
        """Map the slots ``msg`` names, each with its layout or else the worker's own (``layout``,
        ``batch_size``); the ones mapped already are kept (a stacked segment was added)."""
        mapped = {slot.name: slot for slot in self.slots}
        rows = msg.layouts or (None,) * len(msg.slot_names)
        slots = []
        for name, row in zip(msg.slot_names, rows, strict=True):
            slot = mapped.pop(name, None)
            if slot is None:
                own = row is None
                slot = SharedBlock(layout if own else row, batch_size if own else None, name=name)
            slots.append(slot)
        for slot in mapped.values():
            slot.close()
        self.slots = slots

    def array(self, name: str) -> Any:
        """The control block's array ``name`` (every worker's entry), a numpy view."""
        return self.control.td[name].numpy()

    def close(self) -> None:
        for slot in self.slots:
            slot.close()
        self.control.close()
        if self.weights is not None:
            self.weights.close()


#: the operations :func:`read` answers
READS = (GetWeights, GetAttr, GetPath, MapFn)


def read(op: GetWeights | GetAttr | GetPath | MapFn, env: Any, policy: Any) -> Any:
    """The reply to ``op`` on a worker's ``env`` and ``policy``: a copy of its weights (``None`` for a
    policy without), an attribute, a path's value (``_paths.py``), or a call of a path's method."""
    roots = {"env": env, "policy": policy}
    if isinstance(op, GetWeights):
        if not isinstance(policy, torch.nn.Module):
            return None
        return dict(flat_weights(policy).detach().cpu().clone().items())
    if isinstance(op, GetAttr):
        return getattr(roots[op.root], op.name)
    if isinstance(op, GetPath):
        return resolve(roots, op.path)
    return resolve(roots, op.path)(*op.args, **op.kwargs)


def unversioned(op: GetState | LoadState) -> None:
    """A worker's state carries the trainer's versions already: ``versioned=True`` is refused."""
    if op.versioned:
        raise ValueError(
            f"{type(op).__name__}(versioned=True) is for hosted collectors (nodes, actors); a worker's "
            "state carries the trainer's versions already: send versioned=False"
        )
