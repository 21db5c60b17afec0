"""Gymnasium spaces as plain descriptions (dicts of numbers, strings and arrays) and back.

The server sends its envs' spaces this way (inside a :mod:`._wire` tree), never pickled; the client
rebuilds Box, Discrete, MultiDiscrete, MultiBinary, and Dict and Tuple of those.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import spaces

from ._wire import DTYPES, ProtocolError

__all__ = ["describe_space", "rebuild_space"]


def describe_space(space: spaces.Space[Any]) -> dict[str, Any]:
    """A description of ``space`` that :func:`rebuild_space` turns back into an equal space."""
    if isinstance(space, spaces.Box):
        return {"type": "Box", "low": space.low, "high": space.high, "dtype": np.dtype(space.dtype).str}
    if isinstance(space, spaces.Discrete):
        return {"type": "Discrete", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, spaces.MultiDiscrete):
        return {"type": "MultiDiscrete", "nvec": space.nvec, "start": space.start}
    if isinstance(space, spaces.MultiBinary):
        return {"type": "MultiBinary", "n": np.asarray(space.n).tolist()}
    if isinstance(space, spaces.Dict):
        return {"type": "Dict", "spaces": {k: describe_space(s) for k, s in space.spaces.items()}}
    if isinstance(space, spaces.Tuple):
        return {"type": "Tuple", "spaces": [describe_space(s) for s in space.spaces]}
    raise TypeError(
        f"serve_envs cannot describe a {type(space).__name__} space: Box, Discrete, MultiDiscrete, "
        "MultiBinary, Dict and Tuple travel"
    )


def rebuild_space(desc: Any) -> spaces.Space[Any]:
    """The space a :func:`describe_space` description stands for (``ProtocolError`` if malformed)."""
    try:
        return _rebuild(desc)
    except ProtocolError:
        raise
    except (KeyError, TypeError, ValueError, AssertionError) as exc:
        raise ProtocolError(f"bad space description {desc!r}: {exc}") from None


def _rebuild(desc: Any) -> spaces.Space[Any]:
    kind = desc["type"]
    if kind == "Box":
        dtype = DTYPES.get(desc["dtype"])
        if dtype is None:
            raise ProtocolError(f"Box dtype {desc['dtype']!r} is not accepted")
        low, high = np.asarray(desc["low"]), np.asarray(desc["high"])
        return spaces.Box(low=low.astype(dtype), high=high.astype(dtype), dtype=dtype)
    if kind == "Discrete":
        return spaces.Discrete(_int(desc["n"]), start=_int(desc["start"]))
    if kind == "MultiDiscrete":
        nvec = np.asarray(desc["nvec"])
        return spaces.MultiDiscrete(nvec, dtype=nvec.dtype, start=np.asarray(desc["start"]))
    if kind == "MultiBinary":
        n = desc["n"]
        return spaces.MultiBinary(_int(n) if not isinstance(n, list) else [_int(v) for v in n])
    if kind == "Dict":
        return spaces.Dict({str(k): _rebuild(v) for k, v in desc["spaces"].items()})
    if kind == "Tuple":
        return spaces.Tuple([_rebuild(v) for v in desc["spaces"]])
    raise ProtocolError(f"unknown space type {kind!r}")


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"expected an integer, got {value!r}")
    return value
