"""The frames of ``AsyncEnvCollector``: preallocated flat batches, a frame added per env step as it
returns (in the order steps return, so a slow env never holds a batch back)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from .._envs._spaces import LeafSpec, NestedKey

__all__ = ["FrameBatch", "Layout", "PolicyCall", "as_numpy"]

_FLAGS = ("done", "terminated", "truncated")


def _next(key: NestedKey) -> tuple[str, ...]:
    return ("next", key) if isinstance(key, str) else ("next", *key)


class Layout:
    """Keys, shapes and dtypes of a batch's entries (per frame), that of batches whose policy wrote
    ``outputs`` (a call's, :func:`as_numpy`'s arrays)."""

    def __init__(
        self,
        obs_specs: dict[NestedKey, LeafSpec],
        outputs: dict[NestedKey, Any],
        *,
        track: bool,
        grouped: bool,
    ) -> None:
        self.obs_keys = list(obs_specs)
        self.out_keys = list(outputs)
        entries: dict[Any, tuple[tuple[int, ...], torch.dtype]] = {}
        for key, spec in obs_specs.items():
            entries[key] = entries[_next(key)] = (spec.shape, spec.dtype)
        for key, value in outputs.items():
            entries[key] = (tuple(value.shape[1:]), _dtype(value))
        for flag in _FLAGS:
            entries[flag] = entries[("next", flag)] = ((1,), torch.bool)
        entries[("next", "reward")] = ((1,), torch.float32)
        entries[("collector", "traj_ids")] = ((), torch.int64)
        entries[("collector", "env_id")] = ((), torch.int64)
        if track:  # track_policy_version
            entries[("collector", "policy_version")] = ((), torch.int64)
        if grouped:  # group_size: each frame's ("collector", "group_id")
            entries[("collector", "group_id")] = ((), torch.int64)
        self.entries = entries
        self.track_policy_version = track
        self.group_ids = grouped


class PolicyCall:
    """What one policy call saw and wrote, for ``n`` envs: the frames of its envs' steps read it. Its
    actions are numbered ``base`` to ``base + n - 1`` (actions are numbered in the order they are handed
    out, over the collector's life)."""

    __slots__ = ("base", "env_ids", "group_ids", "n", "obs", "outputs", "traj_ids", "version")

    def __init__(
        self,
        obs: list[np.ndarray],
        outputs: list[Any],
        env_ids: np.ndarray,
        traj_ids: np.ndarray,
        version: int,
        base: int,
        group_ids: np.ndarray | None = None,
    ) -> None:
        self.obs = obs
        self.group_ids = group_ids
        self.outputs = outputs
        self.env_ids = env_ids
        self.traj_ids = traj_ids
        self.version = version
        self.base = base
        self.n = len(env_ids)


class FrameBatch:
    """One batch of ``size`` frames, a frame added as each step returns (its next observation written in
    place; its observation, policy outputs, env and trajectory ids gathered from its :class:`PolicyCall`
    when the batch is complete, in one vectorised copy per key). ``blocks`` (the fused engine's batches):
    a block of frames at a time, their observations and the step's values written with them in place."""

    def __init__(self, layout: Layout, size: int, *, blocks: bool = False) -> None:
        self.size = size
        self.filled = 0
        self.episodes: list[tuple[int, float, int]] = []  # (env id, return, length) that ended here
        self.tensors = {
            key: torch.empty((size, *shape), dtype=dtype) for key, (shape, dtype) in layout.entries.items()
        }
        self._views = {key: _numpy(t) for key, t in self.tensors.items()}
        self.next_obs = [self._views[_next(key)] for key in layout.obs_keys]
        self._layout = layout
        # per frame, in order: the number of the action it stepped with, and the step's values (python
        # objects the cyclic GC does not track, in lists: no container per frame); ``blocks``: arrays
        # written a block of rows at a time (the fused engine), the step's values in the batch itself
        self.blocks = blocks
        self.source: Any = []
        self.reward: Any = []
        self.terminated: Any = []
        self.truncated: Any = []
        self.obs: list[Any] = []  # blocks: each key's observations, written with the frames
        if blocks:
            self.obs = [self._views[key] for key in layout.obs_keys]
            self.source = np.empty(size, np.int64)
            self.reward = self._views[("next", "reward")][:, 0]
            self.terminated = self._views[("next", "terminated")][:, 0]
            self.truncated = self._views[("next", "truncated")][:, 0]
        # set by resolve(): the calls of the frames, and each frame's row in their concatenation
        self.calls: list[PolicyCall] = []
        self._rows: np.ndarray | None = None

    def write(
        self,
        row: int,
        off: int,
        end: int,
        number: int,
        nxt: list[np.ndarray],
        flags: tuple[np.ndarray, np.ndarray, np.ndarray],
        obs: list[np.ndarray] | None = None,
        finals: tuple[np.ndarray, list[np.ndarray]] | None = None,
    ) -> None:
        """Rows ``off:end`` of a vector step as the frames from ``row`` on (their actions numbered from
        ``number``): the next observations ``nxt`` (the final ones where ``finals = (ended, blocks)`` marks a
        sub-env whose episode ended), reward, terminated and truncated (``flags``); a block batch also the
        observations ``obs`` the actions were computed from."""
        stop = row + end - off
        for slot, block in zip(self.next_obs, nxt, strict=True):
            slot[row:stop] = block[off:end]
        if finals is not None:
            ended, blocks = finals
            rows = ended[off:end].nonzero()[0]
            for slot, final in zip(self.next_obs, blocks, strict=True):
                slot[row + rows] = final[off + rows]
        reward, terminated, truncated = flags
        if self.blocks:
            assert obs is not None
            for slot, block in zip(self.obs, obs, strict=True):
                slot[row:stop] = block[off:end]
            self.source[row:stop] = np.arange(number + off, number + end)
            self.reward[row:stop] = reward[off:end]
            self.terminated[row:stop] = terminated[off:end]
            self.truncated[row:stop] = truncated[off:end]
        else:
            self.source.extend(range(number + off, number + end))
            self.reward.extend(reward[off:end].tolist())
            self.terminated.extend(terminated[off:end].tolist())
            self.truncated.extend(truncated[off:end].tolist())
        self.filled = stop

    def resolve(self, calls: list[PolicyCall]) -> None:
        """Find the call of each frame among ``calls`` (in the order they were made; they must hold every
        frame's action)."""
        numbers = self.source[: self.filled] if self.blocks else np.asarray(self.source, dtype=np.int64)
        bases = np.fromiter((call.base for call in calls), np.int64, len(calls))
        which = np.searchsorted(bases, numbers, side="right") - 1  # the call of each frame
        used = np.unique(which)
        self.calls = [calls[k] for k in used.tolist()]
        sizes = np.fromiter((call.n for call in self.calls), np.int64, len(self.calls))
        starts = np.zeros(len(used), np.int64)
        np.cumsum(sizes[:-1], out=starts[1:])
        self._rows = starts[np.searchsorted(used, which)] + (numbers - bases[which])

    @property
    def version(self) -> int:
        """The newest policy version among the batch's frames."""
        return max((call.version for call in self.calls), default=0)

    def finish(self) -> TensorDict:
        """The complete batch as a TensorDict ``[frames]``."""
        layout, views, t = self._layout, self._views, self.tensors
        calls = self.calls
        src = self._rows
        assert src is not None, "resolve() first"

        def gather(key: Any, parts: list[Any]) -> None:
            if isinstance(views[key], np.ndarray):
                views[key][...] = np.concatenate(parts)[src].reshape(views[key].shape)
            else:  # a dtype numpy lacks
                t[key].copy_(torch.cat(parts)[torch.from_numpy(src)].reshape(t[key].shape))

        if not self.blocks:
            for k, key in enumerate(layout.obs_keys):
                gather(key, [c.obs[k] for c in calls])
        for k, key in enumerate(layout.out_keys):
            gather(key, [c.outputs[k] for c in calls])
        gather(("collector", "env_id"), [c.env_ids for c in calls])
        gather(("collector", "traj_ids"), [c.traj_ids for c in calls])
        if layout.group_ids:
            gather(("collector", "group_id"), [c.group_ids for c in calls])
        if layout.track_policy_version:
            gather(("collector", "policy_version"), [np.full(c.n, c.version, np.int64) for c in calls])
        if not self.blocks:
            views[("next", "reward")][:, 0] = self.reward
            views[("next", "terminated")][:, 0] = self.terminated
            views[("next", "truncated")][:, 0] = self.truncated
        for flag in _FLAGS:  # the reset step is never a frame: the root flags are always False
            t[flag].zero_()
        torch.logical_or(t[("next", "terminated")], t[("next", "truncated")], out=t[("next", "done")])
        self.calls = []  # the calls' arrays are freed with the batch's last reference to them
        return TensorDict(t, batch_size=[self.size])


def _numpy(tensor: torch.Tensor) -> Any:
    try:
        return tensor.numpy()
    except TypeError:  # dtypes numpy lacks (bfloat16): written through torch
        return tensor


def as_numpy(value: torch.Tensor, n: int) -> Any:
    if not isinstance(value, torch.Tensor) or not value.shape or value.shape[0] != n:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"a policy output has shape {shape}; it must start with the batch of {n} envs")
    value = value.detach().cpu()
    try:
        return value.numpy()
    except TypeError:  # bfloat16: kept as a tensor
        return value


def _dtype(value: Any) -> torch.dtype:
    return value.dtype if isinstance(value, torch.Tensor) else torch.from_numpy(value[:0]).dtype
