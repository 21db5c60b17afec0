"""The frames of ``AsyncEnvCollector``: preallocated flat batches, a row written per env step as it
returns (in the order steps return, so a slow env never holds a batch back)."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from ._envs._spaces import LeafSpec, NestedKey

__all__ = ["FrameBatch", "Layout"]

_FLAGS = ("done", "terminated", "truncated")


def _next(key: NestedKey) -> tuple[str, ...]:
    return ("next", key) if isinstance(key, str) else ("next", *key)


class Layout:
    """Keys, shapes and dtypes of a batch's entries (per frame)."""

    def __init__(
        self,
        obs_specs: dict[NestedKey, LeafSpec],
        out_specs: dict[NestedKey, LeafSpec],
        *,
        track_policy_version: bool,
    ) -> None:
        self.obs_keys = list(obs_specs)
        self.out_keys = list(out_specs)
        entries: dict[Any, tuple[tuple[int, ...], torch.dtype]] = {}
        for key, spec in obs_specs.items():
            entries[key] = entries[_next(key)] = (spec.shape, spec.dtype)
        for key, spec in out_specs.items():
            entries[key] = (spec.shape, spec.dtype)
        for flag in _FLAGS:
            entries[flag] = entries[("next", flag)] = ((1,), torch.bool)
        entries[("next", "reward")] = ((1,), torch.float32)
        entries[("collector", "traj_ids")] = ((), torch.int64)
        entries[("collector", "env_id")] = ((), torch.int64)
        if track_policy_version:
            entries[("collector", "policy_version")] = ((), torch.int64)
        self.entries = entries
        self.track_policy_version = track_policy_version


class FrameBatch:
    """One batch of ``size`` frames, filled row by row as the envs' steps return."""

    def __init__(self, layout: Layout, size: int) -> None:
        self.size = size
        self.filled = 0
        self.episodes: list[tuple[int, float, int]] = []  # (env id, return, length) that ended here
        self.versions: set[int] = set()
        self.tensors = {
            key: torch.empty((size, *shape), dtype=dtype) for key, (shape, dtype) in layout.entries.items()
        }
        for flag in _FLAGS:  # the reset step is never a frame: the root flags are always False
            self.tensors[flag].zero_()
        views = {key: _numpy(t) for key, t in self.tensors.items()}
        self.obs = [(views[key], views[_next(key)]) for key in layout.obs_keys]
        self.outputs = [views[key] for key in layout.out_keys]
        self.reward = views[("next", "reward")][:, 0]
        self.terminated = views[("next", "terminated")][:, 0]
        self.truncated = views[("next", "truncated")][:, 0]
        self.traj_ids = views[("collector", "traj_ids")]
        self.env_ids = views[("collector", "env_id")]
        self.version = views.get(("collector", "policy_version"))

    def finish(self) -> TensorDict:
        """The batch as a TensorDict ``[frames]``."""
        t = self.tensors
        torch.logical_or(t[("next", "terminated")], t[("next", "truncated")], out=t[("next", "done")])
        return TensorDict(t, batch_size=[self.size])


def _numpy(tensor: torch.Tensor) -> Any:
    try:
        return tensor.numpy()
    except TypeError:  # dtypes numpy lacks (bfloat16): written through torch
        return tensor
