"""A ``ProcessVectorEnv`` worker process: builds its share of the sub-envs, then steps them on one-byte
commands, reading the actions from and writing the results into its shared-memory slots.

The control socket is the doorbell both ways: the parent sends ``S`` (step), ``R`` (reset; the seed is
in the slots) or ``C`` (close); the worker answers ``D`` (done) or ``E`` followed by one pickled
``Failed`` frame (the error with the worker's traceback), after which it exits.
"""

from __future__ import annotations

import functools
import socket
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np

from .._core._processes import become_worker
from .._envs._async_vector import ThreadedAsyncVectorEnv
from .._envs._spaces import NestedKey, action_specs, assemble_action, flatten_obs, observation_specs
from .._transport._messages import failure
from .._transport._wire import BlockingChannel, encode
from ._slots import Slots

__all__ = ["build_vector_env", "worker_main"]


def build_vector_env(fns: list[Any]) -> gym.vector.VectorEnv:
    """The worker's sub-envs as one gymnasium vector env: its env fns' single envs in a ``SyncVectorEnv``
    (same-step autoreset), or the one vector env its single env fn returns."""
    envs = [fn() for fn in fns]
    if len(envs) == 1 and isinstance(envs[0], gym.vector.VectorEnv):
        return envs[0]
    if any(isinstance(env, gym.vector.VectorEnv) for env in envs):
        for env in envs:
            env.close()
        raise TypeError(
            "ProcessVectorEnv: an env fn returned a gymnasium VectorEnv next to other env fns of the same "
            "worker; give one vector env per worker (len(env_fns) == num_workers) or single envs only"
        )
    return gym.vector.SyncVectorEnv(
        [functools.partial(_given, env) for env in envs], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )


def _given(env: gym.Env[Any, Any]) -> gym.Env[Any, Any]:
    return env


class _Stepper:
    """The worker's vector env and its slots."""

    def __init__(self, env: gym.vector.VectorEnv, names: str) -> None:
        self.env = ThreadedAsyncVectorEnv(env)
        self.obs_space = env.single_observation_space
        self.act_space = env.single_action_space
        self.slots = Slots(
            observation_specs(self.obs_space), action_specs(self.act_space), env.num_envs, names
        )

    def reset(self) -> None:
        seed = int(self.slots.seed[1]) if self.slots.seed[0] else None
        obs, _ = self.env._reset(seed)
        self._write(self.slots.obs, obs, slice(None))
        self.slots.ended[:] = False

    def step(self) -> None:
        slots = self.slots
        actions = assemble_action(self.act_space, lambda key, _: slots.actions[key].copy())
        obs, reward, terminated, truncated, info = self.env._step(actions)
        self._write(slots.obs, obs, slice(None))
        slots.reward[:] = reward
        slots.terminated[:] = terminated
        slots.truncated[:] = truncated
        ended = info.get("_final_obs")
        slots.ended[:] = False if ended is None else ended
        if ended is not None:
            for k in np.asarray(ended).nonzero()[0].tolist():
                self._write(slots.final, info["final_obs"][k], k)

    def _write(self, into: dict[NestedKey, np.ndarray], obs: Any, index: Any) -> None:
        for key, value in flatten_obs(self.obs_space, obs).items():
            into[key][index] = value


def _serve(sock: socket.socket, stepper: _Stepper) -> None:
    while True:
        cmd = sock.recv(1)
        if not cmd or cmd == b"C":
            return
        if cmd == b"S":
            stepper.step()
        elif cmd == b"R":
            stepper.reset()
        else:
            raise RuntimeError(f"ProcessVectorEnv worker: unknown command {cmd!r}")
        sock.sendall(b"D")


def worker_main(sock: socket.socket, index: int, payload: bytes, show_warnings: bool) -> None:
    """Entry point of a worker process (started through the forkserver)."""
    become_worker(sock, "aiocollect-envs-parent-watch", show_warnings)
    chan = BlockingChannel(sock)
    stepper: _Stepper | None = None
    env: Any = None
    ready = False
    try:
        env = build_vector_env(cloudpickle.loads(payload))
        chan.send((int(env.num_envs), env.single_observation_space, env.single_action_space))
        name = chan.recv()
        if name is None:
            return
        stepper = _Stepper(env, name)
        sock.sendall(b"D")
        ready = True
        _serve(sock, stepper)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent is gone
    except BaseException as exc:
        frame = encode(failure(exc, f"ProcessVectorEnv worker {index}"))
        try:
            sock.sendall((b"E" if ready else b"") + frame)
        except OSError:
            pass
    finally:
        if env is not None:
            try:
                env.close()
            except Exception:
                pass
        if stepper is not None:
            stepper.slots.close()
        sock.close()
