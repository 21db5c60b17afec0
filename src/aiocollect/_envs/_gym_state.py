"""The state of gymnasium envs, for ``GymEnv.get_state()``/``set_state(state)``: classic control (the
``state`` attribute), ALE (``cloneState``/``restoreState``), MuJoCo (the integration state), the
``TimeLimit`` step counter and the env's random generator; ``SyncVectorEnv`` sub-env by sub-env.

Values are numpy arrays, Python scalars, lists and dicts (a checkpoint converts the arrays to tensors).
An env or wrapper whose state is not known here raises a ``TypeError`` naming it.

Example:
    >>> import gymnasium as gym
    >>> env = gym.make("CartPole-v1")
    >>> _ = env.reset(seed=0)
    >>> saved = env_state(env)
    >>> a = env.step(0)[0]
    >>> set_env_state(env, saved)
    >>> bool((env.step(0)[0] == a).all())
    True
"""

from __future__ import annotations

import copy
from typing import Any

import gymnasium as gym
import numpy as np

__all__ = ["env_state", "set_env_state", "vector_state", "set_vector_state"]

#: wrappers that keep no state, or only the attributes named (restored as they were)
_WRAPPER_FIELDS: dict[str, tuple[str, ...]] = {
    "TimeLimit": ("_elapsed_steps",),
    "OrderEnforcing": ("_has_reset",),
    "PassiveEnvChecker": (),
    "ClipAction": (),
    "RescaleAction": (),
    "TransformObservation": (),
    "TransformReward": (),
    "TransformAction": (),
    "FlattenObservation": (),
    "DtypeObservation": (),
}
#: classic-control attributes besides ``state`` (CartPole's count after termination, Pendulum's torque)
_CLASSIC_EXTRAS = ("steps_beyond_terminated", "last_u")


def _chain(env: gym.Env[Any, Any]) -> list[Any]:
    out = []
    while isinstance(env, gym.Wrapper):
        out.append(env)
        env = env.env
    return out


def _generator(inner: Any) -> Any:
    gen = getattr(inner, "_np_random", None)
    return None if gen is None else copy.deepcopy(gen.bit_generator.state)


def env_state(env: gym.Env[Any, Any]) -> dict[str, Any]:
    """The state of one gymnasium env (its wrappers, its simulator, its random generator)."""
    wrappers = []
    for wrapper in _chain(env):
        name = type(wrapper).__name__
        if name not in _WRAPPER_FIELDS:
            raise TypeError(
                f"GymEnv.get_state: the state of the wrapper {name} is not known (known: "
                f"{sorted(_WRAPPER_FIELDS)}); subclass GymEnv with get_state()/set_state(state), or save "
                "without env state"
            )
        wrappers.append({f: getattr(wrapper, f) for f in _WRAPPER_FIELDS[name] if hasattr(wrapper, f)})
    inner = env.unwrapped
    state: dict[str, Any] = {"wrappers": wrappers, "np_random": _generator(inner)}
    if hasattr(inner, "ale"):  # ale_py's AtariEnv
        state["ale"] = np.frombuffer(_ale_bytes(inner.ale), dtype=np.uint8).copy()
    elif (
        hasattr(inner, "data")
        and hasattr(inner, "model")
        and type(inner.data).__module__.startswith("mujoco")
    ):
        state["mujoco"] = _mujoco_state(inner)
    elif type(inner).__module__.startswith("gymnasium.envs.classic_control") and hasattr(inner, "state"):
        value = inner.state
        state["state"] = None if value is None else np.array(value)  # its dtype: reset and step differ
        state["state_is_tuple"] = isinstance(value, tuple)
        state["extras"] = {k: _plain(getattr(inner, k)) for k in _CLASSIC_EXTRAS if hasattr(inner, k)}
    else:
        raise TypeError(
            f"GymEnv.get_state: the state of {type(inner).__module__}.{type(inner).__qualname__} is not "
            "known (classic control, ALE and MuJoCo envs are); subclass GymEnv with get_state()/"
            "set_state(state), or save without env state"
        )
    return state


def set_env_state(env: gym.Env[Any, Any], state: dict[str, Any]) -> None:
    """Restore :func:`env_state`'s output into an env made alike."""
    chain = _chain(env)
    if len(chain) != len(state["wrappers"]):
        raise ValueError(
            f"the saved env had {len(state['wrappers'])} wrappers, this one {len(chain)}: load the state "
            "into an env made alike"
        )
    for wrapper, fields in zip(chain, state["wrappers"], strict=True):
        for name, value in fields.items():
            setattr(wrapper, name, value)
    inner: Any = env.unwrapped
    if state["np_random"] is not None:
        if getattr(inner, "_np_random", None) is None:
            inner._np_random = np.random.Generator(np.random.PCG64())
        inner._np_random.bit_generator.state = state["np_random"]
    if "ale" in state:
        inner.ale.restoreState(_ale_state(np.asarray(state["ale"], dtype=np.uint8).tobytes()))
    elif "mujoco" in state:
        _set_mujoco_state(inner, state["mujoco"])
    elif "state" in state:
        _set_classic(inner, state["state"], bool(state["state_is_tuple"]))
        for name, extra in state["extras"].items():
            setattr(inner, name, extra)


def _set_classic(inner: Any, value: Any, is_tuple: bool) -> None:
    if value is None:
        inner.state = None
    elif is_tuple:
        inner.state = tuple(float(v) for v in value)
    else:
        inner.state = np.array(value)


def vector_state(env: Any) -> dict[str, Any]:
    """A ``SyncVectorEnv``'s sub-envs and its pending autoresets."""
    inner = env.unwrapped
    if not isinstance(inner, gym.vector.SyncVectorEnv) or env is not inner:
        raise TypeError(
            f"GymEnv.get_state: the state of the vector env {type(env).__name__} is not known (a "
            "gymnasium SyncVectorEnv of classic-control, ALE or MuJoCo envs is); save without env state"
        )
    return {
        "envs": [env_state(sub) for sub in inner.envs],
        "autoreset": np.array(inner._autoreset_envs, copy=True),
    }


def set_vector_state(env: Any, state: dict[str, Any]) -> None:
    inner = env.unwrapped
    if len(inner.envs) != len(state["envs"]):
        raise ValueError(f"the saved vector env had {len(state['envs'])} envs, this one {len(inner.envs)}")
    for sub, saved in zip(inner.envs, state["envs"], strict=True):
        set_env_state(sub, saved)
    inner._autoreset_envs = np.asarray(state["autoreset"], dtype=np.bool_).copy()


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.copy()
    return value


# -- simulators: imported only for envs that hold them ------------------------------------------------
def _ale_bytes(ale: Any) -> bytes:
    return bytes(ale.cloneState(include_rng=True).serialize())


def _ale_state(data: bytes) -> Any:
    from ale_py import ALEState

    return ALEState(data)


def _mujoco_state(inner: Any) -> np.ndarray:
    import mujoco

    spec = mujoco.mjtState.mjSTATE_INTEGRATION
    out = np.empty(mujoco.mj_stateSize(inner.model, spec), dtype=np.float64)
    mujoco.mj_getState(inner.model, inner.data, out, spec)
    return out


def _set_mujoco_state(inner: Any, state: Any) -> None:
    import mujoco

    values = np.asarray(state, dtype=np.float64)
    mujoco.mj_setState(inner.model, inner.data, values, mujoco.mjtState.mjSTATE_INTEGRATION)
    mujoco.mj_forward(inner.model, inner.data)
