"""What a checkpoint adds so that a resumed run draws what the uninterrupted run draws.

* random states (torch, numpy and Python generators) as values ``torch.load(weights_only=True)`` takes:
  tensors, Python scalars, lists and string-keyed dicts;
* the rollout's trajectories in flight (the observation to act on, trajectory ids, episode returns and
  lengths) and the env's own state, where the env saves it (``get_state()``/``set_state(state)``);
* without env state, the seed the envs are reset with at a resume: derived from the rollout's random
  state and its frame count, so two resumes from one checkpoint reset alike.

Example:
    >>> import numpy as np
    >>> gen = np.random.default_rng(0)
    >>> saved = to_plain(gen.bit_generator.state)
    >>> first = gen.random()
    >>> gen.bit_generator.state = to_arrays(saved)
    >>> gen.random() == first
    True
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch

__all__ = [
    "RESUME_KEYS",
    "check_fleet_env_state",
    "derived_seed",
    "env_state",
    "load_env_state",
    "load_flight",
    "process_rng_state",
    "flight",
    "load_member",
    "member_state",
    "set_process_rng_state",
    "worker_state",
    "to_arrays",
    "to_plain",
]

#: state-dict entries this module adds (a hosted collector's trainer passes them through)
RESUME_KEYS = ("rng", "env_state")


def to_plain(value: Any) -> Any:
    """``value`` with numpy arrays as tensors (a copy), numpy scalars as Python's, tuples as lists."""
    if isinstance(value, np.ndarray):
        if value.dtype in (np.uint16, np.uint32):  # torch cannot pickle these: int64 holds them
            value = value.astype(np.int64)
        return torch.from_numpy(np.array(value, copy=True))
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if value is None or type(value) in (bool, int, float, str):
        return value
    raise TypeError(
        f"a {type(value).__module__}.{type(value).__qualname__} cannot go into a weights-only checkpoint: "
        "an env's get_state() returns tensors, numpy arrays, Python scalars, lists and dicts only"
    )


def to_arrays(value: Any) -> Any:
    """The inverse of :func:`to_plain` for numpy consumers: tensors become arrays (a copy)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    if isinstance(value, dict):
        return {k: to_arrays(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_arrays(v) for v in value]
    return value


# -- random states ---------------------------------------------------------------------------------
def process_rng_state() -> dict[str, Any]:
    """The process's global generators: torch's (CPU), numpy's legacy one and Python's ``random``.

    A worker process owns them (an in-process collector does not: they are the trainer's)."""
    return {
        "torch": torch.get_rng_state(),
        "numpy": to_plain(np.random.get_state(legacy=False)),
        "python": to_plain(random.getstate()),
    }


def set_process_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    legacy = to_arrays(state["numpy"])
    legacy["state"]["key"] = legacy["state"]["key"].astype(np.uint32)
    np.random.set_state(legacy)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def generator_state(gen: Any) -> Any:
    """A ``torch.Generator``'s or numpy ``Generator``'s state; ``None`` for none."""
    if isinstance(gen, torch.Generator):
        return gen.get_state()
    if isinstance(gen, np.random.Generator):
        return to_plain(gen.bit_generator.state)
    return None


def set_generator_state(gen: Any, state: Any) -> None:
    if state is None or gen is None:
        return
    if isinstance(gen, torch.Generator):
        gen.set_state(state)
    else:
        gen.bit_generator.state = to_arrays(state)


def derived_seed(rng_state: torch.Tensor, frames: int) -> int:
    """The seed envs are reset with at a resume without env state, from the seeded rollout's torch RNG
    state and the frame count: two resumes from one checkpoint reset alike."""
    digest = hashlib.sha256(rng_state.numpy().tobytes()).digest()
    words = [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4)]
    return int(np.random.SeedSequence([*words, frames]).generate_state(1)[0])


# -- the rollout's trajectories in flight and the env's own state ----------------------------------
def flight(rollout: Any) -> dict[str, Any]:
    """What the rollout carries between batches: the observation to act on, the trajectory ids and
    the episodes' returns and lengths so far."""
    if getattr(rollout, "_carry", None) is not None:
        raise TypeError(
            "state_dict(envs=True): a recurrent policy's carried state is not saved; save without envs "
            "(the envs then start from reset at a resume)"
        )
    return {
        "root": [
            [list(k) if isinstance(k, tuple) else k, torch.from_numpy(v.copy())]
            for k, v in rollout._root.items()
        ],
        **{name: torch.from_numpy(np.array(getattr(rollout, f"_{name}"), copy=True)) for name in _CARRIES},
    }


#: the per-env carries of a rollout besides its observation (numpy arrays, or scalars for one unbatched env)
_CARRIES = ("traj_ids", "ep_return", "ep_steps", "ep_length")


def _array(value: torch.Tensor) -> Any:
    """A saved carry as the rollout holds it: an array, or a numpy scalar for an unbatched env."""
    array = value.numpy().copy()
    return array[()] if array.ndim == 0 else array


