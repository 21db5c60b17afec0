"""The state of gymnasium envs, for ``GymEnv.get_state()``/``set_state(state)``: classic control (the
``state`` attribute), ALE (``cloneState``/``restoreState``), MuJoCo (the integration state), an env with
its own ``get_state()``/``set_state(state)``, the env's random generator, and every wrapper of the chain;
``SyncVectorEnv`` sub-env by sub-env.

A wrapper's state: gymnasium's ``TimeLimit`` step counter and ``OrderEnforcing`` flag; for a wrapper with
its own ``get_state()``/``set_state(state)`` (the hook for a wrapper's own state), what they give; for any
other wrapper (one of your own that counts steps, gymnasium's ``RecordEpisodeStatistics``,
``FrameStackObservation``), its attributes: numbers, strings, numpy arrays and scalars, tensors, random
generators, and lists, tuples, deques and dicts of those (its spaces and functions are configuration, not
state). A wrapper attribute of another kind raises a ``TypeError`` naming the wrapper, the attribute and
the hook. Values are numpy arrays, Python scalars, lists and dicts (a checkpoint converts the arrays to
tensors).

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
from collections import deque
from typing import Any

import gymnasium as gym
import numpy as np
import torch

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
#: what ``gymnasium.Wrapper`` itself keeps (the env, cached spaces and spec, constructor arguments)
_WRAPPER_BASE = frozenset(
    {
        "env",
        "_action_space",
        "_observation_space",
        "_metadata",
        "_cached_spec",
        "_saved_kwargs",
        "_reward_range",
    }
)


def _own(obj: Any, name: str) -> Any:
    """``obj``'s method ``name`` if its class defines one (a wrapper does not forward it)."""
    return getattr(obj, name) if callable(getattr(type(obj), name, None)) else None


def _encode(value: Any, where: str) -> Any:
    """A wrapper attribute as checkpoint values, tagged so that :func:`_decode` rebuilds its type."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return {"scalar": np.asarray(value)}
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return value.copy() if isinstance(value, np.ndarray) else value.detach().clone()
    if isinstance(value, np.random.Generator):
        return {"generator": copy.deepcopy(value.bit_generator.state)}
    if isinstance(value, deque):
        return {"deque": [_encode(v, where) for v in value], "maxlen": value.maxlen}
    if isinstance(value, (list, tuple)):
        items = [_encode(v, where) for v in value]
        return items if isinstance(value, list) else {"tuple": items}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: _encode(v, f"{where}[{k!r}]") for k, v in value.items()}}
    raise TypeError(
        f"GymEnv.get_state: {where} is a {type(value).__module__}.{type(value).__qualname__}, which a "
        "checkpoint cannot hold: give the wrapper get_state()/set_state(state) of its own (its state as "
        "numbers, arrays, lists and dicts), or save without env state"
    )


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return np.asarray(value).copy() if isinstance(value, torch.Tensor) else value
    if "scalar" in value:
        return np.asarray(value["scalar"])[()]
    if "generator" in value:
        generator = np.random.Generator(getattr(np.random, value["generator"]["bit_generator"])())
        generator.bit_generator.state = value["generator"]
        return generator
    if "deque" in value:
        return deque([_decode(v) for v in value["deque"]], maxlen=value["maxlen"])
    if "tuple" in value:
        return tuple(_decode(v) for v in value["tuple"])
    return {k: _decode(v) for k, v in value["dict"].items()}


def _wrapper_state(wrapper: Any) -> dict[str, Any]:
    """One wrapper's state: its known fields, its own ``get_state()``, or its attributes."""
    name = type(wrapper).__name__
    if name in _WRAPPER_FIELDS:
        return {f: getattr(wrapper, f) for f in _WRAPPER_FIELDS[name] if hasattr(wrapper, f)}
    if (get := _own(wrapper, "get_state")) is not None:
        return {"own": get()}
    attrs = {k: v for k, v in vars(wrapper).items() if k not in _WRAPPER_BASE}
    kept = {k: v for k, v in attrs.items() if not callable(v) and not isinstance(v, gym.Space)}
    return {"attrs": {k: _encode(v, f"the attribute {k!r} of the wrapper {name}") for k, v in kept.items()}}


def _set_wrapper_state(wrapper: Any, fields: dict[str, Any]) -> None:
    if "own" in fields:
        put = _own(wrapper, "set_state")
        if put is None:
            raise TypeError(f"the saved wrapper had set_state(state), {type(wrapper).__name__} has not")
        put(fields["own"])
    elif "attrs" in fields:
        for name, value in fields["attrs"].items():
            setattr(wrapper, name, _decode(value))
    else:
        for name, value in fields.items():
            setattr(wrapper, name, value)


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
    wrappers = [_wrapper_state(wrapper) for wrapper in _chain(env)]
    inner = env.unwrapped
    state: dict[str, Any] = {"wrappers": wrappers, "np_random": _generator(inner)}
    if (get := _own(inner, "get_state")) is not None and _own(inner, "set_state") is not None:
        state["own"] = get()  # an env of your own that saves itself
    elif hasattr(inner, "ale"):  # ale_py's AtariEnv
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
            "known (classic control, ALE and MuJoCo envs are): give the env get_state()/set_state(state) of "
            "its own, or save without env state"
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
        _set_wrapper_state(wrapper, fields)
    inner: Any = env.unwrapped
    if state["np_random"] is not None:
        if getattr(inner, "_np_random", None) is None:
            inner._np_random = np.random.Generator(np.random.PCG64())
        inner._np_random.bit_generator.state = state["np_random"]
    if "own" in state:
        inner.set_state(state["own"])
    elif "ale" in state:
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
