"""The calls of :class:`PoolFrames` into an EnvPool pool: a step of some envs, the reset observations.

EnvPool's own ``step`` is a Python layer over the C++ pool's ``_send`` and ``_recv``: per call it casts
the action, builds the config dict (twice), infers the players' env ids, checks the action (once), zips
the state into a dict, unflattens it into a tree and computes ``terminated``: 30-60 µs per call, about 6 %
of a step of 256 CartPole envs, which a near-free env shows in full. :func:`pool_io` calls ``_send`` and
``_recv`` itself where the pool is the plain single-player gymnasium pool whose layout it knows (its
action keys ``env_id, players.env_id, action``, its state keys named ``obs``, ``reward``, ``done``,
``trunc``, ``info:env_id``), giving what ``step`` gives: the same arrays, ``terminated = done & ~trunc``.
Any other pool, a newer layout, or a pool whose ``step``/``send``/``recv`` was replaced (a wrapper that
records or reorders its calls) is called through its public methods.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["PoolIO", "pool_io"]

#: the action arrays of a plain single-player pool, in ``_send``'s order
_ACTION_KEYS = ["env_id", "players.env_id", "action"]
#: the state arrays read, by their names in ``_recv``'s list
_STATE_KEYS = ("obs", "reward", "done", "trunc", "info:env_id")


class PoolIO:
    """A pool's calls through its public methods: ``step(action, env_ids)`` gives (observations, reward,
    terminated, truncated, env ids); ``recv_reset()`` the observations and env ids of a sent reset."""

    #: the dtype the pool takes its actions in, where the caller may cast them once ahead (else ``None``)
    action_dtype: np.dtype[Any] | None = None

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def step(self, action: np.ndarray, env_ids: np.ndarray | None) -> tuple[np.ndarray, ...]:
        obs, reward, terminated, truncated, info = self.pool.step(action, env_ids)
        return obs, reward, terminated, truncated, np.asarray(info["env_id"])

    def recv_reset(self) -> tuple[np.ndarray, np.ndarray]:
        obs, info = self.pool.recv(reset=True)  # (obs, info) whatever gym_reset_return_info says
        return obs, np.asarray(info["env_id"])


class _DirectIO(PoolIO):
    """:class:`PoolIO` by the C++ pool's ``_send`` and ``_recv``, skipping EnvPool's Python layer."""

    def __init__(self, pool: Any, action_dtype: np.dtype[Any], index: tuple[int, ...]) -> None:
        super().__init__(pool)
        self._send, self._recv = pool._send, pool._recv
        self._all = pool.all_env_ids
        self.action_dtype = action_dtype
        self._index = index

    def step(self, action: np.ndarray, env_ids: np.ndarray | None) -> tuple[np.ndarray, ...]:
        ids = self._all if env_ids is None else env_ids.astype(np.int32, copy=False)
        sent = [ids, ids, np.ascontiguousarray(action, dtype=self.action_dtype)]  # alive until the recv
        self._send(sent)
        state = self._recv()
        del sent
        o, r, d, t, e = self._index
        trunc = state[t]
        return state[o], state[r], state[d] & ~trunc, trunc, state[e]

    def recv_reset(self) -> tuple[np.ndarray, np.ndarray]:
        state = self._recv()
        o, _, _, _, e = self._index
        return state[o], state[e]


def pool_io(pool: Any) -> PoolIO:
    """The calls into ``pool``: direct where its layout is the known one (see the module's docstring)."""
    direct = _direct_layout(pool)
    if direct is None:
        return PoolIO(pool)
    return _DirectIO(pool, *direct)


def _direct_layout(pool: Any) -> tuple[np.dtype[Any], tuple[int, ...]] | None:
    """(the action's dtype, the state arrays' indices) of a plain single-player gymnasium pool whose
    public ``step``, ``send``, ``recv`` and ``_to`` are EnvPool's own; else ``None``."""
    module = sys.modules.get("envpool.python.envpool")
    mixin = getattr(module, "EnvPoolMixin", None)
    if mixin is None or any(name in vars(pool) for name in ("step", "send", "recv", "_send", "_recv", "_to")):
        return None
    cls = type(pool)
    if any(getattr(cls, name, None) is not getattr(mixin, name, None) for name in ("step", "send", "recv")):
        return None
    if getattr(getattr(cls, "_to", None), "__name__", None) != "_to_gymnasium":
        return None
    try:
        spec = pool._spec
        if list(spec._action_keys) != _ACTION_KEYS or pool.config.get("max_num_players", 1) != 1:
            return None
        state_keys = list(pool._state_keys)
        if "obs" not in state_keys:  # a dict of observations: the public path unwraps it
            return None
        index = tuple(state_keys.index(key) for key in _STATE_KEYS)
        dtype = np.dtype(spec._action_spec[-1][0])
    except (AttributeError, ValueError, TypeError, IndexError, KeyError):
        return None
    return dtype, index