def load_flight(rollout: Any, state: dict[str, Any]) -> None:
    rollout._root = {tuple(k) if isinstance(k, list) else k: v.numpy().copy() for k, v in state["root"]}
    for name in _CARRIES:
        setattr(rollout, f"_{name}", _array(state[name]))


def env_state(env: Any) -> Any:
    """``env.get_state()`` as weights-only values; a clear error for an env that cannot save."""
    get_state = getattr(env, "get_state", None)
    if not callable(get_state):
        raise TypeError(
            f"state_dict(envs=True): the env {type(env).__name__} cannot save its state (it has no "
            "get_state()/set_state(state), see EnvProtocol); call state_dict() without envs: the envs "
            "then start from reset at a resume"
        )
    return to_plain(get_state())


def load_env_state(env: Any, state: Any) -> None:
    set_state = getattr(env, "set_state", None)
    if not callable(set_state):
        raise TypeError(
            f"the checkpoint holds env state, but the env {type(env).__name__} has no set_state(state); "
            "load it into a collector of the same envs, or drop the 'env_state' entries"
        )
    set_state(state)


# -- one member: a Collector's rollout, or a worker's ------------------------------------------------
def member_state(
    rollout: Any,
    rng: Any,
    random_policy: Any,
    *,
    envs: bool,
    process: bool = False,
    ahead: str | None = None,
) -> dict[str, Any]:
    """The random states of a rollout's member (``process``: the process's generators too: a worker's
    process is its own) and with ``envs`` its envs' state and trajectories in flight (refused where
    the member collected ahead of the batches delivered: ``ahead`` says how not to)."""
    if envs and ahead is not None:
        raise ValueError(
            "state_dict(envs=True): the envs ran ahead of the batches delivered, so they are past the "
            f"checkpoint; {ahead} to save the env state exactly"
        )
    rngs: dict[str, Any] = {
        "rollout": None if rng.state is None else rng.state.clone(),
        "random_policy": generator_state(getattr(random_policy, "generator", None)),
    }
    if process:
        rngs["process"] = process_rng_state()
    state: dict[str, Any] = {"rng": rngs}
    if rollout.restarts is not None:  # a rebuild's seed derives from the restarts so far: they go on
        state["env_restarts"] = rollout.restarts.budget.count
    if envs:
        state["env_state"] = {"env": env_state(rollout.env.env), "flight": flight(rollout)}
    return state


def check_fleet_env_state(envs: bool, sync: bool, num_workers: int) -> None:
    """``state_dict(envs=True)`` of a first-ready fleet: only one worker can stop at the batch delivered
    (the others have batches in flight that no checkpoint holds)."""
    if envs and not sync and num_workers > 1:
        raise ValueError(
            f"state_dict(envs=True) of a MultiAsyncCollector with {num_workers} workers: the workers "
            "whose batch was not delivered have collected past the checkpoint; save the env state with "
            "one worker (and max_policy_lag=0), or save without it (the envs then start from reset)"
        )


def worker_state(worker: Any, envs: bool) -> dict[str, Any]:
    """:func:`member_state` of a worker (``_workers/_worker.py``): in ``run_free`` with two slots, a slot
    not handed back holds a batch the trainer was not given yet: its envs are ahead."""
    ahead = worker._sent_slot is not None and len(worker.slots) > 1 and len(worker.free) < len(worker.slots)
    fix = "make the MultiAsyncCollector with max_policy_lag=0 (a worker collects when asked)"
    state = member_state(
        worker.rollout,
        worker.rng,
        worker.random_policy,
        envs=envs,
        process=not worker.spec.in_process,
        ahead=fix if ahead else None,
    )
    state["sent_version"] = worker._sent_version  # a resume splits the trajectories in flight as here
    return state


def load_member(rollout: Any, rng: Any, random_policy: Any, state: dict[str, Any], frames: int) -> None:
    """Restore :func:`member_state`'s output and the rollout's counters (``Rollout.load_state_dict``).

    Without env state the envs start from reset (a seeded run's: seeded by :func:`derived_seed`),
    under new trajectory ids."""
    saved = state.get("env_state")
    rngs = state.get("rng")
    if saved is None:
        if rngs is not None and rngs["rollout"] is not None:
            rollout.env.set_seed(derived_seed(rngs["rollout"], frames))
        rollout.reset()
    rollout.load_state_dict(state)  # trajectory-id counter, policy version; fresh ids
    if rollout.restarts is not None:
        rollout.restarts.budget.count = int(state.get("env_restarts", 0))
    if saved is not None:
        load_env_state(rollout.env.env, saved["env"])
        load_flight(rollout, saved["flight"])
        rollout._next_traj = int(state["next_traj_id"])  # the trajectories in flight go on
    if rngs is not None:
        rng.state = None if rngs["rollout"] is None else rngs["rollout"].clone()
        set_generator_state(getattr(random_policy, "generator", None), rngs["random_policy"])
        if "process" in rngs:
            set_process_rng_state(rngs["process"])
