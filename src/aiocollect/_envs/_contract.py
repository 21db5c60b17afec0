"""An env that breaks gymnasium's API, told so: which env, which method, what the contract is.

The collectors unpack an env's ``reset()`` and ``step()`` where they step it (``GymEnv``'s paths, the
async-env engine) and copy its observations into preallocated batches; an env that returns 4 values from
``step`` (the old gym API), a bare observation from ``reset``, or an observation of another shape than its
``observation_space`` made Python's own error come out (``not enough values to unpack (expected 5, got
4)``, ``could not broadcast input array from shape (4,) into shape (3,)``), naming neither. Such errors,
raised by our unpacking or copying (or by gymnasium's vector env over a sub-env that breaks the API), are
turned into a ``ValueError`` that names the env, the method and the contract, the original as its cause.
Nothing runs per step: the check is where the error is caught.

Example:
    >>> error = contract_error(ValueError("not enough values to unpack (expected 5, got 4)"), None)
    >>> str(error).split(":")[0]
    "the env's step(action) returned 4 values"
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from typing import Any

import gymnasium
import numpy as np

__all__ = ["contract_error", "env_contract", "env_name"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_GYM_VECTOR = os.path.join(os.path.dirname(os.path.abspath(gymnasium.__file__)), "vector")
_NUMPY = os.path.dirname(os.path.abspath(np.__file__)) + os.sep
_UNPACK = re.compile(r"(?:not enough|too many) values to unpack \(expected (\d+)(?:, got (\d+))?\)")
_SHAPE = re.compile(
    r"could not broadcast input array from shape \(([^)]*)\) into shape \(([^)]*)\)"
    r"|Output array is the wrong shape|cannot reshape array of size"
)


def _inner(env: Any) -> Any:
    """The object the user gave: a ``GymEnv``'s gymnasium env, a threaded async env's, an ``ArrayEnv``'s."""
    for _ in range(3):
        inner = getattr(env, "_env", None) or getattr(env, "env", None)
        if inner is None or isinstance(env, gymnasium.Wrapper):
            break
        env = inner
    return env


def env_name(env: Any) -> str:
    """``env`` as a user knows it: its class (the unwrapped one of a gymnasium env) and its id."""
    if env is None:
        return "the env"
    raw = _inner(env)
    base = getattr(raw, "unwrapped", raw)
    spec = getattr(raw, "spec", None)
    name = type(base).__name__
    subs = getattr(base, "envs", None)  # a gymnasium vector env: the sub-env that broke the API under it
    if isinstance(subs, (list, tuple)) and subs:
        sub = getattr(subs[0], "unwrapped", subs[0])
        name = f"{name} of {type(sub).__name__}"
        spec = getattr(subs[0], "spec", None)
    spec_id = getattr(spec, "id", None)
    return f"the env {name} ({spec_id})" if spec_id else f"the env {name}"


def _raised_in_the_contract(exc: BaseException) -> bool:
    """Whether the innermost frame of ``exc`` (numpy's and functools' aside) is aiocollect's (its unpacking
    or copying) or gymnasium's vector env's (a sub-env broke the API under it), not the env's own code."""
    tb, last = exc.__traceback__, None
    while tb is not None:
        path = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if not path.startswith(_NUMPY) and os.path.basename(path) != "functools.py":
            last = path
        tb = tb.tb_next
    return last is not None and (last.startswith(_PACKAGE + os.sep) or last.startswith(_GYM_VECTOR + os.sep))


def contract_error(exc: BaseException, env: Any) -> ValueError | None:
    """A ``ValueError`` that says how ``env`` broke gymnasium's API, if ``exc`` is such a break (``None``
    otherwise: raise ``exc`` as it is)."""
    if not isinstance(exc, (ValueError, TypeError)):
        return None
    if exc.__traceback__ is not None and not _raised_in_the_contract(exc):
        return None  # the env's own error
    text, name = str(exc), env_name(env)
    unpack = _UNPACK.search(text)
    if unpack is not None:
        expected, got = int(unpack.group(1)), unpack.group(2)
        count = f"{got} values" if got is not None else f"more than {expected} values"
        if expected == 5:
            message = (
                f"{name}'s step(action) returned {count}: gymnasium's API returns 5, (observation, reward, "
                "terminated, truncated, info)"
            )
            if got == "4":
                message += (
                    "; 4 is the old gym API's (observation, reward, done, info): return terminated and "
                    "truncated apart (or wrap the env with shimmy's GymV21CompatibilityV0)"
                )
            return ValueError(message)
        if expected == 2:
            return ValueError(
                f"{name}'s reset() returned {count} (a bare observation?): gymnasium's API returns "
                "(observation, info), info a dict"
            )
        return None
    shape = _SHAPE.search(text)
    if shape is not None:
        space = getattr(_inner(env), "single_observation_space", None) or getattr(
            _inner(env), "observation_space", None
        )
        got = f" of shape ({shape.group(1)})" if shape.group(1) is not None else ""
        return ValueError(
            f"{name} returned an observation{got} that does not fit its observation_space {space}: every "
            "observation reset() and step() return keeps the shape and dtype of observation_space (an "
            "observation that changes shape cannot go into a batch)"
        )
    return None


@contextlib.contextmanager
def env_contract(env: Any) -> Iterator[None]:
    """Around the calls that step ``env``: an error that is a break of gymnasium's API leaves as
    :func:`contract_error`'s ``ValueError``, with the original as its cause."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        error = contract_error(exc, env)
        if error is None:
            raise
        raise error from exc
