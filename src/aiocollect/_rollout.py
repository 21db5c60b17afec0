"""The rollout core: the synchronous hot loop that fills one batch.

Plain Python, no async: it runs in a worker thread (``Collector``) or a worker process (multi-process
collectors). Per step it writes numpy views of preallocated tensors; the TensorDict is built once per
batch. Nothing here knows about event loops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import ceil
from typing import Any, Protocol

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import InteractionType, set_interaction_type

from ._envs._adapter import ArrayEnv
from ._envs._spaces import LeafSpec, NestedKey
from ._policies import Runner
from ._storage import StoragePool

_FLAGS = ("done", "terminated", "truncated")


@dataclass(frozen=True)
class RolloutConfig:
    """Per-batch behaviour of the rollout (validated by the collectors)."""

    frames_per_batch: int
    max_frames_per_traj: int | None = None
    set_truncated: bool = False
    reset_at_each_iter: bool = False
    track_policy_version: bool = False
    exploration_type: InteractionType = InteractionType.RANDOM
    storing_device: torch.device | None = None
    #: trajectory ids are ``traj_id_start + k * traj_id_stride``: workers get disjoint id sets
    traj_id_start: int = 0
    traj_id_stride: int = 1


@dataclass
class RolloutResult:
    """One batch plus what the collector's statistics need."""

    batch: TensorDict
    #: valid time steps (all of them unless the rollout was stopped early)
    steps: int
    frames: int
    episode_returns: list[float] = field(default_factory=list)
    episode_lengths: list[int] = field(default_factory=list)
    #: the policy version the batch was collected with
    policy_version: int = 0


class StopSignal(Protocol):
    """What ``Rollout.collect`` reads to stop early: a ``threading.Event``, or a worker's shared stop flag."""

    def is_set(self) -> bool: ...


def _key_tuple(prefix: str, key: NestedKey) -> tuple[str, ...]:
    return (prefix, key) if isinstance(key, str) else (prefix, *key)


def _stack_into(out: np.ndarray, values: list[Any], axis: int) -> None:
    """``np.stack(values, axis=axis, out=out)``, several times faster for thousands of small entries.

    ``np.asarray`` converts the whole list in one C loop where ``np.stack`` makes a view per entry.
    """
    np.copyto(np.moveaxis(out, axis, 0), np.asarray(values), casting="same_kind")


