"""The column carry: random batches from an EnvPool pool that resets ended envs itself, at their next step.

The fused pool loop (``_gym_steps.run_pool_steps``) resets ended envs in the same step, a second call into
the pool at every step where an episode ended (a quarter of the rollout thread's time on CartPole). Here
the pool does its own next-step reset instead, and the step that only resets an env (its action ignored,
its "transition" from the final to the reset observation) is not a frame: each env writes its frames into
its own column of a staging buffer at its own cursor, so an env that reset falls a frame behind the others.
A batch is delivered when every column holds ``T`` frames; the frames of the columns that ran ahead are
carried into the next batch. Every delivered frame is a transition: its next observation follows its
observation, and a column's frames are in order across batches (trajectory ids stay consistent).

Columns drift apart as their episodes end at different times: an env about to fall ``lag`` frames behind
the furthest column is reset in the same step instead (the second call, rarely), which bounds the carry to
``lag`` frames per env.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ._gym_steps import by_env_id

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._gym import GymEnv

__all__ = ["ColumnCarry", "run_pool_carry"]


class ColumnCarry:
    """Per-env write cursors into a staging buffer of ``steps + lag`` frames per env (env first, as the
    batch), and what the columns that ran ahead carry into the next batch. The loop writes each step's
    entries into a time-first chunk (one contiguous copy per entry, as the fused loops do) and moves a
    chunk's frames into their columns at once (:meth:`compact`): a scatter per step costs 5-10x more.

    Example::

        carry = ColumnCarry(steps=64, num_envs=256, lag=64)
        taken, root = run_pool_carry(gym_env, carry, root, more_actions, stop)
        carry.deliver(slots, taken)  # each column's first `taken` frames into the batch's views
    """

    def __init__(self, steps: int, num_envs: int, lag: int) -> None:
        if lag < 2:
            raise ValueError(f"lag must be at least 2 frames, got {lag}")
        self.steps = steps
        self.num_envs = num_envs
        self.lag = lag
        #: each env's frames in the staging buffer (those of the current batch and carried ones)
        self.cursor = np.zeros(num_envs, dtype=np.int64)
        #: observation, next observation, action, reward, terminated, truncated: ``[N, steps + lag, ...]``
        self.stage: list[np.ndarray] = []
        #: the same entries of the steps not compacted yet, time first (``[steps, N, ...]``), and which
        #: of them are frames (not the pool's reset step)
        self.chunk: list[np.ndarray] = []
        self.frame = np.ones((steps, num_envs), dtype=bool)
        #: ended envs reset in the same step to bound the carry (for profiling)
        self.same_step_resets = 0

    def allocate(self, obs: np.ndarray, action: np.ndarray) -> None:
        """The buffers for observations like ``obs`` (``[N, ...]``) and actions like ``action``."""
        if self.stage:
            return
        dtypes: tuple[Any, ...] = (obs.dtype, obs.dtype, action.dtype, np.float32, bool, bool)
        shapes: tuple[tuple[int, ...], ...] = (obs.shape[1:], obs.shape[1:], action.shape[1:], (), (), ())
        n, t = self.num_envs, self.steps
        self.stage = [np.zeros((n, t + self.lag, *s), d) for s, d in zip(shapes, dtypes, strict=True)]
        self.chunk = [np.zeros((t, n, *s), d) for s, d in zip(shapes, dtypes, strict=True)]

    def compact(self, rows: int, start: np.ndarray) -> None:
        """Move the chunk's first ``rows`` steps into the columns: env ``i``'s frames, in order, from its
        cursor at the chunk's start (``start[i]``) on."""
        if not rows:
            return
        frame = self.frame[:rows].T  # [N, rows]
        counts = np.count_nonzero(frame, axis=1)
        width = self.steps + self.lag
        first = np.cumsum(counts) - counts  # env i's first frame in the gathered frames
        total = int(counts.sum())
        at = np.repeat(np.arange(self.num_envs) * width + start - first, counts) + np.arange(total)
        for staged, chunk in zip(self.stage, self.chunk, strict=True):
            flat = staged.reshape(-1, *staged.shape[2:])
            flat[at] = chunk[:rows].swapaxes(0, 1)[frame]
        self.frame[:rows] = True

    def drop(self) -> None:
        """Forget the carried frames (the envs were reset: their trajectories start again)."""
        self.cursor[:] = 0

    def deliver(self, slots: list[np.ndarray], taken: int) -> None:
        """Copy each column's first ``taken`` frames into ``slots`` (the batch's views, env first, in the
        order of :attr:`stage`) and move the carried frames to the front."""
        for slot, staged in zip(slots, self.stage, strict=True):
            slot[:, :taken] = staged[:, :taken].reshape(slot[:, :taken].shape)
            if taken:
                staged[:, : self.lag] = staged[
                    :, taken : taken + self.lag
                ]  # overlapping: numpy copies safely
        self.cursor -= taken


