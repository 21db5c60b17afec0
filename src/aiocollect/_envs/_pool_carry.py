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
    """Per-env write cursors into a staging buffer of ``steps + lag`` rows (time first), and what the
    columns that ran ahead carry into the next batch.

    Example::

        carry = ColumnCarry(steps=64, num_envs=256, lag=64)
        taken, root = run_pool_carry(gym_env, carry, root, more_actions, stop)
        carry.deliver(slots, taken)  # rows [0, taken) into the batch's time-first views
    """

    def __init__(self, steps: int, num_envs: int, lag: int) -> None:
        if lag < 2:
            raise ValueError(f"lag must be at least 2 frames, got {lag}")
        self.steps = steps
        self.num_envs = num_envs
        self.lag = lag
        #: each env's frames in the staging buffer (those of the current batch and carried ones)
        self.cursor = np.zeros(num_envs, dtype=np.int64)
        #: observation, next observation, action, reward, terminated, truncated: ``[steps + lag, N, ...]``
        self.stage: list[np.ndarray] = []
        #: ended envs reset in the same step to bound the carry (for profiling)
        self.same_step_resets = 0

    def allocate(self, obs: np.ndarray, action: np.ndarray) -> None:
        """The staging buffer for observations like ``obs`` (``[N, ...]``) and actions like ``action``."""
        if self.stage:
            return
        rows = (self.steps + self.lag, self.num_envs)
        self.stage = [
            np.zeros((*rows, *obs.shape[1:]), dtype=obs.dtype),
            np.zeros((*rows, *obs.shape[1:]), dtype=obs.dtype),
            np.zeros((*rows, *action.shape[1:]), dtype=action.dtype),
            np.zeros(rows, dtype=np.float32),
            np.zeros(rows, dtype=bool),
            np.zeros(rows, dtype=bool),
        ]

    def drop(self) -> None:
        """Forget the carried frames (the envs were reset: their trajectories start again)."""
        self.cursor[:] = 0

    def deliver(self, slots: list[np.ndarray], taken: int) -> None:
        """Copy each column's first ``taken`` frames into ``slots`` (time-first views, in the order of
        :attr:`stage`) and move the carried frames to the front."""
        for slot, staged in zip(slots, self.stage, strict=True):
            slot[:taken] = staged[:taken].reshape(slot[:taken].shape)
            if taken:
                staged[: self.lag] = staged[taken : taken + self.lag]  # numpy copies overlapping rows safely
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
    pool = self._env
    env_step = pool.step
    num_envs, rows = carry.num_envs, carry.steps
    ids = self._pool_ids
    array, dtype = self._array, self._plain_obs_dtype
    assert dtype is not None  # _fused_steps
    count_nonzero = np.count_nonzero
    cursor = carry.cursor
    columns = np.arange(num_envs, dtype=np.int64)
    env_actions, stored = more()
    carry.allocate(root, stored[0])
    obs_f, next_f, act_f, rew_f, term_f, trunc_f = (s.reshape(-1, *s.shape[2:]) for s in carry.stage)
    fresh: np.ndarray | None = None  # envs whose step is the pool's reset (they ended at the last step)
    s = 0
    while cursor.min() < rows:
        if stop is not None and stop.is_set():
            break
        if s == len(env_actions):
            env_actions, stored, s = *more(), 0
        at = cursor * num_envs + columns
        obs_f[at] = root
        act_f[at] = stored[s]
        obs, reward, terminated, truncated, info = env_step(env_actions[s])
        s += 1
        done = terminated | truncated
        order = info["env_id"]
        if order.shape != (num_envs,) or (order != ids).any():
            obs, reward, terminated, truncated, done = by_env_id(
                np.asarray(order), obs, reward, terminated, truncated, done
            )
        root = array(obs, dtype)
        next_f[at] = root
        rew_f[at] = reward
        term_f[at] = terminated
        trunc_f[at] = truncated
        if fresh is None:
            cursor += 1
        else:  # a reset step is no frame: the env writes its next frame where this one went
            cursor += ~fresh
        fresh = None
        if count_nonzero(done):
            root, fresh = _ended(self, carry, root, done)
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
