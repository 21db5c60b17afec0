"""The fused step loop of an EnvPool pool: the pool resets ended envs itself, each env at its own pace.

An EnvPool pool resets an env whose episode ended at that env's next step (next-step autoreset): that
step ignores the env's action and returns its reset observation. That step is no transition, so it
gives no frame; the env's frames go on one step later. Every env thus fills its row of the ``[N, T]``
batch at its own pace, and at the batch's end the envs that are short of frames are stepped alone
(``pool.step(actions, env_ids)``) until each has its ``T`` frames. The envs that ended on their last
frame are reset (``reset(env_ids)``), so that the pool leaves the batch as the same-step paths leave
it. No partial reset after each step: one call into the pool per step instead of two.

The steps are written time first into staging arrays (contiguous rows, one copy each), and moved into
the batch once, at its end, by one gather per entry; the policy's outputs of the reset steps are
dropped there too. The batch is the same-step batch: every frame a transition, the same frames, seeds
and trajectories as :meth:`GymEnv._step_arrays` gives step by step (random actions: bit for bit; a
policy is also called on the observations of the reset steps, and its outputs there are dropped).
"""

from __future__ import annotations

from time import perf_counter
from typing import Any

import numpy as np
import torch

from ._pool_io import PoolIO, pool_io

__all__ = ["PoolFrames"]


