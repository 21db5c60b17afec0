"""The async vector envs of ``AsyncEnvCollector``'s engine: one task per vector env of ``N`` sub-envs.

The task stages its ``N`` observations as a block (rows ``first`` to ``first + N - 1``, the sub-envs' env
ids), queues its ``N`` rows as ready at once, waits once for the ``N`` actions (one policy call gives them
all: the policy task never splits a vector env's rows), awaits one ``step``, and appends ``N`` frames as
block copies, splitting them over two batches where one fills up. The protocol's autoreset is same-step:
the frame's next observation of an ended sub-env is ``info["final_obs"][k]``, and its staged observation
for the next step the reset one, ``obs[k]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

if TYPE_CHECKING:
    from ._envset import EnvSet
    from ._frames import FrameBatch

__all__ = ["END", "IN_VECTOR", "VectorSteps"]

END = object()  # the action of an env that is to stop
IN_VECTOR = object()  # the action slot of a vector env's rows after its first one, while it steps


class VectorSteps:
    """The vector env tasks, mixed into ``Engine`` (whose state they share; see its docstring)."""

    # the Engine's state these methods use
    spec: EnvSet
    stage: list[np.ndarray]
    traj_ids: np.ndarray
    next_traj: int
    env_frames: list[int]
    config: Any
    policy_signal: Any
    idle_signal: Any
    _ready: list[int]
    _first_ready: float
    _wake_at: int
    _actions: list[Any]
    _action_no: list[int]
    _waiters: list[Any]
    _new_waiter: Callable[[], Any]
    _no_more_actions: bool
    _in_flight: int
    _filling: FrameBatch | None
    _batches_completed: int

    if TYPE_CHECKING:  # Engine's methods

        async def _env_failed(self, u: int, exc: Exception) -> None: ...
        def reset_seed(self, first: int, u: int) -> int | None: ...
        def _new_batch(self) -> FrameBatch: ...
        def _complete(self, batch: FrameBatch) -> None: ...
        @property
        def idle(self) -> bool: ...

    async def _vector_task(self, u: int, env: Any, first: int, width: int) -> None:
        """Step vector env ``u`` (rows ``first`` to ``first + width - 1``) until the budget is spent."""
        stop = first + width
        rows = range(first, stop)
        try:
            obs, _ = await env.reset(seed=self.reset_seed(first, u))
            blocks = self._blocks(obs, width)
            stage = [slot[first:stop] for slot in self.stage]
            is_future = self._new_waiter is not anyio.Event
            ret = np.zeros(width)
            length = np.zeros(width, np.int64)
            while not self._no_more_actions:
                for view, block in zip(stage, blocks, strict=True):
                    view[...] = block
                waiter = self._waiters[first] = self._new_waiter()
                ready = self._ready
                before = len(ready)
                ready.extend(rows)
                if not before:
                    self._first_ready = anyio.current_time()
                wake_at = self._wake_at
                if wake_at and before < wake_at <= before + width:
                    self.policy_signal.set()
                if is_future:
                    await waiter
                else:
                    await waiter.wait()
                action = self._actions[first]
                if action is END:  # the budget is spent
                    return
                obs, reward, terminated, truncated, info = await env.step(action)
                blocks = self._blocks(obs, width)
                self._vector_frames(first, width, blocks, reward, terminated, truncated, info, ret, length)
                if self.idle_signal._event is not None and self.idle:  # a pause() waits for the steps
                    self.idle_signal.set()
        except Exception as exc:
            await self._env_failed(u, exc)

    def _blocks(self, obs: Any, width: int) -> list[np.ndarray]:
        """A vector env's observation as one array ``[width, ...]`` per key, its shapes checked."""
        blocks = [np.asarray(value) for value in self.spec.arrays(obs)]
        for (key, spec), block in zip(self.spec.obs_specs.items(), blocks, strict=True):
            if block.shape != (width, *spec.shape):
                raise ValueError(
                    f"an async vector env of {width} sub-envs gave the observation {key!r} of shape "
                    f"{block.shape}; it must be {(width, *spec.shape)} (num_envs first)"
                )
        return blocks

    def _final_obs(self, blocks: list[np.ndarray], done: np.ndarray, info: Any) -> list[np.ndarray]:
        """The next observations of a step: the reset ones in ``blocks``, where a sub-env ended its final
        one from ``info["final_obs"]`` (same-step autoreset)."""
        finals = info.get("final_obs") if isinstance(info, Mapping) else None
        ended = done.nonzero()[0].tolist()
        if finals is None or len(finals) != len(done) or any(finals[k] is None for k in ended):
            raise ValueError(
                f"an async vector env's sub-envs {ended} ended without info['final_obs'][k]: the async "
                "vector env protocol resets ended sub-envs in the same step and gives their final "
                "observations in info['final_obs'] (gymnasium's AutoresetMode.SAME_STEP)"
            )
        nxt = [block.copy() for block in blocks]
        for k in ended:
            for slot, value in zip(nxt, self.spec.arrays(finals[k]), strict=True):
                slot[k] = value
        return nxt

    def _vector_frames(
        self,
        first: int,
        width: int,
        blocks: list[np.ndarray],
        reward: Any,
        terminated: Any,
        truncated: Any,
        info: Any,
        ret: np.ndarray,
        length: np.ndarray,
    ) -> None:
        """Append a vector step's ``width`` frames (every value checked before the first is written),
        then count its episodes and free its rows' actions."""
        reward = _column(reward, np.float64, width, "reward")
        terminated = _column(terminated, np.bool_, width, "terminated")
        truncated = _column(truncated, np.bool_, width, "truncated")
        done = terminated | truncated
        ended = np.count_nonzero(done)  # (a bool array's any() costs twice as much)
        nxt = self._final_obs(blocks, done, info) if ended else blocks
        ret += reward
        length += 1
        written = self._append(first, width, nxt, reward, terminated, truncated, done, ret, length)
        if written:
            stop = first + written
            self.env_frames[first:stop] = [f + 1 for f in self.env_frames[first:stop]]
        if ended:  # new trajectory ids, in the order of the sub-envs
            ends = done.nonzero()[0]
            self.traj_ids[first + ends] = np.arange(self.next_traj, self.next_traj + len(ends))
            self.next_traj += len(ends)
            ret[done] = 0.0
            length[done] = 0
        # the actions are freed last: a batch completed above may still need their calls
        self._actions[first : first + width] = [None] * width
        self._in_flight -= width

    def _append(
        self,
        first: int,
        width: int,
        nxt: list[np.ndarray],
        reward: np.ndarray,
        terminated: np.ndarray,
        truncated: np.ndarray,
        done: np.ndarray,
        ret: np.ndarray,
        length: np.ndarray,
    ) -> int:
        """Write the frames into the batch being filled, the rest into the next one; frames past the
        ``total_frames`` budget are not written. Returns the frames written."""
        config = self.config
        number = self._action_no[first]  # the rows' actions are numbered in a row
        off = 0
        while off < width:
            if 0 < config.target <= self._batches_completed * config.frames_per_batch:
                break  # the budget is collected: the rest of the step is no frame
            batch = self._filling
            if batch is None:
                batch = self._new_batch()
            row = batch.filled
            m = min(width - off, batch.size - row)
            end = off + m
            for slot, block in zip(batch.next_obs, nxt, strict=True):
                slot[row : row + m] = block[off:end]
            batch.source.extend(range(number + off, number + end))
            batch.reward.extend(reward[off:end].tolist())
            batch.terminated.extend(terminated[off:end].tolist())
            batch.truncated.extend(truncated[off:end].tolist())
            batch.filled = row + m
            for k in (done[off:end].nonzero()[0] + off).tolist():
                batch.episodes.append((first + k, float(ret[k]), int(length[k])))
            if batch.filled == batch.size:
                self._complete(batch)
            off = end
        return off


def _column(value: Any, dtype: Any, width: int, what: str) -> np.ndarray:
    array = np.asarray(value, dtype=dtype)
    if array.shape != (width,):
        raise ValueError(
            f"an async vector env of {width} sub-envs gave {what} of shape {array.shape}; it must be "
            f"({width},)"
        )
    return array