def run_pool_carry(
    self: GymEnv,
    carry: ColumnCarry,
    root: np.ndarray,
    more: Callable[[], tuple[list[Any], np.ndarray]],
    stop: Any,
) -> tuple[int, np.ndarray]:
    """Step the pool until every column of ``carry`` holds ``carry.steps`` frames (or ``stop`` is set);
    returns (the frames every column holds, at most ``carry.steps``; the observation to act on next).

    ``more()`` gives actions for more steps: the pool's converted actions (a list, one per step) and the
    actions as the batch stores them (steps first). The pool is left as the per-step path leaves it: envs
    that ended at the last step are reset before returning."""
    env_step = self._env.step
    num_envs, rows = carry.num_envs, carry.steps
    ids = self._pool_ids
    array, dtype = self._array, self._plain_obs_dtype
    assert dtype is not None  # _fused_steps
    count_nonzero = np.count_nonzero
    cursor = carry.cursor
    env_actions, stored = more()
    carry.allocate(root, stored[0])
    obs_c, next_c, act_c, rew_c, term_c, trunc_c = carry.chunk
    frame = carry.frame
    fresh: np.ndarray | None = None  # envs whose step is the pool's reset (they ended at the last step)
    s = r = 0  # the step in env_actions, the step in the chunk
    start = cursor.copy()
    while cursor.min() < rows:
        if stop is not None and stop.is_set():
            break
        if s == len(env_actions):
            env_actions, stored, s = *more(), 0
        if r == rows:
            carry.compact(r, start)
            start[:], r = cursor, 0
        obs_c[r] = root
        act_c[r] = stored[s]
        obs, reward, terminated, truncated, info = env_step(env_actions[s])
        s += 1
        done = terminated | truncated
        order = info["env_id"]
        if order.shape != (num_envs,) or (order != ids).any():
            obs, reward, terminated, truncated, done = by_env_id(
                np.asarray(order), obs, reward, terminated, truncated, done
            )
        root = array(obs, dtype)
        next_c[r], rew_c[r], term_c[r], trunc_c[r] = root, reward, terminated, truncated
        if fresh is None:
            cursor += 1
        else:  # a reset step is no frame
            frame[r] = ~fresh
            cursor += frame[r]
        r += 1
        fresh = None
        if count_nonzero(done):
            root, fresh = _ended(self, carry, root, done)
    carry.compact(r, start)
    if fresh is not None:  # leave no reset pending in the pool (as the per-step path leaves it)
        root = _reset_now(self, root, fresh)
    self._autoreset_pending = fresh
    self._last_obs = {"observation": root}
    return min(int(cursor.min()), rows), root


def _ended(self: GymEnv, carry: ColumnCarry, root: np.ndarray, done: np.ndarray) -> tuple[Any, Any]:
    """After a step where the envs in ``done`` ended: the observation to act on next, and the envs the pool
    resets at their next step (``None`` if none). An ended env whose reset step would put it ``lag``
    frames behind the furthest column is reset now instead (the carry's bound)."""
    self._pool_fresh = False
    cursor = carry.cursor
    late = done & (cursor < cursor.max() - (carry.lag - 2))
    if np.count_nonzero(late):
        root = _reset_now(self, root, late)
        carry.same_step_resets += int(np.count_nonzero(late))
        done = done & ~late
    return root, done if np.count_nonzero(done) else None


def _reset_now(self: GymEnv, root: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``root`` with the envs in ``mask`` reset by the pool now (``reset_mask``, as ``run_pool_steps``)."""
    pool = self._env
    pool._reset(np.flatnonzero(mask).astype(np.int32))
    obs, info = pool.recv(reset=True, return_info=bool(pool.config["gym_reset_return_info"]))
    root = root.copy()
    root[np.asarray(info["env_id"])] = self._array(obs, root.dtype)
    return root