class PoolFrames:
    """The staging arrays and the loop of one pool (``num_envs`` envs, observations of ``dtype``).

    ``leaf(key, action)``: the policy's action checked and converted as the env takes it.
    """

    def __init__(self, num_envs: int, obs_shape: tuple[int, ...], dtype: np.dtype[Any], leaf: Any) -> None:
        self.num_envs = num_envs
        self.obs_shape = obs_shape
        self.dtype = dtype
        self.leaf = leaf
        self.rows = 0
        self.envs = np.arange(num_envs)
        #: the staged steps, time first: observations (one row more: the observation each step acts on,
        #: then the one it gives), reward, flags, and whether the step gave env i a frame (no reset step)
        self.obs = np.empty((1, num_envs, *obs_shape), dtype=dtype)
        self.reward: np.ndarray = np.empty((0, num_envs), dtype=np.float32)
        self.terminated: np.ndarray = np.empty((0, num_envs), dtype=bool)
        self.truncated: np.ndarray = np.empty((0, num_envs), dtype=bool)
        self.valid: np.ndarray = np.empty((0, num_envs), dtype=bool)
        self._io: PoolIO | None = None

    def _grow(self, rows: int) -> None:
        """Room for ``rows`` steps at least (the staged steps so far kept)."""
        if rows <= self.rows:
            return
        n, old = self.num_envs, self.rows
        new = max(rows, 2 * old)
        obs = np.empty((new + 1, n, *self.obs_shape), dtype=self.dtype)
        flags = [np.zeros((new, n), dtype=dt) for dt in (np.float32, bool, bool, bool)]
        if old:
            obs[: old + 1] = self.obs
            for a, b in zip(flags, (self.reward, self.terminated, self.truncated, self.valid), strict=True):
                a[:old] = b
        self.obs = obs
        self.reward, self.terminated, self.truncated, self.valid = flags
        self.rows = new

    def run(
        self,
        pool: Any,
        steps: int,
        root: np.ndarray,
        act: Any,
        actions: list[Any] | None,
        slots: tuple[np.ndarray, ...],
        out_hist: list[Any],
        stop: Any,
        clock: Any,
    ) -> tuple[int, np.ndarray, np.ndarray | None]:
        """Fill ``slots`` (time-first views: observation, next observation, reward, terminated,
        truncated) with ``steps`` frames per env, or fewer where ``stop`` is set (then as many as the
        furthest env has); ``actions``: each step's actions (random batches), else ``act(obs tensor)``
        per step, its outputs of the delivered frames put in ``out_hist`` as one entry of ``[N, frames]``
        tensors (the batch's layout: the rollout writes it as it is). Returns (frames per env, the
        observations to act on next, the envs reset at the end or ``None``)."""
        self._grow(steps + max(8, steps // 4))
        if self._io is None or self._io.pool is not pool:
            self._io = pool_io(pool)
        io = self._io
        self.obs[0] = root
        # [T * N, ...]: env i's k-th action at row k * N + i
        block = None if actions is None else np.stack(actions).reshape(len(actions) * self.num_envs, -1)
        if block is not None and io.action_dtype is not None:  # cast once, not at every step
            block = block.astype(io.action_dtype, copy=False)
        self.action_shape: tuple[int, ...] = () if actions is None else actions[0].shape
        count = np.zeros(self.num_envs, dtype=np.int64)
        pending = np.zeros(self.num_envs, dtype=bool)
        first_out = len(out_hist)
        perf = perf_counter if clock is not None else None
        s, policy_s = self._steps(io, steps, block, act, out_hist, stop, count, pending, perf)
        target = steps if s == steps else int(count.max(initial=0))
        s, tail_s = self._tail(io, s, target, block, act, out_hist, count, pending, perf)
        if clock is not None:
            clock.policy += policy_s + tail_s
        ended = np.flatnonzero(pending)
        if ended.size:  # the pool would reset them at their next step: now, as the other paths leave it
            pool._reset(ended.astype(np.int32))  # sent; received once the frames are in the batch
        if target:
            self._gather(s, target, slots, out_hist, first_out)
        root = self.obs[s].copy()
        if ended.size:
            new_obs, new_ids = io.recv_reset()
            root[new_ids] = new_obs
        return target, root, pending if ended.size else None

    def _steps(
        self,
        io: PoolIO,
        steps: int,
        block: np.ndarray | None,
        act: Any,
        out_hist: list[Any],
        stop: Any,
        count: np.ndarray,
        pending: np.ndarray,
        perf: Any,
    ) -> tuple[int, float]:
        """``steps`` steps of every env (fewer where ``stop`` is set); returns (steps, policy seconds)."""
        env_step = io.step
        ids = self.envs
        n = self.num_envs
        envs = self.envs
        action_shape = self.action_shape
        obs_rows, reward, terminated, truncated, valid = (
            self.obs,
            self.reward,
            self.terminated,
            self.truncated,
            self.valid,
        )
        take = np.take
        logical_not, logical_or = np.logical_not, np.logical_or
        policy_s = 0.0
        for s in range(steps):
            if stop is not None and stop.is_set():
                return s, policy_s
            if block is None:
                obs = torch.from_numpy(obs_rows[s])
                if perf is None:
                    out = act(obs)
                else:  # the time split's policy share: two clock reads, no call added
                    start = perf()
                    out = act(obs)
                    policy_s += perf() - start
                out_hist.append(out)
                env_action = self.leaf("action", out["action"])
            else:  # env i's next frame is its count[i]-th: that step's action, block[count[i], i]
                env_action = take(block, count * n + envs, axis=0).reshape(action_shape)
            step_obs, reward[s], terminated[s], truncated[s], order = env_step(env_action, None)
            if order.shape != (n,) or (order != ids).any():  # back in env order
                if order.shape != (n,):
                    raise ValueError(f"EnvPool stepped the envs {order.tolist()}, not all of them once")
                rows = np.argsort(order)
                step_obs = step_obs[rows]
                for flags in (reward, terminated, truncated):
                    flags[s] = flags[s][rows]
            obs_rows[s + 1] = step_obs
            logical_not(pending, out=valid[s])  # a reset step (the env ended at its last step) is no frame
            count += valid[s]
            logical_or(terminated[s], truncated[s], out=pending)
        return steps, policy_s

    def _tail(
        self,
        io: PoolIO,
        s: int,
        target: int,
        block: np.ndarray | None,
        act: Any,
        out_hist: list[Any],
        count: np.ndarray,
        pending: np.ndarray,
        perf: Any,
    ) -> tuple[int, float]:
        """Step the envs short of ``target`` frames alone (their reset steps included) until none is;
        returns (the steps staged in all, policy seconds)."""
        n = self.num_envs
        policy_s = 0.0
        while (short := np.flatnonzero(count < target)).size:
            self._grow(s + 1)
            if block is None:  # the policy on every env's observation (one batch shape), its actions taken
                start = perf() if perf is not None else 0.0
                out = act(torch.from_numpy(self.obs[s]))
                policy_s += perf() - start if perf is not None else 0.0
                out_hist.append(out)
                env_action = self.leaf("action", out["action"])[short]
            else:
                env_action = block[count[short] * n + short].reshape(len(short), *self.action_shape[1:])
            obs, reward, terminated, truncated, rows = io.step(env_action, short.astype(np.int32))
            self.obs[s + 1] = self.obs[s]
            self.obs[s + 1, rows] = obs
            self.reward[s, rows] = reward
            self.terminated[s, rows] = terminated
            self.truncated[s, rows] = truncated
            valid = self.valid[s]
            valid[:] = False
            valid[rows] = ~pending[rows]
            count += valid
            pending[rows] = np.logical_or(terminated, truncated)
            s += 1
        return s, policy_s

    def _gather(
        self, staged: int, frames: int, slots: tuple[np.ndarray, ...], out_hist: list[Any], first_out: int
    ) -> None:
        """Move the staged steps' frames into ``slots`` (``frames`` per env, in order), and the policy's
        outputs of those frames into ``out_hist[first_out:]`` as one entry, ``{key: [N, frames, ...]}``
        (the others dropped).

        Env first, as the batch lies (``[N, T]``): each env's ``frames`` valid steps, in order, are the
        positions of its row of the transposed ``valid`` (one ``flatnonzero``), and every entry is one
        ``take`` into contiguous rows of the batch."""
        n = self.num_envs
        # every env has exactly `frames` frames (the tail stepped the others up to the furthest one)
        pos = np.flatnonzero(self.valid[:staged].T)
        if pos.size != n * frames:
            raise AssertionError(
                f"the staged steps hold {pos.size} frames, not {frames} for each of {n} envs"
            )
        flat = pos.reshape(n, frames)
        flat -= (self.envs * staged)[:, None]  # the step of each env's k-th frame
        flat *= n
        flat += self.envs[:, None]  # [N, frames]: indices into the staged rows, env i's frames in row i
        obs = self.obs.reshape(-1, *self.obs_shape)
        staged_entries = (
            obs,
            obs[n:],
            self.reward.reshape(-1),
            self.terminated.reshape(-1),
            self.truncated.reshape(-1),
        )
        for slot, source in zip(slots, staged_entries, strict=True):
            np.take(source, flat, axis=0, out=slot[:frames].swapaxes(0, 1), mode="clip")
        outs = out_hist[first_out:]
        if not outs:
            return
        index = torch.from_numpy(flat)
        out_hist[first_out:] = [
            {key: torch.stack([o[key] for o in outs]).flatten(0, 1)[index] for key in outs[0]}
        ]
