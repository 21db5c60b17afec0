"""What an env server runs for a vector client (:class:`aiocollect.RemoteVectorEnv`): a reset or a step of
its envs ``start..stop-1`` at once, with same-step autoreset, and the reply encoded.

The envs are either single gymnasium envs of the server (stepped in a loop, each reset as soon as its
episode ends: :class:`SingleEnvs`) or the server's one gymnasium vector env (stepped in one call:
:class:`HostedVector`). Either way a message holds all the actions as one array and its reply is one
message: the observations stacked, rewards and flags as arrays, the final observations of the sub-envs
whose episode ended (their indices and their observations, stacked; nothing when none ended) and the
infos in gymnasium's vector layout (``null`` when empty). The whole job, from decoding the message to
encoding its reply, runs in the server's worker thread: the event loop only moves bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from ._actions import batch_action_checker
from ._common import error_message
from ._wire import ProtocolError, decode, encode, pack_tree, unpack_tree

__all__ = ["HostedVector", "SingleEnvs", "VectorJob", "open_vector_env"]

#: a step's result: obs, rewards, terminated, truncated, indices of the ended sub-envs (or None), their
#: final observations (stacked) and the vector info
Stepped = tuple[Any, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, Any, dict[str, Any]]


class _Infos:
    """Gymnasium's merge of one sub-env's info into a vector info (``info[key]`` a column, ``info["_key"]``
    its mask), borrowed from ``VectorEnv``: the infos come out as a local vector env's would."""

    _add_info: Any = gym.vector.VectorEnv._add_info  # a plain function of self.num_envs

    def __init__(self, num_envs: int) -> None:
        self.num_envs = num_envs

    def add(self, infos: dict[str, Any], info: dict[str, Any], k: int) -> dict[str, Any]:
        merged: dict[str, Any] = self._add_info(infos, info, k)
        return merged


class SingleEnvs:
    """Envs ``start..stop-1`` of a server of single envs, stepped as one vector env with same-step
    autoreset (as gymnasium's ``SyncVectorEnv(autoreset_mode=SAME_STEP)`` steps them)."""

    def __init__(self, envs: Sequence[gym.Env[Any, Any]], start: int, stop: int) -> None:
        self.envs = list(envs[start:stop])
        self.num_envs = stop - start
        first = self.envs[0]
        for index, env in enumerate(self.envs, start):
            if env.observation_space != first.observation_space or env.action_space != first.action_space:
                raise ValueError(
                    f"envs {start} to {stop - 1} do not share their spaces (env {index} has "
                    f"{env.observation_space}, {env.action_space}; env {start} {first.observation_space}, "
                    f"{first.action_space}): a vector client steps envs of one observation and action space"
                )
        self.single_observation_space = first.observation_space
        self.single_action_space = first.action_space
        self.check = batch_action_checker(self.single_action_space, self.num_envs)
        self._rows = _row_splitter(self.single_action_space, self.num_envs)
        self._infos = _Infos(self.num_envs)

    def _stack(self, observations: list[Any]) -> Any:
        space = self.single_observation_space
        out: Any = create_empty_array(space, len(observations))
        return concatenate(space, observations, out)

    def reset(self, seed: int | None, options: dict[str, Any] | None) -> tuple[Any, dict[str, Any]]:
        observations: list[Any] = []
        infos: dict[str, Any] = {}
        for k, env in enumerate(self.envs):
            obs, info = env.reset(seed=None if seed is None else seed + k, options=options)
            observations.append(obs)
            if info:
                infos = self._infos.add(infos, info, k)
        return self._stack(observations), infos

    def step(self, actions: Any) -> Stepped:
        n = self.num_envs
        rewards = np.empty(n, dtype=np.float64)
        terminated = np.empty(n, dtype=np.bool_)
        truncated = np.empty(n, dtype=np.bool_)
        observations: list[Any] = []
        ended: list[int] = []
        finals: list[Any] = []
        infos: dict[str, Any] = {}
        for k, (env, action) in enumerate(zip(self.envs, self._rows(actions), strict=True)):
            obs, reward, term, trunc, info = env.step(action)
            rewards[k], terminated[k], truncated[k] = reward, term, trunc
            if term or trunc:
                ended.append(k)
                finals.append(obs)
                infos = self._infos.add(infos, {"final_info": info}, k)
                obs, info = env.reset()
            if info:
                infos = self._infos.add(infos, info, k)
            observations.append(obs)
        obs = self._stack(observations)
        if not ended:
            return obs, rewards, terminated, truncated, None, None, infos
        return obs, rewards, terminated, truncated, np.array(ended, np.int64), self._stack(finals), infos


def _row_splitter(space: spaces.Space[Any], n: int) -> Callable[[Any], list[Any]]:
    """A column of checked actions -> one action per sub-env."""
    if isinstance(space, spaces.Discrete):
        return lambda actions: actions.tolist()  # python ints: the cheapest for an env to check
    if isinstance(space, spaces.Box):
        return list
    batched = batch_space(space, n)
    return lambda actions: list(iterate(batched, actions))


