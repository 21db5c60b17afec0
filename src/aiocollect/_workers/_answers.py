"""What both worker bodies answer alike: the rollout worker (``_worker.py``) and ``MultiAsyncEnvCollector``'s
(``_asyncenv/_worker.py``) serve the same typed operations of ``_transport/_messages.py``; the ones that only
read the worker's env or policy are answered here, and a state asked for with the trainer's versions is
refused here."""

from __future__ import annotations

from typing import Any

import torch

from .._policies._weights import flat_weights
from .._transport._messages import GetAttr, GetPath, GetState, GetWeights, LoadState, MapFn
from ._paths import resolve

__all__ = ["READS", "read", "unversioned"]

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