class Rollout:
    """Collects batches of ``frames_per_batch`` frames from ``env`` with ``policy``.

    ``random_runner`` replaces the policy for random batches (``init_random_frames``).
    """

    def __init__(
        self,
        env: ArrayEnv,
        policy: Runner,
        random_runner: Runner,
        config: RolloutConfig,
    ) -> None:
        self.env = env
        self.policy = policy
        self.random_runner = random_runner
        self.config = config
        self.batch_shape = env.batch_shape
        self.steps_per_batch = ceil(config.frames_per_batch / max(env.numel, 1))
        self.frames_per_batch = self.steps_per_batch * max(env.numel, 1)
        self.policy_version = 0
        self._next_traj = config.traj_id_start
        self._root: dict[NestedKey, np.ndarray] = {}
        self._out_specs: dict[NestedKey, LeafSpec] | None = None
        self._storage = StoragePool()
        self.reset()

    # -- state ------------------------------------------------------------------------------------
    def _new_ids(self, n: int | np.integer[Any]) -> np.ndarray:
        stride = self.config.traj_id_stride
        start, self._next_traj = self._next_traj, self._next_traj + stride * int(n)
        # one numpy call: ``start + stride * np.arange(n)`` costs ~4 us, and it runs at every episode end
        return np.arange(start, self._next_traj, stride, dtype=np.int64)

    def reset(self) -> None:
        """Reset every env and start new trajectories."""
        self._root = self.env.reset()
        shape = self.batch_shape
        self._traj_ids = self._new_ids(max(self.env.numel, 1)).reshape(shape)
        self._ep_return = np.zeros(shape, dtype=np.float64)
        self._ep_steps = np.zeros(shape, dtype=np.int64)  # episode lengths for the statistics
        self._ep_length = np.zeros(shape, dtype=np.int64)  # steps for max_frames_per_traj

    @property
    def next_traj_id(self) -> int:
        return self._next_traj

    def state_dict(self) -> dict[str, Any]:
        return {"next_traj_id": self._next_traj, "policy_version": self.policy_version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._next_traj = int(state["next_traj_id"])
        self.policy_version = int(state["policy_version"])
        # the carried trajectories get fresh ids, as after a reset
        self._traj_ids = self._new_ids(max(self.env.numel, 1)).reshape(self.batch_shape)

    def output_specs(self) -> dict[NestedKey, LeafSpec]:
        """Keys, shapes and dtypes the policy writes (from one dry call on the current observation)."""
        if self._out_specs is None:
            exp = self.env.action_spec
            try:
                with torch.no_grad(), set_interaction_type(self.config.exploration_type):
                    out = self.policy(self._obs_tensors())
            except KeyError as exc:
                if "'action'" in str(exc):  # the policy wrote no action: say what it should write
                    exc.add_note(
                        f"the action space {self.env.action_space} needs an 'action' entry of shape "
                        f"{exp.shape} per env, dtype {exp.dtype}"
                    )
                raise
            nb = len(self.batch_shape)
            specs = {}
            for key, value in out.items():
                value = value.detach()
                if tuple(value.shape[:nb]) != self.batch_shape:
                    raise ValueError(
                        f"policy output {key!r} has shape {tuple(value.shape)}, which does not start with "
                        f"the env batch shape {self.batch_shape}"
                    )
                specs[key] = LeafSpec(tuple(value.shape[nb:]), value.dtype)
            self.env.check_policy_outputs(specs)
            self._out_specs = specs
        return self._out_specs

    def _obs_tensors(self) -> dict[NestedKey, torch.Tensor]:
        return {k: torch.from_numpy(v) for k, v in self._root.items()}

    # -- the hot loop -----------------------------------------------------------------------------
    def _allocate(self, into: TensorDictBase | None = None) -> tuple[TensorDict, dict[Any, np.ndarray]]:
        """The batch's tensors (from ``into``'s, when given) and numpy views to write them through."""
        T = self.steps_per_batch
        bt = (*self.batch_shape, T)
        shapes: dict[Any, tuple[tuple[int, ...], torch.dtype]] = {}
        for key, spec in self.env.obs_specs.items():
            shapes[key] = shapes[_key_tuple("next", key)] = ((*bt, *spec.shape), spec.dtype)
        for key, spec in self.output_specs().items():
            shapes[key] = ((*bt, *spec.shape), spec.dtype)
        for flag in _FLAGS:
            shapes[flag] = shapes[("next", flag)] = ((*bt, 1), torch.bool)
        shapes[("next", "reward")] = ((*bt, 1), torch.float32)
        shapes[("collector", "traj_ids")] = (bt, torch.int64)
        # one buffer for the batch, reused once the consumer has dropped an earlier batch (_storage.py)
        if into is not None:
            tensors = {key: into.get(key) for key in shapes}
        else:
            tensors = dict(zip(shapes, self._storage.take(list(shapes.values())), strict=True))
        for flag in _FLAGS:
            tensors[flag].zero_()
        views: dict[Any, np.ndarray] = {}
        for key, tensor in tensors.items():
            try:
                view = tensor.numpy()
            except TypeError:  # dtypes numpy lacks (bfloat16): written through torch
                view = tensor
            if key in _FLAGS or (isinstance(key, tuple) and key[-1] in (*_FLAGS, "reward")):
                view = view[..., 0]
            views[key] = view
        return TensorDict(tensors, batch_size=bt), views

    def layout(self) -> TensorDict:
        """An empty batch as :meth:`collect` makes it (keys, shapes, dtypes), without collecting."""
        batch, _ = self._allocate()
        if self.config.track_policy_version:
            batch.set(("collector", "policy_version"), torch.zeros(batch.batch_size, dtype=torch.int64))
        return batch

    def collect(
        self, *, random: bool = False, stop: StopSignal | None = None, into: TensorDictBase | None = None
    ) -> RolloutResult:
        """Collect one batch. If ``stop`` is set mid-batch, return early with ``steps`` < T.

        ``into``: write the batch into these tensors (a worker's shared-memory slot, laid out as
        :meth:`layout` says) instead of new ones.

        Observations are written into the preallocated batch at the step they arrive (one copy per key
        and frame, and the env may reuse its arrays afterwards); the policy's outputs, rewards and flags
        (small) are kept as references and stacked once at the end, where episode statistics are
        computed too, vectorised. Random batches draw the actions of the whole batch in one call.
        """
        cfg = self.config
        if cfg.reset_at_each_iter:
            self.reset()
        batch, views = self._allocate(into)
        env = self.env
        env_step = env.step
        action_from = env.action_from
        batched = bool(self.batch_shape)
        nb = len(self.batch_shape)
        T = self.steps_per_batch
        # per observation key: (key, this step's slot of "observation", of ("next", "observation")),
        # as views with time first, so that ``slot[t] = array`` is one copy whatever the batch dims
        obs_slots = [
            (key, np.moveaxis(views[key], nb, 0), np.moveaxis(views[_key_tuple("next", key)], nb, 0))
            for key in env.obs_specs
        ]
        out_keys = list(self.output_specs())
        runner = self.random_runner if random else self.policy
        sample_steps = getattr(runner, "sample_steps", None)
        # random actions for every step at once (steps first): one draw per batch, not per step
        block = sample_steps(T) if sample_steps is not None else None
        block_steps = None
        if block is not None:
            # a GymEnv takes numpy actions: indexing an array per step is ~10x cheaper than a tensor
            as_numpy = env.numpy_actions and all(v.dtype != torch.bfloat16 for v in block.values())
            block_steps = {k: list(v.numpy()) if as_numpy else v.unbind(0) for k, v in block.items()}
        out_hist: list[dict[NestedKey, torch.Tensor]] = []
        rew_hist: list[Any] = []
        term_hist: list[Any] = []
        trunc_hist: list[Any] = []
        ids_hist: list[Any] = []
        max_steps = cfg.max_frames_per_traj
        ep_length = self._ep_length
        traj_ids = self._traj_ids
        steps = T
        root = self._root
        with torch.no_grad(), set_interaction_type(cfg.exploration_type):
            for t in range(T):
                if stop is not None and stop.is_set():
                    steps = t
                    break
                for key, slot, _ in obs_slots:
                    slot[t] = root[key]
                if block_steps is None:
                    out = runner({k: torch.from_numpy(v) for k, v in root.items()})
                    out_hist.append(out)
                else:
                    out = {k: v[t] for k, v in block_steps.items()}
                next_obs, reward, terminated, truncated, next_root = env_step(action_from(out))
                for key, _, next_slot in obs_slots:
                    next_slot[t] = next_obs[key]
                forced = None
                if max_steps is not None:
                    ep_length = ep_length + 1
                    forced = (ep_length >= max_steps) & ~np.logical_or(terminated, truncated)
                    if forced.any():
                        truncated = truncated | forced
                    else:
                        forced = None
                rew_hist.append(reward)
                term_hist.append(terminated)
                trunc_hist.append(truncated)
                ids_hist.append(traj_ids)
                root = next_root
                if batched:
                    done = terminated | truncated
                    n_done = np.count_nonzero(done)  # ~3x cheaper than done.any() then done.sum()
                    if n_done:
                        traj_ids = traj_ids.copy()
                        traj_ids[done] = self._new_ids(n_done)
                        if max_steps is not None:
                            ep_length = np.where(done, 0, ep_length)
                        if forced is not None:
                            root = env.reset(forced)
                elif terminated or truncated:
                    traj_ids = self._new_ids(1).reshape(())
                    if max_steps is not None:
                        ep_length = np.zeros_like(ep_length)
                    if forced is not None:
                        root = env.reset(forced)
        self._root = root
        self._traj_ids = traj_ids
        self._ep_length = ep_length
        if block is not None:  # a random batch: the actions of every step at once, steps first
            out_hist = [{k: v[:steps].movedim(0, nb) for k, v in block.items()}]
        return self._finish(
            batch,
            views,
            steps,
            out_keys,
            out_hist,
            block is not None,
            rew_hist,
            term_hist,
            trunc_hist,
            ids_hist,
            into,
        )

    def _finish(
        self,
        batch: TensorDict,
        views: dict[Any, np.ndarray],
        steps: int,
        out_keys: list[NestedKey],
        out_hist: list[dict[NestedKey, torch.Tensor]],
        out_stacked: bool,
        rew_hist: list[Any],
        term_hist: list[Any],
        trunc_hist: list[Any],
        ids_hist: list[Any],
        into: TensorDictBase | None = None,
    ) -> RolloutResult:
        """Stack the per-step lists into the batch (time dim last) and compute episode statistics.

        ``out_stacked``: ``out_hist`` holds one entry with the time dim in place already."""
        cfg = self.config
        nb = len(self.batch_shape)
        lead = (slice(None),) * nb
        valid = (*lead, slice(0, steps))
        traj_v = views[("collector", "traj_ids")]
        if steps:
            for key in out_keys:
                target = views[key][valid]
                if key not in out_hist[0]:  # a random batch: the policy's other outputs are zeros
                    target[...] = 0
                    continue
                values = out_hist[0][key] if out_stacked else torch.stack([o[key] for o in out_hist], dim=nb)
                # reshape: a random action of shape () fills a policy's (1,) action slot
                values = values.cpu().reshape(target.shape)
                if isinstance(target, np.ndarray):
                    target[...] = values.numpy()
                else:
                    target.copy_(values)
            _stack_into(views[("next", "reward")][valid], rew_hist, nb)
            _stack_into(views[("next", "terminated")][valid], term_hist, nb)
            _stack_into(views[("next", "truncated")][valid], trunc_hist, nb)
            _stack_into(traj_v[valid], ids_hist, nb)
            done_v = views[("next", "done")]
            np.logical_or(
                views[("next", "terminated")][valid],
                views[("next", "truncated")][valid],
                out=done_v[valid],
            )
        if steps < self.steps_per_batch:
            # frames never collected: traj id -1 marks them invalid (their other entries are garbage)
            traj_v[(*lead, slice(steps, None))] = -1
        returns, lengths = self._episode_stats(
            views[("next", "reward")][valid], views[("next", "done")][valid]
        )
        if cfg.set_truncated and steps > 0:
            last: tuple[slice | int, ...] = (*lead, steps - 1)
            views[("next", "truncated")][last] = True
            views[("next", "done")][last] = True
        if cfg.track_policy_version:
            version = into.get(("collector", "policy_version"), None) if into is not None else None
            if version is None:
                version = torch.empty(batch.batch_size, dtype=torch.int64)
            batch.set(("collector", "policy_version"), version.fill_(self.policy_version))
        batch.names = [None] * nb + ["time"]
        if cfg.storing_device is not None and cfg.storing_device != torch.device("cpu"):
            batch = batch.to(cfg.storing_device)
        return RolloutResult(
            batch=batch,
            steps=steps,
            frames=steps * max(self.env.numel, 1),
            episode_returns=returns,
            episode_lengths=lengths,
            policy_version=self.policy_version,
        )

    def _episode_stats(self, reward: np.ndarray, done: np.ndarray) -> tuple[list[float], list[int]]:
        """Returns and lengths of the episodes that ended in this batch (carrying partial ones over)."""
        n = max(self.env.numel, 1)
        T = reward.shape[-1]
        rew = reward.reshape(n, T).astype(np.float64)
        dn = done.reshape(n, T)
        carry_ret = self._ep_return.reshape(n)
        carry_len = self._ep_steps.reshape(n)
        returns: list[float] = []
        lengths: list[int] = []
        csum = np.cumsum(rew, axis=1)
        for i in np.flatnonzero(dn.any(axis=1)) if T else ():
            ends = np.flatnonzero(dn[i])
            seg_ret = np.diff(csum[i, ends], prepend=0.0)
            seg_ret[0] += carry_ret[i]
            seg_len = np.diff(ends, prepend=-1)
            seg_len[0] += carry_len[i]
            returns.extend(seg_ret.tolist())
            lengths.extend(seg_len.tolist())
            carry_ret[i] = csum[i, -1] - csum[i, ends[-1]]
            carry_len[i] = T - 1 - ends[-1]
        others = ~dn.any(axis=1) if T else np.ones(n, dtype=bool)
        if T:
            carry_ret[others] += csum[others, -1]
            carry_len[others] += T
        self._ep_return = carry_ret.reshape(self.batch_shape)
        self._ep_steps = carry_len.reshape(self.batch_shape)
        return returns, lengths