def open_vector_env(made: Any) -> tuple[gym.vector.VectorEnv[Any, Any, Any], bool]:
    """The gymnasium vector env that ``vector_env_fn()`` gave (an ``aiocollect.GymEnv`` of a vector env
    is unwrapped), and whether it resets ended sub-envs in the same step. ``TypeError``/``ValueError``
    (naming the fix) for what cannot be served."""
    from .._envs._gym import GymEnv

    env = made.env if isinstance(made, GymEnv) else made
    if not isinstance(env, gym.vector.VectorEnv):
        raise TypeError(
            "vector_env_fn must return a gymnasium vector env (gymnasium.make_vec(...), a SyncVectorEnv, "
            f"an AsyncVectorEnv, aiocollect.GymEnv(id, num_envs=n)), got {type(made).__name__}"
        )
    mode = env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP)
    mode = AutoresetMode(mode) if not isinstance(mode, AutoresetMode) else mode
    if mode == AutoresetMode.SAME_STEP:
        return env, True
    inner = env.unwrapped
    partial = isinstance(inner, gym.vector.SyncVectorEnv) or (
        isinstance(inner, gym.vector.AsyncVectorEnv) and inner.shared_memory
    )
    if not partial:
        raise ValueError(
            f"serve_envs(vector_env_fn=...) got a {type(inner).__name__} with {mode.name} autoreset, which "
            "cannot be reset in part: make it with same-step autoreset (gymnasium.make_vec(id, n, "
            "vectorization_mode='sync', vector_kwargs={'autoreset_mode': gymnasium.vector.AutoresetMode."
            "SAME_STEP}), or aiocollect.GymEnv(id, num_envs=n))"
        )
    return env, False


class HostedVector:
    """A server's one gymnasium vector env, stepped whole in one call; a vector env with next-step or
    disabled autoreset (gymnasium's Sync/AsyncVectorEnv) has its ended sub-envs reset at once with
    ``reset(options={"reset_mask": ended})``, so that the client sees same-step autoreset."""

    def __init__(self, env: gym.vector.VectorEnv[Any, Any, Any], same_step: bool) -> None:
        self.env, self.same_step = env, same_step
        self.num_envs = int(env.num_envs)
        self.single_observation_space = env.single_observation_space
        self.single_action_space = env.single_action_space
        self.check = batch_action_checker(self.single_action_space, self.num_envs)

    def reset(self, seed: int | None, options: dict[str, Any] | None) -> tuple[Any, dict[str, Any]]:
        obs, info = self.env.reset(seed=seed, options=options)
        return obs, info

    def step(self, actions: Any) -> Stepped:
        obs, rewards, terminated, truncated, info = self.env.step(actions)
        if self.same_step:
            mask = info.get("_final_obs")
            if mask is None or not mask.any():
                return obs, rewards, terminated, truncated, None, None, info
            ended = np.flatnonzero(mask)
            column = info["final_obs"]
            finals = [column[k] for k in ended.tolist()]
            info = {k: v for k, v in info.items() if k not in ("final_obs", "_final_obs")}
            space = self.single_observation_space
            out: Any = create_empty_array(space, len(finals))
            stacked = concatenate(space, finals, out)
            return obs, rewards, terminated, truncated, ended, stacked, info
        done = np.logical_or(terminated, truncated)
        if not done.any():
            return obs, rewards, terminated, truncated, None, None, info
        ended = np.flatnonzero(done)
        finals = _rows(obs, ended)  # a copy: the reset may reuse the env's buffers
        fresh, _ = self.env.reset(options={"reset_mask": done})
        obs = _merged(obs, fresh, done)
        # the step's infos stay (gymnasium puts the ended sub-envs' under "final_info"); the partial
        # reset's infos are not merged in
        info = {**info, "final_info": info, "_final_info": done}
        return obs, rewards, terminated, truncated, ended, finals, info


def _rows(obs: Any, rows: np.ndarray) -> Any:
    if isinstance(obs, dict):
        return {k: _rows(v, rows) for k, v in obs.items()}
    if isinstance(obs, tuple):
        return tuple(_rows(v, rows) for v in obs)
    return obs[rows]


def _merged(obs: Any, fresh: Any, mask: np.ndarray) -> Any:
    """``obs`` with the rows in ``mask`` taken from ``fresh`` (a new array)."""
    if isinstance(obs, dict):
        return {k: _merged(v, fresh[k], mask) for k, v in obs.items()}
    if isinstance(obs, tuple):
        return tuple(_merged(v, f, mask) for v, f in zip(obs, fresh, strict=True))
    return np.where(mask.reshape((-1,) + (1,) * (obs.ndim - 1)), fresh, obs)


class VectorJob:
    """One message of a vector client (decoded where it runs, in the worker thread), and its reply."""

    __slots__ = ("host", "message", "reply")

    def __init__(self, host: SingleEnvs | HostedVector, message: bytes) -> None:
        self.host, self.message = host, message
        self.reply = b""

    def run(self) -> None:
        try:
            self.reply = self._run()
        except Exception as exc:
            self.reply = error_message(exc)

    def _run(self) -> bytes:
        header, arrays = decode(self.message, request=True)
        op, host = header["op"], self.host
        if op == "reset":
            seed, options = header.get("seed"), unpack_tree(header.get("options"), arrays)
            if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
                raise ProtocolError(f"reset seed must be an int or null, got {seed!r}")
            if options is not None and not isinstance(options, dict):
                raise ProtocolError("reset options must be a dict or null")
            obs, info = host.reset(seed, options)
            out: list[Any] = []
            return encode({"op": "reset", "obs": pack_tree(obs, out), "info": _info(info, out)}, out)
        if op != "step":
            raise ProtocolError(f"unknown op {op!r} (reset, step)")
        actions = host.check(unpack_tree(header.get("actions"), arrays))
        obs, rewards, terminated, truncated, ended, finals, info = host.step(actions)
        out = [rewards, terminated, truncated]
        reply: dict[str, Any] = {"op": "step", "obs": pack_tree(obs, out), "final": None}
        if ended is not None:
            reply["final"] = {"index": pack_tree(ended, out), "obs": pack_tree(finals, out)}
        reply["info"] = _info(info, out)
        return encode(reply, out)


def _info(info: dict[str, Any], arrays: list[Any]) -> Any:
    return None if not info else pack_tree(info, arrays)
