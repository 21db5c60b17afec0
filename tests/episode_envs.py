"""Test envs for whole-trajectory batches (``trajs_per_batch``): each episode's length depends on the
reset seed, and every observation says which episode (a stamp, in the order episodes started in this
process), which step, and how long the episode will be."""

from __future__ import annotations

import itertools
from typing import Any

import gymnasium as gym
import numpy as np
import torch

__all__ = ["Stamped", "Stamps", "check_trajectories", "trajectories"]


class Stamps:
    """``0, 1, 2, ...`` as ``next()`` asks: ``itertools.count`` without its pickling (deprecated in Python
    3.13: env fns that close over a counter are pickled for worker processes)."""

    def __init__(self) -> None:
        self.next = 0

    def __iter__(self) -> Stamps:
        return self

    def __next__(self) -> int:
        self.next += 1
        return self.next - 1


class Stamped(gym.Env[np.ndarray, np.int64]):
    """``observation = [stamp, step, length]``; the episode terminates after ``length`` steps, drawn
    from the reset's seed (1 to ``max_length``). ``lengths[stamp]`` records every episode's length."""

    observation_space = gym.spaces.Box(-1.0, 1e9, (3,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, stamps: Any = None, lengths: dict[int, int] | None = None, max_length: int = 30):
        self._stamps = stamps if stamps is not None else Stamps()
        self.lengths = lengths if lengths is not None else {}
        self._max = max_length
        self._stamp = self._step = self._length = 0

    def _obs(self) -> np.ndarray:
        return np.array([self._stamp, self._step, self._length], np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self._stamp = next(self._stamps)
        self._step = 0
        self._length = int(self.np_random.integers(1, self._max + 1))
        self.lengths[self._stamp] = self._length
        return self._obs(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        self._step += 1
        return self._obs(), 1.0, self._step >= self._length, False, {}


def trajectories(batch: Any) -> list[Any]:
    """The batch's trajectories (flat, or padded ``[N, T]`` with a mask), each a flat TensorDict."""
    if batch.ndim == 2:
        mask = batch.get(("collector", "mask"))
        return [batch[i][mask[i]] for i in range(batch.shape[0])]
    ids = batch.get(("collector", "traj_ids"))
    cuts = torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1
    bounds = [0, *cuts.tolist(), ids.numel()]
    return [batch[a:b] for a, b in itertools.pairwise(bounds)]


def check_trajectories(batch: Any, n: int, max_frames_per_traj: int | None = None) -> list[tuple[int, int]]:
    """Assert that ``batch`` holds ``n`` whole trajectories: each starts at a reset (step 0), has every
    step once and in order, ends with ``("next", "done")`` (its own end, or ``max_frames_per_traj``) and
    nowhere before; return each one's ``(stamp, length)``."""
    trajs = trajectories(batch)
    assert len(trajs) == n, f"{len(trajs)} trajectories, expected {n}"
    out = []
    for traj in trajs:
        obs, nxt = traj["observation"], traj["next", "observation"]
        assert traj["collector", "traj_ids"].unique().numel() == 1
        assert (obs[:, 0] == obs[0, 0]).all(), "one episode per trajectory"
        assert obs[:, 1].tolist() == list(range(len(traj))), "starts at a reset, every step once"
        assert torch.equal(nxt[:-1], obs[1:])
        done = traj["next", "done"].reshape(-1)
        assert bool(done[-1]) and not bool(done[:-1].any()), "ends with done, and only there"
        length = int(obs[0, 2])
        if max_frames_per_traj is not None and length > max_frames_per_traj:
            assert len(traj) == max_frames_per_traj and bool(traj["next", "truncated"].reshape(-1)[-1])
        else:
            assert len(traj) == length and bool(traj["next", "terminated"].reshape(-1)[-1])
        out.append((int(obs[0, 0]), len(traj)))
    return out
